"""The wire between a level's orchestrator and its Dask workers (``tasks.stream.dask_load``),
and the worker's side of it (standard library, and the client in the worker only).

One JSON object a line over a TCP connection the worker opens to the orchestrator:

- ``hello`` (its share's number and the level's token) -> :data:`PINGS` ``ping``/``pong``
  round trips (:func:`sync`: the worker's clock offset, :mod:`tasks.stream.clocksync`) ->
  ``go`` (with the API key), or ``abandon`` for a share that ran already (a Dask retry);
- ``record`` per finished request (warm-up ones first, on worker 0), ``ready`` after the
  warm-up, then ``start`` (the instant on the worker's clock) from the orchestrator;
- ``done`` (loop lag, CPU seconds, drift, last completion on the worker's clock), round trips
  again, ``bye``; or ``failed`` (the exception) when the worker's level raised.

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
from dataclasses import replace
from typing import Any

from tasks.stream.clocksync import Offset, Sample, estimate_offset
from tasks.stream.level_result import LevelResult
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings

__all__ = ["PINGS", "Link", "client_task", "set_clock_skew", "sync"]

#: Round trips per clock-offset estimate (the shortest is kept).
PINGS = 10
#: Seconds a worker waits for the orchestrator to accept its connection.
CONNECT_TIMEOUT_S = 120.0

_SKEW_NS = 0  # set_clock_skew: added to this process's clock readings that go to the orchestrator


def set_clock_skew(ns: int) -> None:
    """Make this worker's clock read ``ns`` nanoseconds ahead (the module docstring; for
    ``Client.run(set_clock_skew, ns, workers=[address])``)."""
    global _SKEW_NS
    _SKEW_NS = int(ns)


class Link:
    """One JSON object per line over a TCP socket (with keep-alive: a vanished peer is an
    error within ~25 s instead of never)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
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
        # the collector's full passes skip it (tasks.stream.multiproc measured 64 ms otherwise)
        gc.freeze()
        result = asyncio.run(_measure(k, workers, link, connection, settings, warmup))
        last = result.last_done_ns + _SKEW_NS if result.last_done_ns else 0
        done = {"lag": result.lag, "cpu_s": result.cpu_s, "offset_drift_ns": result.offset_drift_ns}
        link.send({"kind": "done", **done, "last_done_ns": last})
        _answer_pings(link)  # the end's offset, until "bye"
        return "done"
    except BaseException as exc:
        with contextlib.suppress(OSError):
            link.send({"kind": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        link.close()


async def _measure(
    k: int,
    workers: int,
    link: Link,
    connection: Connection,
    settings: LevelSettings,
    warmup: LevelSettings | None,
) -> LevelResult:
    from tasks.stream.load import connect, run_level  # the transport: in the worker only

    def ship(record: RequestRecord) -> None:
        data = record.to_json()
        if data.get("send_ns"):
            data["send_ns"] += _SKEW_NS
        link.send({"kind": "record", "record": data})

    client = connect(connection, settings.max_concurrency)
    try:
        if warmup is not None:
            await run_level(client, warmup, count_tokens=None, on_record=ship)
        link.send({"kind": "ready"})
        start = link.recv()  # blocking this loop costs nothing: nothing is in flight
        if start is None or start["kind"] != "start":
            raise ConnectionError("the orchestrator left before the level started")
        return await run_level(
            client,
            settings,
            count_tokens=None,
            share=(k, workers),
            start_at=(start["at_ns"] - _SKEW_NS) / 1e9,
            on_record=ship,
        )
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
