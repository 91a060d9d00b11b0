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
- :func:`tasks.stats.stretch.choose_baseline` (beside this module): the runs a new audit is
  judged against, and why.

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from otava.analysis import compute_change_points_orig

#: What finds the change points (named in the verdict's notes and DESIGN.md).
LIBRARY = (
    "apache-otava E-Divisive (otava.analysis.compute_change_points_orig, 100 permutations, p <= 0.02, "
    "or p <= 0.05 with a step of 4 run-to-run sds)"
)
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
#: A candidate the permutation test passes only at this weaker level (MAX_PVALUE < p <= 0.05)
#: stays when its step is :data:`WEAK_STEP_SD` run-to-run sds or more. In a short history the
#: test cannot reach MAX_PVALUE whatever the step: of 11 audits, 3 raised between 4 and 4, a
#: +90 % step with 1 % between runs gave p 0.02-0.03 (a new user's audits, 2026-12-04: the
#: verdicts after the way back all inconclusive, their baseline spanning both levels). Measured
#: (tests/benchmarks/changepoints.py, case h and the rule's cases): docs/DESIGN.md "Change points".
WEAK_PVALUE = 0.05
WEAK_STEP_SD = 4.0
#: Seed of Otava's permutations: the same history gives the same change points.
SEED = 0
#: The newest audits analysed: older ones cannot reach a baseline of ``max_runs`` that follows
#: the last change point, and E-Divisive's cost grows with the square of the length (Otava's own
#: default window is 50 too).
HISTORY_RUNS = 50


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


def _floats(values: Sequence[float | None] | None, n: int, what: str) -> np.ndarray:
    if values is None:
        return np.full(n, np.nan)
    if len(values) != n:
        raise ValueError(f"{what} has {len(values)} values, the history {n}")
    return np.array([np.nan if v is None else float(v) for v in values], dtype=float)


def _mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else math.nan


def _detect(values: np.ndarray) -> dict[int, float]:
    """Otava's E-Divisive on finite values: the positions (1..n-1) where a stretch starts, each
    with its permutation p-value (at most :data:`WEAK_PVALUE`)."""
    if values.size < 3 or np.ptp(values) == 0:
        return {}  # nothing to split: E-Divisive needs two non-empty parts with a spread
    found, _ = compute_change_points_orig(values, max_pvalue=WEAK_PVALUE, seed=SEED)
    return {int(point.index): float(point.stats.pvalue) for point in found}


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


def _filter(values: np.ndarray, half_widths: np.ndarray, pvalues: dict[int, float]) -> list[int]:
    """Drop, weakest first, the points whose step the runs cannot resolve (see change_points);
    ``pvalues``: each candidate's permutation p-value."""
    points = sorted(pvalues)
    while points:
        bounds = [0, *points, values.size]
        spread = _pooled_sd(values, points)
        margins = []
        for i, point in enumerate(points):
            left, right = slice(bounds[i], point), slice(point, bounds[i + 2])
            step = abs(_mean(values[right]) - _mean(values[left]))
            need = _pooled_half_width(half_widths[left], half_widths[right])
            if math.isfinite(spread):
                sds = MIN_STEP_SD if pvalues[point] <= MAX_PVALUE else WEAK_STEP_SD
                need = max(need, sds * spread)
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

    The rule: Otava's E-Divisive (:data:`LIBRARY`, level :data:`WEAK_PVALUE`, seeded) finds the
    candidate points; a point stays only when its step, the difference between the means of the
    stretches on either side of it, exceeds both

    1. the half-width of that difference as the runs' own intervals give it
       (:func:`_pooled_half_width`: ``sqrt(mean(h_l^2) / n_l + mean(h_r^2) / n_r)``): the
       interval width taken into account;
    2. :data:`MIN_STEP_SD` times the run-to-run sd pooled within the stretches (a step the next
       audit can be told apart by, see there) for a point at p <= :data:`MAX_PVALUE`,
       :data:`WEAK_STEP_SD` times for one the test passes only at :data:`WEAK_PVALUE` (a short
       history's steps, see there);

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
