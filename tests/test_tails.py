"""Tail shifts (tasks.stats.tails, issue 28 item 4): the exceedance distribution against brute
force, the 15 % x4 TTFT tail caught and named, no change and a whole-run scale shift not read as a
tail move, a tail that went away read as better, ITL's request permutation, and the cases with
too little to judge."""

import itertools
import math

import numpy as np
import pytest

from tasks.stats import tails
from tasks.stats.samples import Unit
from tasks.stats.tails import describe, exceedance_pmf, tail_shift


def ttft_run(rng, n=50, sigma=0.25, scale=1.0, tail_share=0.0, tail_factor=4.0):
    """One run's TTFTs (ms): 80 ms x exp(sigma z) x scale; exactly ``tail_share`` of the
    requests x ``tail_factor``."""
    values = 80.0 * scale * np.exp(sigma * rng.standard_normal(n))
    values[rng.permutation(n) < round(tail_share * n)] *= tail_factor
    return values


def unit(values, family="ttft_ms"):
    return Unit({family: tuple((float(v),) for v in values)})


def runs(rng, count, **kwargs):
    return [unit(ttft_run(rng, **kwargs)) for _ in range(count)]


def test_exceedance_pmf_matches_brute_force():
    # every arrangement of n new and m old values' ranks is equally likely under no change
    n, m = 3, 5
    for j in range(1, m + 1):
        counts = np.zeros(n + 1)
        for new in itertools.combinations(range(n + m), n):  # the positions of the new values, largest first
            old = [r for r in range(n + m) if r not in new]
            counts[sum(1 for r in new if r < old[j - 1])] += 1
        assert exceedance_pmf(n, m, j) == pytest.approx(counts / math.comb(n + m, n), abs=1e-12)
    pmf = exceedance_pmf(50, 150, 2)
    assert pmf.sum() == pytest.approx(1.0) and (np.arange(51) * pmf).sum() == pytest.approx(50 * 2 / 151)
    with pytest.raises(ValueError):
        exceedance_pmf(5, 3, 4)


def test_the_fifteen_percent_x4_tail_is_caught_and_named():
    rng = np.random.default_rng(28)
    baseline = runs(rng, 3)
    shift = tail_shift([unit(ttft_run(rng, tail_share=0.15))], baseline)
    assert isinstance(shift, tails.TailShift)
    assert shift.p_value < 0.01 and shift.p_worse < 0.005 and shift.direction == "worse"
    assert shift.share_beyond_pct >= 15.0  # the 8 slow requests lie beyond the baseline's p99
    assert shift.expected_share_pct == pytest.approx(100 * 2 / 151)  # the 2nd largest of 150
    assert shift.change_pct > 100
    text = describe(shift)
    assert text.startswith(
        f"ttft_ms tail: {shift.share_beyond_pct:.0f} % of requests beyond the baseline's p99"
    )
    assert "(1.3 % expected)" in text and f"p99 {shift.change_pct:+.0f} %" in text


def test_identical_distributions_are_no_tail_move():
    rng = np.random.default_rng(7)
    shift = tail_shift(runs(rng, 1), runs(rng, 3))
    assert isinstance(shift, tails.TailShift)
    assert shift.p_value > 0.05 and shift.share_beyond_pct < 10


def test_a_whole_run_scale_shift_is_not_a_tail_move():
    rng = np.random.default_rng(3)
    baseline = runs(rng, 5, sigma=0.1)
    values = ttft_run(rng, sigma=0.1)
    same = tail_shift([unit(values)], baseline)
    for scale in (0.7, 1.3):  # every request of the run x scale: the scaled values are the same
        moved = tail_shift([unit(values * scale)], baseline)
        assert moved.p_value == same.p_value and moved.share_beyond_pct == same.share_beyond_pct
        assert moved.p_value > 0.05
        assert moved.current_value == pytest.approx(same.current_value * scale)  # the raw p99 moved


