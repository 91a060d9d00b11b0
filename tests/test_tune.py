"""`infermeter tune` (issue 20): the grid and its checks, the front, the repeats and the best's
rule (issue 28), and whole runs.

Whole runs go through the command a user types, against a real MLflow store: a user's own
server (``--serve-cmd``: tests/tune_server.py, the ground-truth instrument behind a command line
whose parameters change its startup or make it crash), and the embedded llama.cpp engine with
two thread counts. The engine's own argument parser judges the parameters (llama.cpp's here;
vLLM's where ``.venv-vllm`` is installed).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tasks.tune import argcheck, rule
from tasks.tune.front import TunePoint, best, pareto
from tasks.tune.grid import (
    TuneInputError,
    check_count,
    configuration_key,
    expand,
    generic_flags,
    parse_server_params,
    scalar,
)
from tasks.tune.repeats import combine_levels, run_order
from tasks.tune.serve import command_line

BIN = Path(sys.executable).parent / "infermeter"
TUNE_SERVER = Path(__file__).parent / "tune_server.py"
SERVE_CMD = f"{sys.executable} {TUNE_SERVER} --port {{port}} {{params}}"
#: the instrument's scenario: 4 tokens, gaps 5 ms (no load slope), TTFT 10 ms
MODEL = "load:4:5:0:10"
WORKLOAD = ["--num-requests", "4", "--warmup", "1", "--max-tokens", "4", "--max-concurrency", "1,2"]


# the grid ---------------------------------------------------------------------------------


def test_server_params_read_as_yaml_scalars_and_expand_in_order() -> None:
    grid = parse_server_params(
        ["max_num_seqs=1,4", "enable_chunked_prefill=true,false", "kv_cache_dtype=fp8"]
    )
    assert grid == {
        "max_num_seqs": [1, 4],
        "enable_chunked_prefill": [True, False],
        "kv_cache_dtype": ["fp8"],
    }
    assert [scalar(t) for t in ("0.5", "16", "False", "auto")] == [0.5, 16, False, "auto"]
    sets = expand(grid, None)
    assert sets == [
        {"max_num_seqs": 1, "enable_chunked_prefill": True, "kv_cache_dtype": "fp8"},
        {"max_num_seqs": 1, "enable_chunked_prefill": False, "kv_cache_dtype": "fp8"},
        {"max_num_seqs": 4, "enable_chunked_prefill": True, "kv_cache_dtype": "fp8"},
        {"max_num_seqs": 4, "enable_chunked_prefill": False, "kv_cache_dtype": "fp8"},
    ]
    explicit = [{"max_num_seqs": 1}, {"max_num_seqs": 8, "enable_chunked_prefill": False}]
    assert expand(None, explicit) == explicit


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["max_num_seqs"], "NAME=V1,V2"),
        (["=1,2"], "NAME=V1,V2"),
        (["max_num_seqs="], "no values"),
        (["a=1", "a=2"], "given twice"),
    ],
)
def test_bad_server_params_name_the_parameter(options, words) -> None:
    with pytest.raises(TuneInputError, match=words):
        parse_server_params(options)


def test_empty_both_and_too_many_are_refused() -> None:
    with pytest.raises(TuneInputError, match="grid is empty"):
        expand({}, None)
    with pytest.raises(TuneInputError, match="not both"):
        expand({"a": [1]}, [{"a": 2}])
    with pytest.raises(TuneInputError, match="server_params.a"):
        expand({"a": []}, None)
    with pytest.raises(TuneInputError, match="65 configurations exceed .* --yes"):
        check_count(65, 64, yes=False)
    check_count(65, 64, yes=True)
    check_count(64, 64, yes=False)


def test_llamacpp_parser_spells_and_judges_the_flags() -> None:
    ok, unknown, wrong, switch, reserved = argcheck.check(
        "llamacpp",
        [
            {"n_threads": 2, "flash_attn": True},
            {"n_thread": 2},
            {"n_batch": "many"},
            {"use_mmap": "maybe"},
            {"port": 1},
        ],
    )
    assert ok == {"flags": ["--n_threads", "2", "--flash_attn", "True"], "error": None}
    assert "'n_thread'" in unknown["error"] and "did you mean n_threads" in unknown["error"]
    assert wrong["error"] == "argument --n_batch: invalid int value: 'many'"
    assert "--use_mmap" in switch["error"]
    assert "infermeter sets it itself" in reserved["error"]


def test_a_user_commands_flags_and_template() -> None:
    flags = generic_flags(
        {"max_num_seqs": 4, "enable_chunked_prefill": False, "enforce_eager": True, "x": [1, 2]}
    )
    assert flags == ("--max-num-seqs", "4", "--no-enable-chunked-prefill", "--enforce-eager", "--x", "1", "2")
    assert command_line("vllm serve {model} --port {port} {params}", "my model", 8123, ("--a", "b c")) == [
        "vllm", "serve", "my model", "--port", "8123", "--a", "b c",
    ]  # fmt: skip


def test_the_key_follows_every_setting_that_shapes_the_measurement() -> None:
    base = configuration_key({"max_num_seqs": 4}, {"stream": {"num_requests": 10}})
    assert base == configuration_key({"max_num_seqs": 4}, {"stream": {"num_requests": 10}})
    assert base != configuration_key({"max_num_seqs": 8}, {"stream": {"num_requests": 10}})
    assert base != configuration_key({"max_num_seqs": 4}, {"stream": {"num_requests": 11}})


# the front --------------------------------------------------------------------------------


def _p(conf, tput, user, ttft, good=None, frac=None) -> TunePoint:
    return TunePoint(conf, f"c{conf}", 0, 1, None, tput, user, ttft, good, frac)


def test_pareto_keeps_exactly_the_undominated_points() -> None:
    points = [
        _p(0, 100, 50, 900),
        _p(1, 200, 30, 400),
        _p(2, 150, 20, 1000),
        _p(3, 300, 10, 2000),
        _p(4, None, 99, 1),
    ]
    front = pareto(points)
    assert [p.configuration for p in front] == [0, 1, 3]  # 2 is beaten by 1 on both axes; 4 has no throughput
    assert [p.configuration for p in pareto(points, "ttft_ms_p99")] == [1, 3]  # less TTFT is better
    tie = [_p(0, 100, 50, 1), _p(1, 100, 50, 1)]
    assert len(pareto(tie)) == 2  # neither strictly better


def test_best_is_the_highest_goodput_among_levels_meeting_the_target() -> None:
    points = [
        _p(0, 100, 50, 900, good=4.0, frac=1.0),
        _p(1, 300, 10, 2000, good=6.0, frac=0.9),
        _p(2, 200, 30, 400, good=5.0, frac=0.96),
    ]
    chosen = best(points, {"ttft_ms": 1000}, target=0.95)
    assert chosen.point.configuration == 2 and "ttft_ms <= 1000" in chosen.reason
    assert best(points, {"ttft_ms": 1000}, target=0.99).point.configuration == 0
    none = best(points, {"ttft_ms": 1}, target=1.01)
    assert none.point is None and "no level" in none.reason
    no_slos = best(points, None, 0.95)
    assert no_slos.point.configuration == 1 and "no SLOs" in no_slos.reason
    # one pass each: the top is named, but the answer says it was not tested
    assert chosen.rule == "untested" and "one pass each gives no interval" in chosen.reason


# the repeats and the best's rule (issue 28) ---------------------------------------------------


def test_the_run_order_is_round_robin_in_seeded_latin_squares() -> None:
    slots = run_order(3, 4, seed=0)
    assert [s.position for s in slots] == list(range(12))
    assert [s.repeat for s in slots] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3  # rounds in turn
    rounds = [tuple(s.configuration for s in slots[r * 3 : r * 3 + 3]) for r in range(4)]
    assert all(sorted(order) == [0, 1, 2] for order in rounds)  # each round: every one once
    for place in range(3):  # the first three rounds: each configuration once in each place
        assert sorted(order[place] for order in rounds[:3]) == [0, 1, 2]
    assert run_order(3, 4, seed=0) == slots  # the seed replays it
    assert any(run_order(3, 4, seed=s) != slots for s in range(1, 5))
    from tasks.config import TuneFlowConfig

    assert TuneFlowConfig().tune.repeats == 3  # the default: the fewest for an interval to mean much
    two = [tuple(s.configuration for s in run_order(2, 3, seed=s)[:4]) for s in range(6)]
    assert all(order[:2] == order[2:][::-1] for order in two)  # A B then B A, whatever the seed
    assert {order[:2] for order in two} == {(0, 1), (1, 0)}  # which goes first: the seed's


def test_a_points_interval_is_students_t_over_the_repeats() -> None:
    found = rule.repeat_interval([10.0, 12.0, 14.0])
    # mean 12, s = 2, t(0.975, 2) = 4.302653: 12 ± 4.302653 x 2 / sqrt(3)
    assert (found.mean, found.count) == (12.0, 3)
    assert found.low == pytest.approx(12 - 4.968275, abs=1e-5)
    assert found.high == pytest.approx(12 + 4.968275, abs=1e-5)
    assert rule.repeat_interval([7.5]).low is None and rule.repeat_interval([None]) is None
    # Welch's two-sided p of 12 vs 10 (both s = 2, n = 3): t = 1.2247 on 4 df, p = 0.28786
    difference, low, high, p = rule.welch([10, 12, 14], [8, 10, 12])
    assert difference == 2.0 and p == pytest.approx(0.287864, abs=1e-5)
    assert (low, high) == pytest.approx((2 - 4.533916, 2 + 4.533916), abs=1e-5)  # t(0.975, 4) x 1.633
    # more repeats: t(0.975, 2(n-1)) x sqrt(8 / n) < 2 first holds at n = 9 (2.120 x 0.943 = 1.999)
    assert rule.repeats_to_separate([10, 12, 14], [8, 10, 12], alpha=0.05) == 9


def test_welch_is_the_textbook_formula() -> None:
    """rule.welch (scipy's ttest_ind, equal_var=False) against Welch's formulas written out:
    se = sqrt(s1²/n1 + s2²/n2), nu by Welch-Satterthwaite, d ± t(1 - alpha/2, nu) x se and
    p = 2 sf(|d| / se, nu), on 400 random pairs of unequal sizes and spreads."""
    from scipy.stats import t as student_t

    rng = np.random.default_rng(51)
    for _ in range(400):
        a = rng.normal(100, rng.uniform(0.1, 10), rng.integers(2, 12))
        b = rng.normal(100 + rng.uniform(-5, 5), rng.uniform(0.1, 10), rng.integers(2, 12))
        confidence = rng.choice([0.9, 0.95, 0.99])
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        se, d = math.sqrt(va + vb), a.mean() - b.mean()
        nu = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
        half = student_t.ppf(1 - (1 - confidence) / 2, nu) * se
        expected = (d, d - half, d + half, 2 * student_t.sf(abs(d) / se, nu))
        assert rule.welch(list(a), list(b), confidence) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert rule.welch([5, 5], [3, 3]) == (2.0, 2.0, 2.0, 0.0)  # both spreads 0: no t
    assert rule.welch([5, 5], [5, 5])[3] == 1.0 and rule.welch([5], [3, 4]) == (1.5, None, None, None)


def _repeated(conf: int, level: int, values: list[float], slos: bool = False) -> TunePoint:
    """A point whose objective is the mean of ``values`` (its repeats)."""
    from tasks.tune.front import point

    figure = "goodput_requests_per_s" if slos else "output_tokens_per_s"
    metrics = {figure: sum(values) / len(values), "goodput_fraction": 1.0 if slos else None}
    metrics.setdefault("output_tokens_per_s", 10.0)
    return point(conf, f"c{conf}", level, {"max_concurrency": 1, "metrics": metrics}, {figure: values})


def test_overlapping_repeats_are_tied_within_noise_and_no_best_is_named() -> None:
    """The issue's case: two configurations whose passes read 7.7 and 29.1 tokens/s, where
    repeats show both readings for both."""
    a, b = [29.1, 8.2, 27.5], [7.7, 28.0, 9.1]
    points = [_repeated(0, 0, a), _repeated(1, 0, b)]
    chosen = best(points, None, 0.95, {(0, 0): a, (1, 0): b})
    assert chosen.point is None and chosen.rule == "tied"
    assert [p.configuration for p in chosen.tied] == [0, 1]
    assert chosen.reason.startswith("tied within noise on output_tokens_per_s")
    assert "c0 c=1 21.6 tokens/s [" in chosen.reason and "c1 c=1 14.9 tokens/s [" in chosen.reason
    [(_, comparison)] = chosen.comparisons
    assert not comparison.separated and comparison.p_value > 0.05
    assert comparison.ci_low < 0 < comparison.ci_high
    # 21.6 vs 14.9 with spreads of ~11 tokens/s: 25 repeats of each would separate them
    assert chosen.repeats_to_separate == 25 and "about --repeats 25 (22 more of each" in chosen.reason
    data = chosen.to_dict()
    assert data["point"] is None and data["rule"] == "tied" and len(data["tied"]) == 2
    assert data["top"]["configuration"] == 0 and data["comparisons"][0]["more_repeats"] == 22
    assert points[0].output_tokens_per_s_ci_low < 8.2 and points[0].output_tokens_per_s_ci_high > 29.1


def test_separated_repeats_name_the_best_with_its_interval() -> None:
    a, b = [30.1, 29.6, 30.4], [20.2, 19.8, 20.5]
    chosen = best([_repeated(0, 0, a), _repeated(1, 0, b)], None, 0.95, {(0, 0): a, (1, 0): b})
    assert chosen.rule == "best" and chosen.point.configuration == 0 and not chosen.tied
    [(runner, comparison)] = chosen.comparisons
    assert runner.configuration == 1 and comparison.separated and comparison.p_value < 0.001
    assert comparison.difference == pytest.approx(9.8667, abs=1e-4) and comparison.ci_low > 9
    assert "separated from the runner-up c1 c=1 20.2 tokens/s" in chosen.reason


def test_the_best_must_be_separated_from_every_other_configuration_holm() -> None:
    """Separated from the runner-up is not enough: a third, noisy configuration whose interval
    reaches the top is tied with it. Under SLOs the objective is goodput."""
    top, runner, noisy = [5.0, 5.1, 4.9], [3.0, 3.1, 2.9], [1.0, 6.0, 2.0]
    samples = {(0, 0): top, (1, 0): runner, (2, 0): noisy}
    points = [_repeated(i, 0, v, slos=True) for (i, _), v in samples.items()]
    chosen = best(points, {"ttft_ms": 500}, 0.95, samples)
    assert chosen.rule == "tied" and chosen.objective == "goodput_requests_per_s"
    assert [p.configuration for p in chosen.tied] == [0, 2]
    assert [c.separated for _, c in chosen.comparisons] == [True, False]
    # each configuration's best level is its candidate: a second level of 0 is not a rival
    samples[(0, 1)] = [4.0, 4.1, 3.9]
    points.append(_repeated(0, 1, samples[(0, 1)], slos=True))
    assert [p.configuration for p, _ in best(points, {"ttft_ms": 500}, 0.95, samples).comparisons] == [1, 2]


def test_repeats_combine_level_by_level() -> None:
    def level(c, tput, ttft):
        return {"max_concurrency": c, "request_rate": None,
                "metrics": {"output_tokens_per_s": tput, "ttft_ms_p99": ttft, "note": "x"}}  # fmt: skip

    combined = combine_levels([[level(1, 10.0, 100), level(4, 30.0, 400)], [level(1, 14.0, 120)]])
    assert [(c.max_concurrency, c.repeats) for c in combined] == [(1, 2), (4, 1)]
    assert combined[0].metrics == {"output_tokens_per_s": 12.0, "ttft_ms_p99": 110.0, "note": "x"}
    assert combined[0].values["output_tokens_per_s"] == (10.0, 14.0)
    assert combined[1].metrics["output_tokens_per_s"] == 30.0


# the best over the repeats' capacities (issue 28, item 6) ----------------------------------


def _search(capacity: float | None, sync_passed: bool = True, client_bound: bool = False) -> dict:
    """A repeat's ``CapacityResult.to_dict()`` (the keys the tune reads)."""
    sync = {"kind": "synchronous", "passed": sync_passed, "metrics": {"client_bound": client_bound}}
    return {"capacity_requests_per_s": capacity, "capacity_output_tokens_per_s": None if capacity is None
            else 4 * capacity, "levels": [sync]}  # fmt: skip


def test_a_repeats_capacity_is_its_searchs_answer_zero_when_one_request_fails() -> None:
    from tasks.tune.capacities import capacity_text, over_repeats, repeat_capacity

    assert repeat_capacity(_search(57.4)) == 57.4
    assert repeat_capacity(_search(None, sync_passed=False)) == 0.0  # SLOs fail one at a time
    assert repeat_capacity(_search(None, sync_passed=False, client_bound=True)) is None  # says nothing
    assert repeat_capacity(None) is None
    over = over_repeats(0, "a", [_search(12.0), _search(None, sync_passed=False), _search(None, False, True)])
    assert over.per_repeat == (12.0, 0.0, None) and over.interval.count == 2
    # mean 6, s = 8.485, t(0.975, 1) = 12.706: 6 ± 76.2, cut at 0 req/s
    assert (over.interval.low, over.interval.high) == pytest.approx((0.0, 6 + 76.2372), abs=1e-3)
    assert capacity_text(over.to_dict()) == "capacity 6 req/s [0, 82.2] (95%, 2 repeats: 12, 0, n/a)"


def _capacity_summaries(capacities: dict[int, list[float]]) -> list:
    """Configurations whose repeats' capacity searches answered ``capacities``: each search's
    levels at rates of its own (synchronous, saturation, the capacity's rate and one above it
    that missed), as a real search probes them."""
    from tasks.pipeline.tune import ConfigurationOutcome, ConfigurationSummary

    def level(concurrency, rate, goodput, fraction):
        return {"max_concurrency": concurrency, "request_rate": rate, "metrics": {
            "goodput_requests_per_s": goodput, "goodput_fraction": fraction, "output_tokens_per_s": 4 * goodput,
            "tpot_ms_p50": 20.0, "ttft_ms_p99": 50.0}}  # fmt: skip

    summaries = []
    for index, values in capacities.items():
        label = "ab"[index]
        summary = ConfigurationSummary(index, label, {"x": index}, [])
        for repeat, capacity in enumerate(values):
            levels = [level(1, None, 10.0, 1.0), level(4, None, 5.0, 0.5),
                      level(4, capacity, capacity, 1.0), level(4, capacity * 1.1, 3.0, 0.5)]  # fmt: skip
            summary.measurements.append(
                ConfigurationOutcome(
                    index, label, {"x": index}, [], "FINISHED", 1.0, levels, _search(capacity), repeat=repeat
                )  # fmt: skip
            )
        summaries.append(summary)
    return summaries


def test_the_capacity_tunes_best_is_decided_over_each_repeats_capacity(capsys) -> None:
    """Each repeat's search probes rates of its own, so no search level has more than one
    repeat: the best was named "untested" from one repeat's level. Now each configuration's
    sample is its capacity in each repeat, and the rule (Welch, Holm) names the best."""
    from flows.commands.tune import print_tune
    from flows.tune import answer, summary_text
    from tasks.config import TuneFlowConfig

    a, b = [30.1, 29.6, 30.4], [20.2, 19.8, 20.5]
    summaries = _capacity_summaries({0: a, 1: b})
    config = TuneFlowConfig.model_validate(
        {"tune": {"capacity": True}, "stream": {"goodput": {"tpot_ms": 50}}}
    )
    found = answer(summaries, config)
    chosen = found["best"]
    assert chosen["rule"] == "best" and chosen["objective"] == "capacity_requests_per_s"
    assert chosen["point"]["configuration"] == 0 and chosen["point"]["level"] == -1
    assert chosen["server_params"] == {"x": 0}
    # the capacity's mean and Student's t interval over the repeats: 30.033 ± 4.302653 x 0.40415 / sqrt(3)
    assert chosen["point"]["capacity_requests_per_s"] == pytest.approx(30.0333, abs=1e-4)
    assert chosen["point"]["capacity_requests_per_s_ci_low"] == pytest.approx(29.0294, abs=1e-4)
    assert chosen["point"]["capacity_requests_per_s_ci_high"] == pytest.approx(31.0373, abs=1e-4)
    [comparison] = chosen["comparisons"]
    assert comparison["point"]["configuration"] == 1 and comparison["separated"]
    assert comparison["difference"] == pytest.approx(9.8667, abs=1e-4) and comparison["p_value"] < 1e-4
    assert (comparison["ci_low"], comparison["ci_high"]) == pytest.approx((9.0018, 10.7316), abs=1e-4)
    assert chosen["reason"].startswith("highest capacity (30 req/s, the mean over its repeats")
    assert "separated from the runner-up b capacity 20.2 req/s [19.3, 21] (3 repeats)" in chosen["reason"]
    over = summaries[0].to_dict()["capacity_over_repeats"]
    assert over["per_repeat"] == a and over["repeats"] == 3
    assert (over["ci_low"], over["ci_high"]) == pytest.approx((29.0294, 31.0373), abs=1e-4)
    assert summaries[0].to_dict()["capacity"]["capacity_requests_per_s"] == 30.1  # kept: the first repeat's
    result = {"configurations": [s.to_dict() for s in summaries], "best": chosen,
              "pareto": {k: [p.to_dict() for p in v] for k, v in found["pareto"].items()}}  # fmt: skip
    print_tune(result)
    out = capsys.readouterr().out
    # one row per configuration: its repeats, mean ± Student's t, the rule's mark, each repeat's capacity
    # (the output tokens/s at capacity, last, left out at 80 columns)
    assert _capacity_rows(out) == {"0": "0 a FINISHED 1.0 3 30.0 ± 1.0 best 30.1, 29.6, 30.4",
                                   "1": "1 b FINISHED 1.0 3 20.2 ± 0.9 20.2, 19.8, 20.5"}  # fmt: skip
    assert "best: a: highest capacity (30 req/s" in " ".join(out.split())
    text = summary_text(summaries, result, None)
    assert "capacity 20.2 req/s [19.3, 21] (95%, 3 repeats: 20.2, 19.8, 20.5)" in text
    assert "best: `a`: highest capacity" in text

    # overlapping capacities: tied within noise, with how many repeats would separate them
    summaries = _capacity_summaries({0: [29.1, 8.2, 27.5], 1: [7.7, 28.0, 9.1]})
    found = answer(summaries, config)
    tied = found["best"]
    assert tied["rule"] == "tied" and tied["point"] is None and tied["repeats_to_separate"] == 25
    assert tied["reason"].startswith("tied within noise on capacity_requests_per_s")
    print_tune({"configurations": [s.to_dict() for s in summaries], "best": tied,
                "pareto": {k: [p.to_dict() for p in v] for k, v in found["pareto"].items()}})  # fmt: skip
    out = capsys.readouterr().out
    # the interval cut at 0 req/s is written by its ends; both configurations marked tied
    assert _capacity_rows(out) == {"0": "0 a FINISHED 1.0 3 21.6 [0.0, 50.5] tied 29.1, 8.2, 27.5",
                                   "1": "1 b FINISHED 1.0 3 14.9 [0.0, 43.1] tied 7.7, 28.0, 9.1"}  # fmt: skip
    assert "best: none (tied within noise on capacity_requests_per_s" in " ".join(out.split())


def _capacity_rows(out: str) -> dict[str, str]:
    """The ``--capacity`` table's rows of ``print_tune``'s output, by configuration index, each
    row's lines joined (a long label or status folds onto a second line)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("───")) + 1
    rows: dict[str, list[str]] = {}
    for line in lines[start:]:
        if not line.strip():
            break
        if re.match(r"\s*\d+\s", line):
            assert line.split()[0] not in rows, f"configuration {line.split()[0]} has more than one row"
            rows[line.split()[0]] = []
        list(rows.values())[-1].extend(line.split())  # a folded cell's second line: its words
    return {k: " ".join(words) for k, words in rows.items()}


# whole runs through the command ------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "INFERMETER_WORK_DIR": str(tmp_path / "work"),
    }


def _tune(tmp_path: Path, *options: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN), "tune", *options],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_env(tmp_path), **env},
    )


@pytest.fixture(scope="module")
def own_server_run(tmp_path_factory):
    """Three configurations of a user's own server (one crashes), the default 3 repeats in
    interleaved rounds, run twice: the second resumes."""
    tmp = tmp_path_factory.mktemp("tune-own")
    config = tmp / "tune.yaml"
    config.write_text(
        "tune:\n"
        f"  serve_cmd: '{SERVE_CMD}'\n"
        "  configurations:\n"
        "    - {startup_delay_s: 0}\n"
        "    - {startup_delay_s: 0.6}\n"
        "    - {crash: true}\n"
        "endpoint: {tokenizer: 'gguf:default'}\n"
        "server: {startup_timeout_s: 30}\n",
        encoding="utf-8",
    )
    options = ["--config", str(config), "--model", MODEL, *WORKLOAD, "--goodput", "ttft_ms:5000"]
    first = _tune(tmp, *options, "--json", str(tmp / "first.json"))
    second = _tune(tmp, *options, "--json", str(tmp / "second.json"))
    return tmp, first, second


def test_each_configuration_is_measured_and_a_crash_is_recorded_and_skipped(own_server_run) -> None:
    tmp, first, _ = own_server_run
    assert first.returncode == 0, first.stderr[-3000:]
    data = json.loads((tmp / "first.json").read_text())
    assert set(data) == {"configurations", "best", "pareto", "order", "repeats", "mlflow_run_id"}
    assert data["repeats"] == 3
    confs = data["configurations"]
    assert [c["status"] for c in confs] == ["FINISHED", "FINISHED", "FAILED"]
    assert [c["server_params"] for c in confs] == [
        {"startup_delay_s": 0},
        {"startup_delay_s": 0.6},
        {"crash": True},
    ]
    assert [len(c["repeats"]) for c in confs] == [3, 3, 1]  # a server that cannot start: once
    assert [c["repeats_skipped"] for c in confs] == [[], [], [1, 2]]
    assert confs[1]["server_startup_s"] - confs[0]["server_startup_s"] > 0.5  # the delay it was given
    assert confs[2]["server_startup_s"] is None
    assert "exited with code 3" in confs[2]["error"] and "crashing before it is healthy" in confs[2]["error"]
    for conf in confs[:2]:
        assert [lv["max_concurrency"] for lv in conf["levels"]] == [1, 2]
        assert all(lv["metrics"]["num_succeeded"] == 4 and lv["repeats"] == 3 for lv in conf["levels"])
        for lv in conf["levels"]:  # the mean over the repeats, inside its interval over them
            each = [
                r["levels"][conf["levels"].index(lv)]["metrics"]["output_tokens_per_s"]
                for r in conf["repeats"]
            ]
            assert lv["metrics"]["output_tokens_per_s"] == pytest.approx(sum(each) / 3)
            assert (
                lv["output_tokens_per_s_ci_low"]
                < lv["metrics"]["output_tokens_per_s"]
                < lv["output_tokens_per_s_ci_high"]
            )
            assert lv["goodput_requests_per_s_ci_low"] is not None
    best_found = data["best"]
    assert best_found["rule"] in ("best", "tied") and best_found["objective"] == "goodput_requests_per_s"
    assert len(best_found["comparisons"]) == 1 and best_found["top"]["configuration"] in (0, 1)
    if best_found["rule"] == "best":  # the two servers are the same instrument: most often tied
        assert best_found["point"]["configuration"] in (0, 1) and best_found["server_params"]
        assert best_found["comparisons"][0]["separated"] and "best: startup_delay_s=" in first.stdout
    else:
        assert best_found["point"] is None and len(best_found["tied"]) == 2
        assert "best: none (tied within noise on goodput_requests_per_s" in first.stdout
    assert data["pareto"]["per_user_tokens_per_s"]
    assert "configuration 2 (crash=true) FAILED" in first.stdout
    assert "3 configurations x 3 interleaved rounds" in first.stdout

    # the order: round-robin, each round shuffled from the seed (0), recorded as measured
    expected = [(s.position, s.repeat, s.configuration) for s in run_order(3, 3, seed=0)]
    assert [(o["position"], o["repeat"], o["configuration"]) for o in data["order"]] == expected
    crash = [o["done"] for o in data["order"] if o["configuration"] == 2]
    assert crash == ["measured", "skipped", "skipped"]
    assert all(o["done"] == "measured" for o in data["order"] if o["configuration"] != 2)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    parent = client.get_run(data["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    # named as the other flows' runs are: when, then what (issue 31: it was `tune`)
    assert re.fullmatch(rf"tune \d\d-\d\d \d\d:\d\d:\d\d serve_cmd {MODEL}", parent.info.run_name)
    assert (
        parent.data.metrics["tune_configurations"] == 3
        and parent.data.metrics["tune_configurations_failed"] == 1
    )
    assert parent.data.tags["tune_best_rule"] == best_found["rule"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"tune.csv", "tune.json", "summary.md"} <= artifacts
    assert "plots/tune_pareto.png" in {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    experiment = [parent.info.experiment_id]
    children = client.search_runs(
        experiment,
        f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"],
    )
    # a child per measurement, started in the recorded order: the interleaving really happened
    measured = [(o["configuration"], o["repeat"]) for o in data["order"] if o["done"] == "measured"]
    assert [
        (int(c.data.params["configuration_index"]), int(c.data.tags["tune_repeat"])) for c in children
    ] == measured
    assert [int(c.data.tags["tune_position"]) for c in children] == [
        o["position"] for o in data["order"] if o["done"] == "measured"
    ]
    by = {(int(c.data.params["configuration_index"]), int(c.data.tags["tune_repeat"])): c for c in children}
    assert [by[(i, 0)].info.status for i in range(3)] == ["FINISHED", "FINISHED", "FAILED"]
    assert by[(1, 1)].info.run_name == "tune 1: startup_delay_s=0.6 (repeat 2/3)"
    assert by[(1, 2)].data.params["startup_delay_s"] == "0.6"
    assert by[(1, 2)].data.tags["server_flags"] == "--startup-delay-s 0.6"
    assert by[(1, 2)].data.metrics["server_startup_s"] == pytest.approx(
        confs[1]["repeats"][2]["server_startup_s"]
    )
    assert "server_log_tail.txt" in {a.path for a in client.list_artifacts(by[(2, 0)].info.run_id)}
    stage = client.search_runs(experiment, f"tags.mlflow.parentRunId = '{by[(0, 1)].info.run_id}'")
    assert len(stage) == 1  # the stream stage, and its two levels below it
    levels = client.search_runs(experiment, f"tags.mlflow.parentRunId = '{stage[0].info.run_id}'")
    assert len(levels) == 2


def test_a_second_run_resumes_the_finished_configurations(own_server_run) -> None:
    tmp, first, second = own_server_run
    assert second.returncode == 0, second.stderr[-3000:]
    before = json.loads((tmp / "first.json").read_text())["configurations"]
    after_data = json.loads((tmp / "second.json").read_text())
    after = after_data["configurations"]
    assert [c["resumed"] for c in after] == [True, True, False]  # a FAILED one is tried again
    assert [[r["resumed"] for r in c["repeats"]] for c in after] == [[True] * 3, [True] * 3, [False]]
    assert [c["mlflow_run_id"] for c in after[:2]] == [c["mlflow_run_id"] for c in before[:2]]
    assert after[0]["levels"] == before[0]["levels"]
    assert [r["mlflow_run_id"] for r in after[1]["repeats"]] == [
        r["mlflow_run_id"] for r in before[1]["repeats"]
    ]
    assert second.stdout.count("(resumed)") == 4  # two levels each
    assert [o["done"] for o in after_data["order"] if o["configuration"] == 0] == ["resumed"] * 3


def test_a_capacity_tune_reports_the_capacity_over_its_repeats(tmp_path: Path) -> None:
    """``--capacity --repeats 2`` through the command: each repeat's search answers a capacity,
    and tune.json, the table, tune.csv, summary.md and the parent's metric all give their mean
    with Student's t interval over the two (the rule itself: the test above)."""
    config = tmp_path / "tune.yaml"
    config.write_text(
        f"tune: {{serve_cmd: '{SERVE_CMD}', configurations: [{{startup_delay_s: 0}}]}}\n"
        "endpoint: {tokenizer: 'gguf:default'}\ncapacity: {max_levels: 2}\n",
        encoding="utf-8",
    )
    # the SLO holds at saturation: each repeat's capacity is its saturation throughput
    proc = _tune(tmp_path, "--config", str(config), "--model", MODEL, *WORKLOAD[:6], "--capacity",
                 "--goodput", "tpot_ms:1000", "--repeats", "2", "--json", str(tmp_path / "t.json"),
                 COLUMNS="200")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "t.json").read_text())
    [conf] = data["configurations"]
    each = [r["capacity"]["capacity_requests_per_s"] for r in conf["repeats"]]
    over = conf["capacity_over_repeats"]
    assert over["per_repeat"] == each and len(each) == 2 and all(v > 0 for v in each)
    mean, half = sum(each) / 2, 12.706205 * abs(each[0] - each[1]) / 2  # t(0.975, 1) x s / sqrt(2)
    assert over["capacity_requests_per_s"] == pytest.approx(mean)
    assert (over["ci_low"], over["ci_high"]) == pytest.approx((max(0.0, mean - half), mean + half), rel=1e-5)
    best_found = data["best"]
    assert (best_found["rule"], best_found["objective"]) == ("only", "capacity_requests_per_s")
    assert best_found["point"]["capacity_requests_per_s"] == pytest.approx(mean)
    from flows.tables.common import fmt_value, interval_text

    [row] = _capacity_rows(proc.stdout).values()  # the configuration once, over its two repeats
    assert row.startswith(f"0 startup_delay_s=0 FINISHED {fmt_value(conf['server_startup_s'])} 2 ")
    assert f" {interval_text(mean, over['ci_low'], over['ci_high'])} best {fmt_value(each[0])}, " in row
    assert "best: startup_delay_s=0: highest capacity" in " ".join(proc.stdout.split())

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(data["mlflow_run_id"])
    assert parent.data.metrics["tune_best_capacity_requests_per_s"] == pytest.approx(mean)
    folder = Path(client.download_artifacts(parent.info.run_id, "", str(tmp_path / "artifacts")))
    rows = [line.split(",") for line in (folder / "tune.csv").read_text().splitlines()]
    column = dict(zip(rows[0], zip(*rows[1:])))
    at = column["level"].index("-1")  # the configuration's capacity row, after its levels
    assert float(column["capacity_requests_per_s"][at]) == pytest.approx(mean)
    assert float(column["capacity_requests_per_s_ci_high"][at]) == pytest.approx(mean + half, rel=1e-5)
    assert f"capacity {mean:.3g} req/s [" in (folder / "summary.md").read_text()


