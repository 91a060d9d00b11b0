"""Change points in an audit history, and the baseline they leave (issue 28).

A nightly audit's verdict needs a baseline: the earlier audits that show the endpoint's normal.
"The median of the last five audits" lets a regressed audit join that normal and blinds every
verdict after it. Here the baseline is the stable stretch since the last *confirmed* change
point of the history, found metric by metric on the run-level figures (one value per audit:
``ttft_ms_p50``, ``itl_ms_p90``, ``output_tokens_per_s`` ...).

- :func:`change_points`: the change points of one metric's history. Found by Apache Otava's
  E-Divisive (``otava.analysis.compute_change_points_orig``: Matteson & James, "A Nonparametric
  Approach for Multiple Change Point Analysis of Multivariate Data", JASA 109, 2014; the
  library is DataStax Hunter's successor: Fleming et al., ICPE 2023), then kept only where the
  step is larger than the runs' own intervals say their figures are uncertain.
- :func:`segments`: the stretches between change points with their means.
- :func:`choose_baseline`: the runs a new audit is judged against, and why.

Why Otava's E-Divisive and not MongoDB's ``signal-processing-algorithms`` (Daly et al., ICPE
2020): measured on planted histories of 20 audits by ``tests/benchmarks/changepoints.py``
(docs/DESIGN.md, "Change points", has the table). Both find a +30 % step within one audit (95-100
%), both rarely mark a noise-only history (3-5 %) or a single outlier. MongoDB's finds both ends
of a step up and back again in 30-49 % of histories, Otava's in 74-99 % (run-to-run sd 8 ... 3
%): MongoDB's splits a stretch at tau with the second part running to the stretch's end, so a
raised stretch in the middle rarely wins the first split; Otava's searches the second part's end
too (kappa, as Matteson & James do). Otava's repository is active (commits through 2026, an
Apache project); MongoDB's had one commit since 2024, and its release caps numpy below 2.

Pure: numpy and Otava's analysis module (numpy, scipy); no MLflow, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from otava.analysis import compute_change_points_orig

#: What finds the change points (named in the verdict's notes and DESIGN.md).
LIBRARY = "apache-otava E-Divisive (otava.analysis.compute_change_points_orig, 100 permutations, p <= 0.02)"
#: The permutation test's level, per metric: a split is a change point when at most 2 of Otava's
#: 100 permutations of the stretch give as large a divergence (Matteson & James sec. 3.2). The
#: baseline takes the union over a dozen metrics, so the level is below the usual 0.05. Measured
#: (tests/benchmarks/changepoints.py, the rule on six metrics, 20 audits, run-to-run sd 5 and 8 %,
#: 150 histories a case): a change point confirmed in 6-8 % of noise-only histories at 0.05, 3 %
#: at 0.02; the baseline after a step up and back holds only runs after the way back in 94-100 %
#: at 0.05, 91-96 % at 0.02.
MAX_PVALUE = 0.02
#: A change point's step must also be at least this many run-to-run sds (pooled within the
#: stretches): below two, single audits of the two stretches overlap so much that the next audit
#: cannot say which stretch it belongs to (the confirmation of choose_baseline asks exactly
#: that), and E-Divisive's choice of the best split among all makes its permutation p-value
#: optimistic. Measured (one metric, 20 audits, sd 5 and 8 %, level 0.05, 150 histories): false
#: change points per noise-only history 0.053-0.060 -> 0.007-0.013, a +30 % step and a step up and
#: back found as often as without.
MIN_STEP_SD = 2.0
#: Seed of Otava's permutations: the same history gives the same change points.
SEED = 0
#: The newest audits analysed: older ones cannot reach a baseline of ``max_runs`` that follows
#: the last change point, and E-Divisive's cost grows with the square of the length (Otava's own
#: default window is 50 too).
HISTORY_RUNS = 50
#: A run with no verdict of its own (an old run, or one whose verdict was inconclusive) departs
#: from its stretch when its modified z-score (0.6745 (x - median) / MAD) exceeds 3.5 in most
#: metrics: Iglewicz & Hoaglin, "How to Detect and Handle Outliers", ASQC 1993, ch. 3. Only
#: against a stretch of at least :data:`MIN_SCREEN_RUNS` runs: a MAD of fewer is a guess.
OUTLIER_Z = 3.5
MIN_SCREEN_RUNS = 5
#: Verdicts that say the run moved.
JUDGED = ("regressed", "improved")


@dataclass(frozen=True)
class Segment:
    """A stretch of a history between change points: runs ``start`` .. ``stop - 1``.

    Attributes:
        start, stop: positions in the history (``stop`` exclusive).
        mean: the mean of the stretch's finite values, in the metric's unit (NaN when none).
    """

    start: int
    stop: int
    mean: float


@dataclass(frozen=True)
class BaselineChoice:
    """The runs a new audit is judged against.

    Attributes:
        indices: positions in the history (oldest = 0) of the baseline runs, oldest first.
        change_point: the confirmed change point they follow, None when the history has none.
        excluded: runs since the baseline's start (the change point, or the first analysed run)
            left out: departures the following audits did not repeat, or not yet repeated.
        enough: at least ``min_runs`` baseline runs.
        note: one plain sentence that says which runs, since when, and what was left out.
    """

    indices: tuple[int, ...]
    change_point: int | None
    excluded: tuple[int, ...]
    enough: bool
    note: str


def _floats(values: Sequence[float | None] | None, n: int, what: str) -> np.ndarray:
    if values is None:
        return np.full(n, np.nan)
    if len(values) != n:
        raise ValueError(f"{what} has {len(values)} values, the history {n}")
    return np.array([np.nan if v is None else float(v) for v in values], dtype=float)


def _mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else math.nan


def _detect(values: np.ndarray) -> list[int]:
    """Otava's E-Divisive on finite values: the positions (1..n-1) where a stretch starts."""
    if values.size < 3 or np.ptp(values) == 0:
        return []  # nothing to split: E-Divisive needs two non-empty parts with a spread
    found, _ = compute_change_points_orig(values, max_pvalue=MAX_PVALUE, seed=SEED)
    return sorted({int(point.index) for point in found})


