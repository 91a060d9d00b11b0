"""A level's timeline: the client's figures per time window, the server's gauges beside them.

A level's figures say *which* configuration won; its timeline says *why*: when the queue grew,
when TTFT rose with it, whether tokens/s held. The level's measured part is cut into equal,
sequential, non-overlapping windows of ``slice_s`` seconds (AIPerf's time slicing,
``--slice-duration``; there per-slice metrics are computed over each slice's requests), and per
window the client's own figures are computed and the server's gauge samples
(:mod:`tasks.endpoint.gauges`, every 250 ms) are summarised, all on one clock:
``time.perf_counter_ns()`` (CLOCK_MONOTONIC, the clock of ``RequestRecord.send_ns`` and its
arrivals, and of the samples), so nothing is converted and nothing drifts.

Windows (:func:`windows`): window k spans ``[start + k * slice_s, start + (k + 1) * slice_s)``,
``start`` = the first measured send; the last window is cut at the end (the last measured
request's end: ``stream_close_ms`` after its send) and closed. The first and last window of a
measured part are ``partial``: the first opens on an idle server with the load still ramping
up, the last is cut short and holds the drain; read the steady state between them. A level of
several repeats (``StreamConfig.repeats``) is one run of windows per repeat
(:func:`level_timeline`), numbered on, on the same time axis (seconds since the level's first
measured send; the pauses between repeats hold no window).

Per window (units in the names; None where the window has nothing to measure):

- ``requests_in_flight``: the time-weighted mean number of measured requests between their send
  and their end (a failed one to its failure): the integral of the in-flight count over the
  window / its length. ``requests_in_flight_max``: the most at any instant in it.
- ``requests_sent`` / ``requests_finished`` / ``requests_failed``: sends, ends, and ends of
  failed requests in it. A failure ends when its user got it (``error_after_ms`` after its
  send: a gateway's 524 after 1.5 s is in flight for 1.5 s, and counted where it came).
- ``ttft_ms_p50`` (of ``ttft_count``): TTFT p50 of the successful requests whose first text
  chunk *arrived* in the window (what the server was delivering then, not when it was asked).
- ``itl_ms_mean`` / ``itl_ms_p50`` (of ``itl_count``): the ITL gaps *ending* in it (the gap
  before chunk i + 1 belongs to chunk i + 1's arrival), of the successful requests whose decode
  the client saw (as the level's ``itl_ms``).
- ``output_tokens`` / ``output_tokens_per_s``: tokens of successful requests whose text chunk
  arrived in it, over its length; a request's ``output_tokens`` are spread evenly over its text
  chunks (exact at one token per chunk; a request without a count counts its chunks).
- ``server_<name>`` / ``server_<name>_max``: mean / max of the gauge samples taken in it
  (``<name>`` MLflow-safe: ``vllm_num_requests_running``); a counter's
  ``server_<name>_delta``: its increase from the last sample before the window (else the
  window's first) to the window's last. None where no sample fell in the window.

Pure arithmetic over records and samples (plus :func:`wall_offset_ms`, one clock read).
"""

from __future__ import annotations

import bisect
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.endpoint.gauges import COUNTERS, GaugeSample
from tasks.stats import percentile
from tasks.stream.records import RequestRecord

_UNSAFE = re.compile(r"[^A-Za-z0-9_]")
_NS_PER_MS = 1_000_000


def safe_name(name: str) -> str:
    """A Prometheus name as an MLflow key part: ``vllm:num_requests_running`` ->
    ``vllm_num_requests_running``."""
    return _UNSAFE.sub("_", name)


def is_counter(name: str) -> bool:
    """Whether a sampled name is a cumulative counter (its windows report the increase)."""
    return name in COUNTERS or name.endswith("_total")


