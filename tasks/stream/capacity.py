"""Capacity under SLOs: the highest request rate whose goodput fraction stays at or above a target.

The search (guidellm's sweep bounds, bisected; vLLM's goodput definition, ``tasks.stats``):

1. **synchronous**: one request at a time (concurrency 1, all arrivals at once): its
   ``requests_per_s`` is the synchronous rate, the lower end of the bracket. If its goodput
   fraction misses the target, even one request at a time breaks the SLOs: no capacity.
2. **saturation**: every request at once (concurrency = the level's requests): its
   ``requests_per_s`` is the saturation throughput, the upper end. If it meets the target, the
   SLOs hold at saturation: the capacity is that throughput.
3. **bisection**: a level at the bracket's middle rate (arrivals from a gamma process, as every
   rate level; concurrency unbounded = the level's requests); meeting the target raises the
   lower end, missing it lowers the upper end; until the bracket is within ``tolerance`` of its
   upper end (``(hi - lo) / hi <= tolerance``) or ``max_levels`` levels (all three kinds
   counted) have run.

The capacity is the lower end: the highest rate measured to meet the target (the synchronous
rate when no higher one did: an engine that serves one request at a time, such as llama.cpp's
server, has that as its capacity, and its saturation throughput is within the tolerance of it).
A level flagged client-bound is not evidence about the server: the search stops there and says
so. Every level keeps its figures and, when it missed, why (which SLO by how many requests,
errors, client-bound).

The levels are run by a callable the caller passes (``measure(kind, request_rate,
max_concurrency)``), so this module is plain logic, tested against the ground-truth instrument
and usable with any level runner. Imports only the standard library and ``tasks.stats``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tasks import stats
from tasks.stream.quality import bound_reason

SYNCHRONOUS, SATURATION, SEARCH = "synchronous", "saturation", "search"


class LevelLike(Protocol):
    """What the search reads of a finished level (``tasks.stream.level_figures.Level`` is one)."""

    metrics: dict[str, Any]

    @property
    def measured(self) -> list[Any]: ...


#: ``measure(kind, request_rate (None = all at once), max_concurrency) -> level``.
Measure = Callable[[str, float | None, int], LevelLike]


def slo_misses(records: Sequence[Any], slos: Mapping[str, float]) -> dict[str, int]:
    """Per SLO, how many successful requests missed it (``tasks.stats.meets_slos`` with that
    SLO alone; failed requests are counted as errors, not here)."""
    ok = [r for r in records if stats.meets_slos(r, {})]
    return {
        name: sum(1 for r in ok if not stats.meets_slos(r, {name: limit})) for name, limit in slos.items()
    }


@dataclass(frozen=True)
class CapacityLevel:
    """One level of the search.

    Attributes:
        kind: ``synchronous``, ``saturation`` or ``search``.
        request_rate: offered arrivals in requests/s (None = all at once).
        max_concurrency: the level's semaphore.
        metrics: the level's figures (``tasks.stats.aggregate_level`` and the client's).
        passed: goodput fraction >= target and not client-bound.
        slo_misses: per SLO, successful requests that missed it.
    """

    kind: str
    request_rate: float | None
    max_concurrency: int
    metrics: dict[str, Any]
    passed: bool
    slo_misses: dict[str, int] = field(default_factory=dict)

    @property
    def goodput_fraction(self) -> float | None:
        return self.metrics.get("goodput_fraction")

    @property
    def client_bound(self) -> bool:
        return bool(self.metrics.get("client_bound"))

    @property
    def requests_per_s(self) -> float | None:
        return self.metrics.get("requests_per_s")

    @property
    def rate_requests_per_s(self) -> float | None:
        """The level's place on the rate axis: the offered rate, or (all at once) the measured
        ``requests_per_s``."""
        return self.request_rate if self.request_rate is not None else self.requests_per_s

    def reason(self, slos: Mapping[str, float], target: float) -> str:
        """Why the level missed (empty when it passed): the goodput against the target, each
        SLO missed (by how many requests, with the level's p99), errors, client-bound."""
        if self.passed:
            return ""
        m = self.metrics
        fraction = self.goodput_fraction
        parts = (
            []
            if fraction is not None and fraction >= target
            else [f"goodput fraction {_fmt(fraction)} < target {target:g}"]
        )
        for name, count in self.slo_misses.items():
            if count:
                p99 = m.get(f"{name}_p99")
                parts.append(
                    f"{name} > {slos[name]:g} ms for {count} of {m.get('num_requests')} requests (p99 {_fmt(p99)} ms)"
                )
        if m.get("num_errors"):
            classes = ", ".join(f"{k[7:]} {v}" for k, v in m.items() if k.startswith("errors_"))
            parts.append(f"{m['num_errors']} errors ({classes})")
        if self.client_bound:
            parts.append(f"client-bound ({bound_reason(m)})")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "request_rate": self.request_rate,
            "max_concurrency": self.max_concurrency,
            "passed": self.passed,
            "goodput_fraction": self.goodput_fraction,
            "slo_misses": dict(self.slo_misses),
            "metrics": dict(self.metrics),
        }


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3g}"


