"""The regression test: per metric, the change against the baseline with its confidence
interval, from the samples of both sides, and one of four verdicts; across metrics, Holm.

The rule (docs/DESIGN.md, "Regression verdicts", has it with its assumptions):

1. **Change and its interval.** Each side's figure is the value it logged (the current run's; the
   baseline's: the median over its runs, as the rule before). Its uncertainty comes from its
   samples (:mod:`tasks.stats.samples`) by a two-level bootstrap (Davison & Hinkley, *Bootstrap
   Methods and their Application*, 1997, sec. 3.8, "multi-stage sampling"): draw units (runs,
   repeats) with replacement, then clusters (requests, timed repeats) with replacement within
   each drawn unit, and compute the statistic on the pooled draw. With one unit the first stage
   is a no-op: the within-run interval; with several it carries the between-run spread. A draw's
   value is the side's figure times ``statistic(draw) / statistic(all samples)``, so the interval
   is that of the figure the run reports. The change in percent is
   ``100 x (current_draw / baseline_draw - 1)``, the two sides drawn independently; its
   ``confidence`` interval is the percentile interval of those draws (Efron & Tibshirani 1993,
   ch. 13).
2. **p-value.** Two-sided, of "no change", from the same draws:
   ``2 x min(share of draws <= 0, share >= 0)`` (with the +1 correction of Davison & Hinkley
   eq. 4.11).
3. **Holm.** Across the judged metrics, Holm's step-down (Holm 1979, *Scand. J. Statist.* 6)
   at ``alpha = 1 - confidence`` keeps the chance that any metric is called changed when none
   changed at most ``alpha`` (family-wise error rate), whatever their correlation.
4. **Verdict per metric.** ``regressed``: Holm rejects "no change" and the change lies beyond
   the threshold on the worse side; ``improved``: the mirror; ``unchanged``: the whole interval
   lies within ± the threshold (an equivalence test, the "two one-sided tests" of Schuirmann
   1987); ``inconclusive`` otherwise, or when a side has too few samples for the statistic
   (:func:`tasks.stats.interval.enough_for`): the verdict says about how many more requests
   (or repeats) would settle it, from the interval's 1/sqrt(n) shrinkage.

Imports numpy; no MLflow, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from tasks.stats.interval import enough_for
from tasks.stats.resample import Estimator, Pool, estimator, relative_draws
from tasks.stats.samples import Samples, Unit

DEFAULT_RESAMPLES = 2000
#: Fewest clusters (requests, timed repeats) a side may have: the bootstrap of 3 repeats has 10
#: distinct draws, its interval is a guess.
MIN_CLUSTERS = 5
VERDICTS = ("regressed", "improved", "unchanged", "inconclusive")


@dataclass(frozen=True)
class Change:
    """A metric's change with its interval, before the verdict (:func:`judge`)."""

    metric: str
    change_pct: float
    ci_low: float
    ci_high: float
    p_value: float
    half_width: float
    clusters: int  #: the smaller side's clusters (requests / repeats): for "N more"