def test_a_capacity_tunes_repeats_are_one_row_per_configuration_and_the_best_by_the_rule(
    tmp_path: Path,
) -> None:
    """Issue 49: ``--capacity --repeats 2`` with two configurations and an SLO that saturation
    misses, so each repeat's search probes a rate of its own. The table grouped nothing: a row
    per search level of each repeat (``n`` 1), no row marked best or tied. Now each
    configuration is one row with its repeats (2), its mean capacity and Student's t interval,
    each repeat's capacity, and ``best`` / ``tied`` as the rule (Welch, Holm:
    ``tasks.tune.rule.decide``) decides over the repeats' capacities."""
    from flows.tables.common import fmt_value, interval_text

    config = tmp_path / "tune.yaml"
    config.write_text(
        f"tune: {{serve_cmd: '{SERVE_CMD}', configurations: [{{startup_delay_s: 0}}, {{startup_delay_s: 0.1}}]}}\n"
        "endpoint: {tokenizer: 'gguf:default'}\ncapacity: {max_levels: 3}\n",
        encoding="utf-8",
    )
    # gaps 5 ms + 5 ms per other request in flight: TPOT 5 ms alone, 20 ms at saturation (4 at once)
    proc = _tune(tmp_path, "--config", str(config), "--model", "load:4:5:5:10", *WORKLOAD[:6], "--capacity",
                 "--goodput", "tpot_ms:15", "--repeats", "2", "--no-track", "--json", str(tmp_path / "t.json"),
                 COLUMNS="200")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "t.json").read_text())
    confs = data["configurations"]
    assert [c["label"] for c in confs] == ["startup_delay_s=0", "startup_delay_s=0.1"]
    rows = _capacity_rows(proc.stdout)  # asserts one row per configuration
    assert sorted(rows) == ["0", "1"]
    # each repeat's search probes a rate of its own (the middle of its measured bracket), so rows
    # matched up by rate would split a configuration. A repeat may stop before it bisects (a
    # level flagged client-bound ends the search; in CI at stop 55 one repeat probed no rate),
    # so the four repeats are asked for two rates at least, not each configuration for two.
    rates = {
        lv["request_rate"] for c in confs for r in c["repeats"] for lv in r["levels"] if lv["request_rate"]
    }
    assert len(rates) >= 2, [r["capacity"]["stop_reason"] for c in confs for r in c["repeats"]]
    candidates, marks = [], {}
    for conf in confs:
        each = [r["capacity"]["capacity_requests_per_s"] for r in conf["repeats"]]
        over = conf["capacity_over_repeats"]
        assert len(each) == 2 and all(v > 0 for v in each) and over["per_repeat"] == each
        assert over["repeats"] == 2 and over["capacity_requests_per_s"] == pytest.approx(sum(each) / 2)
        interval = interval_text(over["capacity_requests_per_s"], over["ci_low"], over["ci_high"])
        row = rows[str(conf["index"])]
        assert row.startswith(
            f"{conf['index']} {conf['label']} FINISHED {fmt_value(conf['server_startup_s'])} 2 "
        )
        assert f" {interval} " in row and f" {', '.join(fmt_value(v) for v in each)} " in row
        after = row.split(f" {interval} ", 1)[1].split()[0]  # the rule's column, then each repeat's
        marks[conf["index"]] = after if after in ("best", "tied") else ""
        candidates.append((conf, each))
    # the best by the rule over the repeats' capacities, ranked by their mean
    candidates.sort(key=lambda c: sum(c[1]) / 2, reverse=True)
    decision = rule.decide([(conf["label"], each) for conf, each in candidates])
    chosen = data["best"]
    assert (chosen["rule"], chosen["objective"]) == (decision.outcome, "capacity_requests_per_s")
    assert decision.outcome in ("best", "tied")  # two repeats each: tested
    top, other = (conf["index"] for conf, _ in candidates)
    assert chosen["top"]["configuration"] == top
    assert chosen["comparisons"][0]["p_value"] == pytest.approx(decision.comparisons[0].p_value)
    said = " ".join(proc.stdout.split())
    if decision.outcome == "best":
        assert chosen["point"]["configuration"] == top and chosen["tied"] == []
        assert (marks[top], marks[other]) == ("best", "")
        assert f"best: {candidates[0][0]['label']}: highest capacity" in said
    else:
        assert chosen["point"] is None and len(chosen["tied"]) == 2
        assert marks[top] == marks[other] == "tied"
        assert "best: none (tied within noise on capacity_requests_per_s" in said