@dataclass(frozen=True)
class Window:
    """One window of a level's timeline (module docstring for every figure).

    Attributes:
        index: its place in the level's timeline (the MLflow step), from 0.
        repeat: the repeat it belongs to (0 without repeats).
        start_ns / end_ns: its edges on ``perf_counter_ns``; origin_ns: the level's first
            measured send (the time axis' 0).
        partial: the first or last window of its measured part (ramp-up, or cut short).
        server: ``<safe name>`` (gauge mean), ``<safe name>_max``, ``<safe name>_delta``
            (counters) -> value.
    """

    index: int
    repeat: int
    start_ns: int
    end_ns: int
    origin_ns: int
    partial: bool
    requests_in_flight: float
    requests_in_flight_max: int
    requests_sent: int
    requests_finished: int
    requests_failed: int
    ttft_ms_p50: float | None
    ttft_count: int
    itl_ms_mean: float | None
    itl_ms_p50: float | None
    itl_count: int
    output_tokens: float
    server: dict[str, float | None] = field(default_factory=dict)

    @property
    def start_s(self) -> float:
        """Seconds from the level's first measured send to the window's start."""
        return (self.start_ns - self.origin_ns) / 1e9

    @property
    def window_s(self) -> float:
        """The window's length in seconds (``slice_s``; the last one shorter when cut)."""
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def output_tokens_per_s(self) -> float | None:
        return self.output_tokens / self.window_s if self.window_s > 0 else None

    def to_row(self) -> dict[str, Any]:
        """The window as a flat row: ``window``, ``window_start_ns``, then every
        figure under the name it is logged with, less the ``timeline_`` prefix."""
        return {
            "window": self.index,
            "repeat_index": self.repeat,
            "window_start_ns": self.start_ns,
            "window_start_s": self.start_s,
            "window_end_s": (self.end_ns - self.origin_ns) / 1e9,
            "window_s": self.window_s,
            "window_partial": int(self.partial),
            "requests_in_flight": self.requests_in_flight,
            "requests_in_flight_max": self.requests_in_flight_max,
            "requests_sent": self.requests_sent,
            "requests_finished": self.requests_finished,
            "requests_failed": self.requests_failed,
            "ttft_ms_p50": self.ttft_ms_p50,
            "ttft_count": self.ttft_count,
            "itl_ms_mean": self.itl_ms_mean,
            "itl_ms_p50": self.itl_ms_p50,
            "itl_count": self.itl_count,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            **{f"server_{name}": value for name, value in self.server.items()},
        }


def request_end_ns(record: RequestRecord) -> int:
    """When a request ended on ``perf_counter_ns``: its stream's close, else its failure
    (``error_after_ms``: an HTTP error's answer), else its last text chunk, else its send."""
    close = record.stream_close_ms if record.stream_close_ms is not None else record.error_after_ms
    if close is None:
        close = record.e2e_ms if record.e2e_ms is not None else (record.ttft_ms or 0.0)
    return record.send_ns + round(close * _NS_PER_MS)


