"""Confidence intervals of a level's figures: how sure a percentile or a mean from N requests is.

:func:`figure_intervals` gives a level's (and a profile point's) figures their
``_ci_low`` / ``_ci_high`` from its samples (:mod:`tasks.stats.samples`), resampled by
:mod:`tasks.stats.resample` (requests within repeats, repeats too when there are several);
:func:`bootstrap_interval` is the same for a plain list of values.

The interval is the percentile bootstrap (Efron 1979; Efron & Tibshirani, *An
Introduction to the Bootstrap*, 1993, ch. 13): draw the samples with replacement ``resamples``
times, compute the statistic on each draw, and take the ``(1 - confidence) / 2`` and
``(1 + confidence) / 2`` quantiles of those statistics. It needs no assumption on the shape of
the latency distribution (latencies are skewed, long-tailed, often bimodal), works for any
percentile as for the mean, and is what benchmarking tools use for timings (Criterion.rs's
``nresamples``). Its known limits, stated where the
figures are shown: it under-covers for small N and for extreme percentiles (a p99 of 40
requests rests on its one or two largest values: the interval is then wide *and* optimistic),
which is why :func:`enough_for` says when a sample is too small for a percentile to mean much.

The draws come from ``numpy.random.default_rng(seed)``: a seed replays the same interval.
Statistics use the project's percentile definition (``numpy.quantile`` ``method="linear"``,
Hyndman & Fan type 7, as :func:`tasks.stats.percentile`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.stats.resample import STREAM_LATENCIES, Estimator, Pool, estimator
from tasks.stats.samples import Unit

#: Bootstrap draws per interval: the Monte Carlo error of a 95 % interval's ends is then about
#: 1-2 % of the interval's width (Efron & Tibshirani 1993, sec. 19.3: 1,000 or more for
#: percentile intervals).
DEFAULT_RESAMPLES = 1000
DEFAULT_CONFIDENCE = 0.95
METHOD = "percentile bootstrap (Efron & Tibshirani 1993, ch. 13)"


@dataclass(frozen=True)
class Interval:
    """A statistic's value and its confidence interval, in the samples' unit.

    Attributes:
        value: the statistic on the samples themselves.
        low, high: the interval's ends (``low <= value <= high`` is usual, not guaranteed).
        confidence: its nominal coverage (0.95).
        count: the number of samples.
    """

    value: float
    low: float
    high: float
    confidence: float
    count: int

    @property
    def half_width(self) -> float:
        """Half the interval's width: the ``± x`` a table shows."""
        return (self.high - self.low) / 2


