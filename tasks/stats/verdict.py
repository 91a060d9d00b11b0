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
   (:func:`tasks.stats.interval.enough_for`): the verdict says what would settle it, in the unit
   that limits it (:func:`settle_advice`): more requests in a run when the within-run part of the
   interval dominates (1/sqrt(n) shrinkage), more audits in the baseline when the run-to-run part
   does (the prediction interval's ``t(U - 1) x sqrt(1 + 1/U)``), or neither when runs differ by
   more than the threshold allows.
5. **The run-to-run spread must be known.** A change judged against one baseline run, with no
   other estimate of how much whole runs differ (:class:`RunSpread`), rests on the request-level
   spread alone; machine load moves whole runs, so such a change is never called regressed or
   improved: ``inconclusive``, saying how many audits the baseline lacks.

Imports numpy; no MLflow, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from tasks.stats.family import family_rejected, holm, holm_adjusted, max_t_adjusted
from tasks.stats.interval import enough_for
from tasks.stats.resample import Estimator, Pool, estimator, relative_draws
from tasks.stats.samples import Samples, Unit
from tasks.stats.spread import RunSpread
from tasks.stats.tails import TailShift
from tasks.stats.tails import describe as tail_describe

DEFAULT_RESAMPLES = 2000
#: Fewest clusters (requests, timed repeats) a side may have: the bootstrap of 3 repeats has 10
#: distinct draws, its interval is a guess.
MIN_CLUSTERS = 5
VERDICTS = ("regressed", "improved", "unchanged", "inconclusive")


#: Fewest baseline runs whose spread the verdict trusts on its own; fewer: the history's, or none.
MIN_BASELINE_RUNS = 3


@dataclass(frozen=True)
class Change:
    """A metric's change with its interval, before the verdict (:func:`judge`).

    ``between_share``: the part (0..1) of the change's log-variance that comes from the
    run-to-run spread (0 when none was carried); ``spread``: that spread, None when unknown (one
    baseline run and no history: the interval is the request-level one alone); ``baseline_runs``:
    the baseline's units."""

    metric: str
    change_pct: float
    ci_low: float
    ci_high: float
    p_value: float
    half_width: float
    clusters: int  #: the smaller side's clusters (requests / repeats): for "N more"
    between_share: float = 0.0
    spread: RunSpread | None = None
    baseline_runs: int = 1
    #: the change's draws of ``log(current / baseline)`` relative to the figures' (NaN where a
    #: draw has none), aligned draw by draw with the other metrics' of the same call (the same
    #: resampled requests and whole-run draws): the joint null distribution of
    #: :func:`max_t_adjusted`; None: not kept
    log_draws: np.ndarray | None = field(default=None, repr=False, compare=False)


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
    spread: RunSpread | None = None,
) -> Change | str:
    """The change of ``metric`` from ``baseline`` to ``current`` (logged figures) with its
    interval from the two sides' units of its group; a string says why none can be had (no
    estimator, too few samples, no samples).

    The run-to-run spread a single current run borrows: ``spread`` (the history's) when given and
    the baseline has fewer than :data:`MIN_BASELINE_RUNS` units, or when it is known on more
    degrees of freedom than the baseline units' own (``U - 1``); else the baseline units' own
    when there are at least 2; else none (the returned ``Change.spread`` is None).

    The history's spread is the pooled within-segment estimate over the whole history
    (:meth:`tasks.report.history.History.run_spread`: one-way ANOVA's pooled mean square, the
    segments its groups; Searle, Casella & McCulloch, *Variance Components*, 1992, sec. 3.5;
    Snedecor & Cochran, *Statistical Methods*, 8th ed., 1989), whose last segment holds the
    baseline's runs: 3 audits after a change point and 7 before it know the spread on 8 degrees
    of freedom where the 3 alone know it on 2 (tests/benchmarks/verdict_error_rates.py
    --histories, the "incident" rows). It assumes the segments' runs differ alike (the pooled
    variance's homogeneity): a much noisier segment raises the pooled estimate."""
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
    units = len(baseline_units)
    borrowed: RunSpread | None = None
    if len(current_units) > 1:  # the current side's own units carry the spread
        borrowed = RunSpread(0.0, len(current_units) - 1, "the current run's own units")
    elif spread is not None:
        borrowed = spread  # the history's with its prior: every baseline run is in it
    # with a borrowed spread the baseline's runs are kept as they are (their requests
    # resampled): the spread's draws carry how far their mean may lie from the normal
    within_only = spread is not None and len(current_units) == 1
    cur = relative_draws(current_units, est, resamples, rng)
    base = relative_draws(baseline_units, est, resamples, rng, within_only=within_only)
    if cur is None or base is None:
        return "no change can be computed (a statistic of 0 or not finite in the samples)"
    if borrowed is None and units >= 2:
        # the runs' deviations carry each run's own sampling noise too: take it out (the one-way
        # random-effects moment estimate, between = total - within: Searle, Casella & McCulloch,
        # Variance Components, 1992, sec. 3.5), the within part from the current run's draws
        within_var = float(np.var(np.log(cur[cur > 0]))) if np.any(cur > 0) else 0.0
        deviations = float(np.var(np.log(_run_deviations(baseline_units, est)), ddof=1))
        own = math.sqrt(max(0.0, deviations - within_var))
        borrowed = RunSpread(own, units - 1, f"the {units} baseline runs")
    with np.errstate(divide="ignore", invalid="ignore"):
        log_ratios = np.log(cur) - np.log(base)
    within_total = float(np.var(log_ratios[np.isfinite(log_ratios)]))
    between_var = 0.0
    if len(current_units) == 1 and borrowed is not None:
        # a new run is one more draw of the machine's state; with the baseline's runs kept as
        # they are, their mean is U more (the prediction of a new run from U runs: Hahn &
        # Meeker, Statistical Intervals, 1991, sec. 4.6): the spread's part is tau^2 (1 + 1/U),
        # tau^2 drawn from what is known of it (tasks.stats.spread)
        scale = (1 + 1 / max(units, 1)) if within_only else 1.0
        tau2 = borrowed.variance_draws(log_ratios.size, rng)
        log_ratios = log_ratios + np.sqrt(scale * tau2) * rng.standard_normal(log_ratios.size)
        between_var = scale * borrowed.sd_log**2
    draws = 100.0 * (current / baseline * np.exp(log_ratios) - 1.0)
    draws = draws[np.isfinite(draws)]
    if draws.size < 2:
        return "no change can be computed (the draws are not finite)"
    tail = (1 - confidence) / 2
    low, high = (float(v) for v in np.quantile(draws, [tail, 1 - tail]))
    n = draws.size
    p = min(1.0, 2 * min((1 + np.sum(draws <= 0)) / (n + 1), (1 + np.sum(draws >= 0)) / (n + 1)))
    clusters = min(sum(u.size for u in current_units), sum(u.size for u in baseline_units))
    point = 100.0 * (current / baseline - 1.0)
    total_var = within_total + between_var
    between_share = 0.0 if total_var <= 0 else min(1.0, between_var / total_var)
    if len(current_units) > 1 or (borrowed is not None and not within_only):
        # the baseline's (or the current's) own units were resampled: their spread is in the
        # draws; its share, the part of the draws' variance the one-unit draws lack
        one_unit = float(np.var(np.log(cur[cur > 0]))) if np.any(cur > 0) else 0.0
        drawn = float(np.var(log_ratios[np.isfinite(log_ratios)]))
        between_share = 0.0 if drawn <= 0 else min(1.0, max(0.0, 1 - 2 * one_unit / drawn))
    return Change(
        metric,
        point,
        low,
        high,
        float(p),
        (high - low) / 2,
        clusters,
        between_share,
        borrowed,
        units,
        log_ratios,
    )


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


