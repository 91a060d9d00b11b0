"""One load level spread over N client processes, for loads one core cannot drive.

The parent sends the level's warm-up requests itself, then starts N processes (``spawn``). Each
runs :func:`tasks.stream.load.run_level` on its share of the measured requests (request ``i``
goes to process ``i % N``; the concurrency is split as evenly as it goes, so N is at most the
concurrency) at their places in the one arrival schedule, which starts at a
``time.perf_counter()`` instant the parent picks once every process is ready. Times are
comparable across processes: ``perf_counter`` / ``perf_counter_ns`` read CLOCK_MONOTONIC, one
clock for the whole machine on Linux.

Records are never lost: each process sends every record to the parent as soon as it finishes
(a multiprocessing queue), and the parent hands it to ``on_record`` (the crash-safe journal)
at once. The processes have no tokenizer: the parent counts output tokens of records without
usage (``fill_output_tokens``) before anything sees them.

The client-bound figures of the level are the worst process's: ``client_loop_lag_ms_p99`` is
the largest p99, ``client_bound`` is set when any process was.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
from typing import Any

from tasks.stream.client import fill_output_tokens
from tasks.stream.load import LevelResult, make_client, run_level
from tasks.stream.records import RequestRecord

#: Seconds a process may take to start (spawn + imports) before the level fails.
START_TIMEOUT_S = 120.0


def _share_of(concurrency: int, processes: int, k: int) -> int:
    return concurrency // processes + (1 if k < concurrency % processes else 0)


def _child(k: int, processes: int, params: dict[str, Any], out: Any, go: Any, start_at: Any) -> None:
    """A client process: report ready, wait for the start instant, run its share."""

    async def main() -> LevelResult:
        client = make_client(params["base_url"], params["api_key"], params["request_timeout_s"],
                             params["max_concurrency"], params["transport"])
        try:
            return await run_level(
                client, **params["level"], max_concurrency=params["max_concurrency"],
                warmup=0, count_tokens=None, share=(k, processes), start_at=start_at.value,
                on_record=lambda r: out.put(("record", r.to_json())),
            )
        finally:
            await client.close()

    try:
        out.put(("ready", k))
        go.wait()
        result = asyncio.run(main())
        out.put(("done", {"client": result.client, "last_done_ns": result.last_done_ns}))
    except BaseException as exc:  # the parent reports it; a record sent before stays kept
        out.put(("failed", f"client process {k}: {type(exc).__name__}: {exc}"))


def run_level_processes(
    processes: int,
    *,
    base_url: str,
    api_key: str | None,
    request_timeout_s: float,
    transport: str = "aiohttp",
    **level_args: Any,
) -> LevelResult:
    """Run one level over ``processes`` client processes (see the module docstring).

    Synchronous (call it without a running event loop). ``level_args``: the keyword arguments of
    :func:`tasks.stream.load.run_level`; records are the same, request ids too.

    Raises:
        ValueError: processes < 1 or more processes than max_concurrency.
        RuntimeError: a process failed or did not start in time (records received before
            are kept: they already went to ``on_record``).
    """
    # what the parent handles itself; the rest (model, sampling, rate, seed ...) every process
    # and the warm-up run with unchanged
    max_concurrency, num_requests = level_args.pop("max_concurrency"), level_args.pop("num_requests")
    warmup, prompts = level_args.pop("warmup"), level_args.pop("prompts")
    prompt_tokens = level_args.pop("prompt_tokens", None)
    count_tokens = level_args.pop("count_tokens")
    on_record = level_args.pop("on_record", None)
    on_measure_start = level_args.pop("on_measure_start", None)
    if not 1 <= processes <= max_concurrency:
        raise ValueError("client_processes must lie between 1 and the level's max_concurrency")

    def keep(record: RequestRecord) -> None:
        fill_output_tokens(record, count_tokens)
        if on_record is not None:
            on_record(record)

    async def warm() -> LevelResult:
        client = make_client(base_url, api_key, request_timeout_s, 1, transport)
        try:
            return await run_level(client, prompts=prompts, max_concurrency=1, num_requests=0,
                                   warmup=warmup, count_tokens=count_tokens, on_record=on_record,
                                   prompt_tokens=prompt_tokens, **level_args)
        finally:
            await client.close()

    result = asyncio.run(warm()) if warmup else LevelResult(
        level_args["level"], max_concurrency, level_args.get("request_rate"))
    result.max_concurrency = max_concurrency
    # The measured requests continue the prompts after the warm-up's (as run_level does).
    turn = warmup % len(prompts)
    shifted_tokens = None
    if prompt_tokens:
        t = warmup % len(prompt_tokens)
        shifted_tokens = list(prompt_tokens[t:]) + list(prompt_tokens[:t])
    ctx = mp.get_context("spawn")
    out, go, start_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    children = []
    for k in range(processes):
        params = {
            "base_url": base_url, "api_key": api_key, "request_timeout_s": request_timeout_s,
            "transport": transport, "max_concurrency": _share_of(max_concurrency, processes, k),
            "level": {**level_args, "prompts": list(prompts[turn:]) + list(prompts[:turn]),
                      "prompt_tokens": shifted_tokens, "num_requests": num_requests},
        }
        child = ctx.Process(target=_child, args=(k, processes, params, out, go, start_at),
                            name=f"infermeter-client-{k}", daemon=True)
        child.start()
        children.append(child)

    measured: list[RequestRecord] = []
    try:
        ready = done = 0
        deadline = time.monotonic() + START_TIMEOUT_S
        lag_p99s, bound, last_done_ns = [], [], 0
        while done < processes:
            try:
                kind, payload = out.get(timeout=1.0)
            except queue.Empty:
                dead = [c for c in children if c.exitcode not in (None, 0)]
                if dead or (ready < processes and time.monotonic() > deadline):
                    raise RuntimeError("a client process died or did not start in time") from None
                continue
            if kind == "ready":
                ready += 1
                if ready == processes:
                    if on_measure_start is not None:
                        on_measure_start()
                    start_at.value = time.perf_counter() + 0.02
                    go.set()
            elif kind == "record":
                record = RequestRecord.from_json(payload)
                keep(record)
                measured.append(record)
            elif kind == "done":
                done += 1
                lag_p99s.append(payload["client"].get("client_loop_lag_ms_p99"))
                bound.append(payload["client"].get("client_bound"))
                last_done_ns = max(last_done_ns, payload["last_done_ns"])
            else:
                raise RuntimeError(payload)
    finally:
        go.set()
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()
    result.records.extend(sorted(measured, key=lambda r: r.send_ns))
    if measured:
        result.last_done_ns = last_done_ns
        result.wall_s = (last_done_ns - min(r.send_ns for r in measured)) / 1e9
    known = [p for p in lag_p99s if p is not None]
    result.client = {
        "client_loop_lag_ms_p99": max(known) if known else None,
        "client_bound": None if not known else int(any(bound)),
        "client_processes": processes,
    }
    return result
