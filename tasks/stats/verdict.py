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

import numpy as np

from tasks.stats.interval import enough_for
from tasks.stats.samples import Samples, Unit

DEFAULT_RESAMPLES = 2000
#: Fewest clusters (requests, timed repeats) a side may have: the bootstrap of 3 repeats has 10
#: distinct draws, its interval is a guess.
MIN_CLUSTERS = 5
VERDICTS = ("regressed", "improved", "unchanged", "inconclusive")


@dataclass(frozen=True)
class Estimator:
    """How a metric is re-estimated from samples.

    Attributes:
        group, family: where its samples are (``stream`` / ``ttft_ms``).
        stat: ``mean`` or ``pNN`` of the pooled values; ``ratio``: the sum of ``family`` over
            the sum of ``per`` (per-request output tokens over E2E: a throughput's relative
            variation); ``inverse_pNN``: 1 / that percentile (a rate from step times).
        per: the ratio's denominator family.
        unit_name: what a cluster is, for "N more ..." (requests, repeats).
    """

    group: str
    family: str
    stat: str
    per: str | None = None
    unit_name: str = "requests"

    @property
    def enough_stat(self) -> str:
        """The statistic whose sample size :func:`enough_for` judges."""
        if self.stat.startswith("inverse_"):
            return self.stat.removeprefix("inverse_")
        return "mean" if self.stat == "ratio" else self.stat


_STREAM_LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
_DERIVED = {
    "output_tokens_per_s": Estimator("stream", "output_tokens", "ratio", per="e2e_ms"),
    "prefill_ms": Estimator("profile", "prefill_ms", "p50", unit_name="repeats"),
    "prefill_tokens_per_s": Estimator("profile", "prefill_ms", "inverse_p50", unit_name="repeats"),
    "decode_tokens_per_s": Estimator("profile", "decode_ms", "inverse_p50", unit_name="repeats"),
}


def estimator(metric: str) -> Estimator | None:
    """The samples that re-estimate ``metric``; None: it has none (judged without an interval)."""
    if metric in _DERIVED:
        return _DERIVED[metric]
    base, _, stat = metric.rpartition("_")
    if base in _STREAM_LATENCIES and (stat == "mean" or (stat.startswith("p") and stat[1:].isdigit())):
        return Estimator("stream", base, stat)
    if base == "decode_ms" and stat.startswith("p") and stat[1:].isdigit():
        return Estimator("profile", "decode_ms", stat, unit_name="repeats")
    return None


class _Pool:
    """One side's units of a group as flat arrays, for draws in blocks.

    A two-level draw is expressed as counts per cluster: drawing ``U`` units with replacement
    gives each unit a multiplicity ``m`` (multinomial), and drawing ``n`` clusters of each of
    its ``m`` copies is ``m x n`` uniform picks among its ``n`` clusters (multinomial again), the
    same distribution without a Python loop per draw.
    """

    def __init__(self, units: Sequence[Unit], families: Sequence[str]) -> None:
        self.sizes = [unit.size for unit in units]
        self.values: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # family -> (values, cluster)
        for family in families:
            values, owner, offset = [], [], 0
            for unit in units:
                for c, cluster in enumerate(unit.clusters.get(family, ())):
                    values.extend(cluster)
                    owner.extend([offset + c] * len(cluster))
                offset += unit.size
            order = np.argsort(np.array(values, dtype=np.float64), kind="stable")
            self.values[family] = (
                np.array(values, dtype=np.float64)[order],
                np.array(owner, dtype=np.int64)[order],
            )

    def counts(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """``(draws, clusters)`` counts of each cluster in each two-level draw."""
        units = len(self.sizes)
        multiplicity = rng.multinomial(units, [1 / units] * units, size=draws)
        return np.concatenate(
            [rng.multinomial(multiplicity[:, u] * n, [1 / n] * n) for u, n in enumerate(self.sizes) if n],
            axis=1,
        )

    def statistic(self, est: Estimator, counts: np.ndarray) -> np.ndarray:
        """The statistic of each draw, ``counts`` ``(draws, clusters)`` -> ``(draws,)`` (NaN: none)."""
        values, owner = self.values[est.family]
        weights = counts[:, owner]
        with np.errstate(divide="ignore", invalid="ignore"):
            if est.stat == "ratio":
                per_values, per_owner = self.values[est.per or ""]
                return (weights * values).sum(axis=1) / (counts[:, per_owner] * per_values).sum(axis=1)
            stat = est.stat.removeprefix("inverse_")
            total = weights.sum(axis=1)
            if stat == "mean":
                out = (weights * values).sum(axis=1) / total
            else:  # numpy's "linear" quantile of the draw, read off the sorted values' cumulative counts
                h = (total - 1) * float(stat[1:]) / 100
                low = np.floor(h)
                cumulative = np.cumsum(weights, axis=1)
                below = np.minimum((cumulative <= low[:, None]).sum(axis=1), values.size - 1)
                above = np.minimum((cumulative <= low[:, None] + 1).sum(axis=1), values.size - 1)
                out = values[below] + (h - low) * (values[above] - values[below])
                out[total == 0] = np.nan
            return 1.0 / out if est.stat.startswith("inverse_") else out


def relative_draws(
    units: Sequence[Unit], est: Estimator, resamples: int, rng: np.random.Generator
) -> np.ndarray | None:
    """``resamples`` draws of ``statistic(draw) / statistic(all)`` for one side (None: no samples)."""
    if not units or not any(unit.size for unit in units):
        return None
    pool = _Pool(units, [est.family] + ([est.per] if est.per else []))
    clusters = sum(pool.sizes)
    whole = float(pool.statistic(est, np.ones((1, clusters), dtype=np.int64))[0])
    if not math.isfinite(whole) or whole == 0:
        return None
    block = max(1, min(resamples, 4_000_000 // max(1, pool.values[est.family][0].size)))  # ~32 MB a block
    draws = [
        pool.statistic(est, pool.counts(min(block, resamples - done), rng))
        for done in range(0, resamples, block)
    ]
    return np.concatenate(draws) / whole


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
    rng = np.random.default_rng(seed)
    cur = relative_draws(current_units, est, resamples, rng)
    base = relative_draws(baseline_units, est, resamples, rng)
    if cur is None or base is None or baseline == 0:
        return "no change can be computed (a statistic of 0)"
    draws = 100.0 * (current * cur / (baseline * base) - 1.0)
    draws = draws[np.isfinite(draws)]
    tail = (1 - confidence) / 2
    low, high = (float(v) for v in np.quantile(draws, [tail, 1 - tail]))
    n = draws.size
    p = min(1.0, 2 * min((1 + np.sum(draws <= 0)) / (n + 1), (1 + np.sum(draws >= 0)) / (n + 1)))
    clusters = min(sum(u.size for u in current_units), sum(u.size for u in baseline_units))
    point = 100.0 * (current / baseline - 1.0)
    return Change(metric, point, low, high, float(p), (high - low) / 2, clusters)


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


def more_needed(c: Change, threshold_pct: float) -> int | None:
    """About how many more clusters per side would settle an inconclusive change: the interval
    shrinks as 1/sqrt(n) until it either fits within ± the threshold (unchanged) or excludes no
    change (beyond the threshold); None when the change sits on the threshold itself."""
    limit = abs(threshold_pct)
    target = limit - abs(c.change_pct) if abs(c.change_pct) < limit else abs(c.change_pct)
    if target <= 0.05 * limit or c.half_width <= 0:
        return None
    return max(1, math.ceil(c.clusters * ((c.half_width / target) ** 2 - 1)))


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
            more = more_needed(c, threshold)
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
