"""Two-level bootstrap draws of a figure from its samples (:mod:`tasks.stats.samples`): the
resampling behind the verdict's change intervals (:mod:`tasks.stats.verdict`) and the levels'
figure intervals (:func:`tasks.stats.interval.figure_intervals`).

A draw resamples units (runs, repeats) with replacement, then clusters (requests, timed
repeats) with replacement within each drawn unit, and computes the statistic on the pooled
draw (Davison & Hinkley, *Bootstrap Methods and their Application*, 1997, sec. 3.8); with one
unit it is the ordinary bootstrap over requests, a request's ITL gaps staying together.

Imports numpy; no MLflow, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tasks.stats.samples import Unit


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


STREAM_LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
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
    if base in STREAM_LATENCIES and (stat == "mean" or (stat.startswith("p") and stat[1:].isdigit())):
        return Estimator("stream", base, stat)
    if base == "decode_ms" and stat.startswith("p") and stat[1:].isdigit():
        return Estimator("profile", "decode_ms", stat, unit_name="repeats")
    return None


class Pool:
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

    def counts(self, draws: int, rng: np.random.Generator, within_only: bool = False) -> np.ndarray:
        """``(draws, clusters)`` counts of each cluster in each two-level draw; ``within_only``:
        every unit once, its clusters resampled (the stratified bootstrap: the units' own
        spread left out, for a caller that adds the run-to-run part itself)."""
        units = len(self.sizes)
        if within_only:
            multiplicity = np.ones((draws, units), dtype=np.int64)
        else:
            multiplicity = rng.multinomial(units, [1 / units] * units, size=draws)
        return np.concatenate(
            [rng.multinomial(multiplicity[:, u] * n, [1 / n] * n) for u, n in enumerate(self.sizes) if n],
            axis=1,
        )

    def whole(self, ests: Sequence[Estimator]) -> list[float]:
        """Each estimator's statistic on all the samples once (the figure the draws vary)."""
        return [
            float(v[0]) for v in self.statistics(ests, np.ones((1, max(1, sum(self.sizes))), dtype=np.int64))
        ]

    def statistic(self, est: Estimator, counts: np.ndarray) -> np.ndarray:
        """The statistic of each draw, ``counts`` ``(draws, clusters)`` -> ``(draws,)`` (NaN: none)."""
        return self.statistics([est], counts)[0]

    def statistics(self, ests: Sequence[Estimator], counts: np.ndarray) -> list[np.ndarray]:
        """:meth:`statistic` of several estimators of one family on the same draws (the draws'
        weights and cumulative counts computed once)."""
        values, owner = self.values[ests[0].family]
        weights = counts[:, owner]
        total = weights.sum(axis=1)
        cumulative = None
        out = []
        with np.errstate(divide="ignore", invalid="ignore"):
            for est in ests:
                stat = est.stat.removeprefix("inverse_")
                if est.stat == "ratio":
                    per_values, per_owner = self.values[est.per or ""]
                    value = (weights * values).sum(axis=1) / (counts[:, per_owner] * per_values).sum(axis=1)
                elif stat == "mean":
                    value = (weights * values).sum(axis=1) / total
                else:  # numpy's "linear" quantile of the draw, read off the sorted values' cumulative counts
                    cumulative = np.cumsum(weights, axis=1) if cumulative is None else cumulative
                    h = (total - 1) * float(stat[1:]) / 100
                    low = np.floor(h)
                    below = np.minimum((cumulative <= low[:, None]).sum(axis=1), values.size - 1)
                    above = np.minimum((cumulative <= low[:, None] + 1).sum(axis=1), values.size - 1)
                    value = values[below] + (h - low) * (values[above] - values[below])
                    value[total == 0] = np.nan
                out.append(1.0 / value if est.stat.startswith("inverse_") else value)
        return out


def relative_draws(
    units: Sequence[Unit],
    est: Estimator,
    resamples: int,
    rng: np.random.Generator,
    within_only: bool = False,
) -> np.ndarray | None:
    """``resamples`` draws of ``statistic(draw) / statistic(all)`` for one side (None: no
    samples); ``within_only``: :meth:`Pool.counts`'."""
    if not units or not any(unit.size for unit in units):
        return None
    pool = Pool(units, [est.family] + ([est.per] if est.per else []))
    [whole] = pool.whole([est])
    if not math.isfinite(whole) or whole == 0:
        return None
    block = max(1, min(resamples, 4_000_000 // max(1, pool.values[est.family][0].size)))  # ~32 MB a block
    draws = [
        pool.statistic(est, pool.counts(min(block, resamples - done), rng, within_only))
        for done in range(0, resamples, block)
    ]
    return np.concatenate(draws) / whole