def test_false_alarms_stay_at_alpha_when_runs_shift():
    # the test's p-values are valid: under no change, with whole runs moved by exp(0.1 z), at most
    # about alpha of seeds reject (400 seeds: binomial sd 1.1 %); raw values would reject ~20 %
    rng = np.random.default_rng(11)
    p = []
    for _ in range(400):
        base = [unit(ttft_run(rng, scale=math.exp(0.1 * rng.standard_normal()))) for _ in range(3)]
        cur = [unit(ttft_run(rng, scale=math.exp(0.1 * rng.standard_normal())))]
        p.append(tail_shift(cur, base).p_value)
    assert 0.005 < np.mean(np.array(p) < 0.05) < 0.07


def test_a_tail_that_went_away_reads_better():
    rng = np.random.default_rng(5)
    baseline = runs(rng, 3, tail_share=0.15)
    shift = tail_shift(runs(rng, 1), baseline)
    assert shift.direction == "better" and shift.p_better < 0.001 and shift.p_value < 0.002
    assert shift.baseline_share_beyond_pct > 10 and shift.change_pct < -50
    assert "of the baseline's beyond this run's p99" in describe(shift)


def itl_run(rng, n=50, tokens=16, tail_share=0.0):
    """One run's ITL gaps (ms), a request's gaps a cluster; ``tail_share`` of requests x4."""
    gaps = 10.0 * np.exp(0.2 * rng.standard_normal((n, tokens - 1)))
    gaps[rng.permutation(n) < round(tail_share * n)] *= 4.0
    return Unit({"itl_ms": tuple(tuple(float(g) for g in row) for row in gaps)})


def test_itl_gaps_are_permuted_by_request():
    rng = np.random.default_rng(2)
    baseline = [itl_run(rng) for _ in range(3)]
    slow = tail_shift([itl_run(rng, tail_share=0.15)], baseline, family="itl_ms", seed=1)
    assert slow.p_value < 0.01 and slow.direction == "worse" and "permutations of requests" in slow.method
    assert describe(slow).startswith("itl_ms tail: ") and " % of gaps beyond" in describe(slow)
    same = tail_shift([itl_run(rng)], baseline, family="itl_ms", seed=1)
    assert same.p_value > 0.05


def test_the_permutation_agrees_with_the_exact_distribution():
    rng = np.random.default_rng(4)
    cur = tails._side([unit(ttft_run(rng, tail_share=0.06, tail_factor=2.0))], "ttft_ms", "current")
    base = tails._side(runs(rng, 3), "ttft_ms", "baseline")
    j = tails._edge_rank(150, 0.95)
    beyond = int(np.sum(cur.scaled > tails._edge(base.scaled, j)))
    exact = float(exceedance_pmf(50, 150, j)[beyond:].sum())
    p_worse, _ = tails._permutation_p(cur, base, 0.95, np.random.default_rng(0))
    assert 0.005 < exact < 0.5  # a p-value the comparison can tell apart
    assert p_worse == pytest.approx(exact, abs=0.02)  # 4000 permutations: sd <= 0.008


def test_too_little_to_judge_says_why():
    rng = np.random.default_rng(1)
    baseline = runs(rng, 3)
    assert "too few ttft_ms values in a current run" in tail_shift([unit(ttft_run(rng, n=5))], baseline)
    two_small = [unit(ttft_run(rng, n=8)), unit(ttft_run(rng, n=8))]  # 16 values, runs of 8
    assert "to scale it by its median" in tail_shift(two_small, baseline)
    assert "none beyond it" in tail_shift(runs(rng, 1), runs(rng, 1))  # 50 values: no p99
    assert tail_shift(runs(rng, 1), baseline, family="e2e_ms") == "no e2e_ms values in the current run"
    tokens = [unit(np.full(50, 16.0), "output_tokens")]
    assert "ties at the p99" in tail_shift(tokens, tokens * 3, family="output_tokens")
    with pytest.raises(ValueError):
        tail_shift(runs(rng, 1), baseline, quantile=1.0)
