"""Arrival times from the kernel: receive timestamps on the client's sockets.

A chunk's arrival stamped in Python is the moment the event loop got round to reading it; on a
busy machine that is milliseconds after the bytes reached the socket (the loop was parsing other
streams, or waited for a CPU). The kernel stamps every received segment when it arrives. With
``SO_TIMESTAMPNS`` set (Linux, ``man 7 socket``; ``Documentation/networking/timestamping.rst``,
software receive timestamps) every ``recvmsg`` returns, as ancillary data, the
``CLOCK_REALTIME`` time at which the last segment it read was received.

:class:`StampedSocket` is the socket the stream client's HTTP/1.1 connections use
(:mod:`tasks.wire.h1`). asyncio's selector transport reads it with ``recv`` (or ``recv_into``
for a buffered protocol, which is what TLS uses: the stamp then belongs to the raw read that
delivered the encrypted bytes, before decryption) and writes it with ``send``; the subclass reads
with ``recvmsg`` instead and keeps the last read's kernel time and return time, and the time the
last ``send`` of a request returned. uvloop, or any transport that does not read through the
Python socket object, never calls these methods: no stamp is taken and the records fall back to
the user-space clock.

Which read delivered which SSE event: the transport hands a read's bytes to the HTTP protocol in
the same loop callback as the read, and the protocol hands the body's bytes, with that read's
stamps, to the SSE reader in that callback too (``tasks.wire.h1.Sink``): an event is stamped
with the read that completed it. Events delivered by one read share its time: rightly when the
server wrote them together; wrongly when the client fell behind, the kernel queued several
segments and one late read took them all (the stamp is the last segment's). Those are
*coalesced* events (:func:`coalesced_events`, counted per request and level).

The records' clock is ``time.perf_counter_ns`` (CLOCK_MONOTONIC). A kernel stamp is converted by
subtracting ``CLOCK_REALTIME - CLOCK_MONOTONIC`` measured right after the request's stream
(:func:`realtime_offset_ns`), so a step of the wall clock (NTP) can only touch the requests in
flight during it; the level measures the offset at its start and end too and reports the drift.

Linux only; elsewhere :data:`SUPPORTED` is False and every record says ``arrival_clock: user``.
"""

from __future__ import annotations

import bisect
import operator
import socket
import struct
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

#: ``SO_TIMESTAMPNS`` (Linux value 35 where Python does not export the name). The ancillary
#: message comes back with the same type (``SCM_TIMESTAMPNS``).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@qq")  # struct timespec on 64-bit Linux: tv_sec, tv_nsec
_ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size) if hasattr(socket, "CMSG_SPACE") else 64
#: Whether this platform can stamp receives in the kernel (Linux with recvmsg).
SUPPORTED = sys.platform.startswith("linux") and hasattr(socket.socket, "recvmsg")
_perf_ns = time.perf_counter_ns


