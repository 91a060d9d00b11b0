"""One load level spread over N client processes, for loads one core cannot drive.

The parent starts N processes, forked from a fork server (``multiprocessing``'s
``forkserver``, :func:`client_context`) that imported this module once: a level's processes are
ready in milliseconds instead of the 0.8-1.0 s each ``spawn`` took (an interpreter, the CLI
script re-run as ``__mp_main__``, openai and this package), and :func:`start_fork_server` lets a
command start that server while it does other work. Process 0 first sends the level's warm-up requests
(so the first measured request reuses the connection they opened, as in one process). Each
runs :func:`tasks.stream.load.run_level` on its share of the measured requests (request ``i``
goes to process ``i % N``; the concurrency is split as evenly as it goes, so N is at most the
concurrency) at their places in the one arrival schedule, which starts at a
``time.perf_counter()`` instant the parent picks once every process is ready. Times are
comparable across processes: ``perf_counter`` / ``perf_counter_ns`` read CLOCK_MONOTONIC, one
clock for the whole machine on Linux.

Records are never lost: each process sends every record to the parent as soon as it finishes
(a multiprocessing queue; those that finished in one loop turn together, at the start of the
next), and the parent hands it to ``on_record`` (the crash-safe journal) at once. The processes
have no tokenizer: the parent counts output tokens of records without usage
(``fill_output_tokens``), and a conversation turn's prompt tokens
(``tasks.stream.level_result.HistoryTokens``), before anything sees them.

The level's client figures (``tasks.stream.quality.client_figures``) are taken over every
process's records; the loop lag is the worst process's (largest p99; its flag set when any
process's was), the CPU time the sum, the clock-offset drift the largest.

:func:`tasks.scaleout.levels.run_levels` runs every level here, one process at the least: the
measuring loop then has a process of its own, with nothing else on its GIL (the flow's threads,
logging, the journal and the tracking client stay in the parent).
"""

from __future__ import annotations

import asyncio
import gc
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from tasks import asyncrun
from tasks.bare_main import bare_main
from tasks.phases import mark
from tasks.stream.lag import LagFigures
from tasks.stream.level_result import HistoryTokens, LevelResult, fill_output_tokens
from tasks.stream.quality import client_figures
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings
from tasks.wire import rxclock

#: Seconds a process may take to start (spawn + imports) before the level fails.
START_TIMEOUT_S = 120.0

#: Concurrent streams one client process drives by default. Measured through `infermeter
#: stream` on the instrument (tests/benchmarks/stream_client.py, 2 cores, 60 chunks 10 ms apart
#: per stream, 2026-11-30): one process kept every chunk's kernel stamp apart at 64 streams in
#: every run, but at 256 it fell behind in 2 of 4 runs (8-10 % of the ITL gaps coalesced, ITL
#: error p99 10-15 ms); two processes at 256 did not in 3 of 3 (p99 0.01 ms).
STREAMS_PER_PROCESS = 128