@dataclass(frozen=True)
class CapacityResult:
    """The search's answer.

    Attributes:
        capacity_requests_per_s: the highest rate that met the target (None: none did).
        capacity_output_tokens_per_s: that level's output tokens/s.
        bracket_requests_per_s: (lower, upper): the capacity lies between them; None when the
            search stopped before it had one.
        levels: every level in the order run.
        stop_reason: why the search ended.
        last_failure: why the last level that missed missed (:meth:`CapacityLevel.reason`).
        slos, target: what was asked.
    """

    capacity_requests_per_s: float | None
    capacity_output_tokens_per_s: float | None
    bracket_requests_per_s: tuple[float, float] | None
    levels: tuple[CapacityLevel, ...]
    stop_reason: str
    last_failure: str | None
    slos: dict[str, float]
    target: float

    def metrics(self) -> dict[str, float | None]:
        """The scalar figures logged on the parent run (``tasks.metrics.registry``)."""
        low, high = self.bracket_requests_per_s or (None, None)
        return {
            "capacity_requests_per_s": self.capacity_requests_per_s,
            "capacity_output_tokens_per_s": self.capacity_output_tokens_per_s,
            "capacity_bracket_low_requests_per_s": low,
            "capacity_bracket_high_requests_per_s": high,
            "capacity_levels": len(self.levels),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.metrics(),
            "bracket_requests_per_s": list(self.bracket_requests_per_s)
            if self.bracket_requests_per_s
            else None,
            "stop_reason": self.stop_reason,
            "last_failure": self.last_failure,
            "slos": dict(self.slos),
            "target": self.target,
            "levels": [lv.to_dict() for lv in self.levels],
        }


def search_capacity(
    measure: Measure,
    slos: Mapping[str, float],
    *,
    num_requests: int,
    target: float = 0.95,
    tolerance: float = 0.05,
    max_levels: int = 8,
    on_level: Callable[[CapacityLevel], None] | None = None,
) -> CapacityResult:
    """Search the capacity (module docstring).

    Args:
        measure: runs one level (warm-up included) and returns it finished.
        slos: the goodput SLOs (``{"ttft_ms": 500, "tpot_ms": 50}``), at least one.
        num_requests: requests per level (the saturation level's concurrency).
        target: the goodput fraction a level must reach, in (0, 1].
        tolerance: stop when ``(hi - lo) / hi <= tolerance`` (0.05 = 5 %).
        max_levels: most levels in all (>= 2: the synchronous and saturation levels).
        on_level: called with each level as it finishes (tracking).

    Raises:
        ValueError: no SLO, a target outside (0, 1], a tolerance not > 0, max_levels < 2.
    """
    if not slos:
        raise ValueError("capacity needs at least one goodput SLO, e.g. ttft_ms:500,tpot_ms:50")
    if not 0 < target <= 1 or not tolerance > 0 or max_levels < 2:
        raise ValueError("target must lie in (0, 1], tolerance be > 0, max_levels >= 2")
    levels: list[CapacityLevel] = []
    last_failure: str | None = None

    def run(kind: str, rate: float | None, concurrency: int) -> CapacityLevel:
        nonlocal last_failure
        done = measure(kind, rate, concurrency)
        fraction = done.metrics.get("goodput_fraction")
        bound = bool(done.metrics.get("client_bound"))
        passed = fraction is not None and fraction >= target and not bound
        level = CapacityLevel(
            kind, rate, concurrency, dict(done.metrics), passed, slo_misses(done.measured, slos)
        )
        levels.append(level)
        if not passed:
            last_failure = (
                f"{kind} level at {_fmt(level.rate_requests_per_s)} req/s: {level.reason(slos, target)}"
            )
        if on_level is not None:
            on_level(level)
        return level

    def result(best: CapacityLevel | None, bracket: tuple[float, float] | None, why: str) -> CapacityResult:
        return CapacityResult(
            capacity_requests_per_s=None if best is None else best.rate_requests_per_s,
            capacity_output_tokens_per_s=None if best is None else best.metrics.get("output_tokens_per_s"),
            bracket_requests_per_s=bracket,
            levels=tuple(levels),
            stop_reason=why,
            last_failure=last_failure,
            slos=dict(slos),
            target=target,
        )

    def client_bound(level: CapacityLevel, best, bracket) -> CapacityResult:
        return result(
            best,
            bracket,
            f"the {level.kind} level at {_fmt(level.rate_requests_per_s)} req/s is client-bound "
            f"({bound_reason(level.metrics)}): "
            "its latencies describe the client, not the server; use --client-processes or a bigger client",
        )

    sync = run(SYNCHRONOUS, None, 1)
    if sync.client_bound:
        return client_bound(sync, None, None)
    if not sync.passed or not sync.requests_per_s:
        return result(None, None, "no capacity: the SLOs fail even one request at a time")
    lo, best = sync.requests_per_s, sync
    saturation = run(SATURATION, None, num_requests)
    if saturation.client_bound:
        return client_bound(saturation, best, None)
    hi = saturation.requests_per_s or lo
    if saturation.passed:
        top = saturation if hi >= lo else sync
        return result(
            top, (max(lo, hi), max(lo, hi)), "the SLOs hold at saturation: the capacity is its throughput"
        )
    if hi <= lo * (1 + tolerance):
        return result(
            best,
            (lo, max(lo, hi)),
            "the saturation throughput is within the tolerance of the synchronous rate (the server "
            "serves about one request at a time): the capacity is the synchronous rate",
        )
    while (hi - lo) / hi > tolerance:
        if len(levels) >= max_levels:
            return result(best, (lo, hi), f"stopped after {max_levels} levels (max_levels)")
        mid = (lo + hi) / 2
        level = run(SEARCH, mid, num_requests)
        if level.client_bound:
            return client_bound(level, best, (lo, hi))
        if level.passed:
            lo, best = mid, level
        else:
            hi = mid
    return result(best, (lo, hi), f"the bracket is within {tolerance:.0%} of its upper end")
