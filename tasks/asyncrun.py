"""``asyncio.run`` for coroutines whose result is large (a level's records, a sweep's points).

Python 3.11's ``asyncio.Runner.run`` installs its own SIGINT handler (a ``functools.partial``
holding the main task) and, once the coroutine is done, checks it with ``signal.getsignal`` and
restores the default with ``signal.signal``. Both look the handler up in the ``signal.Handlers``
enum, and the miss builds a ``ValueError`` message with ``repr(handler)``: the partial's repr
holds the task's, which holds the repr of the task's *result*. For a level's client process
(128 requests of 600 chunks) that was ~0.3 s of CPU formatting every record, twice, after the
level had ended (py-spy of ``infermeter stream`` at 256 streams: 6 % of a client process's
samples). :func:`run` hands the result out through a box, so the task's own result is None.
Standard library only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``'s result and exceptions, without the repr of the result (module
    docstring). Raises whatever ``coro`` raises, and RuntimeError inside a running loop."""
    box: list[T] = []

    async def main() -> None:
        box.append(await coro)

    asyncio.run(main())
    return box[0]