def _pooled_half_width(left: np.ndarray, right: np.ndarray) -> float:
    """Half-width of the difference of two stretches' means from their runs' own intervals.

    A run's figure ``+- h`` is a 95 % interval, so its standard error is ``h / 1.96``; the mean of
    ``n`` independent runs has ``sqrt(mean(h^2) / n) / 1.96`` and the difference of two means
    ``sqrt(se_l^2 + se_r^2)``: times 1.96, ``sqrt(mean(h_l^2) / n_l + mean(h_r^2) / n_r)``. A side
    whose runs give no interval adds nothing.
    """
    total = 0.0
    for side in (left, right):
        known = side[np.isfinite(side)]
        if known.size:
            total += float(np.mean(known**2)) / side.size
    return math.sqrt(total)


def _pooled_sd(values: np.ndarray, points: list[int]) -> float:
    """The run-to-run sd within the stretches (each around its own mean), pooled; NaN without a
    degree of freedom."""
    bounds = [0, *points, values.size]
    residuals = np.concatenate([values[a:b] - values[a:b].mean() for a, b in zip(bounds, bounds[1:])])
    dof = values.size - (len(bounds) - 1)
    return float(np.sqrt(np.sum(residuals**2) / dof)) if dof > 0 else math.nan


def _filter(values: np.ndarray, half_widths: np.ndarray, points: list[int]) -> list[int]:
    """Drop, weakest first, the points whose step the runs cannot resolve (see change_points)."""
    points = list(points)
    while points:
        bounds = [0, *points, values.size]
        spread = _pooled_sd(values, points)
        margins = []
        for i, point in enumerate(points):
            left, right = slice(bounds[i], point), slice(point, bounds[i + 2])
            step = abs(_mean(values[right]) - _mean(values[left]))
            need = _pooled_half_width(half_widths[left], half_widths[right])
            if math.isfinite(spread):
                need = max(need, MIN_STEP_SD * spread)
            margins.append(step - need)
        weakest = int(np.argmin(margins))
        if margins[weakest] > 0:
            break
        # Removing one point changes its neighbours' stretches and the pooled sd: judge again.
        del points[weakest]
    return points


