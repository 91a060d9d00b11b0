"""How late the client's event loop handles data that has arrived: is the client the bottleneck?

A chunk's measured arrival time is the moment the client code sees it, not the moment its bytes
reached the socket. When the event loop is busy (parsing other streams, a blocking call), a
ready socket waits, and every TTFT / ITL measured in that time is late by the wait: the numbers
then describe the client, not the server.

:class:`LoopLagProbe` measures that wait directly with a synthetic stream: a small helper
process writes into a pipe, every ``interval_ms``, the time of the write; the event loop's reader
callback on the other end records ``now - written``. That is the path a real chunk takes (an fd
becomes readable -> the loop notices -> its callback runs), so the probe's lag is the lateness
charged to every chunk read in the same moment, minus the chunk's own parsing. It also charges
the time this process waited for a CPU: on a machine whose cores are busy with other work, the
operating system runs the client late, and both the pipe and the sockets are read late.

The writer is a separate process, not a thread: a thread would need this process's GIL to
write, and while the loop parses other streams it waits for it (up to the 5 ms switch interval),
so the probe would charge a lag no chunk suffered (measured here with a thread stamping its due
time: the flag was raised at 1 and 16 streams where the ITL error p99 stayed under 1 ms). The
write is stamped when it happens, so the writer's own lateness is never charged. A timer-based
probe (``asyncio.sleep`` overshoot) was rejected too: an idle loop's timer already overshoots by
up to 1 ms on Linux (epoll rounds its timeout up to whole ms; measured here p99 0.94 ms), which
would swamp a 1 ms tolerance. Timestamps are ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux:
one clock for every process on the machine).

Only lag that can reach a measurement counts: given the level's chunk arrival times, a sample
stamped at ``t`` with lag ``L`` is kept when some text chunk arrived in ``[t, t + L + interval]``
(the loop was late while it was receiving). A stall while requests are being launched and no
data is due (opening 256 connections takes the loop ~0.2 s here) delays sends, which the
measurement does not see (each request's clock starts at its own send), so it does not flag a
level whose chunks were all read on time.

The flag: a level is ``client_bound`` when the kept samples' p99 lag exceeds the tolerance
(``StreamConfig.client_bound_tolerance_ms``, default 1 ms).

On the kernel clock the probe is also evidence of when the loop was free: a sample written at
``w`` and read at ``r`` says the loop served what was ready at ``w`` by ``r``. The figures
(:class:`LagFigures`) keep the samples as ``timeline`` for
:func:`tasks.wire.rxclock.late_coalesced_gaps`, in this process only. Hence the interval,
:data:`INTERVAL_MS`: a read whose chunks came together after an idle spell is cleared only by
a sample within the 1 ms tolerance before it. Measured on the instrument (256 streams, 60
chunks 10 ms apart, one process, 2 cores shared with other work, 2026-12-06, 4 exact levels,
each sample then counted at its own read): with 0.5 ms samples the ITL gaps left doubtful fell
from 10-43 % (the same runs' samples thinned to 2 ms) to 0.5-4.4 %. The cost: 2,000 wake-ups
a second of the writer process and as many reads of the loop (a few us each).
"""

from __future__ import annotations

import asyncio
import bisect
import os
import struct
import subprocess
import sys
import time

from tasks.stats import percentile

_STAMP = struct.Struct("<q")
#: The probe's default interval (ms) between stamps (module docstring).
INTERVAL_MS = 0.5


class LagFigures(dict):
    """The probe's figures (:meth:`LoopLagProbe.metrics`: a plain dict to JSON and pickle
    readers) and, as the attribute ``timeline``, its samples: ``(written_ns, read_ns)``, two
    lists of ``time.perf_counter_ns`` in write order (None when the figures were not one
    probe's). An attribute, not an item, so that the samples (thousands a minute) never travel
    with the figures: a client process ships its count of doubtful gaps instead
    (``coalesced_late_gaps``, :func:`tasks.scaleout.multiproc.merge_lags`)."""

    timeline: tuple[list[int], list[int]] | None = None