def auto_processes(concurrency: int) -> int:
    """Client processes for a level of ``concurrency`` streams when none are asked for: one
    per :data:`STREAMS_PER_PROCESS` streams, at most one per CPU core, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, math.ceil(concurrency / STREAMS_PER_PROCESS)))


def merge_lags(lags: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The loop-lag figures of several loops (a level's processes, or its repeats): the worst
    loop's (largest p99: any late loop delays its chunks), its flag set when any loop's was;
    empty when none was measured.

    The kernel clock's evidence (``tasks.wire.rxclock.late_coalesced_gaps``) is one loop's:
    ``coalesced_late_gaps`` is summed when every loop counted its own (client processes); else
    the probes' samples (``tasks.stream.lag.LagFigures.timeline``) are joined when the loops
    ran one after another (repeats in one process), and dropped when they may have overlapped
    in time, or came without samples (records whose loops cannot be told apart: the judge then
    takes no loop's evidence but each connection's own). A Dask worker's figures come as JSON,
    without samples or a count: its level is judged that cautious way (more flags, none missed)."""
    known = [lag for lag in lags if lag.get("client_loop_lag_ms_p99") is not None]
    if not known:
        return {}
    worst = max(known, key=lambda lag: lag["client_loop_lag_ms_p99"])
    out = LagFigures(worst, client_bound=int(any(lag.get("client_bound") for lag in known)))
    out.pop("coalesced_late_gaps", None)
    counts = [lag.get("coalesced_late_gaps") for lag in lags]
    if all(count is not None for count in counts):
        out["coalesced_late_gaps"] = sum(counts)
        return out
    timelines = sorted(
        (t for t in (getattr(lag, "timeline", None) for lag in lags) if t is not None and t[0]),
        key=lambda t: t[0][0],
    )
    if len(timelines) == len(lags) and all(a[1][-1] < b[0][0] for a, b in zip(timelines, timelines[1:])):
        out.timeline = ([w for t in timelines for w in t[0]], [r for t in timelines for r in t[1]])
    return out


def _share_of(concurrency: int, processes: int, k: int) -> int:
    return concurrency // processes + (1 if k < concurrency % processes else 0)


_LINUX = sys.platform.startswith("linux")
#: The environment the running fork server started with (:func:`start_fork_server`).
_SERVER_ENVIRON: dict[str, str] | None = None


def client_context() -> Any:
    """The ``multiprocessing`` context client processes start from: ``forkserver`` with this
    module and the client's (``tasks.stream.load``) preloaded (Linux), else ``spawn``. The fork
    server is a clean process (no threads, no event loop, no CUDA) that this command started,
    so forking from it is safe; it exits when the command does (its ``alive`` pipe reads EOF,
    SIGKILL included), and its children with it (:func:`_exit_with_parent`)."""
    if not _LINUX:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "tasks.stream.load"])
    return ctx


def start_fork_server() -> None:
    """Start the fork server now, so that its imports run beside the caller's own work (the
    first level then finds it ready); a no-op where it runs already or is not used.

    One started under another environment is replaced first: its children inherit the
    environment it started with (a client's TLS context reads ``SSL_CERT_FILE`` from it), so a
    process that changed a variable since (a library user, a test) gets a fork server that sees
    the change, as a spawned child would."""
    global _SERVER_ENVIRON
    if not _LINUX:
        return
    client_context()
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None and _SERVER_ENVIRON != os.environ:
        server._stop()
    if server._forkserver_pid is None:
        _SERVER_ENVIRON = dict(os.environ)
    server.ensure_running()


def _exit_with_parent() -> None:
    """A client process ends when the command does, however the command ends (SIGKILL too).
    Without this, a child whose parent was killed blocks for ever at exit, flushing records
    into a queue nobody reads.

    Forked from the fork server (Linux): the kernel kills it when its parent, the fork server,
    dies (``PR_SET_PDEATHSIG``; the fork server itself exits when the command ends). A spawned
    child waits on the spawn machinery's sentinel, which reads EOF when the command ends."""
    if _LINUX:
        import ctypes
        import signal
        from multiprocessing import forkserver

        # A forked child inherits the fork server's "alive" pipe (so that it could start
        # children of its own); holding it, it would keep the fork server from seeing the
        # command's end, and both would wait for each other for ever.
        server = forkserver._forkserver
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = None
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the death signal was armed
            os._exit(1)
        return
    parent_process = mp.parent_process()
    if parent_process is not None:
        mp.connection.wait([parent_process.sentinel])
        os._exit(1)


