"""The regression test on samples (tasks.stats.verdict, issue 21): each verdict class on
constructed samples, Holm across many small changes, the interval of a change, the samples file,
and the legacy fallback for a baseline that kept no samples (against a real MLflow store)."""

from dataclasses import replace

import numpy as np
import pytest

from tasks.config import RegressionConfig
from tasks.report.baseline import SAMPLES_ARTIFACT, judge
from tasks.report.regression import overall, verdict
from tasks.report.samples_file import read_samples, write_samples
from tasks.stats import verdict as test
from tasks.stats.samples import Unit, from_rows, profile_units, rows, stream_units
from tasks.tracking import Tracker

THRESHOLDS = {"ttft_ms_p50": 15.0, "ttft_ms_p99": 15.0, "itl_ms_p50": 15.0, "output_tokens_per_s": -10.0}


def run(rng, n=60, scale_ttft=1.0, scale_itl=1.0, sigma=0.1, tokens=16):
    """One run of n requests: (its logged figures, its samples), log-normal TTFT and ITL."""
    ttft = rng.lognormal(np.log(50 * scale_ttft), sigma, n)
    itl = rng.lognormal(np.log(10 * scale_itl), sigma, (n, tokens - 1))
    e2e = ttft + itl.sum(axis=1)
    records = [
        {"ttft_ms": t, "itl_ms": list(g), "e2e_ms": e, "tpot_ms": g.mean(), "output_tokens": tokens}
        for t, g, e in zip(ttft, itl, e2e)
    ]
    figures = {
        "ttft_ms_p50": float(np.quantile(ttft, 0.5)),
        "ttft_ms_p99": float(np.quantile(ttft, 0.99)),
        "itl_ms_p50": float(np.quantile(itl, 0.5)),
        "output_tokens_per_s": n * tokens / e2e.sum() * 1000,
    }
    return figures, {"stream": stream_units(records)}


def classes(rows_):
    return {row.metric: row.verdict for row in rows_}


KNOWN = test.RunSpread(0.05, 4, "five earlier runs")  # a run-to-run spread the judge may trust


def change(*args):
    return test.Change(*args, 0.0, KNOWN, 5)


def test_each_verdict_class_on_constructed_samples():
    rng = np.random.default_rng(7)
    bases, cur = [run(rng) for _ in range(3)], run(rng)
    base = ({m: float(np.median([b[0][m] for b in bases])) for m in THRESHOLDS}, None)
    figures, samples = [b[0] for b in bases], [b[1] for b in bases]
    same = verdict(cur[0], figures, THRESHOLDS, cur[1], samples)
    assert classes(same) == {
        "ttft_ms_p50": "unchanged",
        "ttft_ms_p99": "inconclusive",  # 60 requests: 0.6 beyond the p99
        "itl_ms_p50": "unchanged",
        "output_tokens_per_s": "unchanged",
        "ttft_ms_tail": "unchanged",  # the whole TTFT distribution, each run scaled to its median
    }
    assert "too few samples for p99" in same[1].note and same[1].change_pct_ci_low is None
    assert all(row.rule == "samples" and not row.regressed for row in same)
    slower = run(rng, scale_ttft=1.3, scale_itl=1.3)
    worse = verdict(slower[0], figures, THRESHOLDS, slower[1], samples)
    assert classes(worse) == {
        "ttft_ms_p50": "regressed",
        "ttft_ms_p99": "inconclusive",
        "itl_ms_p50": "regressed",
        "output_tokens_per_s": "regressed",  # throughput fell ~23 %: worse for a -10 threshold
        "ttft_ms_tail": "unchanged",  # a whole-run factor moves no tail
    }
    row = worse[0]
    assert row.change_pct_ci_low < row.change_pct < row.change_pct_ci_high and row.change_pct_ci_low > 0
    assert 20 < row.change_pct < 40 and row.p_value < 0.01
    faster = run(rng, scale_ttft=0.7, scale_itl=0.7)
    better = verdict(faster[0], figures, THRESHOLDS, faster[1], samples)
    assert (
        classes(better)["ttft_ms_p50"] == "improved" and classes(better)["output_tokens_per_s"] == "improved"
    )
    assert not any(row.regressed for row in better)
    assert base[0]["ttft_ms_p50"] == worse[0].baseline  # the baseline figure: the runs' median


