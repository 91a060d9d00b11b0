"""The wire between a level's orchestrator and its Dask workers (``tasks.scaleout.dask_load``),
and the worker's side of it (standard library, and the client in the worker only).

One JSON object a line over a TCP connection the worker opens to the orchestrator:

- ``hello`` (its share's number and the level's token) -> :data:`PINGS` ``ping``/``pong``
  round trips (:func:`sync`: the worker's clock offset, :mod:`tasks.scaleout.clocksync`) ->
  ``go`` (with the API key), or ``abandon`` for a share that ran already (a Dask retry);
- ``record`` per finished request (warm-up ones first, on worker 0), ``ready`` after the
  warm-up, then ``start`` (the instant on the worker's clock) from the orchestrator;
- ``done`` (loop lag, CPU seconds, drift, last completion on the worker's clock), round trips
  again, ``bye``; or ``failed`` (the exception) when the worker's level raised.

From ``go`` to ``done`` nothing else flows to the worker but ``start``, so while its client's
loop runs the worker watches the link for its end (``_Wire``, peeking, never reading): when the
orchestrator exits, is interrupted or fails, the worker cancels its requests in flight and
sends no more (its task returns ``"orphaned"``); the hooks given to :func:`when_orphaned` run
then (a LocalCluster's worker mutes its output: ``tasks.scaleout.dask_cluster.mute_worker``). Its
records leave without blocking that loop: each goes to the socket with one non-blocking
``send``; what the socket does not take waits in a buffer that the loop writes out as the
socket drains (an orchestrator slow to read holds no request of the level), and the buffer is
written out before ``done`` (no record is lost at the end).

:func:`set_clock_skew` makes a worker's clock read ahead, as one on another host would: its
pongs, its records' ``send_ns``, its ``last_done_ns``, and the start instant it receives (the
tests' injected offset, which the alignment must remove).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tasks import asyncrun
from tasks.scaleout.clocksync import Offset, Sample, estimate_offset
from tasks.stream.level_result import LevelResult
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings
from tasks.wire import rxclock

__all__ = ["PINGS", "Link", "client_task", "set_clock_skew", "sync", "when_orphaned"]

#: Round trips per clock-offset estimate (the shortest is kept).
PINGS = 10
#: Seconds a worker waits for the orchestrator to accept its connection.
CONNECT_TIMEOUT_S = 120.0

_SKEW_NS = 0  # set_clock_skew: added to this process's clock readings that go to the orchestrator
_ORPHANED: list[Callable[[], None]] = []  # when_orphaned's hooks


def when_orphaned(hook: Callable[[], None]) -> None:
    """Call ``hook()`` in this worker each time a level's link closes before its end (the
    orchestrator exited, was interrupted or failed), once its requests are cancelled (at most
    once per hook: a hook given twice is kept once)."""
    if hook not in _ORPHANED:
        _ORPHANED.append(hook)


def set_clock_skew(ns: int) -> None:
    """Make this worker's clock read ``ns`` nanoseconds ahead (the module docstring; for
    ``Client.run(set_clock_skew, ns, workers=[address])``)."""
    global _SKEW_NS
    _SKEW_NS = int(ns)


class Link:
    """One JSON object per line over a TCP socket. A peer whose host vanished (no FIN, no RST)
    is an error within ~25 s instead of never: keep-alive probes it while nothing is sent, and
    ``TCP_USER_TIMEOUT`` (Linux, RFC 5482) bounds how long sent data may stay unacknowledged,
    which keep-alive does not (a worker shipping records to a vanished orchestrator would
    otherwise retransmit, and go on sending requests, for ~15 minutes: ``tcp_retries2``)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        options = (
            ("TCP_KEEPIDLE", 10),
            ("TCP_KEEPINTVL", 5),
            ("TCP_KEEPCNT", 3),
            ("TCP_USER_TIMEOUT", 25_000),
        )
        for name, value in options:
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        self.sock = sock
        self.reader = sock.makefile("rb")

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def recv(self) -> dict[str, Any] | None:
        """The next message; None when the peer closed the connection."""
        line = self.reader.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        """Shut the connection (a thread blocked reading it wakes, the peer reads its end)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


# The worker's side --------------------------------------------------------------------------


def _clock_ns() -> int:
    return time.perf_counter_ns() + _SKEW_NS


def _answer_pings(link: Link) -> dict[str, Any] | None:
    """Answer the orchestrator's pings with this clock; the first other message (None: closed)."""
    while (message := link.recv()) is not None and message["kind"] == "ping":
        link.send({"kind": "pong", "ns": _clock_ns()})
    return message


