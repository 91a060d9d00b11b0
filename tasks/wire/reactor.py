"""Plain-TCP connections of the stream client read without asyncio's transport per socket.

asyncio's selector loop gives every readable socket its own turn: the selector's key look-up,
a callback handle queued and run in its context, then the transport's two read methods before
the protocol's ``data_received``: about as much CPU per read as the chunk's own framing and JSON
(README "Cheaper per chunk"). Here one :class:`Reactor` per pool keeps its connections in a
private epoll (Linux, ``man 7 epoll``) that is itself one reader of the loop: one turn reads
every connection that is ready (``epoll_wait`` with no wait), each with one ``recv`` handed
straight to its protocol. The loop's own selector still decides when that turn comes, so the
reads are as prompt as before, and their kernel stamps (:mod:`tasks.wire.rxclock`) are the
same stamps.

:class:`PlainTransport` is the part of ``asyncio.Transport`` that :class:`tasks.wire.h1.Response`
uses: ``write`` (the request; what the socket does not take at once is sent when it can),
``close`` and ``is_closing``, with the protocol called as asyncio calls it (``connection_made``,
``data_received``, ``eof_received``, then ``connection_lost`` once, from a later loop turn when
closed by the client). TLS connections, and platforms without epoll (:data:`SUPPORTED`), keep
asyncio's transports.

The read itself is compiled where it could be built (``tasks/wire/_rx.c``, :data:`COMPILED`:
~2 us less per read, README "The read compiled"); :meth:`Reactor.read_ready` in Python does the
same where it could not, with the same stamps and the same calls.

The compiled read's wait in the loop's own epoll (README "Waiting in the reactor") needs three
private attributes of asyncio's selector loop: ``_selector._selector`` (its ``select.epoll``),
``_ready`` (the deque of queued callbacks) and ``_scheduled`` (the heap of ``TimerHandle``, read
through the public ``TimerHandle.when()``). :func:`probe` checks them once per :class:`Reactor`
(one per pool and loop): where any is missing or of another type (another loop, such as uvloop; a
selector that is not epoll; a Python whose asyncio changed) or :data:`FALLBACK_ENV` is set, the
reactor takes the fallback (:attr:`Reactor.path` ``"read"``): each loop turn reads what is ready,
with no wait, through public APIs only (``add_reader`` and the reactor's own epoll). Same reads,
same stamps; the cost is a loop turn per read (tests/benchmarks/reactor_fallback.py measures it).
"""

from __future__ import annotations

import asyncio
import collections
import os
import select
import selectors
import socket
import time
from typing import Any

from tasks.wire import rxclock

try:
    from tasks.wire import _rx
except ImportError:  # not built (no compiler at install, not Linux): the Python read below
    _rx = None  # type: ignore[assignment]

__all__ = ["FALLBACK_ENV", "SUPPORTED", "PlainTransport", "Reactor", "probe"]

#: Whether this platform has epoll (Linux); elsewhere the client keeps asyncio's transports.
SUPPORTED = hasattr(select, "epoll")
#: Bytes taken per read at most (asyncio's selector transport takes 256 KiB; _rx.c's READ_BYTES).
READ_BYTES = 256 * 1024
#: Whether the compiled read (``tasks/wire/_rx.c``) was built and is used.
COMPILED = _rx is not None
#: The longest the compiled read goes on waiting for bytes in one loop turn (s), when nothing
#: else comes due on the loop before.
WAIT_BOUND_S = 0.002
#: Set to anything but "" or "0", the reactor takes the fallback path (no wait in the loop's epoll,
#: no private attribute of asyncio) whatever the loop has: how the tests run that path here, and
#: how a user rules the private attributes out. Read when a :class:`Reactor` is made.
FALLBACK_ENV = "INFERMETER_REACTOR_FALLBACK"