def test_a_client_bound_level_moves_no_stream_verdict():
    """The same x1.3 audit that reads regressed above, its level flagged client-bound: every
    stream figure that moved reads inconclusive, saying what it read and why; the overall
    verdict is not "regressed" (the client, not the server, may have been slow)."""
    rng = np.random.default_rng(7)
    bases = [run(rng) for _ in range(3)]
    run(rng)  # the draws of the test above, so the same slower run
    slower = run(rng, scale_ttft=1.3, scale_itl=1.3)
    figures, samples = [b[0] for b in bases], [b[1] for b in bases]
    free = verdict(slower[0], figures, THRESHOLDS, slower[1], samples)
    bound = verdict(slower[0], figures, THRESHOLDS, slower[1], samples, client_bound=True)
    assert classes(free)["ttft_ms_p50"] == classes(free)["itl_ms_p50"] == "regressed"
    assert classes(bound) == {
        "ttft_ms_p50": "inconclusive",
        "ttft_ms_p99": "inconclusive",
        "itl_ms_p50": "inconclusive",
        "output_tokens_per_s": "inconclusive",
        "ttft_ms_tail": "unchanged",  # it did not move: nothing to take back
    }
    assert not any(row.regressed for row in bound) and overall(bound) == "inconclusive"
    assert bound[0].note.startswith("regressed by its figures, but the client was the bottleneck")
    assert bound[0].change_pct == free[0].change_pct  # the figures stay, only the word changes
    # the legacy rule (a side kept no samples) too
    legacy = verdict(slower[0], figures, {"ttft_ms_p50": 15.0}, client_bound=True)[0]
    assert legacy.verdict == "inconclusive" and "client was the bottleneck" in legacy.note


def test_a_baseline_of_one_run_never_reads_regressed_on_the_requests_alone():
    """30 % slower against ONE baseline run: significant on the requests (p < 0.01), but one run
    cannot show how much whole runs differ (machine load moves them): inconclusive, saying how
    many audits the baseline lacks; with a run-to-run spread known from the history, regressed."""
    rng = np.random.default_rng(7)
    base, slower = run(rng), run(rng, scale_ttft=1.3, scale_itl=1.3)
    alone = verdict(slower[0], [base[0]], {"ttft_ms_p50": 15.0}, slower[1], [base[1]])[0]
    assert alone.verdict == "inconclusive" and alone.p_value < 0.01 and not alone.regressed
    assert "a baseline of 1 audit cannot show how much whole runs differ" in alone.note
    assert "about 2 more audits in the baseline" in alone.note
    c = test.change(
        "ttft_ms_p50", slower[0]["ttft_ms_p50"], base[0]["ttft_ms_p50"], slower[1]["stream"],
        base[1]["stream"], confidence=0.95, spread=test.RunSpread(0.03, 8, "the audit history"),
    )  # fmt: skip
    assert c.spread.source == "the audit history" and c.ci_low > 15
    assert test.judge({"ttft_ms_p50": c}, {"ttft_ms_p50": 15.0}, 0.95)[0].verdict == "regressed"


def test_a_noisy_short_run_is_inconclusive_and_says_how_many_more_requests():
    rng = np.random.default_rng(3)
    bases = [run(rng, n=12, sigma=0.5) for _ in range(3)]
    cur = run(rng, n=12, sigma=0.5, scale_ttft=1.1)
    judged = verdict(cur[0], [b[0] for b in bases], {"ttft_ms_p50": 15.0}, cur[1], [b[1] for b in bases])[0]
    assert judged.verdict == "inconclusive"
    assert judged.change_pct_ci_high - judged.change_pct_ci_low > 30  # far wider than +-15 %
    more = int(judged.note.split("about ")[1].split()[0])
    half, change = (judged.change_pct_ci_high - judged.change_pct_ci_low) / 2, abs(judged.change_pct)
    target = change if change > 15 else 15 - change  # exclude no change, or fit within +-15 %
    assert more == pytest.approx(12 * ((half / target) ** 2 - 1), abs=1) and more > 0
    assert "more requests a run would settle it" in judged.note