def change_points(values: Sequence[float], half_widths: Sequence[float | None] | None = None) -> list[int]:
    """The change points of one metric's run-level history.

    Args:
        values: one figure per audit, oldest first, in the metric's unit; NaN (or None) where a
            run lacks the metric (left out, its neighbours are adjacent).
        half_widths: each figure's own interval half-width (``(ci_high - ci_low) / 2``, same
            unit; the run's 95 % interval from its requests); None or NaN where unknown. None:
            no interval is known.

    Returns:
        Sorted positions ``k`` (1..n-1) where a new stretch starts: ``values[k]`` is its first
        finite value. Fewer than 3 finite values, or all equal: none.

    Raises:
        ValueError: ``values`` not one-dimensional, ``half_widths`` of another length, or a
            negative half-width.

    The rule: Otava's E-Divisive (:data:`LIBRARY`, level :data:`MAX_PVALUE`, seeded) finds the
    candidate points; a point stays only when its step, the difference between the means of the
    stretches on either side of it, exceeds both

    1. the half-width of that difference as the runs' own intervals give it
       (:func:`_pooled_half_width`: ``sqrt(mean(h_l^2) / n_l + mean(h_r^2) / n_r)``): the
       interval width taken into account;
    2. :data:`MIN_STEP_SD` times the run-to-run sd pooled within the stretches: a step the next
       audit can be told apart by (see there);

    weakest point first, its neighbours judged again after each removal (the merge step of
    Fleming et al., ICPE 2023, with these criteria in place of their t-test). Why a post-filter
    and not weights: E-Divisive's permutation test already compares the step with the scatter
    between runs; what it cannot know is that each run's figure is itself uncertain (a p99 of 50
    requests rests on its largest value), and a step those intervals cannot resolve is not one a
    verdict should cut its baseline for. Weighting the runs would change E-Divisive's statistic
    and its permutation test's calibration; the filter leaves both as the library measured them.
    Measured (tests/benchmarks/changepoints.py, case g: +4 % with 1 % between runs, each run's
    interval +- 8 %): E-Divisive alone marks it in 95-98 % of histories, with the filter 48 %.
    """
    x = np.array([math.nan if v is None else v for v in values], dtype=float)
    if x.ndim != 1:
        raise ValueError(f"values must be one-dimensional, got shape {x.shape}")
    h = _floats(half_widths, x.size, "half_widths")
    if np.any(h[np.isfinite(h)] < 0):
        raise ValueError("half-widths must be >= 0")
    keep = np.flatnonzero(np.isfinite(x))
    points = _filter(x[keep], h[keep], _detect(x[keep]))
    return [int(keep[p]) for p in points]


