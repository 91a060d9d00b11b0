"""The best configuration by the verdicts' rule: named only where the noise between runs cannot
explain its lead; otherwise "tied within noise", with about how many repeats would separate them.

Each configuration is measured ``tune.repeats`` times, in interleaved rounds
(:mod:`tasks.tune.repeats`), so each level of a configuration has one value of the objective
(output tokens/s, or goodput requests/s under SLOs) per repeat. The rule:

1. **A point's interval.** The mean over its ``n`` repeats and Student's t interval of it,
   ``mean ± t(1 - alpha/2, n - 1) x s / sqrt(n)`` (Student, *Biometrika* 6, 1908), ``s`` the
   repeats' sample standard deviation. Not the percentile bootstrap of
   :mod:`tasks.stats.interval`: a level's throughput is one value per run, and over 3 runs the
   bootstrap has 10 distinct resamples, so its interval is far too narrow (Hesterberg, *The
   American Statistician* 69(4), 2015; the verdict's ``MIN_CLUSTERS = 5`` says the same). The t
   interval is exact at any ``n >= 2`` when the run-level figure is normal, and a level's
   throughput is an average over hundreds of tokens, near normal from run to run (its long tail,
   a run slowed by the machine's other load, widens ``s`` and so the interval, as it should).
2. **The top against each other candidate.** Candidates are, per configuration, its level with
   the highest mean objective among those that qualify (:func:`tasks.tune.front.best`); the top
   is the highest. For each other candidate, Welch's difference of means (Welch, *Biometrika*
   34, 1947): the interval ``d ± t(1 - alpha/2, nu) x se``, ``se = sqrt(s1²/n1 + s2²/n2)``,
   ``nu`` by Welch-Satterthwaite, and the two-sided p-value of "same mean".
3. **Holm** across those comparisons (:func:`tasks.stats.family.holm`; Holm, *Scand. J.
   Statist.* 6, 1979) at ``alpha = 1 - confidence``: a candidate is *separated* from the top when
   Holm rejects "same mean", so the chance of naming a best when all are equal stays <= alpha
   however many configurations there are.
4. **Outcome.** ``best``: every other candidate is separated; ``tied``: some are not (the top
   and those are "tied within noise"); ``only``: one candidate; ``untested``: no pair has two
   repeats on each side (``--repeats 1``: the top is named from one pass, and the answer says it
   was not tested); ``none``: no candidate.
5. **What would separate them.** For a tied candidate: the smallest number of repeats ``n'``
   of each at which the difference measured so far would be separated at Holm's strictest level
   (``alpha / m`` for ``m`` comparisons): ``t(1 - alpha/(2m), nu(n')) x se(n') < |d|``, with
   ``se`` shrinking as ``1 / sqrt(n')`` (the spreads held at what was measured); ``None`` when
   the means are equal (no number of repeats separates them) or more than ``max_repeats``
   would. A guide, not a promise: it holds only if the difference is real.

numpy and scipy (Student's t); no MLflow, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tasks.stats.family import holm

DEFAULT_CONFIDENCE = 0.95
#: more repeats than this are not suggested (the difference is then noise for any practical use)
MAX_REPEATS = 1000
OUTCOMES = ("best", "tied", "only", "untested", "none")


def _finite(values: Sequence[float | None]) -> np.ndarray:
    data = np.array([v for v in values if v is not None], dtype=float)
    return data[np.isfinite(data)]


def _t_quantile(q: float | np.ndarray, df: float | np.ndarray) -> float | np.ndarray:
    from scipy.stats import t as student_t  # lazy: scipy's import is ~0.3 s, only the answer needs it

    return student_t.ppf(q, df)


@dataclass(frozen=True)
class RepeatInterval:
    """A figure over a configuration's repeats.

    Attributes:
        mean: the mean of the repeats' values (the figure's unit).
        low, high: Student's t interval of the mean (None with fewer than 2 values).
        count: the repeats it rests on.
        confidence: the interval's nominal coverage.
    """

    mean: float
    low: float | None
    high: float | None
    count: int
    confidence: float


def repeat_interval(
    values: Sequence[float | None], confidence: float = DEFAULT_CONFIDENCE, floor: float | None = None
) -> RepeatInterval | None:
    """The mean of ``values`` (None and NaN dropped) and its Student's t interval (module
    docstring, step 1); None without a value. ``floor``: the least value the figure can take
    (0 for a rate): the interval is cut there, which keeps its coverage (the true mean is never
    below it) and spares a reader a negative throughput.

    Raises:
        ValueError: ``confidence`` outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    data = _finite(values)
    if data.size == 0:
        return None
    mean = float(data.mean())
    if data.size < 2:
        return RepeatInterval(mean, None, None, 1, confidence)
    half = (
        float(_t_quantile(1 - (1 - confidence) / 2, data.size - 1))
        * float(data.std(ddof=1))
        / math.sqrt(data.size)
    )
    low = mean - half if floor is None else max(floor, mean - half)
    return RepeatInterval(mean, low, mean + half, int(data.size), confidence)