def test_many_metrics_each_changing_a_little_raise_no_alarm_and_holm_is_step_down():
    """Twelve metrics each 16 % worse (just past the threshold), each significant alone (p =
    0.01): Holm over twelve needs p <= 0.05 / 12 for the first, so none is called regressed
    (each alone would be); twelve 5 % changes with narrow intervals are each unchanged."""
    names = [f"ttft_ms_p{q}" for q in range(40, 52)]
    little = {m: change(m, 16.0, 1.0, 31.0, 0.01, 15.0, 100) for m in names}
    judged = test.judge(little, dict.fromkeys(names, 15.0), 0.95)
    assert {j.verdict for j in judged} == {"inconclusive"}
    assert all("not significant after Holm" in j.note for j in judged)
    alone = test.judge({names[0]: little[names[0]]}, {names[0]: 15.0}, 0.95)
    assert alone[0].verdict == "regressed"
    small = {m: change(m, 5.0, -1.0, 11.0, 0.1, 6.0, 100) for m in names}
    assert {j.verdict for j in test.judge(small, dict.fromkeys(names, 15.0), 0.95)} == {"unchanged"}
    assert test.holm([0.01, 0.02, 0.04], 0.05) == [True, True, True]  # .01 <= .05/3, .02 <= .05/2, .04 <= .05
    assert test.holm([0.01, 0.03, 0.04], 0.05) == [True, False, False]  # .03 > .05/2: it stops
    assert test.holm([0.001, 0.011, 0.02], 0.05) == [True, True, True]  # Bonferroni (<= .0167) stops at 0.02
    assert test.holm([0.03, 0.001], 0.05) == [True, True]


def test_a_change_beyond_threshold_that_holm_does_not_back_is_inconclusive():
    c = change("ttft_ms_p50", 20.0, 1.0, 39.0, 0.04, 19.0, 50)
    others = {f"itl_ms_p{q}": change(f"itl_ms_p{q}", 0.0, -2.0, 2.0, 0.9, 2.0, 50) for q in (50, 90)}
    judged = test.judge(
        {"ttft_ms_p50": c, **others}, {"ttft_ms_p50": 15.0, "itl_ms_p50": 15.0, "itl_ms_p90": 15.0}, 0.95
    )
    assert judged[0].verdict == "inconclusive" and "not significant after Holm" in judged[0].note
    assert [j.verdict for j in judged[1:]] == ["unchanged", "unchanged"]


def test_several_baseline_runs_add_their_between_run_spread():
    """Five baseline runs that differ by +-10 % between runs (not within): the change's interval
    is wider than from one run's requests alone."""
    rng = np.random.default_rng(11)
    baselines = [run(rng, scale_ttft=s) for s in (0.9, 0.95, 1.0, 1.05, 1.1)]
    cur = run(rng)
    pooled = test.change(
        "ttft_ms_p50", cur[0]["ttft_ms_p50"], 50.0, cur[1]["stream"],
        [u for _, s in baselines for u in s["stream"]], confidence=0.95,
    )  # fmt: skip
    one = test.change(
        "ttft_ms_p50",
        cur[0]["ttft_ms_p50"],
        50.0,
        cur[1]["stream"],
        baselines[2][1]["stream"],
        confidence=0.95,
    )
    assert pooled.half_width > 1.3 * one.half_width