def probe(loop: asyncio.AbstractEventLoop, fd: int) -> tuple[int, str | None]:
    """Whether the compiled read may wait in ``loop``'s own epoll, where ``fd`` (the reactor's
    epoll) is already one of its readers: ``(the loop's epoll descriptor, None)`` when asyncio's
    private attributes are there with the types the wait relies on (CPython 3.11-3.13's
    ``BaseSelectorEventLoop``: ``Lib/asyncio/selector_events.py``, ``base_events.py``), else
    ``(-1, why not)``: the fallback. Never raises for a loop of another kind."""
    if os.environ.get(FALLBACK_ENV, "") not in ("", "0"):
        return -1, f"{FALLBACK_ENV} is set"
    selector = getattr(loop, "_selector", None)
    if not isinstance(selector, selectors.BaseSelector):
        return -1, f"{type(loop).__name__} has no selector (not asyncio's selector loop)"
    inner = getattr(selector, "_selector", None)
    if not isinstance(inner, select.epoll):
        return -1, f"the loop's selector {type(selector).__name__} holds no select.epoll"
    try:  # the reactor's epoll is a reader of this very selector (public selectors API)
        selector.get_key(fd)
    except (KeyError, ValueError):
        return -1, "the reactor's epoll is not registered with the loop's selector"
    if not isinstance(getattr(loop, "_ready", None), collections.deque):
        return -1, "the loop's _ready is not a deque"
    scheduled = getattr(loop, "_scheduled", None)
    if not isinstance(scheduled, list) or not all(isinstance(h, asyncio.TimerHandle) for h in scheduled):
        return -1, "the loop's _scheduled is not a list of TimerHandle"
    # the wait's deadline is the loop's time on CLOCK_MONOTONIC (_rx.c's clock_gettime)
    if abs(loop.time() - time.monotonic()) > 0.1:
        return -1, "the loop's time() is not time.monotonic()"
    return inner.fileno(), None


