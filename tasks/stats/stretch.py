"""The baseline an audit history leaves: the stable stretch since the last confirmed change
point (issue 28). The change points themselves: :mod:`tasks.stats.changepoint`, which has the
library's choice and its measurements; the rule below is in :func:`choose_baseline`'s docstring.

Pure: numpy; no MLflow, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# the history's own helpers: one reading of a series (NaN for a missing figure), one mean
from tasks.stats.changepoint import HISTORY_RUNS, _floats, _mean, change_points

#: A run with no verdict of its own (an old run, or one whose verdict was inconclusive) departs
#: from its stretch when its modified z-score (0.6745 (x - median) / MAD) exceeds 3.5 in most
#: metrics: Iglewicz & Hoaglin, "How to Detect and Handle Outliers", ASQC 1993, ch. 3. Only
#: against a stretch of at least :data:`MIN_SCREEN_RUNS` runs: a MAD of fewer is a guess.
OUTLIER_Z = 3.5
MIN_SCREEN_RUNS = 5
#: Verdicts that say the run moved.
JUDGED = ("regressed", "improved")


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
        change_points: every change point the scan confirmed, oldest first (``change_point`` is
            the last): the stretches whose runs' spread is one level's
            (``tasks.report.history.AuditHistory.run_spread``).
    """

    indices: tuple[int, ...]
    change_point: int | None
    excluded: tuple[int, ...]
    enough: bool
    note: str
    change_points: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Scan:
    start: int  # first run of the baseline's stretch
    change_point: int | None
    exclude: dict[int, str]  # run -> why ("unconfirmed", "pending", "unexplained"); empty: done
    points: tuple[int, ...] = ()  # every change point confirmed, oldest first


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
    confirmed: list[int] = []
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
                return _Scan(start, change_point, {k: "unexplained"}, tuple(confirmed))
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
            confirmed.append(k)
            explained.update(streak)
        else:
            why = "pending" if len(streak) == followers else "unconfirmed"
            return _Scan(start, change_point, dict.fromkeys(streak, why), tuple(confirmed))
    return _Scan(start, change_point, {}, tuple(confirmed))


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
    return BaselineChoice(indices, scan.change_point, tuple(left_out), enough, note, scan.points)