def client_task(
    k: int,
    workers: int,
    where: tuple[str, int],
    token: str,
    connection: Connection,
    settings: LevelSettings,
    warmup: LevelSettings | None,
) -> str:
    """The Dask task of worker ``k`` of ``workers`` (the module docstring's steps); returns
    how it ended. Raises what the level raised (after telling the orchestrator)."""
    link = Link(socket.create_connection(where, timeout=CONNECT_TIMEOUT_S))
    link.sock.settimeout(None)
    try:
        link.send({"kind": "hello", "k": k, "token": token})
        answer = _answer_pings(link)
        if answer is None or answer["kind"] != "go":
            return "abandoned"  # a retry of a share that already ran (or the level is over)
        connection = replace(connection, api_key=answer["api_key"])
        # the heap before the level (imports: Dask's, this package's) is never garbage; frozen,
        # the collector's full passes skip it (tasks.scaleout.multiproc measured 64 ms otherwise)
        gc.freeze()
        result = asyncrun.run(_measure(k, workers, link, connection, settings, warmup))
        if result is None:
            return "orphaned"  # the orchestrator left mid-level: nothing more was sent
        last = result.last_done_ns + _SKEW_NS if result.last_done_ns else 0
        # the doubtful coalesced gaps judged on this worker's own loop, as a client process does
        lag = rxclock.judged_lag(result.lag, result.measured, settings.lag_tolerance_ms)
        done = {"lag": lag, "cpu_s": result.cpu_s, "offset_drift_ns": result.offset_drift_ns}
        link.send({"kind": "done", **done, "last_done_ns": last})
        _answer_pings(link)  # the end's offset, until "bye"
        return "done"
    except BaseException as exc:
        with contextlib.suppress(OSError):
            link.send({"kind": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        link.close()


class _Wire:
    """The worker's side of the link while its client's loop runs (a context manager): messages
    out without blocking the loop (one ``send`` each; what the socket does not take waits for
    it to drain, in order), and the link's end watched: when the orchestrator closes it (it
    exited, was interrupted, or failed) every task of the loop is cancelled, the requests in
    flight with them, and ``closed`` says why. The watcher only peeks: nothing flows to the
    worker while its level runs, and a message that does arrive is left for :meth:`recv`."""

    def __init__(self, link: Link) -> None:
        self.link, self.fd = link, link.sock.fileno()
        self.loop = asyncio.get_running_loop()
        self.pending = bytearray()
        self.drained: asyncio.Future[None] | None = None
        self.closed = False

    def __enter__(self) -> _Wire:
        self.link.sock.setblocking(False)
        self.loop.add_reader(self.fd, self._readable)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.link.sock.setblocking(True)

    def send(self, message: dict[str, Any]) -> None:
        if self.closed:
            return
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        if not self.pending:
            try:
                sent = self.link.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._lost()
                return
            if sent == len(data):
                return
            data = data[sent:]
            self.loop.add_writer(self.fd, self._flush)
        self.pending += data

    def _flush(self) -> None:
        try:
            sent = self.link.sock.send(self.pending)
        except BlockingIOError:
            return
        except OSError:
            self._lost()
            return
        del self.pending[:sent]
        if not self.pending:
            self.loop.remove_writer(self.fd)
            if self.drained is not None and not self.drained.done():
                self.drained.set_result(None)

    async def drain(self) -> None:
        """Until every message sent has gone to the socket."""
        if self.pending and not self.closed:
            self.drained = self.loop.create_future()
            await self.drained

    async def recv(self) -> dict[str, Any] | None:
        """The orchestrator's next message, after what was sent has gone (None: it closed);
        read blocking the loop, which costs nothing when nothing is in flight."""
        await self.drain()
        self.loop.remove_reader(self.fd)
        self.link.sock.setblocking(True)
        try:
            return self.link.recv()
        finally:
            self.link.sock.setblocking(False)
            self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            peeked = self.link.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            peeked = b""
        self.loop.remove_reader(self.fd)  # data: a message for recv, left unread
        if not peeked:
            self._lost()

    def _lost(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        for hook in _ORPHANED:
            with contextlib.suppress(Exception):  # a hook's failure must not keep a request going
                hook()


async def _measure(
    k: int,
    workers: int,
    link: Link,
    connection: Connection,
    settings: LevelSettings,
    warmup: LevelSettings | None,
) -> LevelResult | None:
    """The worker's level (warm-up, ``ready``, ``start``, its share); None when the
    orchestrator closed the link first (``_Wire``: nothing more was sent)."""
    from tasks.stream.load import connect, open_connections, run_level  # the transport: in the worker only

    client = connect(connection, settings.max_concurrency)
    try:
        with _Wire(link) as wire:

            def ship(record: RequestRecord) -> None:
                data = record.to_json()
                if data.get("send_ns"):
                    data["send_ns"] += _SKEW_NS
                wire.send({"kind": "record", "record": data})

            try:
                if warmup is not None:
                    await run_level(client, warmup, count_tokens=None, on_record=ship)
                await open_connections(client, settings, (k, workers))
                wire.send({"kind": "ready"})
                start = await wire.recv()
                if start is None:
                    return None
                if start["kind"] != "start":
                    raise ConnectionError(f"the orchestrator sent {start['kind']!r}, not the start")
                result = await run_level(
                    client,
                    settings,
                    count_tokens=None,
                    share=(k, workers),
                    start_at=(start["at_ns"] - _SKEW_NS) / 1e9,
                    on_record=ship,
                )
                await wire.drain()
                return None if wire.closed else result
            except asyncio.CancelledError:
                if wire.closed:
                    return None
                raise
    finally:
        await client.close()


# The orchestrator's side --------------------------------------------------------------------


def sync(link: Link) -> Offset:
    """:data:`PINGS` round trips to the worker at the other end; its clock's offset.

    Raises:
        ConnectionError: it closed or answered out of turn."""
    samples = []
    for _ in range(PINGS):
        t0 = time.perf_counter_ns()
        link.send({"kind": "ping"})
        answer = link.recv()
        t1 = time.perf_counter_ns()
        if answer is None or answer["kind"] != "pong":
            raise ConnectionError("the worker did not answer the clock's round trips")
        samples.append(Sample(t0, answer["ns"], t1))
    return estimate_offset(samples)