def test_samples_survive_their_file_and_profile_repeats_are_clusters(tmp_path):
    rng = np.random.default_rng(5)
    samples = run(rng, n=6)[1]
    samples["stream"][0] = Unit({**samples["stream"][0].clusters, "tpot_ms": ((),) * 6})  # no TPOT at all
    samples["profile"] = profile_units(
        {"prefill_ms_runs": [3.0, 3.5], "decode_ms_runs": [[1.0, 1.1], [1.2, 1.3]]}
    )
    assert samples["profile"][0].size == 2 and samples["profile"][0].count("decode_ms") == 4
    assert from_rows(rows(samples)) == samples
    path = write_samples(samples, tmp_path / SAMPLES_ARTIFACT)
    assert read_samples(path) == samples
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a samples file"):
        read_samples(tmp_path / "bad.parquet")
    assert stream_units([{"warmup": True, "ttft_ms": 1.0}, {"ttft_ms": None, "error": {"class": "x"}}]) == []


def test_a_baseline_without_samples_is_judged_by_the_legacy_rule_with_a_note(tmp_path):
    tracker = Tracker("verdict", f"sqlite:///{tmp_path / 'mlflow.db'}")
    ident = {"flow": "audit", "endpoint_kind": "llama.cpp", "endpoint_model": "m", "model": "gguf:default"}
    rng = np.random.default_rng(9)
    cfg = RegressionConfig(thresholds_pct=THRESHOLDS, min_baseline_audits=1)  # one audit: judged
    old, new = run(rng), run(rng)
    legacy = tracker.start_run("logged before samples", tags=ident)
    tracker.log_metrics(legacy, old[0])
    tracker.end_run(legacy)
    current = tracker.start_run("now", tags=ident)
    result = judge(tracker, current, new[0], ident, cfg, new[1])
    assert {row.rule for row in result.rows} == {"legacy"} and "legacy rule" in result.rows[0].note
    assert result.rows[0].change_pct_ci_low is None and "legacy rule" in result.markdown()
    # the same baseline with its samples kept: the test, intervals in the json and the markdown
    tracker.log_artifact(legacy, write_samples(old[1], tmp_path / SAMPLES_ARTIFACT))
    result = judge(tracker, current, new[0], ident, cfg, new[1])
    row = result.to_dict()["rows"][0]
    # one baseline audit: the run-to-run spread is the prior's alone (5 % worth 3 runs), wider
    # than the threshold leaves room for: never "unchanged" on a guess
    assert row["rule"] == "samples" and row["verdict"] == "inconclusive"
    assert row["run_spread"]["source"] == "the prior" and row["run_spread"]["audits"] == 0
    assert row["run_spread"]["run_spread_pct"] == pytest.approx(5.0, abs=0.1)
    assert row["change_pct_ci_low"] < -15 < row["change_pct"] < 15 < row["change_pct_ci_high"]
    assert "| ttft_ms_p50 |" in result.markdown() and " .. " in result.markdown()
    assert tracker.runs_by_id([current])[0]["tags"]["verdict.ttft_ms_p50"] == "inconclusive"
    # an unreadable samples artifact: the legacy rule again, never a crash
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / SAMPLES_ARTIFACT).write_text("garbage")
    other = tracker.start_run("broken samples", tags=ident)
    tracker.log_metrics(other, old[0])
    tracker.log_artifact(other, tmp_path / "broken" / SAMPLES_ARTIFACT)
    tracker.end_run(other)
    result = judge(
        tracker,
        current,
        new[0],
        ident,
        RegressionConfig(thresholds_pct=THRESHOLDS, baseline_run_id=other),
        new[1],
    )
    assert {row.rule for row in result.rows} == {"legacy"}
    # the last audits, one with samples and one without: judged on the one that kept them
    result = judge(tracker, current, new[0], ident, cfg, new[1])
    assert {row.rule for row in result.rows} == {"samples"} and result.baseline_run_ids == [legacy]
    assert "1 of them kept samples" in result.baseline_label


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5])
def test_a_confidence_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError, match="confidence"):
        RegressionConfig(confidence=bad)