def bootstrap_interval(
    values: Iterable[float | None],
    stat: str,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """The percentile-bootstrap interval of ``stat`` (``"mean"``, ``"p50"``, ``"p99"`` ...) of
    ``values`` (None and NaN dropped; each value its own cluster), or None with fewer than 2.

    Raises:
        ValueError: an unknown ``stat``, ``confidence`` outside (0, 1), ``resamples`` < 100.
    """
    if not (stat == "mean" or re.fullmatch(r"p\d+(\.\d+)?", stat) and float(stat[1:]) <= 100):
        raise ValueError(f"stat must be 'mean' or 'pNN' (0 <= NN <= 100), got {stat!r}")
    data = tuple((float(v),) for v in values if v is not None and not math.isnan(v))
    return _intervals([Unit({"x": data})], [Estimator("", "x", stat)], confidence, resamples, seed)[0]


def _intervals(
    units: Sequence[Unit], ests: Sequence[Estimator], confidence: float, resamples: int, seed: int
) -> list[Interval | None]:
    """The intervals of several estimators of one family, on the same draws (module docstring).
    Fewer draws for very large samples: ``resamples x values <= 1e8`` (200 at the least), so a
    level of 1,000 requests x 256 tokens takes seconds, not a minute."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples!r}")
    families = [ests[0].family] + sorted({est.per for est in ests if est.per})
    pool = Pool(units, families)
    count = int(pool.values[ests[0].family][0].size)
    if count < 2 or sum(pool.sizes) < 2:
        return [None] * len(ests)
    wholes = pool.whole(ests)
    resamples = max(200, min(resamples, 100_000_000 // count))
    rng = np.random.default_rng(seed)
    block = max(1, min(resamples, 4_000_000 // count))  # ~32 MB of weights a block
    draws: list[list[np.ndarray]] = [[] for _ in ests]
    for done in range(0, resamples, block):
        for kept, values in zip(draws, pool.statistics(ests, pool.counts(min(block, resamples - done), rng))):
            kept.append(values)
    tail = (1 - confidence) / 2
    out: list[Interval | None] = []
    for whole, kept in zip(wholes, draws):
        values = np.concatenate(kept)
        values = values[np.isfinite(values)]
        if not math.isfinite(whole) or values.size < 2:
            out.append(None)
            continue
        low, high = np.quantile(values, [tail, 1 - tail])
        out.append(Interval(whole, float(low), float(high), confidence, count))
    return out


def enough_for(stat: str, count: int, min_beyond: int = 5) -> bool:
    """Whether ``count`` samples put at least ``min_beyond`` of them beyond the percentile
    ``stat`` (p99 of 400 requests: 4 beyond it, not enough; the mean: always, from 2): below
    that, the percentile is its few largest values and the bootstrap cannot say how far off it
    is (the percentile bootstrap is too narrow in small samples: Hesterberg, *What Teachers Should
    Know About the Bootstrap*, The American Statistician 69(4), 2015)."""
    if stat == "mean":
        return count >= 2
    q = float(stat[1:])  # in percent: 50 x (100 - 90) / 100 is 5 exactly, 50 x 0.1 is not
    return count * min(q, 100 - q) / 100 >= min_beyond


#: The level figures that get an interval (``<figure>_ci_low`` / ``_ci_high``): the means and
#: percentiles of the four request latencies.
LEVEL_INTERVAL_FIGURES = tuple(f"{m}_{s}" for m in STREAM_LATENCIES for s in ("mean", "p50", "p90", "p99"))
#: A profile point's: its prefill (median of the repeats) and its median decode step.
PROFILE_INTERVAL_FIGURES = ("prefill_ms", "decode_ms_p50")


def figure_interval(
    units: Sequence[Unit],
    figure: str,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """The interval of ``figure`` (``ttft_ms_p50``, ``prefill_ms`` ...) from its units' samples
    (:mod:`tasks.stats.resample`: two-level over several units, a request's ITL gaps together);
    None without an estimator or with fewer than 2 samples. ``count``: the values it rests on.

    Raises:
        ValueError: ``confidence`` outside (0, 1), ``resamples`` < 100.
    """
    est = estimator(figure)
    return None if est is None else _intervals(units, [est], confidence, resamples, seed)[0]


def figure_intervals(
    units: Sequence[Unit],
    figures: Iterable[str],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> dict[str, float | None]:
    """``{f"{figure}_ci_low": ..., f"{figure}_ci_high": ...}`` for each figure (None: no interval,
    as :func:`figure_interval`); the figures of one family share their draws."""
    by_family: dict[str, list[tuple[str, Estimator]]] = {}
    out: dict[str, float | None] = {}
    for figure in figures:
        est = estimator(figure)
        out[f"{figure}_ci_low"] = out[f"{figure}_ci_high"] = None
        if est is not None:
            by_family.setdefault(est.family, []).append((figure, est))
    for members in by_family.values():
        intervals = _intervals(units, [est for _, est in members], confidence, resamples, seed)
        for (figure, _), interval in zip(members, intervals):
            if interval is not None:
                out[f"{figure}_ci_low"], out[f"{figure}_ci_high"] = interval.low, interval.high
    return out


def with_intervals(names: Iterable[str], figures: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: figures[name]}`` for each name, each followed by its ``_ci_low`` / ``_ci_high``
    where ``figures`` has them (a stage's headline, logged on the audit's parent run)."""
    out: dict[str, Any] = {}
    for name in names:
        out[name] = figures.get(name)
        for end in ("ci_low", "ci_high"):
            if figures.get(f"{name}_{end}") is not None:
                out[f"{name}_{end}"] = figures[f"{name}_{end}"]
    return out