def change(
    metric: str,
    current: float,
    baseline: float,
    current_units: Sequence[Unit],
    baseline_units: Sequence[Unit],
    *,
    confidence: float,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Change | str:
    """The change of ``metric`` from ``baseline`` to ``current`` (logged figures) with its
    interval from the two sides' units of its group; a string says why none can be had (no
    estimator, too few samples, no samples)."""
    est = estimator(metric)
    if est is None:
        return "no samples define this metric"
    for side, units in (("current", current_units), ("baseline", baseline_units)):
        count = sum(unit.count(est.family) for unit in units)
        if not units or not count:
            return f"no samples in the {side} run"
        if not enough_for(est.enough_stat, count):
            return f"too few samples for {est.enough_stat} ({count} in the {side} run)"
        clusters = sum(unit.size for unit in units)
        if clusters < MIN_CLUSTERS:
            return (
                f"too few {est.unit_name} to resample ({clusters} in the {side} run, {MIN_CLUSTERS} needed)"
            )
    if not (math.isfinite(current) and math.isfinite(baseline)) or baseline == 0:
        return "no change can be computed (a figure that is 0 or not finite)"
    rng = np.random.default_rng(seed)
    cur = relative_draws(current_units, est, resamples, rng)
    base = relative_draws(baseline_units, est, resamples, rng)
    if cur is None or base is None:
        return "no change can be computed (a statistic of 0 or not finite in the samples)"
    if len(current_units) == 1 and len(baseline_units) >= 2:
        # one current run is one more draw of the machine's run-to-run state: it borrows the
        # baseline's between-run spread, the sd s of the baseline runs' log deviations, drawn as
        # s x Student's t with U - 1 degrees of freedom (the prediction of a new run from U:
        # Hahn & Meeker, Statistical Intervals, 1991, sec. 4.6; the resampled baseline side
        # carries the mean's own 1 / U part)
        spread = float(np.std(np.log(_run_deviations(baseline_units, est)), ddof=1))
        cur = cur * np.exp(spread * rng.standard_t(len(baseline_units) - 1, cur.size))
    draws = 100.0 * (current * cur / (baseline * base) - 1.0)
    draws = draws[np.isfinite(draws)]
    if draws.size < 2:
        return "no change can be computed (the draws are not finite)"
    tail = (1 - confidence) / 2
    low, high = (float(v) for v in np.quantile(draws, [tail, 1 - tail]))
    n = draws.size
    p = min(1.0, 2 * min((1 + np.sum(draws <= 0)) / (n + 1), (1 + np.sum(draws >= 0)) / (n + 1)))
    clusters = min(sum(u.size for u in current_units), sum(u.size for u in baseline_units))
    point = 100.0 * (current / baseline - 1.0)
    return Change(metric, point, low, high, float(p), (high - low) / 2, clusters)


def _run_deviations(units: Sequence[Unit], est: Estimator) -> np.ndarray:
    """Each unit's statistic over the pooled units' (1 = an average run); NaN-free (1 where a
    unit has none)."""
    pooled = Pool(units, [est.family] + ([est.per] if est.per else []))
    [whole] = pooled.whole([est])
    out = []
    for unit in units:
        alone = Pool([unit], [est.family] + ([est.per] if est.per else []))
        [value] = alone.whole([est])
        out.append(value / whole if math.isfinite(value) and whole and math.isfinite(whole) else 1.0)
    return np.array(out)


def holm(p_values: Sequence[float], alpha: float) -> list[bool]:
    """Holm's step-down: which hypotheses are rejected at family-wise level ``alpha``."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for rank, index in enumerate(order):
        if p_values[index] > alpha / (len(p_values) - rank):
            break
        rejected[index] = True
    return rejected


@dataclass(frozen=True)
class Judged:
    """One metric's verdict: ``verdict`` one of :data:`VERDICTS`, ``note`` why."""

    metric: str
    change: Change | None
    verdict: str
    note: str


def more_needed(c: Change, threshold_pct: float, tested: int = 1, confidence: float = 0.95) -> int | None:
    """About how many more clusters per side would settle an inconclusive change: the interval
    shrinks as 1/sqrt(n) until it either fits within ± the threshold (unchanged) or, for a
    change beyond the threshold, excludes no change at Holm's strictest level among ``tested``
    metrics (``1 - (1 - confidence) / tested``); None when the change sits on the threshold."""
    limit = abs(threshold_pct)
    half = c.half_width
    if abs(c.change_pct) < limit:
        target = limit - abs(c.change_pct)
    else:
        target = abs(c.change_pct)
        alpha = 1 - confidence
        half *= NormalDist().inv_cdf(1 - alpha / (2 * tested)) / NormalDist().inv_cdf(1 - alpha / 2)
    if target <= 0.05 * limit or half <= 0:
        return None
    return max(1, math.ceil(c.clusters * ((half / target) ** 2 - 1)))


def judge(
    changes: Mapping[str, Change | str], thresholds_pct: Mapping[str, float], confidence: float
) -> list[Judged]:
    """The verdicts of :func:`change`'s results, Holm across the metrics that have an interval
    (module docstring, step 4). ``thresholds_pct`` signed as :mod:`tasks.report.regression`."""
    tested = [m for m, c in changes.items() if isinstance(c, Change)]
    rejected = dict(zip(tested, holm([changes[m].p_value for m in tested], 1 - confidence)))  # type: ignore[union-attr]
    out = []
    for metric, c in changes.items():
        if not isinstance(c, Change):
            out.append(Judged(metric, None, "inconclusive", c))
            continue
        threshold = thresholds_pct[metric]
        worse = c.change_pct * math.copysign(1, threshold)  # > 0: the worse way
        if rejected[metric] and abs(c.change_pct) > abs(threshold):
            kind = "regressed" if worse > 0 else "improved"
            out.append(
                Judged(metric, c, kind, f"beyond the threshold; p = {c.p_value:.3g}, Holm-significant")
            )
        elif -abs(threshold) < c.ci_low and c.ci_high < abs(threshold):
            out.append(Judged(metric, c, "unchanged", "the interval lies within ± the threshold"))
        else:
            more = more_needed(c, threshold, len(tested), confidence)
            unit = estimator(metric).unit_name  # type: ignore[union-attr]
            why = "the interval reaches past the threshold"
            if abs(c.change_pct) > abs(threshold) and not rejected[metric]:
                why = f"beyond the threshold but not significant after Holm (p = {c.p_value:.3g})"
            out.append(
                Judged(
                    metric,
                    c,
                    "inconclusive",
                    why + (f"; about {more} more {unit} would settle it" if more else ""),
                )
            )
    return out


__all__ = ["Change", "Estimator", "Judged", "Samples", "change", "estimator", "holm", "judge", "more_needed"]