@dataclass(frozen=True)
class Judged:
    """One metric's verdict: ``verdict`` one of :data:`VERDICTS`, ``note`` why; ``tail``: the
    tail test's result for a ``<family>_tail`` row."""

    metric: str
    change: Change | None
    verdict: str
    note: str
    tail: TailShift | None = None


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


def _judge_tail(
    metric: str, shift: TailShift, threshold: float, rejected: Mapping[str, bool], alpha: float
) -> Judged:
    """A tail's verdict: ``regressed`` / ``improved`` where Holm rejects "the tail did not grow"
    / "did not shrink" and its quantile moved beyond the threshold that way; ``inconclusive``
    where a one-sided p-value alone is below ``alpha`` but Holm does not back it; else
    ``unchanged`` (the test has the power for the tail the issue names,
    :mod:`tasks.stats.tails`); the note names the tail either way."""
    said = tail_describe(shift)
    change = shift.change_pct if math.isfinite(shift.change_pct) else 0.0
    worse = change * math.copysign(1, threshold)  # > 0: the worse way
    for side, kind, p in (("worse", "regressed", shift.p_worse), ("better", "improved", shift.p_better)):
        if rejected[side] and abs(change) > abs(threshold) and (worse > 0) == (side == "worse"):
            return Judged(metric, None, kind, f"{said}; p = {p:.3g}, Holm-significant", shift)
    if rejected["worse"] or rejected["better"]:
        return Judged(metric, None, "unchanged", f"the tail moved less than the threshold: {said}", shift)
    p = min(shift.p_worse, shift.p_better)
    if p < alpha:
        return Judged(metric, None, "inconclusive", f"{said}; p = {p:.3g}: not significant after Holm", shift)
    return Judged(metric, None, "unchanged", f"no tail moved: {said}; p = {p:.3g}", shift)


