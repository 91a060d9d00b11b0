"""Change points over an audit history and the baseline they leave (tasks.stats.changepoint,
issue 28), on planted run-level histories: seeded log-normal noise around known levels, so each
change point and each baseline run is known in advance. Rates over many histories are measured
by tests/benchmarks/changepoints.py; these are single histories with exact answers."""

import math

import numpy as np
import pytest

from tasks.stats import changepoint as cp
from tasks.stats import stretch

# Four headline figures of an audit: (level, each run's own 95 % half-width as a share of it).
METRICS = {
    "ttft_ms_p50": (100.0, 0.09),
    "ttft_ms_p90": (165.0, 0.15),
    "tpot_ms_mean": (10.0, 0.04),
    "output_tokens_per_s": (90.0, 0.05),
}
NORMAL, SLOW, FAST = 1.0, 1.35, 0.7


def history(levels, seed=1, tail=(), shared_sd=0.04, own_sd=0.02):
    """(series, half_widths) of audits at ``levels`` (latency factor per audit: 1.35 = everything
    35 % slower, throughput divided by it): a run factor shared by all figures (machine load) and
    each figure's own noise, both log-normal. ``tail``: audits whose TTFT p90 alone is x 2.2 (15 %
    of requests waiting 4x longer for the first token)."""
    rng = np.random.default_rng(seed)
    levels = np.asarray(levels, dtype=float)
    shared = np.exp(rng.normal(0.0, shared_sd, levels.size))
    series, widths = {}, {}
    for metric, (level, half_width) in METRICS.items():
        factor = levels * shared * np.exp(rng.normal(0.0, own_sd, levels.size))
        figures = level / factor if metric.endswith("_per_s") else level * factor
        if metric == "ttft_ms_p90":
            figures[list(tail)] *= 2.2
        series[metric] = [float(v) for v in figures]
        widths[metric] = [float(v) * half_width for v in figures]
    return series, widths


def one_metric(levels, seed=1, sd=0.05):
    rng = np.random.default_rng(seed)
    return 100.0 * np.asarray(levels, dtype=float) * np.exp(rng.normal(0.0, sd, len(levels)))


# --- change_points, one metric -------------------------------------------------------------


def test_a_step_is_found_where_it_was_planted():
    values = one_metric([NORMAL] * 8 + [1.3] * 12)
    assert cp.change_points(values) == [8]
    assert cp.change_points(values, [v * 0.1 for v in values]) == [8]


def test_no_change_gives_no_change_point():
    assert cp.change_points(one_metric([NORMAL] * 20)) == []


def test_a_step_up_and_back_gives_two_change_points():
    assert cp.change_points(one_metric([NORMAL] * 6 + [1.3] * 6 + [NORMAL] * 8)) == [6, 12]


def test_a_short_historys_step_up_and_back_is_found():
    """A new user's audits: 4 at 22 ms, 3 at 42 ms, 4 back at 22 (1 % between runs). The
    permutation test cannot reach p 0.02 on 11 audits whatever the step: the step was missed and
    every verdict after the way back judged against a baseline spanning both levels."""
    values = (
        22.0
        * np.array([NORMAL] * 4 + [1.9] * 3 + [NORMAL] * 4)
        * np.exp(np.random.default_rng(1).normal(0.0, 0.01, 11))
    )
    assert cp.change_points(values) == [4, 7]
    assert cp.change_points(one_metric([NORMAL] * 11, sd=0.01)) == []  # no step, no point
    assert cp.change_points(one_metric([NORMAL] * 4 + [1.03] * 3 + [NORMAL] * 4, sd=0.01)) == []


def test_a_single_outlier_makes_no_change_point():
    levels = [NORMAL] * 20
    levels[9] = 1.5
    assert cp.change_points(one_metric(levels)) == []


def test_a_step_within_the_runs_own_intervals_is_dropped():
    # +4 % with 1 % between runs: E-Divisive sees it; runs whose own intervals are +- 12 % cannot
    # resolve it (the difference of the means from their intervals: +- 12 x sqrt(1/8 + 1/12) =
    # 5.5 %), runs of +- 2 % can (0.9 %)
    values = one_metric([NORMAL] * 8 + [1.04] * 12, sd=0.01)
    assert cp.change_points(values) == [8]
    assert cp.change_points(values, [v * 0.12 for v in values]) == []
    assert cp.change_points(values, [v * 0.02 for v in values]) == [8]
    assert cp.change_points(values, [None] * 20) == [8]  # unknown intervals filter nothing


