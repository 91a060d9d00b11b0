"""How far a level's own timings can be trusted: the client's side of the measurement.

A level's figures describe the server only while the client keeps up. What degrades them
depends on the clock the arrivals were stamped with (``RequestRecord.arrival_clock``,
:mod:`tasks.wire.rxclock`):

- ``kernel``: each text chunk carries the kernel's receive time of the read that completed it,
  so a busy event loop does not delay the stamp. It fails only when the loop falls so far behind
  that the kernel queues several events that arrived apart and one read takes them all: those
  events share one stamp (*coalesced*), the last one's, and their gaps collapse to 0. Events a
  server wrote back to back share a stamp rightly, however late they were read (an instrument
  or engine catching up after a stall does that: counted as client failures, they flagged
  exact levels at 256 and 512 streams, issue 50). So the level is ``client_bound`` when the
  ITL gaps that *may* be off by more than ``lag_tolerance_ms`` exceed ``coalesced_tolerance``
  of all its gaps (default 1 %: above it the ITL p99 can be the client's):
  :func:`tasks.wire.rxclock.late_coalesced_gaps` bounds each coalesced read's error by what
  the client saw of its own loop (the connection's previous read, the reads of other
  connections and the loop-lag probe's samples before it), one loop at a time (client
  processes count their own: ``coalesced_late_gaps`` in ``lag``). ``coalesced_events`` and
  ``coalesced_event_fraction`` still count every chunk read over 1 ms late with the one before
  (:func:`tasks.wire.rxclock.coalesced_events`): what happened, not what it cost.
- ``user``: each chunk is stamped when the loop read it, late by the loop's lag; the level is
  ``client_bound`` when the loop-lag probe's p99 exceeds ``lag_tolerance_ms``
  (:mod:`tasks.stream.lag`). The probe is kept on the kernel clock too, as a diagnostic.

Beside the flag: how closely the sends kept to the arrival schedule (vLLM #21104: a client that
cannot keep up sends fewer requests per second than asked, and its lateness grows with the
index): ``achieved_request_rate`` over the measured sends and ``send_lateness_ms_p99``; the
client's CPU per text chunk; the drift of the realtime-to-monotonic offset over the level.

Pure functions over records; no clock reads, no I/O.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tasks.stats import percentile
from tasks.wire import rxclock

#: Default coalesced fraction of ITL gaps above which a kernel-clock level is client-bound.
COALESCED_TOLERANCE = 0.01
#: Said after a kernel-clock flag when the endpoint is this machine's loopback. A server on the
#: client's cores stalls when they are busy and then writes its late chunks back to back; a
#: client descheduled meanwhile reads them in one read, as it reads chunks it was late for: the
#: kernel keeps one stamp for segments queued together, so nothing the client sees tells the two
#: apart. tests/benchmarks/client_bound_flags.py (2026-12-06, 2 cores, 256 and 512 streams):
#: the instrument at normal priority, 4 of 15 exact levels flagged (8 runs each); written on
#: time (SCHED_FIFO, as a server with cores of its own), 0 of 29 (20 runs each), none of the
#: 11 wrong ones missed.
SAME_HOST_NOTE = (
    "; the server runs on this machine's cores, and chunks it wrote together after a stall of its "
    "own look the same to the client: give it cores of its own (taskset) to tell the two apart"
)
#: Drift (ms) of CLOCK_REALTIME - CLOCK_MONOTONIC over a level above which a warning is given.
DRIFT_WARN_MS = 1.0
#: Send lateness p99 (ms) above which a replayed schedule (a trace) is not faithful (issue 19).
SCHEDULE_LATENESS_TOLERANCE_MS = 10.0


def schedule_fidelity(metrics: Mapping[str, Any], schedule_s: Sequence[float]) -> dict[str, Any]:
    """How faithfully a level kept a recorded schedule (a trace replay): ``recorded_request_rate``
    (its requests over its span, requests/s; None below 2 or a zero span) beside the measured
    ``achieved_request_rate``, and ``schedule_faithful`` (1 when ``send_lateness_ms_p99`` is at
    most :data:`SCHEDULE_LATENESS_TOLERANCE_MS`, 0 when over it, None without sends).

    Args:
        metrics: the level's client figures (:func:`client_figures`).
        schedule_s: the send times the level was given, seconds after the first, for the
            measured requests only.
    """
    span = schedule_s[-1] - schedule_s[0] if len(schedule_s) > 1 else 0.0
    p99 = metrics.get("send_lateness_ms_p99")
    return {
        "recorded_request_rate": (len(schedule_s) - 1) / span if span > 0 else None,
        "schedule_faithful": None if p99 is None else int(p99 <= SCHEDULE_LATENESS_TOLERANCE_MS),
    }


def level_clock(records: Iterable[Any]) -> str | None:
    """``kernel`` when every measured record with a text chunk was stamped by the kernel, else
    ``user``; None for a level with no text at all (no arrival was stamped on any clock)."""
    clocks = {r.arrival_clock for r in records if not r.warmup and r.token_offsets_ms}
    if not clocks:
        return None
    return "kernel" if clocks == {"kernel"} else "user"


def clock_fallbacks(records: Iterable[Any]) -> dict[str, list[str]]:
    """The measured records whose arrivals fell back to the user clock although the kernel's
    was asked for: ``{reason: [request_id, ...]}`` (``RequestRecord.clock_fallback``)."""
    out: dict[str, list[str]] = {}
    for r in records:
        if not r.warmup and r.clock_fallback:
            out.setdefault(r.clock_fallback, []).append(r.request_id)
    return out


def fallback_message(level: int, records: Iterable[Any]) -> str | None:
    """The warning for a level some of whose records fell back to the user clock although the
    kernel's was asked for: how many of the level's requests with text, and per reason the
    first request ids; None when none fell back (a level with no text says nothing)."""
    records = [r for r in records if not r.warmup]
    fallbacks = clock_fallbacks(records)
    if not fallbacks:
        return None
    with_text = sum(1 for r in records if r.token_offsets_ms)
    reasons = "; ".join(
        f"{reason}: {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}" for reason, ids in fallbacks.items()
    )
    return (
        f"level {level}: {sum(map(len, fallbacks.values()))} of {with_text} requests with text are on "
        f"the user-space clock (when the event loop read each chunk; late by the loop's lag), not "
        f"the kernel's: {reasons}"
    )


#: A level whose schedule would send its last request later than this (s) after its first is
#: said at its start: a trace in the wrong unit or a mistyped rate otherwise just waits.
LONG_SCHEDULE_S = 3600.0


def long_schedule_message(settings: Any) -> str | None:
    """The warning for a level (``tasks.stream.settings.LevelSettings``) whose schedule would
    run over :data:`LONG_SCHEDULE_S` with no ``duration_s`` to end it: a recorded schedule's
    last send of the level (``schedule_s``), or a rate's expected one (``(num_requests - 1) /
    request_rate``). None otherwise."""
    if settings.duration_s is not None:
        return None
    if settings.schedule_s is not None:
        span_s, what = max(settings.schedule_s[: settings.num_requests], default=0.0), "the trace's"
    elif settings.request_rate is not None:
        span_s, what = (settings.num_requests - 1) / settings.request_rate, "at the rate, the"
    else:
        return None
    if span_s <= LONG_SCHEDULE_S:
        return None
    return (
        f"level {settings.level} will take {span_s / 3600:.3g} hours: {what} last request is "
        f"sent {span_s:.6g} s after the first; --duration-s ends a level sooner (check the "
        "trace's timestamp unit, or the rate)"
    )


def failures_message(level: int, records: Iterable[Any]) -> str | None:
    """The warning for a level some of whose measured requests failed (records with ``warmup``,
    ``error_class`` and ``error_message``: ``tasks.stream.records.RequestRecord``): how many, of
    which classes, each with how long its users waited for it where the records say
    (``error_after_ms``: ``server 3 (waited p50 1.50 s, max 1.52 s)``: a slow failure is not a
    fast one), and the first error; the level's latency figures are over the requests that
    succeeded only (a server that died mid-level leaves the few that finished before). None
    when none failed."""
    measured = [r for r in records if not r.warmup]
    failed = [r for r in measured if r.error_class is not None]
    if not failed:
        return None
    split = ", ".join(
        f"{name} {count}{waited(r.error_after_ms for r in failed if r.error_class == name)}"
        for name, count in sorted(Counter(r.error_class for r in failed).items())
    )
    return (
        f"level {level}: {len(failed)} of {len(measured)} requests failed ({split}); its latency "
        f"figures are over the {len(measured) - len(failed)} that succeeded; first error "
        f"({failed[0].error_class}): {failed[0].error_message}"
    )


def waited(waits_ms: Iterable[float | None]) -> str:
    """`` (waited p50 1.50 s, max 1.52 s)``: the p50 and max, in seconds, of failures'
    ``error_after_ms`` (``RequestRecord``'s: send -> error); '' where none is known (None: a
    record from before the field)."""
    waits = sorted(w for w in waits_ms if w is not None)
    if not waits:
        return ""
    return f" (waited p50 {percentile(waits, 50) / 1000:.2f} s, max {waits[-1] / 1000:.2f} s)"


def client_figures(
    records: Iterable[Any],
    lag: Mapping[str, Any],
    *,
    lag_tolerance_ms: float,
    coalesced_tolerance: float = COALESCED_TOLERANCE,
    cpu_s: float | None = None,
    offset_drift_ns: int | None = None,
) -> dict[str, Any]:
    """The level's client figures (module docstring).

    Args:
        records: the level's records (warm-up ones are left out).
        lag: :meth:`tasks.stream.lag.LoopLagProbe.metrics` of the measured part (its
            ``client_bound`` is the user clock's flag; its ``timeline``, or a
            ``coalesced_late_gaps`` count that client processes made of their own, the kernel
            clock's evidence; without either, each connection's own reads only), or
            :func:`tasks.scaleout.multiproc.merge_lags` of several.
        lag_tolerance_ms, coalesced_tolerance: the user clock's lag threshold (ms), also the
            error a coalesced gap may carry before it is doubtful on the kernel clock; the
            kernel clock's share of doubtful gaps.
        cpu_s: the client's CPU seconds over the measured part (all its processes), or None.
        offset_drift_ns: change of CLOCK_REALTIME - CLOCK_MONOTONIC from the level's start to its
            end, or None.

    Returns ``client_loop_lag_ms_*`` (from ``lag``), ``arrival_clock`` (:func:`level_clock`),
    ``num_clock_fallbacks`` (:func:`clock_fallbacks`' records), ``coalesced_events``,
    ``coalesced_event_fraction`` (of the ITL gaps; None without gaps), ``client_bound`` (0/1,
    None when the clock in use has nothing to judge by), ``achieved_request_rate`` (requests/s
    between the first and last measured send; None below 2 sends), ``send_lateness_ms_p50`` /
    ``send_lateness_ms_p99``
    (None without a schedule), ``client_cpu_us_per_chunk`` and ``clock_offset_drift_ms``.
    """
    measured = [r for r in records if not r.warmup]
    clock = level_clock(measured)
    gaps = sum(max(len(r.token_offsets_ms) - 1, 0) for r in measured)
    chunks = sum(len(r.token_offsets_ms) for r in measured)
    coalesced = sum(r.coalesced_events for r in measured)
    fraction = coalesced / gaps if gaps else None
    if clock == "kernel":
        late = lag.get("coalesced_late_gaps")
        if late is None:  # one loop's records and its probe's samples, or no loop's evidence
            late = rxclock.late_coalesced_gaps(measured, getattr(lag, "timeline", None), lag_tolerance_ms)
        bound = None if not gaps else int(late / gaps > coalesced_tolerance)
    else:
        bound = lag.get("client_bound")
    sends = sorted(r.send_ns for r in measured if r.send_ns)
    span_s = (sends[-1] - sends[0]) / 1e9 if len(sends) > 1 else 0.0
    lateness = sorted(r.send_lateness_ms for r in measured if r.send_lateness_ms is not None)
    out = {k: v for k, v in lag.items() if k.startswith("client_loop_lag")}
    out.update(
        arrival_clock=clock,
        num_clock_fallbacks=sum(len(ids) for ids in clock_fallbacks(measured).values()),
        coalesced_events=coalesced if clock == "kernel" else None,
        coalesced_event_fraction=fraction if clock == "kernel" else None,
        client_bound=bound,
        achieved_request_rate=(len(sends) - 1) / span_s if span_s > 0 else None,
        send_lateness_ms_p50=percentile(lateness, 50.0),
        send_lateness_ms_p99=percentile(lateness, 99.0),
        client_cpu_us_per_chunk=cpu_s * 1e6 / chunks if cpu_s is not None and chunks else None,
        clock_offset_drift_ms=None if offset_drift_ns is None else abs(offset_drift_ns) / 1e6,
    )
    return out


def bound_reason(metrics: Mapping[str, Any]) -> str:
    """Why a client-bound level is flagged, on the clock it used: ``"42.0 % of ITL gaps
    coalesced behind a late loop"`` (kernel: more than the tolerated share of them may be off
    by over the tolerance, :func:`client_figures`) or ``"event-loop lag p99 3.06 ms"`` (user)."""
    if metrics.get("arrival_clock") == "kernel" and metrics.get("coalesced_event_fraction") is not None:
        return f"{100 * metrics['coalesced_event_fraction']:.1f} % of ITL gaps coalesced behind a late loop"
    lag = metrics.get("client_loop_lag_ms_p99")
    return f"event-loop lag p99 {'n/a' if lag is None else f'{lag:.2f}'} ms"


def distinct_texts(value: float, limit: float) -> tuple[str, str]:
    """``value`` and ``limit`` with two decimals, or as many more (up to 9) as it takes for
    them to read differently: a warning must never say "1.00 ms (> 1.00 ms)"."""
    for decimals in range(2, 10):
        texts = f"{value:.{decimals}f}", f"{limit:.{decimals}f}"
        if texts[0] != texts[1]:
            break
    return texts


def rate_text(value: float | None) -> str:
    """A rate in a warning: one decimal, ``n/a`` for None."""
    return "n/a" if value is None else f"{value:.1f}"


def _peak_overlap(spans: Iterable[tuple[int, int]]) -> int:
    """The most spans ``(start, end)`` open at one instant (one ending as another starts: not
    both open)."""
    events = sorted((t, step) for start, end in spans for t, step in ((start, 1), (end, -1)))
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def more_clients(metrics: Mapping[str, Any]) -> str:
    """The advice for more client capacity: Dask workers for a level run on Dask (its metrics
    hold ``client_workers``), else client processes."""
    return (
        "more Dask workers (--task-runner dask:N)"
        if "client_workers" in metrics
        else "more --client-processes"
    )


def schedule_advice(
    records: Iterable[Any], max_concurrency: int, more: str = "more --client-processes"
) -> str:
    """What to do about sends that fell behind a recorded schedule, from what the level shows
    (its measured records; times from ``send_ns``, ``ttft_ms``, ``e2e_ms``, ``stream_close_ms``):

    - the server streamed one response at a time (no two responses' first-to-last text chunks
      overlapped, over at least 2 of more than one token) while more than one request was in
      flight: the server serialises them; a higher ``--max-concurrency`` only queues more there;
    - ``max_concurrency`` 1: each send waited for the response before it;
    - fewer than ``max_concurrency`` in flight at any instant: the slots were not the limit, the
      client was slow to send;
    - else the slots were full while the server answered several at once: raise
      ``--max-concurrency``.

    ``more``: how to add client capacity (:func:`more_clients`). Returns one clause for a
    warning (``...: <advice>``).
    """
    done = [r for r in records if r.stream_close_ms is not None]
    flight = _peak_overlap((r.send_ns, r.send_ns + int(r.stream_close_ms * 1e6)) for r in done)
    decoding = [
        (r.send_ns + int(r.ttft_ms * 1e6), r.send_ns + int(r.e2e_ms * 1e6))
        for r in done
        if r.ttft_ms is not None and r.e2e_ms is not None and r.e2e_ms > r.ttft_ms
    ]
    slower = "replay slower (--time-scale below 1)"
    if len(decoding) >= 2 and _peak_overlap(decoding) <= 1 and flight > 1:
        return (
            f"the server answered one request at a time (never two responses streaming at once, "
            f"with up to {flight} in flight): the server is the limit, and a higher "
            f"--max-concurrency only queues more there; {slower}, or serve more requests at once "
            "(more parallel slots, e.g. llama.cpp --parallel)"
        )
    if max_concurrency == 1:
        return (
            "each send waited for the response before it (--max-concurrency 1): the server took "
            f"longer per request than the trace's gaps; raise --max-concurrency (the server then "
            f"queues them), or {slower}"
        )
    if flight < max_concurrency:
        return (
            f"at most {flight} of {max_concurrency} slots were ever in use, so the client was slow "
            f"to send: {more}, or {slower}"
        )
    return f"raise --max-concurrency, or {more}, or {slower}"


def warn_client(
    metrics: Mapping[str, Any],
    settings: Any,
    logger: logging.Logger | logging.LoggerAdapter,
    same_host: bool = False,
) -> None:
    """The client-side warnings of a level (``metrics``: its figures; ``settings``: its
    ``tasks.stream.settings.LevelSettings``): a Dask worker lost, client-bound (on the clock in
    use; ``same_host``: the endpoint is this machine's loopback, :data:`SAME_HOST_NOTE` said) and
    a drift of the realtime-to-monotonic offset that could move kernel stamps."""
    index = settings.level
    for worker in metrics.get("client_workers") or ():
        if worker["cause"]:
            logger.warning(
                "level %d: Dask worker %s was lost (%s): %d of the %d requests of its share never "
                "came back; the level's figures are over the records received",
                *(index, worker["worker"], worker["cause"], worker["lost"], worker["requests"]),
            )
    drift = metrics.get("clock_offset_drift_ms")
    if metrics.get("arrival_clock") == "kernel" and drift is not None and drift > DRIFT_WARN_MS:
        logger.warning(
            "level %d: CLOCK_REALTIME moved %.3f ms against CLOCK_MONOTONIC during the level (a "
            "wall-clock adjustment); kernel arrival stamps near it may be off by up to that",
            index,
            drift,
        )
    if not metrics.get("client_bound"):
        return
    if metrics.get("arrival_clock") == "kernel":
        share, limit = distinct_texts(
            100 * metrics["coalesced_event_fraction"], 100 * settings.coalesced_tolerance
        )
        logger.warning(
            "level %d is client-bound: over %s %% of its ITL gaps may be off by more than %s ms: "
            "their chunks came in one read after the client's loop had been behind longer than "
            "that, so they share the last one's stamp (%s %% of its gaps came coalesced); its "
            "ITL figures may describe the client, not the server (%s, or fewer streams)%s",
            index,
            limit,
            f"{settings.lag_tolerance_ms:g}",
            share,
            more_clients(metrics),
            SAME_HOST_NOTE if same_host else "",
        )
        return
    lag_text, limit_text = distinct_texts(metrics["client_loop_lag_ms_p99"], settings.lag_tolerance_ms)
    logger.warning(
        "level %d is client-bound: the client's event-loop lag p99 is %s ms "
        "(> %s ms); its latencies describe the client, not the server",
        index,
        lag_text,
        limit_text,
    )
