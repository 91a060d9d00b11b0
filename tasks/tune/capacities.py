"""A configuration's capacity over its repeats: the sample the best is decided on under
``tune.capacity``.

With ``tune.capacity`` each repeat of a configuration runs the capacity search
(:mod:`tasks.stream.capacity`), and each search probes its own request rates (the bisection
follows what that repeat measured), so the levels of two repeats seldom share a rate and
:func:`tasks.tune.repeats.combine_levels` has one repeat per search level. The figure each
repeat answers, and that the repeats share, is the capacity itself: the highest request rate
(requests/s) whose goodput fraction reached the target (``CapacityResult.capacity_requests_per_s``;
for the synchronous and saturation levels their measured ``requests_per_s``). That per-repeat
value is the sample of the best's rule (:mod:`tasks.tune.rule`: Student's t interval over the
repeats, Welch with Holm between configurations), as a level's throughput is without
``--capacity``.

A repeat's capacity (:func:`repeat_capacity`):

- the search's ``capacity_requests_per_s`` when it found one;
- **0 req/s** when it found none because the SLOs failed at one request at a time (the
  synchronous level missed the target and was not client-bound): no rate meets the target, and
  dropping the repeat would credit the configuration with its luckier repeats only;
- **unknown** (dropped) when the search could not say: no result, or the synchronous level was
  client-bound (its latencies describe the client, not the server).

Standard library, :mod:`tasks.tune.rule` and :mod:`tasks.tune.front`; no MLflow, no Prefect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.tune.front import CAPACITY, CAPACITY_LEVEL, TunePoint
from tasks.tune.repeats import number
from tasks.tune.rule import DEFAULT_CONFIDENCE, RepeatInterval, repeat_interval


def repeat_capacity(capacity: Mapping[str, Any] | None) -> float | None:
    """One repeat's capacity in requests/s from its ``CapacityResult.to_dict()`` (module
    docstring: the found capacity, 0 when even one request at a time missed the SLOs, None when
    the search could not say)."""
    if not capacity:
        return None
    found = number(capacity.get(CAPACITY))
    if found is not None:
        return found
    levels = capacity.get("levels") or []
    first = levels[0] if levels else {}
    synchronous_missed = first.get("kind") == "synchronous" and first.get("passed") is False
    client_bound = bool((first.get("metrics") or {}).get("client_bound"))
    return 0.0 if synchronous_missed and not client_bound else None


@dataclass(frozen=True)
class CapacityOverRepeats:
    """A configuration's capacity over its finished repeats.

    Attributes:
        configuration, label: the configuration.
        per_repeat: each finished repeat's capacity in requests/s (:func:`repeat_capacity`;
            None where its search could not say), in repeat order.
        output_tokens_per_s: each repeat's output tokens/s at its capacity level (None: no
            capacity), in repeat order.
        interval: the mean capacity and Student's t interval over the known repeats
            (:func:`tasks.tune.rule.repeat_interval`, cut at 0 req/s; None: no repeat knows).
    """

    configuration: int
    label: str
    per_repeat: tuple[float | None, ...]
    output_tokens_per_s: tuple[float | None, ...]
    interval: RepeatInterval | None

    @property
    def mean(self) -> float | None:
        """The mean capacity over the known repeats (requests/s)."""
        return self.interval.mean if self.interval else None

    def point(self) -> TunePoint | None:
        """The configuration's capacity as a candidate of :func:`tasks.tune.front.best`
        (objective :data:`tasks.tune.front.CAPACITY`, level :data:`tasks.tune.front.CAPACITY_LEVEL`
        and ``max_concurrency`` 0: not one of its levels, each repeat's capacity level having a
        rate of its own; ``output_tokens_per_s``: the mean at capacity); None when no repeat
        knows its capacity."""
        if self.interval is None:
            return None
        tokens = [v for v in self.output_tokens_per_s if v is not None]
        return TunePoint(
            configuration=self.configuration,
            label=self.label,
            level=CAPACITY_LEVEL,
            max_concurrency=0,
            request_rate=None,
            output_tokens_per_s=sum(tokens) / len(tokens) if tokens else None,
            per_user_tokens_per_s=None,
            ttft_ms_p99=None,
            repeats=self.interval.count,
            capacity_requests_per_s=self.interval.mean,
            capacity_requests_per_s_ci_low=self.interval.low,
            capacity_requests_per_s_ci_high=self.interval.high,
        )

    def to_dict(self) -> dict[str, Any]:
        """``capacity_requests_per_s`` (the mean, requests/s) with ``ci_low`` / ``ci_high``
        (None with fewer than 2 known repeats), ``confidence``, ``repeats`` (the known ones),
        ``per_repeat`` and ``capacity_output_tokens_per_s`` (the mean at capacity, tokens/s)."""
        tokens = [v for v in self.output_tokens_per_s if v is not None]
        found = self.interval
        return {
            CAPACITY: found.mean if found else None,
            "ci_low": found.low if found else None,
            "ci_high": found.high if found else None,
            "confidence": found.confidence if found else None,
            "repeats": found.count if found else 0,
            "per_repeat": list(self.per_repeat),
            "capacity_output_tokens_per_s": sum(tokens) / len(tokens) if tokens else None,
        }


def over_repeats(
    configuration: int,
    label: str,
    capacities: Sequence[Mapping[str, Any] | None],
    confidence: float = DEFAULT_CONFIDENCE,
) -> CapacityOverRepeats:
    """Each finished repeat's ``CapacityResult.to_dict()`` (in repeat order) -> the
    configuration's capacity over them (module docstring)."""
    per_repeat = tuple(repeat_capacity(c) for c in capacities)
    tokens = tuple(number((c or {}).get("capacity_output_tokens_per_s")) for c in capacities)
    interval = repeat_interval(per_repeat, confidence, floor=0.0)  # a rate: never below 0
    return CapacityOverRepeats(configuration, label, per_repeat, tokens, interval)


def capacity_text(over: Mapping[str, Any]) -> str:
    """``CapacityOverRepeats.to_dict()`` in words, for the summary and the table: ``capacity
    57.4 req/s [45.1, 69.7] (95 %, 3 repeats: 49.9, 58.8, 58.7)`` (``n/a`` for a repeat whose
    search could not say)."""
    mean = over.get(CAPACITY)
    if mean is None:
        return "capacity unknown (no repeat's search could say)"
    values = ", ".join("n/a" if v is None else f"{v:.3g}" for v in over.get("per_repeat") or ())
    low, high = over.get("ci_low"), over.get("ci_high")
    interval = f" [{low:.3g}, {high:.3g}]" if low is not None and high is not None else ""
    level = f"{over['confidence']:.0%}, " if interval else ""
    count = over.get("repeats", 0)
    return f"capacity {mean:.3g} req/s{interval} ({level}{count} repeat{'s' * (count != 1)}: {values})"