def _child(
    k: int,
    processes: int,
    connection: Connection,
    settings: LevelSettings,
    warmup: LevelSettings | None,
    out: Any,
    go: Any,
    start_at: Any,
    cwd: str,
) -> None:
    """A client process: in the command's current folder (the fork server keeps the one it
    started in), run the warm-up when given one (on the connection the level then reuses),
    report ready, wait for the start instant, run its share. (Its environment is the
    command's: :func:`start_fork_server`.)"""
    # the transport (openai, tasks.wire.h1) is imported here, in the client process (the fork
    # server has it preloaded: client_context), never in the command's own process
    from tasks.stream.load import connect, open_connections, run_level

    if os.getcwd() != cwd:
        os.chdir(cwd)
    # The heap forked from the server (the imports: ~10^5 objects) is never garbage, but the
    # collector's full passes walked it during the level (one took 64 ms at 256 streams, ~5 us
    # per chunk: README "Cheaper per chunk"); frozen, they skip it.
    gc.freeze()

    # The records that finished in one loop turn go to the parent together, at the start of the
    # next turn: one put, one wake of the queue's feeder thread and one pipe write for all of
    # them (a put per record was ~15 % of a one-chunk request's CPU: README "Records shipped a
    # loop turn at a time"). Pickled as they are: no JSON-ready dict to build.
    pending: list[RequestRecord] = []

    def flush() -> None:
        if pending:
            out.put(("records", pending[:]))
            pending.clear()

    def send(record: RequestRecord) -> None:
        if not pending:
            asyncio.get_running_loop().call_soon(flush)
        pending.append(record)

    async def main() -> LevelResult:
        client = connect(connection, settings.max_concurrency)
        try:
            if warmup is not None:
                await run_level(client, warmup, count_tokens=None, on_record=send)
                flush()
            await open_connections(client, settings, (k, processes))
            mark("client_process_ready")
            out.put(("ready", k))
            go.poll(None)  # the parent's end closed; nothing is in flight: blocking costs no measurement
            return await run_level(
                client,
                settings,
                count_tokens=None,
                share=(k, processes),
                start_at=start_at.value,
                on_record=send,
            )
        finally:
            flush()  # before "done" or "failed": every record that finished
            await client.close()

    if _LINUX:
        _exit_with_parent()
    else:
        threading.Thread(target=_exit_with_parent, daemon=True, name="parent-watch").start()
    try:
        mark("client_process_started")
        out.put(("started", k))
        result = asyncrun.run(main())  # not asyncio.run: tasks.asyncrun
        # the doubtful coalesced gaps are judged here, on this loop's own reads and probe
        lag = rxclock.judged_lag(result.lag, result.measured, settings.lag_tolerance_ms)
        done = {"lag": lag, "cpu_s": result.cpu_s, "offset_drift_ns": result.offset_drift_ns}
        out.put(("done", {**done, "last_done_ns": result.last_done_ns}))
    except BaseException as exc:  # the parent reports it; a record sent before stays kept
        out.put(("failed", f"client process {k}: {type(exc).__name__}: {exc}"))