def test_missing_values_are_skipped_and_positions_kept():
    values = list(one_metric([NORMAL] * 8 + [1.3] * 12))
    values[8] = math.nan  # the first run after the step lacks the figure
    values[3] = None
    assert cp.change_points(values) == [9]


@pytest.mark.parametrize("n", [0, 1, 2, 4])
def test_short_histories_have_no_change_point(n):
    assert cp.change_points(one_metric([NORMAL] * n)) == []


def test_change_points_rejects_bad_input():
    with pytest.raises(ValueError):
        cp.change_points(np.ones((4, 2)))
    with pytest.raises(ValueError):
        cp.change_points([1.0, 2.0, 3.0], [0.1, 0.1])
    with pytest.raises(ValueError):
        cp.change_points([1.0, 2.0, 3.0], [0.1, -0.1, 0.1])


def test_segments_and_their_means():
    values = [1.0, 3.0, math.nan, 10.0, 12.0, 20.0]
    assert cp.segments(values, [3, 5]) == [
        cp.Segment(0, 3, 2.0),
        cp.Segment(3, 5, 11.0),
        cp.Segment(5, 6, 20.0),
    ]
    assert cp.segments(values, []) == [cp.Segment(0, 6, pytest.approx(46.0 / 5))]
    assert cp.segments([], []) == []
    for bad in ([0], [6], [3, 3], [4, 2]):
        with pytest.raises(ValueError):
            cp.segments(values, bad)


# --- choose_baseline -----------------------------------------------------------------------


def choose(levels, verdicts, **kwargs):
    tail = kwargs.pop("tail", ())
    series, widths = history(levels, tail=tail, seed=kwargs.pop("seed", 1))
    return stretch.choose_baseline(series, widths, verdicts, **kwargs)


def test_a_regressed_audit_does_not_join_the_baseline():
    choice = choose([NORMAL] * 3 + [SLOW], [None, None, None, "regressed"])
    assert choice == stretch.BaselineChoice(
        (0, 1, 2),
        None,
        (3,),
        True,
        "the 3 audits of the history (no change point) (audit 4 left out: a change not yet confirmed by a later audit)",
    )


def test_regressed_then_a_tail_then_improved_keep_the_first_three():
    # The sequence: everything 35 % slower; then only TTFT p90 up; then 30 % faster.
    choice = choose(
        [NORMAL] * 3 + [SLOW, NORMAL, FAST], [None] * 3 + ["regressed", "regressed", "improved"], tail=(4,)
    )
    assert choice.indices == (0, 1, 2)
    assert choice.change_point is None
    assert choice.excluded == (3, 4, 5)
    assert choice.enough
    assert choice.note == (
        "the 3 audits of the history (no change point) (audits 4, 5 left out: a departure the next "
        "audits did not repeat; audit 6 left out: a change not yet confirmed by a later audit)"
    )


def test_a_regression_the_next_audit_repeats_is_the_new_normal():
    choice = choose([NORMAL] * 3 + [SLOW, SLOW], [None] * 3 + ["regressed", "regressed"])
    assert choice == stretch.BaselineChoice(
        (3, 4), 3, (), False, "only 2 audits since the change point at audit 4: judged on those", (3,)
    )


def test_an_improvement_after_a_confirmed_regression_waits_for_confirmation():
    choice = choose([NORMAL] * 3 + [SLOW, SLOW, NORMAL], [None] * 3 + ["regressed", "regressed", "improved"])
    assert (choice.indices, choice.change_point, choice.excluded, choice.enough) == ((3, 4), 3, (5,), False)


def test_no_change_takes_the_newest_max_runs():
    choice = choose([NORMAL] * 12, [None] * 6 + ["unchanged"] * 6)
    assert choice == stretch.BaselineChoice(
        tuple(range(2, 12)), None, (), True, "the newest 10 of the 12 audits of the history (no change point)"
    )
    assert choose([NORMAL] * 12, [None] * 12, max_runs=5).indices == (7, 8, 9, 10, 11)