def test_metrics_without_samples_non_finite_figures_and_empty_samples_never_crash():
    """requests_per_s has no samples behind it: judged by the legacy rule (and can regress); a
    NaN figure is inconclusive, not a crash; an empty samples file keeps nothing: legacy."""
    rng = np.random.default_rng(13)
    base, cur = run(rng), run(rng)
    thresholds = {"ttft_ms_p50": 15.0, "requests_per_s": -10.0}
    rows_ = verdict(
        {**cur[0], "requests_per_s": 1.0}, [{**base[0], "requests_per_s": 2.0}], thresholds, cur[1], [base[1]]
    )
    assert [(r.metric, r.rule, r.verdict) for r in rows_] == [
        ("ttft_ms_p50", "samples", "unchanged"),
        ("requests_per_s", "legacy", "regressed"),
    ]
    assert rows_[1].regressed and "no samples define this metric" in rows_[1].note
    nan = verdict(
        {**cur[0], "ttft_ms_p50": float("nan")}, [base[0]], {"ttft_ms_p50": 15.0}, cur[1], [base[1]]
    )
    assert nan[0].verdict == "inconclusive" and nan[0].change_pct is None
    legacy_nan = verdict({"ttft_ms_p50": float("nan")}, [base[0]], {"ttft_ms_p50": 15.0})
    assert legacy_nan[0].verdict == "inconclusive" and legacy_nan[0].change_pct is None
    empty = verdict(cur[0], [base[0]], {"ttft_ms_p50": 15.0}, {}, [base[1]])
    assert empty[0].rule == "legacy"


def test_one_current_run_borrows_the_baselines_run_to_run_spread():
    """No true change, but runs differ by 8 % as a whole: with five baseline runs and one current,
    the change's interval carries the between-run spread (the baseline runs' spread, Student's t
    on the Satterthwaite degrees of freedom), so it excludes no change rarely: about 15 of 40
    such trials without the borrowing (the within-run interval alone)."""
    rng = np.random.default_rng(17)
    alarms = 0
    for _ in range(40):
        baselines = [run(rng, n=50, scale_ttft=float(rng.lognormal(0, 0.08))) for _ in range(5)]
        cur = run(rng, n=50, scale_ttft=float(rng.lognormal(0, 0.08)))
        base_p50 = float(np.median([b[0]["ttft_ms_p50"] for b in baselines]))
        c = test.change(
            "ttft_ms_p50", cur[0]["ttft_ms_p50"], base_p50, cur[1]["stream"],
            [u for _, s in baselines for u in s["stream"]], confidence=0.95, resamples=500,
        )  # fmt: skip
        alarms += c.ci_low > 0 or c.ci_high < 0
    assert alarms <= 6, alarms  # <= 15 % of 40 (nominal 5 %; without the borrowing ~15 of 40)


def test_a_baseline_of_three_borrows_the_historys_spread_when_it_knows_it_on_more_df():
    """Three baseline runs whose own spread came out wide by chance (sd 11 % on 2 degrees of
    freedom: Student's t(2) at Holm's level hides a x1.3 change); the history's spread (with its
    prior: 5 % known on 8 degrees of freedom) is taken instead, the baseline's runs kept as they
    are (the spread's draws carry their mean's 1/U), and the change is regressed; a spread known
    on 2 degrees of freedom only is wide again."""
    rng = np.random.default_rng(4)
    bases = [run(rng, n=50, scale_ttft=s, sigma=0.25) for s in (0.93, 1.0, 1.07)]
    cur = run(rng, n=50, scale_ttft=1.3, sigma=0.25)
    base = float(np.median([b[0]["ttft_ms_p50"] for b in bases]))
    units = [u for _, s in bases for u in s["stream"]]

    def judged(spread):
        c = test.change(
            "ttft_ms_p50",
            cur[0]["ttft_ms_p50"],
            base,
            cur[1]["stream"],
            units,
            confidence=0.95,
            spread=spread,
        )
        return c, test.judge({"ttft_ms_p50": c}, {"ttft_ms_p50": 15.0}, 0.95)[0].verdict

    own, verdict_own = judged(None)
    assert own.spread.source == "the 3 baseline runs" and own.spread.df == 2 and own.spread.sd_log > 0.08
    assert verdict_own == "inconclusive" and own.ci_low < 0
    few, _ = judged(test.RunSpread(0.05, 2, "the audit history (3 audits)"))
    pooled, verdict_pooled = judged(test.RunSpread(0.05, 8, "the audit history (10 audits)"))
    assert pooled.spread.source == "the audit history (10 audits)" and pooled.ci_low > 0
    assert verdict_pooled == "regressed"
    assert few.ci_high - few.ci_low > 1.2 * (pooled.ci_high - pooled.ci_low)  # t(2) vs t(8) tails