class Reactor:
    """The plain connections of one pool on one event loop (module docstring). Raises OSError
    when the epoll cannot be made."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._epoll = select.epoll()
        self._transports: dict[int, PlainTransport] = {}
        # the compiled read's handlers: fd -> (the stamped socket or None, protocol, transport)
        self._handlers: dict[int, tuple[rxclock.StampedSocket | None, asyncio.Protocol, PlainTransport]] = {}
        # Every read lands in this one buffer and only its bytes are copied out: a fresh
        # READ_BYTES object per read is an mmap, mremap and munmap where malloc's mmap threshold
        # is fixed, as in a Dask worker (its nanny sets MALLOC_TRIM_THRESHOLD_): README "Load
        # from several hosts".
        self._buffer = bytearray(READ_BYTES)
        self._view = memoryview(self._buffer)
        self._epfd = self._epoll.fileno()
        loop.add_reader(self._epfd, self._turn)
        # The loop's own epoll, where the compiled read waits while nothing else is due
        # (_rx.c's drain; README "Waiting in the reactor"); -1: the fallback (probe says why).
        self._loop_epfd, self.fallback_reason = probe(loop, self._epfd)
        #: The read this reactor does: "wait" (compiled, waiting in the loop's epoll), "read"
        #: (compiled, what is ready each loop turn: public APIs only) or "python" (not compiled).
        self.path = "python" if _rx is None else "wait" if self._loop_epfd >= 0 else "read"

    async def connect(self, sock: socket.socket, address: Any, protocol: asyncio.Protocol) -> PlainTransport:
        """Connect the non-blocking ``sock`` to ``address`` and read it for ``protocol``. The
        connections ready to read are read first, before the connect and after it: a burst of
        new connections (a level's start: 128 per client process at 256 streams) otherwise kept
        them waiting through whole loop turns, over 10 ms: the first measured request's first
        chunk was read with its second, 10 ms later (its kernel stamp then the second's).

        Raises: OSError from the connect."""
        self.read_ready()
        await self._loop.sock_connect(sock, address)
        self.read_ready()
        return PlainTransport(self, sock, protocol)

    def _turn(self) -> None:
        """The loop's call when a connection is readable: read every ready one and, compiled,
        go on reading as their bytes come until anything else is due on the loop (its next
        timer, a queued callback, another reader) or :data:`WAIT_BOUND_S` has passed."""
        if _rx is None or self._loop_epfd < 0:
            self.read_ready()
            return
        loop = self._loop
        # asyncio's timers (a heap; read each turn: the loop replaces the list when it drops
        # cancelled timers), their instants by the public TimerHandle.when()
        scheduled = loop._scheduled  # type: ignore[attr-defined]
        until = loop.time() + WAIT_BOUND_S
        if scheduled and scheduled[0].when() < until:
            until = scheduled[0].when()
        _rx.drain(self._epfd, self._handlers, self._loop_epfd, loop._ready, int(until * 1e9))  # type: ignore[attr-defined]

    def read_ready(self) -> None:
        """Read every connection that has bytes waiting (one ``recv`` each): compiled, or here."""
        if _rx is not None:
            _rx.drain(self._epfd, self._handlers)
            return
        transports = self._transports
        for fd, _ in self._epoll.poll(0):
            transport = transports.get(fd)
            if transport is not None:
                transport._read()

    def _add(self, fd: int, transport: PlainTransport) -> None:
        self._epoll.register(fd, select.EPOLLIN)
        self._transports[fd] = transport
        sock = transport._sock
        stamped = sock if isinstance(sock, rxclock.StampedSocket) else None
        self._handlers[fd] = (stamped, transport._protocol, transport)

    def _remove(self, fd: int) -> None:
        self._handlers.pop(fd, None)
        if self._transports.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def close(self) -> None:
        """Close every connection still open and stop reading (their protocols are told)."""
        for transport in list(self._transports.values()):
            transport._lost(None)
        self._loop.remove_reader(self._epfd)
        self._epoll.close()


class PlainTransport:
    """One connected non-blocking socket read by ``reactor`` for ``protocol`` (an
    ``asyncio.Protocol``), which it tells at once that the connection is made."""

    def __init__(self, reactor: Reactor, sock: socket.socket, protocol: asyncio.Protocol) -> None:
        self._reactor, self._sock, self._protocol = reactor, sock, protocol
        self._fd = sock.fileno()
        self._recv_into = sock.recv_into
        self._unsent = b""  # what the socket did not take yet
        self._closing = self._lost_called = False
        reactor._add(self._fd, self)
        protocol.connection_made(self)  # type: ignore[arg-type]

    def _read(self) -> None:
        try:
            count = self._recv_into(self._reactor._buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(exc)
            return
        if count:
            self._protocol.data_received(self._reactor._view[:count].tobytes())
        else:  # the server closed its side
            self._closed_by_read(None)

    def _closed_by_read(self, exc: Exception | None) -> None:
        """A read found the server's end of file (``exc`` None) or failed with ``exc``."""
        if exc is None:
            self._protocol.eof_received()
        self._lost(exc)

    def write(self, data: bytes) -> None:
        """Send ``data``: at once as far as the socket takes it, the rest when it can."""
        if self._closing:
            return
        if self._unsent:
            self._unsent += data
            return
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._lost(exc)
            return
        if sent < len(data):
            self._unsent = data[sent:]
            self._reactor._loop.add_writer(self._fd, self._write_more)

    def _write_more(self) -> None:
        try:
            sent = self._sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(exc)
            return
        self._unsent = self._unsent[sent:]
        if not self._unsent:
            self._reactor._loop.remove_writer(self._fd)

    def close(self) -> None:
        """Stop reading, close the socket and tell the protocol in a later loop turn."""
        if not self._closing:
            self._closing = True
            self._shut()
            self._reactor._loop.call_soon(self._lost, None)

    def is_closing(self) -> bool:  # noqa: D102
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:  # noqa: D102
        return self._sock if name == "socket" else default

    def _shut(self) -> None:
        if self._sock.fileno() < 0:
            return
        self._reactor._remove(self._fd)
        if self._unsent:
            self._reactor._loop.remove_writer(self._fd)
            self._unsent = b""
        self._sock.close()

    def _lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._shut()
        if not self._lost_called:
            self._lost_called = True
            self._protocol.connection_lost(exc)