def run_level_processes(
    processes: int,
    connection: Connection,
    settings: LevelSettings,
    *,
    count_tokens: Callable[[str], int] | None,
    on_record: Callable[[RequestRecord], None] | None = None,
    on_measure_start: Callable[[], None] | None = None,
) -> LevelResult:
    """Run one level over ``processes`` client processes (see the module docstring).

    Synchronous (call it without a running event loop). The callbacks are those of
    :func:`tasks.stream.load.run_level`, called in this (the parent) process; records are the
    same as in one process, request ids too.

    Raises:
        ValueError: processes < 1 or more processes than max_concurrency.
        RuntimeError: a process failed or did not start in time (records received before
            are kept: they already went to ``on_record``).
    """
    if not 1 <= processes <= settings.max_concurrency:
        raise ValueError("client_processes must lie between 1 and the level's max_concurrency")

    history = HistoryTokens(settings)

    def keep(record: RequestRecord) -> None:
        fill_output_tokens(record, count_tokens)
        history.fill(record)  # a conversation turn's prompt, by the client's count
        if on_record is not None:
            on_record(record)

    result = LevelResult(settings.level, settings.max_concurrency, settings.request_rate)
    # The warm-up runs in process 0, before its share, so the level's first measured request
    # reuses the connection it opened (as in one process); it is sequential whatever the
    # concurrency.
    warmup = replace(settings, num_requests=0) if settings.warmup else None
    # Each process: its share of the concurrency, no warm-up of its own, the prompts (and
    # everything that belongs to them) continuing after the warm-up's.
    share = settings.after_warmup()
    mark("client_processes_start")
    start_fork_server()  # running already (the flow started it), unless the environment changed
    ctx = client_context()
    # The start is the parent closing its end of a pipe (every child's end then reads EOF). Not
    # a multiprocessing Event: its set() waits for each waiter to wake, for ever when a waiter
    # died while waiting (a Ctrl-C or SIGTERM during process 0's warm-up hung the command).
    out, start_at = ctx.Queue(), ctx.Value("d", 0.0)
    go, start = ctx.Pipe(duplex=False)
    children = []
    for k in range(processes):
        mine = replace(share, max_concurrency=_share_of(settings.max_concurrency, processes, k))
        child = ctx.Process(
            target=_child,
            args=(
                k,
                processes,
                connection,
                mine,
                warmup if k == 0 else None,
                out,
                go,
                start_at,
                os.getcwd(),
            ),  # fmt: skip
            name=f"infermeter-client-{k}",
            daemon=True,
        )
        with bare_main():  # the CLI script is not re-run in the child (tasks.bare_main)
            child.start()
        children.append(child)

    measured: list[RequestRecord] = []
    try:
        started = ready = done = 0
        deadline = time.monotonic() + START_TIMEOUT_S
        lags, cpu_s, drifts, last_done_ns = [], 0.0, [], 0
        while done < processes:
            try:
                kind, payload = out.get(timeout=1.0)
            except queue.Empty:
                dead = [c for c in children if c.exitcode not in (None, 0)]
                if dead or (started < processes and time.monotonic() > deadline):
                    raise RuntimeError("a client process died or did not start in time") from None
                continue
            if kind == "started":
                started += 1
            elif kind == "ready":
                ready += 1
                if ready == processes:
                    if on_measure_start is not None:
                        on_measure_start()
                    start_at.value = time.perf_counter() + 0.02
                    start.close()
            elif kind == "records":
                for record in payload:
                    keep(record)
                    (result.records if record.warmup else measured).append(record)
            elif kind == "done":
                done += 1
                lags.append(payload["lag"])
                cpu_s += payload["cpu_s"] or 0.0
                drifts.append(payload["offset_drift_ns"] or 0)
                last_done_ns = max(last_done_ns, payload["last_done_ns"])
            else:
                raise RuntimeError(payload)
    except BaseException:
        # interrupted (Ctrl-C, SIGTERM) or failed: the shares still sending are not wanted.
        # Before, the join below waited its 10 s for each of them (a SIGTERM to the command
        # alone reaches only this process: its exit took 16 s, 10 of them here).
        for child in children:
            if child.is_alive():
                child.terminate()
        raise
    finally:
        start.close()  # (a no-op once closed) children still waiting go on, or see they must stop
        go.close()
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()
    result.records.extend(sorted(measured, key=lambda r: r.send_ns))
    if measured:
        result.last_done_ns = last_done_ns
        result.wall_s = (last_done_ns - min(r.send_ns for r in measured)) / 1e9
    result.lag = merge_lags(lags)
    result.cpu_s = cpu_s
    result.offset_drift_ns = max(drifts, key=abs) if drifts else None
    result.client = {
        **client_figures(
            measured,
            result.lag,
            lag_tolerance_ms=settings.lag_tolerance_ms,
            coalesced_tolerance=settings.coalesced_tolerance,
            cpu_s=cpu_s,
            offset_drift_ns=result.offset_drift_ns,
        ),
        "client_processes": processes,
    }
    return result
