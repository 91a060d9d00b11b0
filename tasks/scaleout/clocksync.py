"""A remote clock's offset from round trips, the NTP way (standard library only).

A client process on another host (``tasks.scaleout.dask_load``) reads its own monotonic clock;
the orchestrator reads its own. Each round trip gives a :class:`Sample`: the orchestrator's
clock when it sent the question (``t0``), the remote clock when it answered (``tw``), the
orchestrator's clock when the answer came back (``t1``). With the two legs taken as equally
long (NTP's assumption: RFC 5905 section 8, the on-wire offset with T2 = T3 = ``tw``; Cristian,
"Probabilistic clock synchronization", Distributed Computing 3, 1989)::

    offset = tw - (t0 + t1) / 2        (remote minus orchestrator)
    uncertainty = (t1 - t0) / 2        (the true offset lies within +- that, whatever the legs)

Of several samples the one of the shortest round trip is kept (NTP's clock filter keeps the
sample of least delay: the least time for queueing to have skewed the legs). All times are
integer nanoseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Offset", "Sample", "estimate_offset"]


@dataclass(frozen=True)
class Sample:
    """One round trip: ``t0`` orchestrator's clock at the send, ``tw`` the remote clock's
    reading in the answer, ``t1`` orchestrator's clock at the answer (ns)."""

    t0: int
    tw: int
    t1: int


@dataclass(frozen=True)
class Offset:
    """The remote clock minus the orchestrator's (``offset_ns``), within
    ``+-uncertainty_ns``; ``at_ns``: the orchestrator's clock at the sample's midpoint."""

    offset_ns: int
    uncertainty_ns: int
    at_ns: int

    def to_local(self, remote_ns: int) -> int:
        """A reading of the remote clock on the orchestrator's clock (ns)."""
        return remote_ns - self.offset_ns

    def to_remote(self, local_ns: int) -> int:
        """A reading of the orchestrator's clock on the remote clock (ns)."""
        return local_ns + self.offset_ns

    def to_dict(self) -> dict[str, int]:
        return {"offset_ns": self.offset_ns, "uncertainty_ns": self.uncertainty_ns}


def estimate_offset(samples: Sequence[Sample]) -> Offset:
    """The offset from the sample of the shortest round trip (module docstring).

    Raises:
        ValueError: no samples, or a sample whose answer came back before its question left
            (``t1 < t0``: not one clock on the orchestrator's side).
    """
    if not samples:
        raise ValueError("no round-trip samples to estimate a clock offset from")
    if any(s.t1 < s.t0 for s in samples):
        raise ValueError("a round trip ended before it began (t1 < t0)")
    best = min(samples, key=lambda s: s.t1 - s.t0)
    middle = (best.t0 + best.t1) // 2
    return Offset(best.tw - middle, (best.t1 - best.t0 + 1) // 2, middle)