def test_a_step_up_and_back_takes_the_runs_since_the_second():
    levels = [NORMAL] * 6 + [1.3] * 6 + [NORMAL] * 6
    for verdicts in ([None] * 18, [None] * 6 + ["regressed"] + [None] * 5 + ["improved"] + [None] * 5):
        choice = choose(levels, verdicts)
        assert (choice.indices, choice.change_point, choice.excluded) == (tuple(range(12, 18)), 12, ())
        assert choice.note == "the 6 audits since the change point at audit 13"


def test_a_short_step_up_and_back_takes_the_runs_since_the_way_back():
    choice = choose([NORMAL] * 4 + [1.9] * 3 + [NORMAL] * 4, [None] * 11)
    assert (choice.indices, choice.change_point, choice.change_points) == ((7, 8, 9, 10), 7, (4, 7))


def test_a_slow_drift_is_cut_where_the_steps_are_large_enough():
    # +30 % over 20 audits, 1.5 % an audit against 4-5 % of noise: documented outcome
    # (docs/DESIGN.md, "Change points"): the history is cut where the stretches on either side
    # differ by two run-to-run sds, and the baseline is the newest max_runs since the last cut,
    # so each audit is compared with the recent level, not the level of 20 audits ago.
    levels = np.linspace(1.0, 1.3, 20)
    choice = choose(levels, [None] * 20)
    assert (choice.change_point, choice.indices, choice.excluded) == (7, tuple(range(10, 20)), ())
    assert levels[list(choice.indices)].max() / levels[list(choice.indices)].min() < 1.15


def test_a_single_outlier_makes_no_change_point_and_stays_out():
    levels = [NORMAL] * 10
    levels[6] = 1.5
    for verdict in (None, "regressed", "inconclusive"):
        verdicts = [None] * 10
        verdicts[6] = verdict
        choice = choose(levels, verdicts)
        assert (choice.indices, choice.change_point, choice.excluded) == (
            (0, 1, 2, 3, 4, 5, 7, 8, 9),
            None,
            (6,),
        )
        assert choice.note == (
            "the 9 audits of the history (no change point) (audit 7 left out: a departure the next audits did not repeat)"
        )


def test_a_history_shorter_than_min_runs_is_used_whole():
    choice = choose([NORMAL] * 2, [None, "inconclusive"])
    assert choice == stretch.BaselineChoice(
        (0, 1), None, (), False, "only 2 audits in the history: judged on those"
    )
    assert choose([NORMAL], [None]).note == "only 1 audit in the history: judged on those"


def test_an_empty_history_says_so():
    choice = stretch.choose_baseline({m: [] for m in METRICS}, {}, [])
    assert choice == stretch.BaselineChoice(
        (), None, (), False, "no earlier audit of this endpoint and model: nothing to judge against"
    )


def test_metrics_missing_from_old_runs_and_unknown_intervals():
    series, widths = history([NORMAL] * 4 + [SLOW] * 3)
    series["tpot_ms_mean"][:4] = [math.nan] * 4  # not measured before audit 4
    widths = {"ttft_ms_p50": widths["ttft_ms_p50"]}  # the others' intervals unknown
    choice = stretch.choose_baseline(series, widths, [None] * 4 + ["regressed", "regressed", "unchanged"])
    assert (choice.indices, choice.change_point, choice.excluded, choice.enough) == ((4, 5, 6), 4, (), True)


def test_choose_baseline_rejects_bad_input():
    series, widths = history([NORMAL] * 4)
    with pytest.raises(ValueError):
        stretch.choose_baseline(series, widths, [None] * 3)
    with pytest.raises(ValueError):
        stretch.choose_baseline(series, {"ttft_ms_p50": [1.0]}, [None] * 4)
    with pytest.raises(ValueError):
        stretch.choose_baseline(series, widths, [None] * 4, confirm=0)


def test_a_verdict_no_figure_explains_is_left_out():
    # judged regressed on a figure this history does not hold: none moved beyond its interval
    series = {"ttft_ms_p50": [100.0, 101.0, 99.0, 100.0, 100.5, 99.5]}
    choice = stretch.choose_baseline(
        series, {"ttft_ms_p50": [9.0] * 6}, [None] * 3 + ["regressed", None, None]
    )
    assert choice == stretch.BaselineChoice(
        (0, 1, 2, 4, 5),
        None,
        (3,),
        True,
        "the 5 audits of the history (no change point) (audit 4 left out: judged regressed/improved, "
        "no figure beyond its interval)",
    )