def test_a_killed_tune_leaves_no_server_and_resumes(tmp_path: Path) -> None:
    """SIGKILL of the command while the second configuration's server starts: the lifeline
    stops that server; the same command again reads the first configuration back from MLflow
    and measures only the second."""
    # one pass; the order is shuffled from the seed (0): the quick server goes first
    delays = "0,6" if run_order(2, 1, seed=0)[0].configuration == 0 else "6,0"
    command = [str(BIN), "tune", "--serve-cmd", SERVE_CMD, "--model", MODEL, "--tokenizer", "gguf:default",
               "--server-param", f"startup_delay_s={delays}", "--repeats", "1", *WORKLOAD[:6],
               "--json", str(tmp_path / "t.json")]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(tmp_path))
    try:
        server = None
        deadline = time.monotonic() + 180
        while server is None and time.monotonic() < deadline and proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "--startup-delay-s 6" in " ".join(child.cmdline()):
                        server = child
            time.sleep(0.1)
        assert server is not None, "the second configuration's server never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs([server], timeout=15)
        assert not alive, f"server {server.pid} outlived the killed command"
    finally:
        if proc.poll() is None:
            proc.kill()
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    confs = json.loads((tmp_path / "t.json").read_text())["configurations"]
    quick, slow = sorted(confs, key=lambda c: c["server_params"]["startup_delay_s"])
    assert [(c["status"], c["resumed"]) for c in (quick, slow)] == [("FINISHED", True), ("FINISHED", False)]
    assert slow["server_startup_s"] > 6


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ([], "grid is empty"),
        (["--server-param", "n_thread=1"], "did you mean n_threads"),
        (["--server-param", "n_threads=abc"], "argument --n_threads: invalid int value: 'abc'"),
        (["--server-param", "n_batch=8,16,32", "--max-configurations", "2"], "3 configurations exceed"),
        (["--server-param", "port=1"], "infermeter sets it itself"),
        (["--serve-cmd", "myserver --port 8000", "--server-param", "a=1"], "serve_cmd needs {port}"),
        (["--server-param", "n_threads=1", "--capacity"], "--capacity: the capacity search needs SLOs"),
        (["--server-param", "n_threads=1", "--repeats", "0"], "--repeats"),
    ],
)
def test_bad_input_exits_2_before_any_server_starts(tmp_path: Path, options, words) -> None:
    proc = _tune(tmp_path, *options, "--no-track", timeout=120)
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-1000:])
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_the_embedded_llamacpp_engine_with_two_thread_counts(tmp_path: Path) -> None:
    """Two thread counts measured, and a third the server refuses at its start (n_threads=-5:
    argparse takes it, llama-cpp-python's settings do not): the line tune prints for it says
    why, from the top of the server's log, not the tail of argparse's help (issue 31, item 4)."""
    proc = _tune(
        tmp_path, "--server-param", "n_threads=1,2,-5", "--num-requests", "3", "--warmup", "1",
        "--max-tokens", "8", "--repeats", "1", "--json", str(tmp_path / "t.json"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["best"]["rule"] == "untested" and "one pass each gives no interval" in proc.stdout
    confs = data["configurations"]
    assert [c["status"] for c in confs] == ["FINISHED", "FINISHED", "FAILED"]
    assert [c["server_flags"] for c in confs] == [
        ["--n_threads", "1"],
        ["--n_threads", "2"],
        ["--n_threads", "-5"],
    ]
    assert all(0 < c["server_startup_s"] < 120 for c in confs[:2])
    assert all(c["levels"][0]["metrics"]["num_succeeded"] == 3 for c in confs[:2])
    said = " ".join(proc.stdout.split())  # the table's lines, unwrapped
    assert (
        "configuration 2 (n_threads=-5) FAILED: server did not start: llamacpp server exited with code 1 "
        "before it was healthy: 1 validation error for ModelSettings | n_threads: Input should be "
        "greater than or equal to 1"
    ) in said


@pytest.mark.parametrize(
    ("readings", "rule_outcome", "line"),
    [
        (
            {0: [29.1, 8.2, 27.5], 1: [7.7, 28.0, 9.1]},
            "tied",
            "best: none (tied within noise on output_tokens_per_s",
        ),
        (
            {0: [30.1, 29.6, 30.4], 1: [20.2, 19.8, 20.5]},
            "best",
            "best: a at concurrency 1: highest output tokens/s",
        ),
    ],
)
def test_the_table_and_json_say_the_rules_outcome(capsys, readings, rule_outcome, line) -> None:
    """Planted repeats through the flow's answer and the command's table: the tie, the best."""
    from flows.commands.tune import print_tune
    from flows.tune import answer
    from tasks.config import TuneFlowConfig
    from tasks.pipeline.tune import ConfigurationOutcome, ConfigurationSummary

    summaries = []
    for index, values in readings.items():
        label = "ab"[index]
        summary = ConfigurationSummary(index, label, {"x": index}, ["--x", str(index)])
        for repeat, tput in enumerate(values):
            level = {"max_concurrency": 1, "request_rate": None,
                     "metrics": {"output_tokens_per_s": tput, "tpot_ms_p50": 20.0, "ttft_ms_p99": 50.0}}  # fmt: skip
            summary.measurements.append(
                ConfigurationOutcome(index, label, {"x": index}, [], "FINISHED", 1.0, [level], repeat=repeat)
            )
        summaries.append(summary)
    found = answer(summaries, TuneFlowConfig())
    assert found["best"]["rule"] == rule_outcome
    result = {
        "configurations": [s.to_dict() for s in summaries],
        "best": found["best"],
        "pareto": {k: [p.to_dict() for p in v] for k, v in found["pareto"].items()},
    }
    print_tune(result)
    out = capsys.readouterr().out
    assert line in out
    level = result["configurations"][0]["levels"][0]
    half = level["output_tokens_per_s_ci_high"] - level["metrics"]["output_tokens_per_s"]
    assert f"{level['metrics']['output_tokens_per_s']:.1f} ± {half:.1f}" in out  # the objective's interval
    mark = "tied" if rule_outcome == "tied" else "best"
    assert out.count(f" {mark}") >= (2 if mark == "tied" else 1)