def more_audits(c: Change, threshold_pct: float, tested: int = 1, confidence: float = 0.95) -> int | None:
    """About how many more audits in the baseline would settle an inconclusive change whose
    interval the run-to-run spread dominates; None when no number would (the spread alone, even
    known exactly, is wider than the room the threshold leaves) or the spread is unknown.

    The run-to-run part of the half-width is ``s x t(U - 1) x sqrt(1 + 1/U)`` (a new run's
    prediction from U runs: Hahn & Meeker 1991, sec. 4.6); the within-run part stays. The target
    is :func:`more_needed`'s."""
    if c.spread is None or c.spread.sd_log <= 0:
        return None
    from scipy.stats import t as student_t

    limit, z = abs(threshold_pct), 1 - (1 - confidence) / 2
    target = limit - abs(c.change_pct) if abs(c.change_pct) < limit else abs(c.change_pct)
    if abs(c.change_pct) >= limit:  # significance at Holm's strictest level: a narrower target
        alpha = 1 - confidence
        target *= NormalDist().inv_cdf(z) / NormalDist().inv_cdf(1 - alpha / (2 * tested))
    if target <= 0.05 * limit:
        return None
    runs = max(c.baseline_runs, int(c.spread.df) + 1)

    def between(u: int) -> float:  # percent, on the log scale's first order
        return 100.0 * c.spread.sd_log * float(student_t.ppf(z, max(u - 1, 1))) * math.sqrt(1 + 1 / u)

    within_sq = max(0.0, c.half_width**2 - between(runs) ** 2)
    for more in range(1, 201):
        if math.sqrt(within_sq + between(runs + more) ** 2) <= target:
            return more
    return None


def settle_advice(c: Change, threshold_pct: float, tested: int, confidence: float, unit: str) -> str:
    """What would settle an inconclusive change, in the unit that limits it: ``about N more
    requests a run`` (the within-run part dominates), ``about N more audits in the baseline``
    (the run-to-run part does, ``Change.between_share`` > 0.5), or why neither would."""
    more = more_needed(c, threshold_pct, tested, confidence)
    if c.spread is not None and c.between_share > 0.5 and c.spread.sd_log > 0:
        audits = more_audits(c, threshold_pct, tested, confidence)
        if audits is not None:
            return f"the spread between runs limits it: about {audits} more audits in the baseline would settle it"
        z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
        limit = abs(threshold_pct)
        room = limit - abs(c.change_pct) if abs(c.change_pct) < limit else abs(c.change_pct)
        if 100 * c.spread.sd_log * z >= room:  # the spread alone, even known exactly, is too wide
            return (
                f"whole runs differ by about {100 * c.spread.sd_log:.0f} % from one another "
                f"({c.spread.source}), too much for a {limit:g} % threshold: no number of audits "
                "settles it (a steadier machine, or a wider threshold, would)"
            )
        return (
            "both the spread between runs and the requests limit it: more audits in the baseline "
            f"and more {unit} a run" + (f" (about {more} more)" if more else "") + " would settle it"
        )
    return f"about {more} more {unit} a run would settle it" if more else ""