def _drawn(metric, log_change, draws):
    """A Change of ``log_change`` whose joint draws are ``draws`` (log factors about it)."""
    pct = 100 * float(np.expm1(log_change))
    return test.Change(metric, pct, 0.0, 0.0, 0.0, 1.0, 50, 0.0, KNOWN, 5, draws)


def test_max_t_corrects_metrics_that_move_together_less_than_holm_and_independent_ones_alike():
    """Eight metrics each 2.5 sd from no change (raw p ~ 0.012): drawn as one (the same run
    factor moves them all), the step-down max-T adjusts each hardly (the maximum of eight equal
    statistics is one of them), where Holm would multiply the smallest by 8; drawn independently
    it adjusts about as Holm does (Westfall & Young 1993: exact for independence, less for
    correlation)."""
    rng = np.random.default_rng(3)
    shared = rng.standard_normal(20_000) * 0.1
    names = [f"ttft_ms_p{q}" for q in range(40, 48)]
    together = {m: _drawn(m, 0.25, shared) for m in names}
    adjusted = test.max_t_adjusted(together)
    assert all(0.008 < p < 0.02 for p in adjusted.values()), adjusted
    apart = {m: _drawn(m, 0.25, rng.standard_normal(20_000) * 0.1) for m in names}
    adjusted = test.max_t_adjusted(apart)
    assert all(0.06 < p < 0.12 for p in adjusted.values()), adjusted  # Holm's 8 x 0.0124 = 0.099
    # without aligned draws: Holm's adjusted p-values
    plain = {m: change(m, 20.0, 10.0, 30.0, p, 10.0, 50) for m, p in zip(names[:3], (0.01, 0.03, 0.04))}
    assert test.max_t_adjusted(plain) == pytest.approx({names[0]: 0.03, names[1]: 0.06, names[2]: 0.06})
    # never below a change's own p-value (the percentile reading of its draws, floor 2 / (n + 1))
    alone = {names[0]: replace(_drawn(names[0], 0.6, shared), p_value=0.002)}
    assert test.max_t_adjusted(alone)[names[0]] == 0.002  # max-T alone: 1 / 20001


def test_the_family_and_the_tails_share_alpha_by_weighted_holm():
    """The metrics' family has 0.8 of alpha while the tail's two hypotheses are open, 0.1 each;
    a rejected tail hypothesis hands its share on (step-down)."""
    tails = {"ttft_ms_tail:worse": 0.3, "ttft_ms_tail:better": 0.9}
    assert test.family_rejected({"a": 0.039}, tails, 0.05)["a"]  # 0.039 <= 0.05 x 0.8
    assert not test.family_rejected({"a": 0.041}, tails, 0.05)["a"]
    worse = {"ttft_ms_tail:worse": 0.004, "ttft_ms_tail:better": 0.9}  # 0.004 <= 0.005: rejected
    out = test.family_rejected({"a": 0.043}, worse, 0.05)
    assert out["ttft_ms_tail:worse"] and out["a"]  # then 0.8 / 0.9 of alpha: 0.044
    assert test.family_rejected({"a": 0.049}, {}, 0.05)["a"]  # no tail: all of alpha
