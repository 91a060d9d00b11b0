"""A tune run's repeats: the order they are measured in, and a configuration's repeats as one.

**Order.** ``tune.repeats`` rounds; each round measures every configuration once, each with a
fresh server. The rounds come in blocks of as many rounds as there are configurations, each
block a Latin square drawn from the seed (a shuffled order, its rotations, the rotations
shuffled: ``random.Random`` seeded with the text ``tune-order:<seed>``, so a seed replays it),
so within a block each configuration comes once in each position of a round; the last block is
cut to the rounds left. This is the "randomized block" design with the order counterbalanced
(Box, Hunter & Hunter, *Statistics for Experimenters*, 2nd ed., 2005, ch. 4, blocks and Latin
squares): a drift of the machine over the run (another job starting, a thermal state, a cache
filling) lands on every configuration alike instead of on whichever came last, and a slow spell
hits one repeat of each configuration, not all the repeats of one (run-to-run variance in
benchmarks: Georges, Buytaert & Eeckhout, "Statistically Rigorous Java Performance Evaluation",
OOPSLA 2007). Plain independent shuffles would leave two configurations in the same order in
every round one time in four over 3 rounds. A server per repeat, not one per configuration kept
up between rounds: the start itself (memory layout, compilation, warm caches) is part of what
varies from one deployment to the next, and interleaving needs it anyway (two servers of one
GPU's size cannot run side by side).

**Combining.** A configuration's levels are matched across its repeats by their concurrency and
rate (the k-th level of that pair), and each numeric figure of a combined level is the mean
over the repeats that have it; other values are the first repeat's. The objective figures keep
their value in each repeat for the intervals and the rule (:mod:`tasks.tune.rule`).

Standard library only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

#: the figures whose value in each repeat is kept (the objectives of the best, and the share
#: of requests within the SLOs that decides whether a level may be best)
KEPT_FIGURES = ("output_tokens_per_s", "goodput_requests_per_s", "goodput_fraction")


@dataclass(frozen=True)
class Slot:
    """One measurement in the run's order.

    Attributes:
        position: its place in the run (0-based).
        repeat: its round (0-based).
        configuration: the configuration's index.
    """

    position: int
    repeat: int
    configuration: int

    def to_dict(self) -> dict[str, int]:
        return {"position": self.position, "repeat": self.repeat, "configuration": self.configuration}


def run_order(configurations: int, repeats: int, seed: int) -> list[Slot]:
    """``repeats`` rounds of every configuration once, in seeded Latin-square blocks (module
    docstring).

    Raises:
        ValueError: fewer than 1 configuration or repeat.
    """
    if configurations < 1 or repeats < 1:
        raise ValueError(f"run_order: need >= 1 configuration and repeat, got {configurations}, {repeats}")
    rng = random.Random(f"tune-order:{seed}")
    rounds: list[list[int]] = []
    while len(rounds) < repeats:
        base = list(range(configurations))
        rng.shuffle(base)
        square = [base[k:] + base[:k] for k in range(configurations)]  # each once in each position
        rng.shuffle(square)
        rounds += square
    slots: list[Slot] = []
    for repeat, order in enumerate(rounds[:repeats]):
        slots += [Slot(len(slots) + k, repeat, index) for k, index in enumerate(order)]
    return slots


@dataclass(frozen=True)
class CombinedLevel:
    """A level over a configuration's repeats.

    Attributes:
        max_concurrency, request_rate: the level.
        metrics: each numeric figure's mean over the repeats that have it (others: the first's).
        values: for each of :data:`KEPT_FIGURES`, its value in each repeat (None where a repeat
            lacks it), in repeat order.
        repeats: how many repeats measured this level.
    """

    max_concurrency: int
    request_rate: float | None
    metrics: dict[str, Any]
    values: dict[str, tuple[float | None, ...]]
    repeats: int

    def to_dict(self) -> dict[str, Any]:
        """The level as a configuration's ``levels`` entry (``max_concurrency``, ``request_rate``,
        ``metrics``) with ``repeats``."""
        return {
            "max_concurrency": self.max_concurrency,
            "request_rate": self.request_rate,
            "metrics": self.metrics,
            "repeats": self.repeats,
        }


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (bools, non-numbers, NaN and infinities)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def combine_levels(repeats: Sequence[Sequence[Mapping[str, Any]]]) -> list[CombinedLevel]:
    """Each repeat's levels (``max_concurrency``, ``request_rate``, ``metrics``) -> the levels
    over the repeats, in the order they first appear (module docstring). One repeat: its levels,
    figures unchanged."""
    groups: dict[tuple[Any, Any, int], list[Mapping[str, Any]]] = {}
    for levels in repeats:
        seen: dict[tuple[Any, Any], int] = {}
        for level in levels:
            pair = (level.get("max_concurrency"), level.get("request_rate"))
            seen[pair] = seen.get(pair, -1) + 1
            groups.setdefault((*pair, seen[pair]), []).append(level)
    out = []
    for (concurrency, rate, _), levels in groups.items():
        all_metrics = [level.get("metrics") or {} for level in levels]
        metrics: dict[str, Any] = {}
        for name in dict.fromkeys(k for m in all_metrics for k in m):
            numbers = [n for n in (number(m.get(name)) for m in all_metrics) if n is not None]
            if len(levels) == 1 or not numbers:
                metrics[name] = next((m[name] for m in all_metrics if m.get(name) is not None), None)
            else:
                metrics[name] = fmean(numbers)
        values = {name: tuple(number(m.get(name)) for m in all_metrics) for name in KEPT_FIGURES}
        out.append(CombinedLevel(concurrency, rate, metrics, values, len(levels)))
    return out
