"""A body's read bound for the stream client's HTTP/1.1 (:mod:`tasks.wire.h1`), without a
timer per read.

A timer armed and cancelled per read cost ~5 us a chunk at 128 streams; here one look per half
bound at the body's byte count, and two looks in a row without new bytes fail the read with
``TimeoutError``: the body fails 1 to 1.5 bounds after its last byte. Standard library only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Stall:
    """Watch a body being read: ``total()`` its bytes so far, ``fail(exc)`` called with a
    ``TimeoutError`` once it went two looks (each ``timeout_s / 2`` apart) without new ones;
    :meth:`cancel` when the body is done."""

    __slots__ = ("_fail", "_half_s", "_handle", "_seen", "_still", "_total")

    def __init__(
        self, total: Callable[[], int], fail: Callable[[BaseException], None], timeout_s: float
    ) -> None:
        self._total, self._fail, self._half_s = total, fail, timeout_s / 2
        self._seen, self._still = total(), 0
        self._handle = asyncio.get_running_loop().call_later(self._half_s, self._look)

    def _look(self) -> None:
        total = self._total()
        self._still = self._still + 1 if total == self._seen else 0
        self._seen = total
        if self._still < 2:
            self._handle = asyncio.get_running_loop().call_later(self._half_s, self._look)
        else:
            self._fail(TimeoutError("Timeout on reading data from socket"))

    def cancel(self) -> None:
        """Stop watching: the body is done."""
        self._handle.cancel()