@dataclass(frozen=True)
class Comparison:
    """The top candidate against one other (module docstring, steps 2, 3 and 5).

    Attributes:
        name: the other candidate (as the caller named it).
        difference: the top's mean minus its mean (the objective's unit; >= 0 for a ranked list).
        ci_low, ci_high: Welch's interval of the difference at ``confidence`` (None: untestable).
        p_value: two-sided, of "same mean" (None: fewer than 2 repeats on a side).
        separated: Holm rejected "same mean".
        repeats_to_separate: for one not separated, the repeats of each that would separate it
            if the difference holds (None: never, or more than :data:`MAX_REPEATS`, or
            untestable).
        counts: the repeats of (the top, this one).
    """

    name: str
    difference: float
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    separated: bool
    repeats_to_separate: int | None
    counts: tuple[int, int]

    @property
    def more_repeats(self) -> int | None:
        """How many repeats of each beyond those measured (``repeats_to_separate`` - the fewer)."""
        if self.repeats_to_separate is None:
            return None
        return max(1, self.repeats_to_separate - min(self.counts))


def welch(
    top: Sequence[float], other: Sequence[float], confidence: float = DEFAULT_CONFIDENCE
) -> tuple[float, float | None, float | None, float | None]:
    """``(difference, ci_low, ci_high, p_value)`` of ``mean(top) - mean(other)`` by Welch
    (module docstring, step 2): ``scipy.stats.ttest_ind(equal_var=False)``, its p-value and its
    ``confidence_interval``, which agree with the formulas written out to about 1e-12 relative
    (tests/test_tune.py; ``tests/benchmarks/library_pieces.py welch``: 0.7 to 1.3 ms a call on 2
    loaded cores against 0.3 ms written out, a few calls per tune). The interval and p-value
    None with fewer than 2 values on a side. Both spreads 0 (where scipy's t is undefined): the
    interval is the difference itself, p 0 (differ) or 1 (equal).

    Raises:
        ValueError: a side without a finite value.
    """
    a, b = _finite(top), _finite(other)
    if a.size == 0 or b.size == 0:
        raise ValueError("welch: each side needs at least one finite value")
    difference = float(a.mean() - b.mean())
    if a.size < 2 or b.size < 2:
        return difference, None, None, None
    if a.var(ddof=1) == 0 and b.var(ddof=1) == 0:
        return difference, difference, difference, 0.0 if difference else 1.0
    from scipy.stats import ttest_ind  # lazy, as _t_quantile's

    result = ttest_ind(a, b, equal_var=False)
    interval = result.confidence_interval(confidence)
    return difference, float(interval.low), float(interval.high), float(result.pvalue)


def repeats_to_separate(
    top: Sequence[float], other: Sequence[float], alpha: float, max_repeats: int = MAX_REPEATS
) -> int | None:
    """The fewest repeats ``n'`` of each side at which Welch's test at level ``alpha`` would
    reject "same mean" for the difference measured so far (module docstring, step 5); None when
    the means are equal, a side has fewer than 2 values, or more than ``max_repeats`` are needed."""
    a, b = _finite(top), _finite(other)
    if a.size < 2 or b.size < 2:
        return None
    difference = abs(float(a.mean() - b.mean()))
    va, vb = float(a.var(ddof=1)), float(b.var(ddof=1))
    if difference == 0:
        return None
    if va + vb == 0:
        return int(max(a.size, b.size))  # no spread: any difference is already separated
    n = np.arange(2, max_repeats + 1, dtype=float)
    se = np.sqrt((va + vb) / n)
    df = (va + vb) ** 2 * (n - 1) / (va**2 + vb**2)  # Welch-Satterthwaite with n' on each side
    enough = np.nonzero(_t_quantile(1 - alpha / 2, df) * se < difference)[0]
    return int(n[enough[0]]) if enough.size else None


@dataclass(frozen=True)
class Decision:
    """The rule's outcome over ranked candidates.

    Attributes:
        outcome: one of :data:`OUTCOMES` (module docstring, step 4).
        top: the first candidate's name (None: no candidate).
        comparisons: the top against each other candidate, in rank order.
        confidence: the level of the intervals and of Holm's family-wise error.
    """

    outcome: str
    top: str | None
    comparisons: tuple[Comparison, ...]
    confidence: float

    @property
    def tied(self) -> tuple[Comparison, ...]:
        """The candidates not separated from the top."""
        return tuple(c for c in self.comparisons if not c.separated)


def decide(
    candidates: Sequence[tuple[str, Sequence[float]]],
    confidence: float = DEFAULT_CONFIDENCE,
    max_repeats: int = MAX_REPEATS,
) -> Decision:
    """The rule over ``candidates``: ``(name, the objective's values over its repeats)``,
    ranked best first by the caller (the first is the top). Module docstring, steps 2-5.

    Raises:
        ValueError: a candidate without a finite value, ``confidence`` outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if not candidates:
        return Decision("none", None, (), confidence)
    (top_name, top_values), others = candidates[0], candidates[1:]
    if not others:
        return Decision("only", top_name, (), confidence)
    alpha = 1 - confidence
    tests = [welch(top_values, values, confidence) for _, values in others]
    testable = [i for i, t in enumerate(tests) if t[3] is not None]
    rejected = dict(zip(testable, holm([tests[i][3] for i in testable], alpha)))  # type: ignore[misc]
    comparisons = []
    for i, ((name, values), (difference, low, high, p)) in enumerate(zip(others, tests)):
        separated = rejected.get(i, False)
        needed = None
        if not separated and p is not None:
            needed = repeats_to_separate(top_values, values, alpha / len(others), max_repeats)
        counts = (int(_finite(top_values).size), int(_finite(values).size))
        comparisons.append(Comparison(name, difference, low, high, p, separated, needed, counts))
    if not testable:
        outcome = "untested"
    else:
        outcome = "best" if all(c.separated for c in comparisons) else "tied"
    return Decision(outcome, top_name, tuple(comparisons), confidence)
