"""Confidence intervals of a level's figures (issue 21, part 1: tasks.stats.interval): the
percentile bootstrap holds the true value about as often as it says, on data of known
distribution, and is replayed by its seed."""

from __future__ import annotations

import math
import random

import pytest

from tasks.stats import percentile
from tasks.stats.interval import bootstrap_interval, enough_for


def _coverage(stat: str, true_value: float, draw, n: int, trials: int = 200) -> float:
    rng = random.Random(7)
    hits = 0
    for trial in range(trials):
        interval = bootstrap_interval([draw(rng) for _ in range(n)], stat, seed=trial)
        hits += interval.low <= true_value <= interval.high
    return hits / trials


@pytest.mark.parametrize(
    ("stat", "true_value"),
    [("mean", 1.0), ("p50", math.log(2)), ("p90", math.log(10))],  # exponential(1): quantile -ln(1-q)
)
def test_a_95_percent_interval_holds_the_true_value_in_90_to_99_percent_of_200_draws(stat, true_value):
    covered = _coverage(stat, true_value, lambda rng: rng.expovariate(1.0), n=200)
    assert 0.90 <= covered <= 0.99, covered


def test_a_lognormal_tail_like_latencies_is_covered_too():
    # TTFT-like: log-normal, median 100 ms, sigma 0.5; p90 = 100 * exp(0.5 * 1.2816)
    true_p90 = 100 * math.exp(0.5 * 1.2815516)
    covered = _coverage("p90", true_p90, lambda rng: rng.lognormvariate(math.log(100), 0.5), n=300)
    assert 0.90 <= covered <= 0.99, covered


def test_the_value_is_the_projects_percentile_and_the_seed_replays_the_interval():
    rng = random.Random(1)
    values = [rng.gauss(50, 10) for _ in range(101)]
    a = bootstrap_interval(values, "p90", seed=3)
    assert a.value == pytest.approx(percentile(sorted(values), 90))
    assert a == bootstrap_interval(values, "p90", seed=3) != bootstrap_interval(values, "p90", seed=4)
    assert a.low <= a.value <= a.high and a.count == 101 and a.confidence == 0.95
    wider = bootstrap_interval(values, "p90", seed=3, confidence=0.99)
    assert wider.low <= a.low and wider.high >= a.high
    assert bootstrap_interval([None, 3.0, float("nan")], "mean") is None  # one value: no interval


def test_more_samples_narrow_the_interval_as_one_over_root_n():
    rng = random.Random(2)
    small = bootstrap_interval([rng.expovariate(1) for _ in range(400)], "mean", seed=0)
    large = bootstrap_interval([rng.expovariate(1) for _ in range(6400)], "mean", seed=0)
    assert large.half_width == pytest.approx(small.half_width / 4, rel=0.25)  # sqrt(16) = 4


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_interval([1.0, 2.0], "mean", confidence=1.0)
    with pytest.raises(ValueError, match="stat"):
        bootstrap_interval([1.0, 2.0], "median")
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_interval([1.0, 2.0], "mean", resamples=10)


def test_a_percentile_needs_samples_beyond_it():
    assert not enough_for("p99", 400) and enough_for("p99", 500) and enough_for("p50", 10)
    assert enough_for("mean", 2) and not enough_for("mean", 1)


def test_figure_intervals_resample_requests_within_repeats_and_repeats_too():
    """Three repeats that differ by +-20 % as a whole (within each, 60 requests of +-5 %): the
    two-level interval of TTFT p50 is wider than one repeat's, and a request's ITL gaps move
    together (one slow request: its gaps are drawn as one)."""
    from tasks.stats.interval import LEVEL_INTERVAL_FIGURES, figure_intervals, with_intervals
    from tasks.stats.samples import Unit

    rng = random.Random(3)

    def unit(scale):
        ttft = tuple((scale * rng.lognormvariate(math.log(50), 0.05),) for _ in range(60))
        itl = tuple(tuple(rng.lognormvariate(math.log(10), 0.05) for _ in range(15)) for _ in range(60))
        return Unit({"ttft_ms": ttft, "itl_ms": itl, "tpot_ms": ttft, "e2e_ms": ttft, "output_tokens": ttft})

    one, three = [unit(1.0)], [unit(0.8), unit(1.0), unit(1.2)]
    narrow = figure_intervals(one, LEVEL_INTERVAL_FIGURES)
    wide = figure_intervals(three, ["ttft_ms_p50"])
    assert narrow["ttft_ms_p50_ci_low"] < 50 * 1.02 and narrow["ttft_ms_p50_ci_high"] > 50 * 0.98
    assert (wide["ttft_ms_p50_ci_high"] - wide["ttft_ms_p50_ci_low"]) > 4 * (
        narrow["ttft_ms_p50_ci_high"] - narrow["ttft_ms_p50_ci_low"]
    )
    assert set(narrow) == {f"{f}_{end}" for f in LEVEL_INTERVAL_FIGURES for end in ("ci_low", "ci_high")}
    assert figure_intervals([Unit({"ttft_ms": ((1.0,),)})], ["ttft_ms_p50", "nope_p50"]) == {
        "ttft_ms_p50_ci_low": None, "ttft_ms_p50_ci_high": None, "nope_p50_ci_low": None, "nope_p50_ci_high": None,
    }  # fmt: skip
    assert with_intervals(["ttft_ms_p50", "x"], {"ttft_ms_p50": 1.0, "ttft_ms_p50_ci_low": 0.5}) == {
        "ttft_ms_p50": 1.0, "ttft_ms_p50_ci_low": 0.5, "x": None,
    }  # fmt: skip
