"""The family-wise correction across the metrics a verdict judges together
(:mod:`tasks.stats.verdict`): Holm's step-down, its adjusted p-values, Westfall & Young's
step-down max-T on joint draws, and the weighted Holm that joins the metrics' family with a
tail's hypotheses. Holm's step-down also separates tune's configurations (:mod:`tasks.tune.rule`).

Imports numpy; no MLflow, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np


class Change(Protocol):
    """What the max-T reads of a change (:class:`tasks.stats.verdict.Change`)."""

    change_pct: float
    p_value: float
    log_draws: np.ndarray | None


def holm(p_values: Sequence[float], alpha: float) -> list[bool]:
    """Holm's step-down: which hypotheses are rejected at family-wise level ``alpha``."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for rank, index in enumerate(order):
        if p_values[index] > alpha / (len(p_values) - rank):
            break
        rejected[index] = True
    return rejected


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values (Holm 1979; Westfall & Young 1993, eq. 2.6):
    ``max over i <= j of min(1, (J - i + 1) p_(i))`` in the order of the p-values."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    out, running = [1.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        out[index] = running
    return out


def max_t_adjusted(changes: Mapping[str, Change]) -> dict[str, float]:
    """Family-wise adjusted p-values of ``changes`` by the step-down max-T of Westfall & Young
    (*Resampling-Based Multiple Testing*, 1993, Algorithm 2.8) on their joint draws: each
    change's statistic ``|log(current / baseline)| / sd``, its null draws ``|draw| / sd`` (a
    draw is the log of the change's factor about the figures' ratio: the draws as they would
    fall about no change, the raw p-value's reading of them), and for the j-th largest statistic the
    share of draws whose maximum over the j-th and smaller ones reaches it (+1 correction,
    Davison & Hinkley eq. 4.11), made monotone. Where metrics move together (one machine's load
    moves every latency of a run) their maximum is hardly larger than one of them, and the
    correction is as small as the correlation allows; independent metrics get about Holm's.
    Changes without aligned draws get Holm's adjusted p-values among themselves."""
    names = list(changes)
    arrays = [changes[m].log_draws for m in names]
    sizes = {a.size for a in arrays if a is not None}
    if not names or any(a is None for a in arrays) or len(sizes) != 1:
        return dict(zip(names, holm_adjusted([changes[m].p_value for m in names])))
    draws = np.vstack(arrays)  # (metrics, draws)
    observed = np.array([math.log1p(changes[m].change_pct / 100) for m in names])
    with np.errstate(invalid="ignore"):
        sd = np.nanstd(draws, axis=1)
        sd[~(sd > 0)] = np.inf
        stat = np.abs(observed) / sd
        null = np.abs(draws) / sd[:, None]  # the draws vary the figures' ratio about the change
    null = np.nan_to_num(null, nan=0.0)
    order = np.argsort(-stat)
    adjusted, running = {}, 0.0
    n = draws.shape[1]
    for rank, index in enumerate(order):
        tail_max = null[order[rank:]].max(axis=0)
        p = (1 + int(np.sum(tail_max >= stat[index]))) / (n + 1)
        # never below the change's own p-value (the percentile interval's reading of the same
        # draws: its floor is 2 / (n + 1) where this one's is 1 / (n + 1))
        running = max(running, p, changes[names[index]].p_value)
        adjusted[names[index]] = min(1.0, running)
    return adjusted


#: The weights of weighted Holm between the metrics' changes (one family, max-T inside) and a
#: tail's two one-sided hypotheses: each tail hypothesis keeps the share of alpha Holm over ten
#: hypotheses gave it (1/10), the changes have the rest (Holm 1979 allows weights; Westfall &
#: Krishen, J. Stat. Plan. Inference 99, 2001).
TAIL_WEIGHT = 0.1


def family_rejected(
    adjusted: Mapping[str, float], tails: Mapping[str, float], alpha: float
) -> dict[str, bool]:
    """Which hypotheses are rejected at family-wise level ``alpha``: the changes (their
    family-adjusted p-values, ``adjusted``) as one weighted unit of weight ``1 - 2 x
    TAIL_WEIGHT`` x their share, each tail hypothesis (``tails``: raw p-values) of weight
    :data:`TAIL_WEIGHT`, by weighted Holm's step-down: a unit is tested at ``alpha x its
    weight / the weights of the units not yet rejected``, until nothing more is rejected."""
    rejected = dict.fromkeys([*adjusted, *tails], False)
    block = 1.0 - TAIL_WEIGHT * len(tails) if tails else 1.0
    while True:
        open_changes = [m for m in adjusted if not rejected[m]]
        open_tails = [t for t in tails if not rejected[t]]
        total = (block if open_changes else 0.0) + TAIL_WEIGHT * len(open_tails)
        if total <= 0:
            return rejected
        newly = [m for m in open_changes if adjusted[m] <= alpha * block / total]
        newly += [t for t in open_tails if tails[t] <= alpha * TAIL_WEIGHT / total]
        if not newly:
            return rejected
        for name in newly:
            rejected[name] = True