def windows(
    records: Iterable[RequestRecord],
    slice_s: float,
    start_ns: int,
    end_ns: int,
    *,
    samples: Sequence[GaugeSample] = (),
    origin_ns: int | None = None,
    repeat: int = 0,
    first_index: int = 0,
) -> list[Window]:
    """The windows of ``slice_s`` seconds from ``start_ns`` to ``end_ns`` (both
    ``perf_counter_ns``) over the measured ``records`` (warm-ups are left out) and the gauge
    ``samples`` taken in them (module docstring). The first and last window are partial.

    ``origin_ns``: the time axis' 0 (default ``start_ns``); ``repeat`` / ``first_index``: the
    windows' repeat and the first one's index. Empty when ``end_ns <= start_ns``.

    Raises:
        ValueError: ``slice_s`` <= 0.
    """
    if not slice_s > 0:
        raise ValueError(f"slice_s must be > 0 seconds, got {slice_s}")
    if end_ns <= start_ns:
        return []
    step = max(1, round(slice_s * 1e9))
    n = -(-(end_ns - start_ns) // step)
    edges = [start_ns + k * step for k in range(n)] + [end_ns]

    def at(t: int) -> int:  # the window holding instant t (clamped to the level)
        return min(max((t - start_ns) // step, 0), n - 1)

    busy, sent, finished, failed = [0] * n, [0] * n, [0] * n, [0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]
    gaps: list[list[float]] = [[] for _ in range(n)]
    tokens = [0.0] * n
    events: list[tuple[int, int]] = []
    for r in records:
        if r.warmup or not r.send_ns:
            continue
        send, end = r.send_ns, request_end_ns(r)
        sent[at(send)] += 1
        finished[at(end)] += 1
        failed[at(end)] += not r.succeeded
        events += [(send, 1), (end, -1)]
        lo, hi = max(send, start_ns), min(end, end_ns)
        if hi > lo:  # its share of each window it overlaps (ns)
            for k in range(at(lo), at(hi - 1) + 1):
                busy[k] += min(hi, edges[k + 1]) - max(lo, edges[k])
        if not r.succeeded:
            continue
        ttfts[at(send + round(r.ttft_ms * _NS_PER_MS))].append(r.ttft_ms)
        offsets = [send + round(off * _NS_PER_MS) for off in r.token_offsets_ms]
        per_chunk = r.output_tokens / len(offsets) if offsets and r.output_tokens is not None else 1.0
        for t in offsets:
            tokens[at(t)] += per_chunk
        if r.decode_unobserved is None:
            for gap, t in zip(r.itl_ms, offsets[1:]):
                gaps[at(t)].append(gap)

    peaks = _peaks(events, edges)
    server = _server(samples, edges)
    out = []
    for k in range(n):
        length = edges[k + 1] - edges[k]
        itl = sorted(gaps[k])
        out.append(
            Window(
                index=first_index + k,
                repeat=repeat,
                start_ns=edges[k],
                end_ns=edges[k + 1],
                origin_ns=start_ns if origin_ns is None else origin_ns,
                partial=k in (0, n - 1),
                requests_in_flight=busy[k] / length if length else float(peaks[k]),
                requests_in_flight_max=peaks[k],
                requests_sent=sent[k],
                requests_finished=finished[k],
                requests_failed=failed[k],
                ttft_ms_p50=percentile(sorted(ttfts[k]), 50),
                ttft_count=len(ttfts[k]),
                itl_ms_mean=sum(itl) / len(itl) if itl else None,
                itl_ms_p50=percentile(itl, 50),
                itl_count=len(itl),
                output_tokens=tokens[k],
                server=server[k],
            )
        )
    return out


def _peaks(events: list[tuple[int, int]], edges: Sequence[int]) -> list[int]:
    """The most requests in flight at any instant of each window (an end and a send at the same
    instant: the end first)."""
    events = sorted(events)
    peaks, count, j = [], 0, 0
    for k in range(len(edges) - 1):
        while j < len(events) and events[j][0] < edges[k]:
            count += events[j][1]
            j += 1
        peak = count
        last = k == len(edges) - 2
        while j < len(events) and (events[j][0] < edges[k + 1] or (last and events[j][0] <= edges[-1])):
            count += events[j][1]
            peak = max(peak, count)
            j += 1
        peaks.append(peak)
    return peaks


def _server(samples: Sequence[GaugeSample], edges: Sequence[int]) -> list[dict[str, float | None]]:
    """Each window's gauge mean / max and counter increase (module docstring)."""
    ordered = sorted(samples, key=lambda s: s.t_ns)
    names = list(dict.fromkeys(name for s in ordered for name in s.values))
    n = len(edges) - 1
    inside: list[list[GaugeSample]] = [[] for _ in range(n)]
    for s in ordered:
        if edges[0] <= s.t_ns <= edges[-1]:  # [edge k, edge k + 1), the last window closed
            inside[min(bisect.bisect_right(edges, s.t_ns) - 1, n - 1)].append(s)
    out: list[dict[str, float | None]] = []
    last: dict[str, float] = {}  # each counter's value at the last sample before the window
    j = 0
    for k in range(n):
        while j < len(ordered) and ordered[j].t_ns < edges[k]:
            last.update(ordered[j].values)
            j += 1
        row: dict[str, float | None] = {}
        for name in names:
            key = safe_name(name)
            values = [s.values[name] for s in inside[k] if name in s.values]
            if is_counter(name):
                base = last.get(name, values[0] if values else None)
                row[f"{key}_delta"] = values[-1] - base if values and base is not None else None
            else:
                row[key] = sum(values) / len(values) if values else None
                row[f"{key}_max"] = max(values) if values else None
        out.append(row)
    return out


def level_timeline(
    records: Sequence[RequestRecord], samples: Sequence[GaugeSample], slice_s: float
) -> list[Window]:
    """A finished level's timeline: :func:`windows` over each repeat's measured part (its first
    measured send to its last measured end), numbered on, on one time axis from the level's first
    measured send. Empty without measured requests."""
    measured = [r for r in records if not r.warmup and r.send_ns]
    if not measured:
        return []
    origin = min(r.send_ns for r in measured)
    out: list[Window] = []
    for repeat in sorted({r.repeat for r in measured}):
        part = [r for r in measured if r.repeat == repeat]
        start, end = min(r.send_ns for r in part), max(request_end_ns(r) for r in part)
        out += windows(
            part, slice_s, start, end, samples=samples, origin_ns=origin, repeat=repeat, first_index=len(out)
        )
    return out


def sample_rows(samples: Sequence[GaugeSample], origin_ns: int) -> list[dict[str, Any]]:
    """The raw gauge samples as rows: ``t_s`` (since ``origin_ns``), ``t_ns``, ``fetch_ms``, then
    ``<safe name>`` per sampled name (None where a sample lacked it)."""
    names = list(dict.fromkeys(name for s in samples for name in s.values))
    return [
        {
            "t_s": (s.t_ns - origin_ns) / 1e9,
            "t_ns": s.t_ns,
            "fetch_ms": s.fetch_ms,
            **{safe_name(name): s.values.get(name) for name in names},
        }
        for s in samples
    ]


def wall_offset_ms() -> float:
    """Unix ms minus ``perf_counter_ns`` in ms, read now: ``t_ns / 1e6 + wall_offset_ms()`` is
    an instant of the client's clock in wall time (MLflow's step timestamps)."""
    return time.time() * 1000 - time.perf_counter_ns() / 1e6
