"""An answer's end on the openai client's transport: after it, the body's end is awaited for
:data:`tasks.wire.h1.END_GRACE_S` at most, as the stream client's own HTTP/1.1 awaits it
(:meth:`tasks.wire.h1.Response.answered`).

Why: the openai client's stream (openai-python 3.x, ``AsyncStream.__stream__``) stops at
``[DONE]`` and drains what follows for 0.1 s at most (its ``drain_response_async``, the fix of
openai-python #3440), but an answer that ends without ``[DONE]`` (the finish and the usage-only
chunk, then a body kept open) or a Responses stream (``response.completed``, no ``[DONE]``) is
read until the body ends: a server or proxy that keeps it open made the request a ``timeout``
after ``request_timeout_s`` (measured: 3.2 s for a 0.2 s answer under a 3 s bound; the case of
tests/test_wire_bodies.py). Here the reader's ``state["answered"]()`` (the key of
:func:`tasks.wire.transports.new_state`) arms an :func:`asyncio.timeout` around the read;
when it expires the read stops, the request complete in the time of its answer, and the openai
client's stream is closed by its caller (the connection, its body not ended, is not reused).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from tasks.wire.h1 import END_GRACE_S


class AnswerGrace:
    """``async with AnswerGrace(state):`` around the openai client's read of one answer.

    Sets ``state["answered"]`` to :meth:`answered`; the block then ends at the body's end, or
    :data:`END_GRACE_S` after the first :meth:`answered` with the read cut there (no error).
    Any other ``TimeoutError`` and a cancellation from outside propagate unchanged."""

    __slots__ = ("_timeout",)

    def __init__(self, state: dict[str, Any]) -> None:
        self._timeout = asyncio.timeout(None)
        state["answered"] = self.answered

    def answered(self) -> None:
        """The answer ended (``[DONE]``, the usage after a ``finish_reason``,
        ``response.completed``): its body's end is awaited :data:`END_GRACE_S` from now at most;
        later calls change nothing. A no-op outside the block."""
        timeout = self._timeout
        if timeout.when() is None and not timeout.expired():
            try:
                timeout.reschedule(asyncio.get_running_loop().time() + END_GRACE_S)
            except RuntimeError:  # not (or no longer) inside the block: nothing to bound
                pass

    async def __aenter__(self) -> AnswerGrace:
        await self._timeout.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if self._timeout.expired():  # the grace ran out: the answer is complete
                return True
            raise
        return False
