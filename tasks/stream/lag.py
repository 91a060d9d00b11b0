"""How late the client's event loop handles data that has arrived: is the client the bottleneck?

A chunk's measured arrival time is the moment the client code sees it, not the moment its bytes
reached the socket. When the event loop is busy (parsing other streams, a blocking call), a
ready socket waits, and every TTFT / ITL measured in that time is late by the wait: the numbers
then describe the client, not the server.

:class:`LoopLagProbe` measures that wait directly with a synthetic stream: a helper thread
writes into a socket pair, every ``interval_ms`` on a fixed schedule, the time at which the
write was due; the event loop's reader callback on the other end records ``now - due``. That is
the path a real chunk takes (socket readable -> the loop notices -> its callback runs), so the
probe's lag is the lateness charged to every chunk read in the same moment, minus the chunk's
own parsing. Counting from the due time (not from the thread's actual wake-up) also charges
the time this process waited for a CPU or for the GIL: on a machine whose cores are busy with
other work, the operating system wakes the client late, and its chunks are read late too. A timer-based probe (``asyncio.sleep`` overshoot) was rejected: an idle loop's timer
already overshoots by up to 1 ms on Linux (epoll rounds its timeout up to whole ms; measured
here p99 0.94 ms), which would swamp a 1 ms tolerance.

Only lag that can reach a measurement counts: given the level's chunk arrival times, a sample
stamped at ``t`` with lag ``L`` is kept when some text chunk arrived in ``[t, t + L + interval]``
(the loop was late while it was receiving). A stall while requests are being launched and no
data is due (opening 256 connections takes the loop ~0.2 s here) delays sends, which the
measurement does not see (each request's clock starts at its own send), so it does not flag a
level whose chunks were all read on time.

The flag: a level is ``client_bound`` when the kept samples' p99 lag exceeds the tolerance
(``StreamConfig.client_bound_tolerance_ms``, default 1 ms).
"""

from __future__ import annotations

import asyncio
import bisect
import socket
import struct
import threading
import time

from tasks.stats import percentile

_STAMP = struct.Struct("<q")


class LoopLagProbe:
    """Measure the running loop's read lag while the ``async with`` block runs.

    Attributes:
        lags_ms: one entry per probe stamp received: receive time - stamp time, in ms.
        stamps_ns: the stamp of each entry (``time.perf_counter_ns``).

    Usage::

        async with LoopLagProbe() as probe:
            ... run the load ...
        probe.p99_ms
    """

    def __init__(self, interval_ms: float = 2.0) -> None:
        self.interval_s = interval_ms / 1000.0
        self.lags_ms: list[float] = []
        self.stamps_ns: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rsock: socket.socket | None = None
        self._wsock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._buffer = b""

    def _on_readable(self) -> None:
        now = time.perf_counter_ns()
        try:
            data = self._rsock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        data = self._buffer + data
        whole = len(data) - len(data) % _STAMP.size
        self._buffer = data[whole:]
        for (stamp,) in _STAMP.iter_unpack(data[:whole]):
            self.stamps_ns.append(stamp)
            self.lags_ms.append((now - stamp) / 1e6)

    def _run(self) -> None:
        perf, sleep, pack, send = time.perf_counter_ns, time.sleep, _STAMP.pack, self._wsock.send
        step = int(self.interval_s * 1e9)
        due = perf() + step
        while not self._stop.is_set():
            wait = due - perf()
            if wait > 0:
                sleep(wait / 1e9)
            try:
                send(pack(due))  # the time it was due: a late wake-up of this thread counts too
            except OSError:
                return
            due += step
            now = perf()
            if due < now:  # more than one interval late: resume the schedule from now
                due = now + step

    async def __aenter__(self) -> LoopLagProbe:
        self._loop = asyncio.get_running_loop()
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._loop.add_reader(self._rsock.fileno(), self._on_readable)
        self._thread = threading.Thread(target=self._run, name="loop-lag-probe", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        await asyncio.sleep(0)  # let a stamp already written be read
        self._loop.remove_reader(self._rsock.fileno())
        self._rsock.close()
        self._wsock.close()

    @property
    def p99_ms(self) -> float | None:
        """The 99th percentile of the lags (None without samples)."""
        return percentile(sorted(self.lags_ms), 99.0)

    def receiving_lags_ms(self, arrivals_ns: list[int]) -> list[float]:
        """The lags during which a chunk arrived (see the module docstring); ``arrivals_ns``
        sorted ascending."""
        pad_ns = int(self.interval_s * 1e9)
        kept = []
        for stamp, lag in zip(self.stamps_ns, self.lags_ms):
            i = bisect.bisect_left(arrivals_ns, stamp)
            if i < len(arrivals_ns) and arrivals_ns[i] <= stamp + lag * 1e6 + pad_ns:
                kept.append(lag)
        return kept

    def metrics(
        self, tolerance_ms: float, arrivals_ns: list[int] | None = None
    ) -> dict[str, float | int | None]:
        """``client_loop_lag_ms_p50/p99/max``, ``client_loop_lag_samples`` and ``client_bound``
        (1 when p99 > ``tolerance_ms``, else 0; None without samples). With ``arrivals_ns``
        (the level's text-chunk arrival times, sorted), only the samples during which a chunk
        arrived count; without, all."""
        lags = self.lags_ms if arrivals_ns is None else self.receiving_lags_ms(arrivals_ns)
        data = sorted(lags)
        p99 = percentile(data, 99.0)
        return {
            "client_loop_lag_ms_p50": percentile(data, 50.0),
            "client_loop_lag_ms_p99": p99,
            "client_loop_lag_ms_max": data[-1] if data else None,
            "client_loop_lag_samples": len(data),
            "client_bound": None if p99 is None else int(p99 > tolerance_ms),
        }
