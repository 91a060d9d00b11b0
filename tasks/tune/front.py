"""The answer of a tune run: each measured level a point, the Pareto front, the best under SLOs.

A point is one load level of one configuration (a configuration measured at concurrency 1 and
8 gives two points), with the two sides of the trade-off every serving engine makes:

- ``output_tokens_per_s``: what one instance produces (all output tokens over the level's
  wall time; the level's own figure);
- ``per_user_tokens_per_s`` = 1000 / ``tpot_ms_p50``: how fast one user's text arrives once it
  started (the median request's decode speed), and ``ttft_ms_p99``: how long the unluckiest
  users wait for it to start.

Fronts (vLLM's ``bench sweep plot_pareto`` draws the first; we add the second, the one SLOs on
TTFT care about): a point is on the throughput / per-user front when no other point has at
least its throughput *and* at least its per-user speed, one of them strictly more; on the
throughput / TTFT p99 front likewise with less TTFT p99 better. Points missing a figure (a level
whose requests all failed, or all came in one chunk so TPOT is unknown) are on no front.

Best under the SLOs: among points whose ``goodput_fraction`` (the share of requests within every
SLO, ``tasks.stats``) reaches ``target``, the one with the highest ``goodput_requests_per_s``
(ties: more output tokens/s). Without SLOs, the point with the highest output tokens/s, and the
answer says that is all it means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TunePoint:
    """One level of one configuration.

    Attributes:
        configuration: the configuration's index in the run.
        label: its parameters, ``max_num_seqs=4``.
        level: the level's index within the configuration's workload.
        max_concurrency: the level's concurrency.
        request_rate: its request rate (None = as fast as the concurrency allows).
        output_tokens_per_s, per_user_tokens_per_s, ttft_ms_p99: see the module docstring (None
            when the level cannot say).
        goodput_requests_per_s, goodput_fraction: None without SLOs.
    """

    configuration: int
    label: str
    level: int
    max_concurrency: int
    request_rate: float | None
    output_tokens_per_s: float | None
    per_user_tokens_per_s: float | None
    ttft_ms_p99: float | None
    goodput_requests_per_s: float | None = None
    goodput_fraction: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def point(configuration: int, label: str, level: int, level_dict: Mapping[str, Any]) -> TunePoint:
    """A level (``Level.to_dict()`` shape: ``max_concurrency``, ``request_rate``, ``metrics``) as a point."""
    m = level_dict.get("metrics") or {}
    tpot = _finite(m.get("tpot_ms_p50"))
    return TunePoint(
        configuration=configuration,
        label=label,
        level=level,
        max_concurrency=int(level_dict.get("max_concurrency") or 0),
        request_rate=_finite(level_dict.get("request_rate")),
        output_tokens_per_s=_finite(m.get("output_tokens_per_s")),
        per_user_tokens_per_s=1000.0 / tpot if tpot and tpot > 0 else None,
        ttft_ms_p99=_finite(m.get("ttft_ms_p99")),
        goodput_requests_per_s=_finite(m.get("goodput_requests_per_s")),
        goodput_fraction=_finite(m.get("goodput_fraction")),
    )


def pareto(points: Sequence[TunePoint], other: str = "per_user_tokens_per_s") -> list[TunePoint]:
    """The points no other point dominates on (output tokens/s up, ``other``): ``other`` is
    ``per_user_tokens_per_s`` (more is better) or ``ttft_ms_p99`` (less is better). Sorted by
    throughput."""
    sign = -1.0 if other == "ttft_ms_p99" else 1.0
    known = [
        (p, p.output_tokens_per_s, sign * getattr(p, other))
        for p in points
        if p.output_tokens_per_s is not None and getattr(p, other) is not None
    ]
    front = [
        p for p, x, y in known if not any(x2 >= x and y2 >= y and (x2 > x or y2 > y) for _, x2, y2 in known)
    ]
    return sorted(front, key=lambda p: p.output_tokens_per_s)


@dataclass(frozen=True)
class Best:
    """The answer: ``point`` (None: no point qualifies) and why it is the best (one sentence)."""

    point: TunePoint | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.point.to_dict() if self.point else None, "reason": self.reason}


def best(points: Sequence[TunePoint], slos: Mapping[str, float] | None, target: float) -> Best:
    """The best point under ``slos`` at goodput fraction ``target`` (module docstring)."""
    if not slos:
        ranked = [p for p in points if p.output_tokens_per_s is not None]
        if not ranked:
            return Best(None, "no level produced output tokens")
        top = max(ranked, key=lambda p: p.output_tokens_per_s)
        return Best(top, "highest output tokens/s (no SLOs given: pass --goodput to rank by goodput)")
    slo_text = ", ".join(f"{k} <= {v:g}" for k, v in slos.items())
    meeting = [
        p
        for p in points
        if p.goodput_fraction is not None
        and p.goodput_fraction >= target
        and p.goodput_requests_per_s is not None
    ]
    if not meeting:
        return Best(None, f"no level had {target:.0%} of its requests within {slo_text}")
    top = max(meeting, key=lambda p: (p.goodput_requests_per_s, p.output_tokens_per_s or 0.0))
    return Best(
        top,
        f"highest goodput ({top.goodput_requests_per_s:.3g} req/s) among levels with "
        f">= {target:.0%} of requests within {slo_text}",
    )
