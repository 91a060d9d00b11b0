"""Confidence intervals of a level's figures: how sure a percentile or a mean from N requests is.

:func:`bootstrap_interval` is the percentile bootstrap (Efron 1979; Efron & Tibshirani, *An
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
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

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


def _statistic(stat: str):
    """``"mean"`` or ``"pNN"`` -> a function of a 2-D array (one draw per row) -> 1-D."""
    if stat == "mean":
        return lambda draws: draws.mean(axis=-1)
    if stat.startswith("p") and stat[1:].replace(".", "", 1).isdigit() and 0 <= float(stat[1:]) <= 100:
        q = float(stat[1:]) / 100
        return lambda draws: np.quantile(draws, q, axis=-1, method="linear")
    raise ValueError(f"stat must be 'mean' or 'pNN' (0 <= NN <= 100), got {stat!r}")


def bootstrap_interval(
    values: Iterable[float | None],
    stat: str,
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """The percentile-bootstrap interval of ``stat`` (``"mean"``, ``"p50"``, ``"p99"`` ...) of
    ``values`` (None and NaN dropped), or None with fewer than 2 values.

    Memory: ``resamples x len(values)`` float64 (1,000 x 10,000 requests = 80 MB); larger
    samples are drawn in blocks of resamples.

    Raises:
        ValueError: an unknown ``stat``, ``confidence`` outside (0, 1), ``resamples`` < 100.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples!r}")
    of = _statistic(stat)
    data = np.array([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if data.size < 2:
        return None
    rng = np.random.default_rng(seed)
    block = max(1, min(resamples, 10_000_000 // data.size))  # about 80 MB per block at most
    stats = np.concatenate(
        [of(data[rng.integers(0, data.size, size=(min(block, resamples - done), data.size))])
         for done in range(0, resamples, block)]
    )  # fmt: skip
    tail = (1 - confidence) / 2
    low, high = np.quantile(stats, [tail, 1 - tail], method="linear")
    return Interval(float(of(data[np.newaxis, :])[0]), float(low), float(high), confidence, int(data.size))


def enough_for(stat: str, count: int, min_beyond: int = 5) -> bool:
    """Whether ``count`` samples put at least ``min_beyond`` of them beyond the percentile
    ``stat`` (p99 of 400 requests: 4 beyond it, not enough; the mean: always, from 2): below
    that, the percentile is its few largest values and the bootstrap cannot say how far off it
    is (the percentile bootstrap is too narrow in small samples: Hesterberg, *What Teachers Should
    Know About the Bootstrap*, The American Statistician 69(4), 2015)."""
    if stat == "mean":
        return count >= 2
    q = float(stat[1:]) / 100
    return count * min(q, 1 - q) >= min_beyond
