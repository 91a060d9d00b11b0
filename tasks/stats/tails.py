"""Tail shifts: did a minority of requests move, where the headline percentiles cannot tell?

With 50 requests a run, 15 % of requests waiting 4x longer for their first token moves TTFT's
p90 from 110 to ~240 ms, yet the verdict's two-level bootstrap of ``ttft_ms_p90`` cannot settle
it against three baseline runs (below: 35 % at Holm's level). This module counts instead.

**The rule.** Each run's values of a family are divided by that run's median: a whole run that
moved (machine load, a faster release) is the median metrics' to judge, and after the scaling it
is exactly no tail move. Then two counts, each with its exact distribution under "no change"
(the ``n + m`` scaled values exchangeable):

- *worse*: how many of the current side's ``n`` values exceed the baseline's ``j``-th largest of
  its ``m`` (``j = round(m (1 - quantile))``, at least 1: the baseline's p99 is its 2nd largest
  of 150 or 250); ``P(X = x) = C(j - 1 + x, x) C(m - j + n - x, n - x) / C(m + n, n)``
  (:func:`exceedance_pmf`; Gumbel & von Schelling, Ann. Math. Statist. 21, 1950), ``p_worse``
  its upper tail;
- *better*, the mirror: how many of the baseline's ``m`` exceed the current's ``j'``-th largest
  (a tail that went away leaves the baseline's slow requests beyond everything the current run
  has); ``p_better``.

``p_value = min(1, 2 min(p_worse, p_better))`` (Bonferroni over the two directions) is one
hypothesis for Holm among the verdict's metrics; ``p_worse`` and ``p_better`` may instead enter
Holm as two (valid either way: Holm holds for any set of valid p-values; two hypotheses keep
more power, figures below). Families with several values a request (ITL gaps) use the same
statistics, calibrated by permuting whole requests between the sides.

**Why, measured** (``tests/benchmarks/tail_power.py``, 200 seeds a cell: one current run of 50
requests against 3 or 5 baseline runs of 50; TTFT ``80 ms x exp(sigma z)``, each run also
``x exp(tau z)``; slow requests drawn per request with their probability). Percent of seeds
rejecting at 0.05 / at 0.05 / 8 (Holm's first step among 8 tested metrics, what a lone tail
test must beat); sigma 0.25, 3 baseline runs, tau 0.1, the issue's case ("1s": ``p_worse`` /
``p_better`` as two hypotheses, the case's direction; no-move cases: either):

=======================  =========  ========  ========  ========  ======  ======  ===========  ======
test                     no change  run +30%  15 % x4   10 % x3   25 %    all     tail fixed   15 % x4
                                                                  x1.5    x0.7    (improved)   +hiccup
=======================  =========  ========  ========  ========  ======  ======  ===========  ======
bootstrap ttft_ms_p90    6/2        32/20     68/35     31/12     30/14   42/22   27/4         59/36
AD k-sample, raw         48/35      93/88     74/47     50/30     55/42   100/98  61/34        66/46
AD k-sample, scaled      0/0        0/0       44/6      10/2      6/0     1/0     6/0          31/4
permutation p90, raw     36/16      80/68     93/87     66/52     54/38   97/94   84/50        90/82
permutation p90, scaled  3/0        4/0       90/84     60/48     23/7    4/1     83/18        89/78
exceed p90, raw          23/8       80/67     64/33     35/15     50/33   75/0    98/0         55/38
exceed p90, scaled       4/0        4/0       51/11     16/2      14/2    3/0     46/6         42/11
exceed p97.5, scaled     7/1        4/0       93/76     72/38     23/6    3/0     100/88       94/70
exceed p99, scaled       4/0        4/0       98/82     78/44     18/3    2/0     100/88       97/79
exceed p99, scaled, 1s   10/2       10/2      100/90    92/62     38/8    10/0    100/95       100/92
exceed max, scaled       5/0        4/0       100/89    85/57     18/2    2/0     100/88       0/0
=======================  =========  ========  ========  ========  ======  ======  ===========  ======

- Raw values cry wolf when whole runs move (no change: 23-48 % at 0.05 here, 8-81 % across the
  settings; a +30 % run reads as a tail move), whatever the test: the scaling is what makes a
  tail test usable.
- On scaled values, Anderson-Darling (``scipy.stats.anderson_ksamp``) is valid but weighs the
  whole distribution, and a minority barely moves it (44/6). The permutation test of the scaled
  p90 sees the far tail (90/84) but not its going away (83/18), at 16 ms a call against 1.3 ms.
- Counting beyond the p90 is the weakest count: its 10 % background buries 7 slow requests,
  and the slow requests lift the run's median, which pushes the ordinary ones below the edge.
  The higher the edge the better for a minority moved far (also for 25 % x1.5 at sigma 0.1:
  p90 60 %, p99 98 % at 0.05 / 8). The baseline's largest value as the edge is a little
  stronger still (89 %), but one stalled baseline request (x10 in 150) blinds it (0 %) for as
  long as that baseline stands; the p99 (2nd largest) survives it (79 %, 92 % 1s): the default.
- Across all eight settings (sigma 0.1 / 0.25, 3 / 5 baseline runs, tau 0.05 / 0.1), p99 scaled:
  false alarms on no change, on +30 % and on x0.7 runs 2.6-4.9 % at 0.05 and <= 0.7 % at
  0.05 / 8 (2000 seeds; "1s", either way: 8.3-10.8 % and <= 1.4 %, i.e. <= alpha a direction);
  15 % x4 caught 80-94 % two-sided, 89-94 % as two hypotheses; a baseline of 3 is the hard
  one: a per-request draw leaves <= 4 slow requests in 11 % of runs, and 4 in 50 against 150
  cannot reach p < 0.05 / 16 for any count (``C(50, 4) / C(200, 4) = 0.0036``). With exactly
  15 % of requests slow: 100 % in every setting. Tail gone (the improved direction): 87-98 %.
- The exact distribution costs ~1 ms a call; ITL's 4000 request permutations ~0.6 s.

**Assumes** runs that differ by a scale only: after the scaling, requests are exchangeable
across runs. A machine whose *share* of slow requests varies between runs (shape, not scale)
is outside what was measured; a tail nearer than ~2 sigma is mostly missed (25 % x1.5 at sigma
0.25: 18 % at 0.05).

Imports numpy; no MLflow, no Prefect, no scipy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tasks.stats.samples import Unit

#: The tail's edge: the baseline's p99 (its 2nd largest of 150 or 250 requests). Measured the
#: best of p90 .. p99 for a minority moved far, and unlike the baseline's largest value it
#: survives one stalled baseline request (module docstring).
DEFAULT_QUANTILE = 0.99
#: Fewest values a run may have: fewer, and its median (the scale every value is divided by)
#: is itself one of a handful of draws.
MIN_RUN_VALUES = 10
#: Fewest values of the current side: with 10 requests the test can still reject (3 of 10
#: beyond the 2nd largest of 150 has probability 0.0007 under no change); below, a share of a
#: handful is a guess.
MIN_CURRENT_VALUES = 10
#: Cluster permutations for a family with several values a request (ITL gaps).
PERMUTATIONS = 4000

#: What one value of a family is, for the sentence.
_WHAT = {"itl_ms": "gaps", "decode_ms": "decode steps", "prefill_ms": "repeats"}


@dataclass(frozen=True)
class TailShift:
    """How the tail of one family moved from the baseline to the current run.

    Attributes:
        family: ``ttft_ms``, ``itl_ms`` ...
        quantile: the tail's edge, as a fraction (0.99: the p99).
        baseline_value, current_value: that quantile of each side's raw values, pooled over its
            runs (numpy's "linear" quantile), in the family's unit (ms).
        change_pct: ``100 x (current_value / baseline_value - 1)``.
        share_beyond_pct: the share of current values beyond the baseline's quantile, in %,
            both sides' values divided by their own run's median (the count behind ``p_worse``).
        expected_share_pct: that share's expectation under no change, in % (``j / (m + 1)``:
            the baseline's ``j``-th largest of its ``m`` values is the edge).
        p_value: two-sided p-value of "the tail did not move": ``min(1, 2 min(p_worse,
            p_better))``; one hypothesis among the verdict's metrics in Holm.
        method: how it was computed, in words.
        baseline_share_beyond_pct, baseline_expected_share_pct: the mirror, the share of the
            baseline's values beyond the current run's quantile and its expectation, in % (the
            count behind ``p_better``: a tail that went away leaves the baseline's slow requests
            beyond everything the current run has).
        p_worse, p_better: the one-sided p-values (more current values beyond the baseline's
            edge than chance allows; more baseline values beyond the current's edge). Holm may
            take them as two hypotheses instead of ``p_value`` as one.
    """

    family: str
    quantile: float
    baseline_value: float
    current_value: float
    change_pct: float
    share_beyond_pct: float
    expected_share_pct: float
    p_value: float
    method: str
    baseline_share_beyond_pct: float = math.nan
    baseline_expected_share_pct: float = math.nan
    p_worse: float = 1.0
    p_better: float = 1.0

    @property
    def direction(self) -> str:
        """``worse`` (the tail grew: ``p_worse`` the smaller), ``better`` (it shrank) or ``same``."""
        if self.p_worse < self.p_better:
            return "worse"
        return "better" if self.p_better < self.p_worse else "same"


def exceedance_pmf(n: int, m: int, j: int) -> np.ndarray:
    """``P(X = x)``, ``x = 0 .. n``: of ``n`` new values, how many exceed the ``j``-th largest of
    ``m`` earlier ones, when all ``n + m`` are exchangeable (no change, no ties):
    ``C(j - 1 + x, x) C(m - j + n - x, n - x) / C(m + n, n)`` (Gumbel & von Schelling, "The
    distribution of the number of exceedances", Ann. Math. Statist. 21, 1950; the ranks of the
    pooled values are a uniform arrangement, and ``X = x`` fixes the top ``j + x`` of them).

    Shape ``(n + 1,)``, sums to 1. Raises ValueError unless ``n >= 0`` and ``1 <= j <= m``.
    """
    if n < 0 or not 1 <= j <= m:
        raise ValueError(f"exceedances: need n >= 0 and 1 <= j <= m (n={n}, m={m}, j={j})")

    def log_choose(a: int, b: int) -> float:
        return math.lgamma(a + 1) - math.lgamma(b + 1) - math.lgamma(a - b + 1)

    total = log_choose(m + n, n)
    log_pmf = np.array(
        [log_choose(j - 1 + x, x) + log_choose(m - j + n - x, n - x) - total for x in range(n + 1)]
    )
    pmf = np.exp(log_pmf)
    return pmf / pmf.sum()  # the identity holds exactly; this removes lgamma's rounding


@dataclass(frozen=True)
class _Side:
    """One side's values of a family: raw, divided by their run's median, and their cluster."""

    raw: np.ndarray
    scaled: np.ndarray
    owner: np.ndarray  #: cluster index, 0 .. clusters - 1 over the side's runs
    clusters: int


def _side(units: Sequence[Unit], family: str, name: str) -> _Side | str:
    raw, scaled, owner, offset = [], [], [], 0
    for unit in units:
        values, clusters = [], []
        for c, cluster in enumerate(unit.clusters.get(family, ())):
            for value in cluster:
                if math.isfinite(value):
                    values.append(value)
                    clusters.append(offset + c)
        offset += unit.size
        if not values:
            continue  # a run without this family (no decode seen): nothing to scale
        if len(values) < MIN_RUN_VALUES:
            return f"too few {family} values in a {name} run to scale it by its median ({len(values)}, {MIN_RUN_VALUES} needed)"
        array = np.array(values, dtype=np.float64)
        median = float(np.median(array))
        if not median > 0:
            return f"a {name} run's median {family} is {median:g}: no scale to divide by"
        raw.append(array)
        scaled.append(array / median)
        owner.append(np.array(clusters, dtype=np.int64))
    if not raw:
        return f"no {family} values in the {name} run"
    return _Side(np.concatenate(raw), np.concatenate(scaled), np.concatenate(owner), offset)


def _edge_rank(m: int, quantile: float) -> int:
    """``j``: a side's ``j``-th largest of its ``m`` values is its ``quantile`` (at least 1)."""
    return max(1, min(m, round(m * (1 - quantile))))


def _edge(values: np.ndarray, j: int) -> float:
    """The ``j``-th largest of ``values``."""
    return float(np.partition(values, values.size - j)[values.size - j])


def _permutation_p(cur: _Side, base: _Side, quantile: float, rng: np.random.Generator) -> tuple[float, float]:
    """One-sided p-values (worse, better) of the two exceedance shares minus their expectations,
    by permuting whole clusters (requests) between the sides: a request's values stay together,
    so the dependence between one request's ITL gaps does not pass for evidence (Good,
    *Permutation, Parametric and Bootstrap Tests of Hypotheses*, 3rd ed., 2005, sec. 3.6); the
    +1 correction of Davison & Hinkley (1997) eq. 4.11."""
    values = np.concatenate([cur.scaled, base.scaled])
    _, owner = np.unique(np.concatenate([cur.owner, cur.clusters + base.owner]), return_inverse=True)
    clusters, current = int(owner.max()) + 1, np.unique(cur.owner).size
    owner = owner[np.argsort(-values, kind="stable")]  # values from the largest down

    def beyond(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
        """Share of ``mine`` beyond the other side's edge minus its expectation, per draw;
        ``mine`` / ``theirs``: (draws, values) booleans in descending order of value."""
        seen = np.cumsum(theirs, axis=1, dtype=np.int32)
        m, n = seen[:, -1], mine.shape[1] - seen[:, -1]
        j = np.clip(np.rint(m * (1 - quantile)).astype(np.int64), 1, m)
        edge = np.argmax(seen >= j[:, None], axis=1)  # the position of their j-th largest
        return (edge + 1 - j) / n - j / (m + 1)  # mine before it, over mine

    def statistics(in_current: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cur_mask = in_current[:, owner]
        return beyond(cur_mask, ~cur_mask), beyond(~cur_mask, cur_mask)

    observed = np.zeros((1, clusters), dtype=bool)
    observed[0, :current] = True
    seen_worse, seen_better = (float(s[0]) for s in statistics(observed))
    worse = better = 0
    block = max(1, min(PERMUTATIONS, 2_000_000 // max(1, values.size)))
    for done in range(0, PERMUTATIONS, block):
        draws = min(block, PERMUTATIONS - done)
        in_current = np.argsort(rng.random((draws, clusters)), axis=1) < current
        s_worse, s_better = statistics(in_current)
        worse += int(np.sum(s_worse >= seen_worse - 1e-12))
        better += int(np.sum(s_better >= seen_better - 1e-12))
    return (1 + worse) / (PERMUTATIONS + 1), (1 + better) / (PERMUTATIONS + 1)


def tail_shift(
    current_units: Sequence[Unit],
    baseline_units: Sequence[Unit],
    family: str = "ttft_ms",
    quantile: float = DEFAULT_QUANTILE,
    *,
    seed: int = 0,
) -> TailShift | str:
    """Whether more of the current run's values lie beyond the baseline's ``quantile`` than
    chance allows (worse), or more of the baseline's beyond the current's (better), each run's
    values divided by that run's median first (the module has the rule and its measurements).

    Args:
        current_units, baseline_units: each side's runs (:class:`tasks.stats.samples.Unit`),
            pooled per side after the scaling.
        family: the per-request family (``ttft_ms``, ``itl_ms``, ``tpot_ms``, ``e2e_ms``).
        quantile: the tail's edge, a fraction in (0, 1).
        seed: for the cluster permutation of a family with several values a request (ITL);
            a family with one value a request has the exact distribution and ignores it.

    Returns:
        The :class:`TailShift`; a string says why there is none: a side without values, a run
        with fewer than :data:`MIN_RUN_VALUES`, a current side with fewer than
        :data:`MIN_CURRENT_VALUES`, a baseline too small to have a value beyond its quantile, a
        run whose median is not > 0, ties at an edge (a discrete family, e.g. output tokens at
        a fixed limit).

    Raises:
        ValueError: ``quantile`` not in (0, 1).
    """
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must lie in (0, 1), not {quantile}")
    cur = _side(current_units, family, "current")
    if isinstance(cur, str):
        return cur
    base = _side(baseline_units, family, "baseline")
    if isinstance(base, str):
        return base
    n, m = cur.scaled.size, base.scaled.size
    q = f"p{100 * quantile:g}"
    if n < MIN_CURRENT_VALUES:
        return f"too few {family} values in the current run ({n}, {MIN_CURRENT_VALUES} needed)"
    if m * (1 - quantile) < 1:
        return f"too few {family} values in the baseline for its {q} ({m}: none beyond it)"
    j_base, j_cur = _edge_rank(m, quantile), _edge_rank(n, quantile)
    base_edge, cur_edge = _edge(base.scaled, j_base), _edge(cur.scaled, j_cur)
    pooled = np.concatenate([cur.scaled, base.scaled])
    if np.count_nonzero(pooled == base_edge) > 1 or np.count_nonzero(pooled == cur_edge) > 1:
        return f"ties at the {q} of {family}: no share beyond it to count"
    cur_beyond = int(np.count_nonzero(cur.scaled > base_edge))
    base_beyond = int(np.count_nonzero(base.scaled > cur_edge))
    scaled = f"exceedances beyond each side's {q}, each run scaled to its median"
    if np.unique(cur.owner).size == n and np.unique(base.owner).size == m:  # one value a request
        p_worse = float(exceedance_pmf(n, m, j_base)[cur_beyond:].sum())
        p_better = float(exceedance_pmf(m, n, j_cur)[base_beyond:].sum())
        method = f"{scaled}; exact (Gumbel & von Schelling 1950)"
    else:
        p_worse, p_better = _permutation_p(cur, base, quantile, np.random.default_rng(seed))
        method = f"{scaled}; {PERMUTATIONS} permutations of requests"
    baseline_value = float(np.quantile(base.raw, quantile))
    current_value = float(np.quantile(cur.raw, quantile))
    return TailShift(
        family=family,
        quantile=quantile,
        baseline_value=baseline_value,
        current_value=current_value,
        change_pct=100.0 * (current_value / baseline_value - 1.0) if baseline_value else math.nan,
        share_beyond_pct=100.0 * cur_beyond / n,
        expected_share_pct=100.0 * j_base / (m + 1),
        p_value=min(1.0, 2 * min(p_worse, p_better)),  # Bonferroni over the two directions
        method=method + ", two-sided",
        baseline_share_beyond_pct=100.0 * base_beyond / m,
        baseline_expected_share_pct=100.0 * j_cur / (n + 1),
        p_worse=p_worse,
        p_better=p_better,
    )


def describe(shift: TailShift) -> str:
    """The sentence that names the tail: ``"ttft_ms tail: 24 % of requests beyond the baseline's
    p90 (10 % expected), p90 +118 %"``; where it shrank, also the baseline's share beyond the
    current run's quantile (the count that shows it)."""
    q = f"p{100 * shift.quantile:g}"
    what = _WHAT.get(shift.family, "requests")
    text = (
        f"{shift.family} tail: {_pct(shift.share_beyond_pct)} % of {what} beyond the baseline's {q} "
        f"({_pct(shift.expected_share_pct)} % expected), {q} {shift.change_pct:+.0f} %"
    )
    if shift.direction == "better":
        text += (
            f"; {_pct(shift.baseline_share_beyond_pct)} % of the baseline's beyond this run's {q} "
            f"({_pct(shift.baseline_expected_share_pct)} % expected)"
        )
    return text


def _pct(value: float) -> str:
    """A share in % for the sentence: whole percent from 10, one decimal below (1.3 %, not 1 %)."""
    return f"{value:.0f}" if value >= 10 or value == 0 else f"{value:.1f}"


__all__ = ["DEFAULT_QUANTILE", "TailShift", "describe", "exceedance_pmf", "tail_shift"]