def realtime_offset_ns(tries: int = 5) -> int:
    """``CLOCK_REALTIME - CLOCK_MONOTONIC`` in ns: the realtime read that was bracketed most
    tightly by two monotonic reads (``time.perf_counter_ns`` is CLOCK_MONOTONIC on Linux), minus
    the bracket's midpoint. Error: half the tightest bracket (well under 1 us here)."""
    perf, real = time.perf_counter_ns, time.time_ns
    best: tuple[int, int] | None = None
    for _ in range(tries):
        a = perf()
        r = real()
        b = perf()
        if best is None or b - a < best[0]:
            best = (b - a, r - (a + b) // 2)
    assert best is not None
    return best[1]


class StampedSocket(socket.socket):
    """A TCP socket that keeps, for its last read, the kernel receive time and the time the read
    returned, and the time its last ``send`` returned (module docstring). The protocol reading
    it takes them in the same loop callback as the read.

    Attributes:
        rx_ns: kernel CLOCK_REALTIME ns of the last read that carried a stamp (0: none yet).
        read_ns: ``perf_counter_ns`` when the last read returned (the user-space clock's arrival).
        sent_ns: ``perf_counter_ns`` when the last ``send`` returned (the request's last byte
            was handed to the kernel); 0 before any.
        created_ns: ``perf_counter_ns`` when the socket was made (the connection's start).
    """

    def __init__(self, family: int, type_: int, proto: int) -> None:
        super().__init__(family, type_, proto)
        self.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.created_ns = time.perf_counter_ns()
        self.rx_ns = self.read_ns = self.sent_ns = 0

    # The three calls asyncio's selector transport makes. ---------------------------------
    def recv(self, bufsize: int, flags: int = 0) -> bytes:  # noqa: D102
        # off the hot path on Linux (the reactor and TLS read with recv_into): one stamp reader
        buffer = bytearray(bufsize)
        return bytes(memoryview(buffer)[: self.recv_into(buffer, 0, flags)])

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:  # noqa: D102
        buffers = (memoryview(buffer)[:nbytes],) if nbytes else (buffer,)
        count, ancillary, _, _ = self.recvmsg_into(buffers, _ANCILLARY_BYTES, flags)
        self.read_ns = _perf_ns()
        # inline, not a call per read: this runs once per chunk (README "Cheaper per chunk")
        for level, kind, payload in ancillary:
            if kind == SO_TIMESTAMPNS and level == socket.SOL_SOCKET and len(payload) >= _TIMESPEC.size:
                sec, nsec = _TIMESPEC.unpack_from(payload)
                self.rx_ns = sec * 1_000_000_000 + nsec
        return count

    def send(self, data: Any, flags: int = 0) -> int:  # noqa: D102
        count = super().send(data, flags)
        self.sent_ns = _perf_ns()
        return count


def stamped_socket(addr_info: tuple) -> socket.socket | None:
    """A :class:`StampedSocket` for ``(family, type, proto, ...)``; None where timestamps are
    not supported or the option is refused (the records then say ``arrival_clock: user``)."""
    family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
    if SUPPORTED:
        try:
            return StampedSocket(family, type_, proto)
        except OSError:
            pass
    return None


#: How much later than its user-space stamp a converted kernel stamp may lie before the
#: conversion is distrusted (a wall-clock step during the request): the user clock is kept then.
_SLACK_NS = 200_000


#: Why a record's arrivals stayed on the user-space clock although the kernel's was asked for.
NO_STAMP = "a text chunk had no kernel receive stamp"
CLOCK_STEPPED = "a converted kernel stamp fell outside the request (the wall clock stepped)"
NO_STAMPED_SOCKET = "no stamped socket under the reply (the kernel refused the timestamp option)"


def kernel_arrivals(
    send_ns: int, user_ns: list[int], rx_ns: list[int], offset_ns: int
) -> tuple[list[int] | None, str | None]:
    """The text chunks' arrival times on the records' clock (``perf_counter_ns``) from their
    kernel stamps, and None with the reason when the user-space stamps must stand
    (:data:`NO_STAMPED_SOCKET`, :data:`NO_STAMP`: a chunk without a kernel stamp;
    :data:`CLOCK_STEPPED`: a converted stamp before the send or after its user-space stamp by
    more than 0.2 ms). No text chunk: ``(None, None)`` (nothing to stamp, nothing fell back).

    Args:
        send_ns: the request's send time (``perf_counter_ns``).
        user_ns: each text chunk's user-space arrival (``perf_counter_ns``).
        rx_ns: each text chunk's kernel receive time (CLOCK_REALTIME ns; 0 = none; empty when the
            socket was not a :class:`StampedSocket`).
        offset_ns: :func:`realtime_offset_ns`, read after the stream.
    """
    if not user_ns:
        return None, None
    if not rx_ns:
        return None, NO_STAMPED_SOCKET
    if len(rx_ns) != len(user_ns) or not all(rx_ns):
        return None, NO_STAMP
    kernel = [stamp - offset_ns for stamp in rx_ns]
    if kernel[0] < send_ns or max(map(operator.sub, kernel, user_ns)) > _SLACK_NS:
        return None, CLOCK_STEPPED
    return kernel, None


#: A read handled this long (ns) after its kernel stamp was a late read (the loop was behind).
LATE_READ_NS = 1_000_000


def coalesced_events(rx_ns: list[int], kernel_ns: list[int], user_ns: list[int]) -> int:
    """Text chunks that came in one read with the text chunk before them (equal kernel stamps)
    while the client read late (its user-space stamp over :data:`LATE_READ_NS` after the kernel
    stamp): the loop was behind, the kernel had queued several segments, and the read carries the
    last one's time, so the earlier chunks' times are too late and their gaps collapse. Chunks
    the server wrote together and the client read at once share a stamp rightly and do not
    count. ``kernel_ns`` / ``user_ns``: :func:`kernel_arrivals` and the user-space stamps."""
    return sum(
        [
            1
            for before, stamp, kernel, user in zip(rx_ns, rx_ns[1:], kernel_ns[1:], user_ns[1:])
            if stamp and stamp == before and user - kernel > LATE_READ_NS
        ]
    )


#: Evidence entries one doubtful read may walk back over before it settles for what it found
#: (a smaller lower bound: a larger, so more cautious, doubt).
_EVIDENCE_WALK = 1024


def _reads(record: Any) -> list[tuple[int, int, int]]:
    """A kernel-clock record's reads that carried text: ``(kernel_ns, read_ns, events)`` on the
    records' clock, consecutive text chunks with one kernel stamp being one read."""
    out: list[list[int]] = []
    send = record.send_ns
    for kernel, user in zip(record.token_offsets_ms, record.user_token_offsets_ms):
        if out and out[-1][3] == kernel:
            out[-1][2] += 1
        else:
            out.append([send + round(kernel * 1e6), send + round(user * 1e6), 1, kernel])
    return [(k, u, n) for k, u, n, _ in out]


def _probe_evidence(timeline: tuple[Sequence[int], Sequence[int]]) -> list[tuple[int, int]]:
    """The probe's samples as evidence ``(read_ns, arrival_ns)``: a sample written at ``w`` and
    read in one loop turn proves that a connection ready at ``w`` was read by the end of that
    turn, which is before the probe's next read (a later turn), not before the sample's own
    read (the reactor's turn may come after the probe's in the same loop turn: measured
    1-29 ms early under load). So each sample counts as read at the next distinct read."""
    latest: dict[int, int] = {}  # read_ns -> the latest write it took
    for written, read in zip(*timeline):
        latest[read] = max(written, latest.get(read, written))
    reads = sorted(latest)
    return [(after, latest[read]) for read, after in zip(reads, reads[1:])]


def late_coalesced_gaps(
    records: Iterable[Any], timeline: tuple[Sequence[int], Sequence[int]] | None, tolerance_ms: float
) -> int:
    """How many ITL gaps of one event loop's kernel-clock records may be wrong by more than
    ``tolerance_ms`` because their chunks came coalesced (several in one read). Judged from what
    the client saw, never from a count of coalesced chunks alone.

    Why (``SO_TIMESTAMPNS`` stamps a read with its LAST segment's arrival, module docstring):
    a read of ``n`` text chunks stamped ``s`` is exact when the chunks arrived together (a
    server that wrote them back to back: an instrument or engine catching up after a stall, a
    server that batches); it is wrong by ``s - a`` for a chunk that arrived at ``a`` and waited
    for the later ones. Those chunks' gaps, and the gap into the read, are then off by up to
    ``s - a_first``. The client cannot see ``a_first``, but it can bound it from below:

    - the connection's previous read (``read_ns``) took everything that had arrived by then,
      so ``a_first`` is after it (the request's send for its first read);
    - the loop takes every ready connection in each turn, in the order they became ready
      (epoll's ready list), so ``a_first`` is after the arrival of anything it read before this
      read: another connection's single-chunk read (its one segment's stamp), only those
      whose arrival is at or before ``s``;
    - a loop-lag probe sample (``timeline``: written at ``w``) read in a loop turn before the
      turn of this read (:func:`_probe_evidence`): a connection ready at ``w`` would have been
      read in the sample's turn, so ``a_first`` is after ``w``. An idle loop reads each sample
      at once: the bound is then about two probe intervals.

    So ``s - max(those)`` bounds every error the read can hold. A read whose bound exceeds the
    tolerance makes its ``n`` gaps doubtful (``n - 1`` for a response's first read: no gap
    into it). The bound is tight where the loop was free or turning quickly (the other
    connections' reads and the probe come every few microseconds to 1 ms), and as wide as the
    loop's stall where it was not: exactly where chunks that arrived apart can share a stamp.
    Where the client itself was descheduled while the server wrote, nothing it saw can tell
    chunks written together from chunks written apart (the kernel keeps one stamp for the
    segments queued on a socket: a 1-byte ``MSG_PEEK`` returns the last one's too, measured
    here), so such reads stay doubtful. The ready-list order is an assumption, not a guarantee:
    a connection read in the previous turn keeps its place in the list, so a read can come
    before one whose bytes arrived earlier (seen under heavy load); the benchmark counts the
    missed flags it can cost (tests/benchmarks/client_bound_flags.py).
    With 512 streams on two shared cores, the instrument stalls as the client does and then
    writes a stream's late chunks back to back; the client reads them, read over 1 ms after
    their stamp, in one read: the old count (:func:`coalesced_events`) called those wrong and
    flagged levels whose ITL error p99 was 0.04 ms (issue 50).

    ``records``: one loop's records (``send_ns``, ``arrival_clock``, ``token_offsets_ms`` and
    ``user_token_offsets_ms``; others are skipped); mixing loops (client processes) would take
    one loop's reads as evidence for another: pass ``timeline=None`` then, and only the
    connection's own previous read bounds ``a_first`` (more doubtful reads, never fewer).
    ``timeline``: :attr:`tasks.stream.lag.LagFigures.timeline` of the same loop, or None.
    """
    kept = [
        (r.send_ns, _reads(r))
        for r in records
        if r.arrival_clock == "kernel" and r.user_token_offsets_ms and r.send_ns
    ]
    evidence: list[tuple[int, int]] = []  # (read_ns, arrival_ns), in read order
    if timeline is not None:
        evidence = [(u, k) for _, reads in kept for k, u, n in reads if n == 1]
        evidence += _probe_evidence(timeline)
        evidence.sort()
    read_times = [u for u, _ in evidence]
    limit = round(tolerance_ms * 1e6)
    doubtful = 0
    for before, reads in kept:  # before: the request's send, then the previous read
        for i, (kernel, user, n) in enumerate(reads):
            if n > 1:
                lower, j = before, bisect.bisect_left(read_times, user) - 1
                stop = max(j - _EVIDENCE_WALK, -1)
                while j > stop and evidence[j][0] > lower:  # read at or before `lower`: arrived before
                    if lower < evidence[j][1] <= kernel:
                        lower = evidence[j][1]
                    j -= 1
                if kernel - lower > limit:
                    doubtful += n if i else n - 1
            before = user
    return doubtful


def judged_lag(lag: Any, measured: Iterable[Any], tolerance_ms: float) -> dict[str, Any]:
    """One event loop's loop-lag figures (``tasks.stream.lag.LagFigures``, a mapping) with its
    ``coalesced_late_gaps`` (:func:`late_coalesced_gaps` of its own ``measured`` records and
    probe samples) beside them: what a client process or a Dask worker ships to the level's
    owner, whose records mix loops (one loop's reads are no evidence of another's)."""
    late = late_coalesced_gaps(measured, getattr(lag, "timeline", None), tolerance_ms)
    return {**lag, "coalesced_late_gaps": late}