# The writer process: plain Python with no imports beyond the standard library, so it starts in
# tens of milliseconds. argv: the pipe's write fd, the interval in ns. It ends when the pipe
# is closed (EPIPE) or on SIGTERM.
_WRITER = """
import os, struct, sys, time
fd, step = int(sys.argv[1]), int(sys.argv[2])
pack, perf, sleep, write = struct.Struct("<q").pack, time.perf_counter_ns, time.sleep, os.write
due = perf() + step
try:
    while True:
        wait = due - perf()
        if wait > 0:
            sleep(wait / 1e9)
        write(fd, pack(perf()))
        due += step
        now = perf()
        if due < now:
            due = now + step
except OSError:
    pass
"""


class LoopLagProbe:
    """Measure the running loop's read lag while the ``async with`` block runs.

    Attributes:
        lags_ms: one entry per probe stamp received: receive time - write time, in ms.
        stamps_ns: the write time of each entry (``time.perf_counter_ns``).
        reads_ns: the time the loop read each entry (``time.perf_counter_ns``).

    Usage::

        async with LoopLagProbe() as probe:
            ... run the load ...
        probe.p99_ms

    Raises:
        OSError: the writer process could not be started (on ``__aenter__``).
    """

    def __init__(self, interval_ms: float = INTERVAL_MS) -> None:
        self.interval_s = interval_ms / 1000.0
        self.lags_ms: list[float] = []
        self.stamps_ns: list[int] = []
        self.reads_ns: list[int] = []
        self._writer: subprocess.Popen | None = None
        self._rfd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._buffer = b""

    def _on_readable(self) -> None:
        try:
            data = os.read(self._rfd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        # the clock read after the read: a stamp written between a clock read before it and the
        # read itself would be younger than "now" (a negative lag; once in a full suite's run
        # with a stamp every 0.5 ms). The read's own microseconds count as lag, as they should.
        now = time.perf_counter_ns()
        data = self._buffer + data
        whole = len(data) - len(data) % _STAMP.size
        self._buffer = data[whole:]
        for (stamp,) in _STAMP.iter_unpack(data[:whole]):
            self.stamps_ns.append(stamp)
            self.reads_ns.append(now)
            self.lags_ms.append((now - stamp) / 1e6)

    async def __aenter__(self) -> LoopLagProbe:
        self._loop = asyncio.get_running_loop()
        self._rfd, wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        try:
            self._writer = subprocess.Popen(
                [sys.executable, "-S", "-c", _WRITER, str(wfd), str(int(self.interval_s * 1e9))],
                pass_fds=(wfd,),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(wfd)
        self._loop.add_reader(self._rfd, self._on_readable)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._on_readable()  # a stamp already written
        self._loop.remove_reader(self._rfd)
        os.close(self._rfd)  # the writer's next write fails with EPIPE and it exits
        self._writer.terminate()
        self._writer.wait()

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

    def metrics(self, tolerance_ms: float, arrivals_ns: list[int] | None = None) -> LagFigures:
        """``client_loop_lag_ms_p50/p99/max``, ``client_loop_lag_samples`` and ``client_bound``
        (1 when p99 > ``tolerance_ms``, else 0; None without samples). With ``arrivals_ns``
        (the level's text-chunk arrival times, sorted), only the samples during which a chunk
        arrived count; without, all. Every sample is in ``timeline`` (:class:`LagFigures`)."""
        lags = self.lags_ms if arrivals_ns is None else self.receiving_lags_ms(arrivals_ns)
        data = sorted(lags)
        p99 = percentile(data, 99.0)
        figures = LagFigures(
            client_loop_lag_ms_p50=percentile(data, 50.0),
            client_loop_lag_ms_p99=p99,
            client_loop_lag_ms_max=data[-1] if data else None,
            client_loop_lag_samples=len(data),
            client_bound=None if p99 is None else int(p99 > tolerance_ms),
        )
        figures.timeline = (list(self.stamps_ns), list(self.reads_ns))
        return figures