def judge(
    changes: Mapping[str, Change | TailShift | str], thresholds_pct: Mapping[str, float], confidence: float
) -> list[Judged]:
    """The verdicts of :func:`change`'s results, and of :func:`tasks.stats.tails.tail_shift`'s
    (a tail's row: ``<family>_tail``), Holm across every one that has a p-value (module
    docstring, steps 4 and 5). ``thresholds_pct`` signed as :mod:`tasks.report.regression`; a
    tail's threshold is that of its quantile's figure."""
    # a tail enters Holm as two one-sided hypotheses, "it grew" and "it shrank" (measured: the
    # 15 % x4 TTFT tail is caught in 89-94 % of audits so, 80-94 % as one two-sided p-value;
    # tests/benchmarks/tail_power.py)
    measured = {m: c for m, c in changes.items() if isinstance(c, Change)}
    adjusted = max_t_adjusted(measured)
    tails: dict[str, float] = {}
    for m, c in changes.items():
        if isinstance(c, TailShift):
            tails |= {f"{m}:worse": c.p_worse, f"{m}:better": c.p_better}
    rejected = family_rejected(adjusted, tails, 1 - confidence)
    tested = [m for m, c in changes.items() if isinstance(c, Change)]
    out = []
    for metric, c in changes.items():
        if isinstance(c, TailShift):
            moved = {"worse": rejected[f"{metric}:worse"], "better": rejected[f"{metric}:better"]}
            out.append(_judge_tail(metric, c, thresholds_pct[metric], moved, 1 - confidence))
            continue
        if not isinstance(c, Change):
            out.append(Judged(metric, None, "inconclusive", c))
            continue
        threshold = thresholds_pct[metric]
        worse = c.change_pct * math.copysign(1, threshold)  # > 0: the worse way
        unit = estimator(metric).unit_name  # type: ignore[union-attr]
        unknown = c.spread is None or (c.spread.prior_only and c.baseline_runs < MIN_BASELINE_RUNS)
        if rejected[metric] and abs(c.change_pct) > abs(threshold) and unknown:
            lack = MIN_BASELINE_RUNS - c.baseline_runs
            out.append(
                Judged(
                    metric,
                    c,
                    "inconclusive",
                    f"beyond the threshold (p = {c.p_value:.3g} on the requests alone), but a baseline of "
                    f"{c.baseline_runs} audit cannot show how much whole runs differ: about {lack} more "
                    "audits in the baseline would settle it",
                )
            )
        elif rejected[metric] and abs(c.change_pct) > abs(threshold):
            kind = "regressed" if worse > 0 else "improved"
            out.append(
                Judged(
                    metric,
                    c,
                    kind,
                    f"beyond the threshold; p = {c.p_value:.3g} ({adjusted[metric]:.3g} adjusted for the "
                    "metrics judged together), Holm-significant",
                )
            )
        elif -abs(threshold) < c.ci_low and c.ci_high < abs(threshold):
            out.append(Judged(metric, c, "unchanged", "the interval lies within ± the threshold"))
        else:
            why = "the interval reaches past the threshold"
            if abs(c.change_pct) > abs(threshold) and not rejected[metric]:
                why = (
                    f"beyond the threshold but not significant after Holm (p = {c.p_value:.3g}, "
                    f"{adjusted[metric]:.3g} adjusted for the metrics judged together)"
                )
            advice = settle_advice(c, threshold, len(tested), confidence, unit)
            out.append(Judged(metric, c, "inconclusive", why + (f"; {advice}" if advice else "")))
    return out


__all__ = [
    "Change",
    "Estimator",
    "Judged",
    "RunSpread",
    "Samples",
    "change",
    "estimator",
    "family_rejected",
    "holm",
    "holm_adjusted",
    "judge",
    "max_t_adjusted",
    "more_audits",
    "more_needed",
    "settle_advice",
]