def segments(values: Sequence[float], points: Sequence[int]) -> list[Segment]:
    """The stretches of ``values`` that ``points`` (from :func:`change_points`) delimit.

    Returns one :class:`Segment` per stretch, in order, covering ``0 .. len(values)``; each
    mean over the stretch's finite values (NaN when it has none). No values: no segment.

    Raises:
        ValueError: points not strictly increasing within 1..len(values)-1.
    """
    x = _floats(list(values), len(values), "values")
    bounds = [0, *[int(p) for p in points], x.size]
    if x.size == 0:
        if points:
            raise ValueError("change points of an empty history")
        return []
    if any(not 0 < p < x.size for p in bounds[1:-1]) or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"change points must increase strictly within 1..{x.size - 1}, got {list(points)}")
    return [Segment(a, b, _mean(x[a:b])) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class _Scan:
    start: int  # first run of the baseline's stretch
    change_point: int | None
    exclude: dict[int, str]  # run -> why ("unconfirmed", "pending", "unexplained"); empty: done


def _step_metrics(x: np.ndarray, h: np.ndarray, k: int, ref: list[int], judged: bool) -> dict[int, float]:
    """Metrics in which run ``k`` departs from the reference runs, with its level there.

    A run judged regressed / improved: beyond its own half-width (unknown: beyond twice the
    reference's sd, with at least 3 reference runs; fewer: any departure); the verdict already
    said that it moved, this says where. Any other run: a modified z-score beyond
    :data:`OUTLIER_Z` (and beyond its half-width) in most metrics, against at least
    :data:`MIN_SCREEN_RUNS` reference runs; otherwise none.
    """
    moved: dict[int, float] = {}
    present = 0
    for m in range(x.shape[0]):
        value, base = x[m, k], x[m, ref]
        base = base[np.isfinite(base)]
        if not math.isfinite(value) or base.size == 0:
            continue
        present += 1
        departure = abs(value - base.mean())
        own = h[m, k] if math.isfinite(h[m, k]) else 0.0
        if judged:
            if math.isfinite(h[m, k]):
                bar = own
            else:
                bar = 2 * float(np.std(base, ddof=1)) if base.size >= 3 else 0.0
            if departure > bar:
                moved[m] = value
        elif base.size >= MIN_SCREEN_RUNS:
            median = float(np.median(base))
            mad = float(np.median(np.abs(base - median)))
            if mad > 0 and 0.6745 * abs(value - median) / mad > OUTLIER_Z and departure > own:
                moved[m] = value
    if not judged and 2 * len(moved) <= present:
        return {}  # a minority of metrics: noise in a few figures, not a run that moved
    return moved


def _repeats(run: np.ndarray, sides: dict[int, tuple[float, float]]) -> bool | None:
    """Whether a run repeats a step (None: it has none of the step's metrics).

    Per metric that moved from ``before`` to ``after``, the share of the step the run made,
    ``(x - before) / (after - before)``: it repeats the step there when that share lies between
    1/2 (nearer the new level than the old) and 2 (not a further, larger move). Across metrics,
    each counts by the size of its step (relative to ``before``), and the run repeats the step
    when the metrics it repeats carry more than half the weight: a figure that moved a little by
    chance cannot outvote the one that moved a lot, and a run that moved one tail figure only
    repeats neither a run that moved all of them nor one that moved another way.
    """
    weight = agreeing = 0.0
    for m, (before, after) in sides.items():
        if not math.isfinite(run[m]):
            continue
        size = abs(after / before - 1)
        share = (run[m] - before) / (after - before)
        weight += size
        if 0.5 < share < 2.0:
            agreeing += size
    return 2 * agreeing > weight if weight > 0 else None


def _scan(
    x: np.ndarray, h: np.ndarray, verdicts: Sequence[str | None], active: list[int], confirm: int
) -> _Scan:
    """One pass over the active runs: the candidates in order, each confirmed or not.

    Stops at the first candidate that leaves runs out (the caller re-detects without them).
    """
    # Library change points per metric, on the active runs; for each, the stretch it starts.
    found: dict[int, dict[int, list[int]]] = {}  # run -> metric -> runs of its new stretch
    for m in range(x.shape[0]):
        points = change_points(x[m, active], h[m, active])
        bounds = [*points, len(active)]
        for i, p in enumerate(points):
            found.setdefault(active[p], {})[m] = active[p : bounds[i + 1]]
    if len(active) > 2 and active[1] in found:
        # The first run alone in its stretch: an outlier at the edge, not a change (one run
        # cannot show a level); it goes the way of any unrepeated departure.
        return _Scan(active[0], None, {active[0]: "unconfirmed"})
    start, change_point = active[0], None
    explained: set[int] = set()
    for k in active[1:]:
        if k in explained:
            continue
        ref = [i for i in active if start <= i < k]
        judged = verdicts[k] in JUDGED
        if k in found:
            levels = {m: _mean(x[m, runs]) for m, runs in found[k].items()}
        else:
            levels = _step_metrics(x, h, k, ref, judged)
        # Per metric that moved: the reference's level and the new one.
        sides = {}
        for m, level in levels.items():
            before = _mean(x[m, ref])
            if math.isfinite(before) and before != 0 and math.isfinite(level) and level != before:
                sides[m] = (before, level)
        if not sides:
            if judged:
                return _Scan(start, change_point, {k: "unexplained"})
            continue
        streak, followers = [], 0
        for j in active[active.index(k) :]:
            repeats = _repeats(x[:, j], sides)
            if repeats is None:
                continue  # this run lacks those metrics: it says nothing either way
            followers += 1
            if not repeats:
                break
            streak.append(j)
        if not streak:
            continue  # the stretch the library found does not begin at k: no step here
        if len(streak) >= confirm:
            if k not in found and not judged:
                # An outlier screen's hit that the next audits repeat is no outlier; a change
                # point needs the library's or a verdict's evidence: leave it to them.
                continue
            start, change_point = k, k
            explained.update(streak)
        else:
            why = "pending" if len(streak) == followers else "unconfirmed"
            return _Scan(start, change_point, dict.fromkeys(streak, why))
    return _Scan(start, change_point, {})


def _runs(indices: Sequence[int]) -> str:
    """``audit 4`` / ``audits 4, 5``: counted from 1, oldest first, as a reader counts them."""
    listed = ", ".join(str(i + 1) for i in indices)
    return f"audit {listed}" if len(indices) == 1 else f"audits {listed}"


def choose_baseline(
    series: Mapping[str, Sequence[float]],
    half_widths: Mapping[str, Sequence[float | None]],
    run_verdicts: Sequence[str | None],
    *,
    min_runs: int = 3,
    confirm: int = 2,
    max_runs: int = 10,
) -> BaselineChoice:
    """The baseline of a new audit: the earlier audits since the last confirmed change point.

    Args:
        series: metric -> its run-level figures of the earlier audits, oldest first, each in the
            metric's unit; all of one length; NaN (or None) where a run lacks the metric.
        half_widths: metric -> each figure's interval half-width (same unit); a metric missing,
            or None / NaN values: unknown.
        run_verdicts: each earlier audit's own overall verdict ('regressed', 'improved',
            'unchanged', 'inconclusive'; None for runs from before verdicts).
        min_runs: fewest baseline runs that are ``enough``.
        confirm: audits, the change's own first one included, that must agree before a change
            becomes the new normal.
        max_runs: the newest this many runs of the stretch at most.

    Returns:
        A :class:`BaselineChoice`; positions are those of the history (oldest = 0). No history:
        no runs and a note that says so.

    Raises:
        ValueError: series of different lengths, or of another length than ``run_verdicts``; a
            count below 1.

    The rule, over the newest :data:`HISTORY_RUNS` audits:

    1. **Candidates.** Each metric's change points (:func:`change_points`: Otava's E-Divisive
       with the interval filter); each run judged regressed or improved; each other run that
       departs from its stretch by a modified z-score beyond :data:`OUTLIER_Z` in most metrics
       (a single outlier makes no change point for E-Divisive, but must not join a baseline).
    2. **Confirmation**, candidates in order, against the reference (the non-excluded runs from
       the last confirmed change point, or the start, to the candidate): per metric that moved
       (where the library found the point: the new stretch's mean; otherwise the run's own
       value, beyond its half-width), the reference's level and the new one; a run *agrees*
       when it repeats the step (:func:`_repeats`: between half and twice the step, in the
       metrics that carry most of the step's size). Confirmed: the first ``confirm``
       runs from the candidate on all agree; it is then the new start, and the agreeing runs
       after it are explained (their own regressed / improved verdicts included). Not
       confirmed: the agreeing runs from the candidate are left out (``excluded``):
       "unconfirmed" when a later audit went back, "pending" when no later audit exists yet; a
       run judged regressed / improved in which no metric moved beyond its interval is left out
       ("unexplained"). A library point whose first run does not agree is no step there and
       leaves nothing out; an outlier screen's hit that the next audits repeat is no outlier
       and no change point either (the library or a verdict must find that). A library point
       at the second run leaves the first alone in its stretch: an outlier at the edge, left
       out as "unconfirmed" (one run cannot show a level).
    3. **Again without them.** After any exclusion, the change points are found again on the
       remaining runs (an outlier left out no longer bends its stretch's mean), until nothing
       more is left out.
    4. **The baseline**: the remaining runs since the last confirmed change point, the newest
       ``max_runs``; ``enough`` when at least ``min_runs``. Fewer: the verdict judges by what
       there is and says so.

    Agreement is "repeats the step", not the brief's "same side of the previous mean": a run
    back at the old level lies on either side of the old mean by chance, so "same side" would
    confirm a regression with a normal audit half the time. It weighs the metrics by how far they
    moved, not one vote each (a run that moved in one tail figure has, by chance, a few others a
    little off too), and a run that moved much further, or another way, is a level of its own:
    the issue's sequence of a slow audit, then one whose TTFT p90 alone doubled, then a fast one
    is three departures, none confirmed.
    """
    if min(min_runs, confirm, max_runs) < 1:
        raise ValueError("min_runs, confirm and max_runs must be >= 1")
    n = len(run_verdicts)
    metrics = list(series)
    for metric in metrics:
        if len(series[metric]) != n:
            raise ValueError(f"{metric} has {len(series[metric])} runs, run_verdicts {n}")
    if n == 0:
        return BaselineChoice(
            (), None, (), False, "no earlier audit of this endpoint and model: nothing to judge against"
        )
    x = np.array([_floats(series[m], n, m) for m in metrics]).reshape(len(metrics), n)
    h = np.array([_floats(half_widths.get(m), n, f"half_widths[{m}]") for m in metrics]).reshape(
        len(metrics), n
    )

    offset = max(0, n - HISTORY_RUNS)
    excluded: dict[int, str] = {}
    while True:
        active = [i for i in range(offset, n) if i not in excluded]
        if not active:
            scan = _Scan(n, None, {})
            break
        scan = _scan(x, h, run_verdicts, active, confirm)
        if not scan.exclude:
            break
        excluded.update(scan.exclude)

    stretch = [i for i in range(scan.start, n) if i not in excluded]
    indices = tuple(stretch[-max_runs:])
    left_out = {i: why for i, why in sorted(excluded.items()) if i >= scan.start}
    enough = len(indices) >= min_runs

    since = (
        f"since the change point at audit {scan.change_point + 1}" if scan.change_point is not None else ""
    )
    if not indices:
        head = "no earlier audit is usable as a baseline"
    elif enough:
        newest = (
            f"the newest {len(indices)} of the {len(stretch)} audits"
            if len(stretch) > len(indices)
            else f"the {len(indices)} audits"
        )
        head = f"{newest} {since}" if since else f"{newest} of the history (no change point)"
    else:
        count = f"only {len(indices)} audit{'s' if len(indices) > 1 else ''}"
        head = f"{count} {since or 'in the history'}: judged on those"
    parts = []
    for why, reason in (
        ("unconfirmed", "a departure the next audits did not repeat"),
        ("pending", "a change not yet confirmed by a later audit"),
        ("unexplained", "judged regressed/improved, no figure beyond its interval"),
    ):
        runs = [i for i, w in left_out.items() if w == why]
        if runs:
            parts.append(f"{_runs(runs)} left out: {reason}")
    note = head + (f" ({'; '.join(parts)})" if parts else "")
    return BaselineChoice(indices, scan.change_point, tuple(left_out), enough, note)
