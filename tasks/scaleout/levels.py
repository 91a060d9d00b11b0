"""The level loop of the stream stage: run each level, aggregate it, check it, say what is off.

Per level (:func:`run_levels`): the server's Prometheus ``/metrics`` is scraped after the
warm-up and after the measured requests, its gauges sampled every 250 ms between
(``tasks.endpoint.prometheus``, ``tasks.endpoint.gauges``; skipped when the server has none), the
level runs in this process or over client processes (``StreamConfig.client_processes``, at
most the level's concurrency), its records are aggregated (``tasks.stats.aggregate_level``)
beside the client's loop-lag figures, the server's own view and the client/server cross-check,
and the short outputs are counted. Warnings go to the logger passed in: the client and
the server disagree on TTFT/E2E, ``ignore_eos`` was sent but outputs came back short, the
level is client-bound, and the prefix cache's measured share is off the expected one
(``tasks.endpoint.cache.mismatch_warning``; a workload built to share nothing found its prompts cached).

A level of ``repeats`` > 1 (``StreamConfig.repeats``) is run that many times in a row, each a
fresh start (its own warm-up, prefix-cache reset and scrapes); its figures are over every
repeat's measured records pooled (wall times summed), and the spread between the repeats sits
beside them (``<figure>_repeat_min`` / ``_max``): runs on a shared machine vary more than the
requests within one run.

A finished level is a :class:`tasks.stream.level_figures.Level` (settings, metrics, records);
``to_dict()`` is the stage's JSON entry; its figures and warnings are
:func:`tasks.stream.level_figures.level_metrics`'. Tracking (child runs, plots) is the caller's,
through ``on_level``. The loop is here, above the stream's figures, because it decides where
each level runs: in client processes here (:mod:`tasks.scaleout.multiproc`) or over Dask
workers (:mod:`tasks.scaleout.dask_load`).

Imports neither prefect nor mlflow.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from tasks.config.taskrunner import parse_task_runner
from tasks.endpoint import cache, endpoint_http, prometheus
from tasks.endpoint.gauges import GaugeSampler
from tasks.engines.death import server_died_error
from tasks.scaleout.dask_cluster import dask_client
from tasks.scaleout.dask_load import pooled_workers, run_level_dask
from tasks.scaleout.multiproc import auto_processes, merge_lags, run_level_processes
from tasks.stream import quality
from tasks.stream.level_figures import Level, level_metrics, repeat_spread
from tasks.stream.level_result import LevelResult
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings
from tasks.wire import proxy as proxies
from tasks.wire.errors import SERVER_DIED

_LOG = logging.getLogger("infermeter.stream")


def run_levels(
    connection: Connection,
    levels: Sequence[LevelSettings],
    *,
    count_tokens: Callable[[str], int] | None,
    goodput: Mapping[str, float] | None = None,
    client_processes: int | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    on_level: Callable[[Level], None] | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
    task_runner: str | None = None,
) -> list[Level]:
    """Run the levels in order (module docstring) and return them finished.

    Args:
        connection: where the requests go (its key also reads ``/metrics``).
        levels: one settings per level (``tasks.stream.settings.settings_from_config`` or
            ``level_settings``); each level sends its own warm-up requests.
        count_tokens: the output-token fallback when the server sends no usage.
        goodput: SLOs for the goodput figures (``tasks.stats.meets_slos``), e.g.
            ``{"ttft_ms": 500}``.
        client_processes: client processes per level, capped at each level's concurrency;
            None: ``tasks.scaleout.multiproc.auto_processes`` (one per 128 streams).
        on_record: every finished record, as it finishes (the crash-safe journal).
        on_level: every finished level, before the next starts (child runs, plots).

    Raises:
        ServerDiedError: the embedded server (``settings.server_pid``) died during a level: the
            levels after it are not run (that level and those before it went to ``on_level``).
        logger: where the warnings go (default ``infermeter.stream``).
        task_runner: ``threads``/None: client processes here; ``dask`` / ``dask:N`` /
            ``dask:ADDRESS`` (``tasks.config.taskrunner``): every level over Dask workers
            (``tasks.scaleout.dask_load``), a LocalCluster started here for the run and closed after.

    Synchronous: each level runs its own event loop (``asyncio.run``) or its own processes, so
    call it from a thread without a running loop.
    """
    logger = logger or _LOG
    done: list[Level] = []
    said_user_clock = connection.arrival_clock != "kernel"  # asked for: nothing to say
    cached = cache.ExpectedCache()  # what a perfect prefix cache holds, across the levels
    choice = parse_task_runner(task_runner)  # a LocalCluster, or a scheduler's workers: once for the run
    if choice is not None:  # no more local workers than the run has streams
        choice = choice.at_most(max((s.max_concurrency for s in levels), default=1))
    with dask_client(choice) if choice else contextlib.nullcontext() as dask:
        for settings in levels:
            long_schedule = quality.long_schedule_message(settings)
            if long_schedule:
                logger.warning("%s", long_schedule)
            level = _run_one(
                connection, settings, count_tokens, goodput, client_processes, on_record, logger, cached, dask
            )
            fallback = quality.fallback_message(settings.level, level.records)
            if fallback:  # some records could not use the kernel's stamps: which, and why
                logger.warning("%s", fallback)
            elif not said_user_clock and level.metrics.get("arrival_clock") == "user":
                said_user_clock = True  # once per run: no record could be stamped, nor will any be
                logger.warning(
                    "arrival times are on the user-space clock (when the event loop read each chunk): "
                    "kernel receive timestamps are not available here (%s); on a busy client they "
                    "run late by the loop's lag",
                    "the openai transport reads through httpx"
                    if connection.transport == "openai"
                    else "this platform gives none",
                )
            done.append(level)
            if on_level is not None:
                on_level(level)
            if any(r.error_class == SERVER_DIED for r in level.records):  # no level after it
                records = [r for each in done for r in each.records]
                answered = sum(r.succeeded for r in records if not r.warmup)
                cut = sum(r.error_class == SERVER_DIED for r in records if not r.warmup)
                sent = sum(not r.warmup for r in level.records)  # (a conversation's turns: more)
                unsent = max(0, settings.num_requests * settings.repeats - sent)
                unsent += sum(later.num_requests * later.repeats for later in levels[len(done) :])
                where = f" during level {settings.level}"
                raise server_died_error(settings.server_pid, answered, cut, where, unsent)
    return done


def _run_one(
    connection: Connection,
    settings: LevelSettings,
    count_tokens: Callable[[str], int] | None,
    goodput: Mapping[str, float] | None,
    client_processes: int | None,
    on_record: Callable[[RequestRecord], None] | None,
    logger: logging.Logger | logging.LoggerAdapter,
    cached: cache.ExpectedCache,
    dask: Any = None,
) -> Level:
    """One level of :func:`run_levels`: per repeat, reset the prefix cache, scrape, run, scrape;
    then aggregate the repeats pooled, and check. ``dask``: a ``distributed.Client`` whose
    workers run the level instead of client processes here."""
    refused: list[str] = []
    # always in client processes, one at the least: the measuring loop gets a process with
    # nothing else on its GIL (measured, README "Stream": in the flow's own process the
    # user-clock ITL error p99 at 64 streams was twice the bare client's)
    asked = client_processes or auto_processes(settings.max_concurrency)
    processes = max(1, min(asked, settings.max_concurrency))
    results: list[LevelResult] = []
    pairs: list[tuple[dict[str, float] | None, dict[str, float] | None]] = []
    befores: dict[int, dict[str, float] | None] = {}  # repeat -> the scrape before its measured part
    where = (connection.base_url, connection.api_key)  # and the endpoint's way there (endpoint_http):
    way = {"ca_bundle": connection.ca_bundle, "logger": logger}  # its proxy, its CA bundle
    sampler = GaugeSampler(*where, **way)  # off the timed path (gauges.py)

    def scrape_before() -> None:  # after the repeat's warm-up, nothing in flight
        if settings.reset_cache:
            why = endpoint_http.reset_prefix_cache(*where, ca_bundle=connection.ca_bundle)
            if why is not None:
                refused.append(why)
        befores[len(results)] = prometheus.scrape(*where, **way)
        if befores[len(results)]:  # a server without /metrics is not asked again
            sampler.start()

    with sampler:  # stopped however the level ends
        for repeat in range(settings.repeats):  # each a fresh start: its own warm-up, reset, scrapes
            results.append(
                (run_level_dask if dask is not None else run_level_processes)(
                    dask if dask is not None else processes,
                    connection,
                    replace(settings, repeat=repeat),
                    count_tokens=count_tokens,
                    on_record=on_record,
                    on_measure_start=scrape_before,
                )
            )
            sampler.stop()  # the measured part is over: its last request ended
            before = befores.get(repeat)
            after = prometheus.scrape(*where, **way) if before else None
            pairs.append((before, after))
    result = _pooled(results, settings)
    before, after = prometheus.combine(pairs)
    same_host = proxies.is_loopback(urlsplit(connection.base_url).hostname or "")
    metrics = level_metrics(result, before, after, settings, goodput, logger, same_host)
    if settings.repeats > 1:
        metrics.update(repeat_spread(results, goodput))
    reset = settings.reset_cache and not refused
    served = next((cache.block_size_tokens(b) for b in befores.values() if b), None)
    block = served or settings.cache_block_size_tokens  # the server's, else the user's, else None
    metrics.update(cached.level(results, settings, reset, block))
    if settings.reset_cache and refused and not cached.said_no_reset:
        # said once when the server answered without the route; each level when it did not answer
        cached.said_no_reset = refused[0].startswith("HTTP ")
        logger.warning("%s", cache.reset_refused(refused[0]))
    cache.warn_unexpected_hits(metrics, settings.level, logger)
    mismatch = cache.mismatch_warning(metrics, settings.level)
    if mismatch:
        logger.warning("%s", mismatch)
    return Level(settings, metrics, tuple(result.records), result.wall_s, tuple(sampler.samples))


def _pooled(results: Sequence[LevelResult], settings: LevelSettings) -> LevelResult:
    """A level's repeats as one result: their records in order (each repeat's warm-up, then its
    measured requests), wall times summed, the client's figures over every repeat's records
    (the worst repeat's loop lag, CPU summed, the largest clock drift; the achieved rate over
    each repeat's own sends, not the pauses between them). One repeat: its result."""
    if len(results) == 1:
        return results[0]
    out = LevelResult(settings.level, settings.max_concurrency, settings.request_rate)
    out.records = [r for result in results for r in result.records]
    out.wall_s = sum(result.wall_s for result in results)
    out.last_done_ns = results[-1].last_done_ns
    out.lag = merge_lags([result.lag for result in results])
    cpu = [result.cpu_s for result in results if result.cpu_s is not None]
    out.cpu_s = sum(cpu) if cpu else None
    drifts = [result.offset_drift_ns for result in results if result.offset_drift_ns is not None]
    out.offset_drift_ns = max(drifts, key=abs) if drifts else None
    figures = quality.client_figures(
        out.measured,
        out.lag,
        lag_tolerance_ms=settings.lag_tolerance_ms,
        coalesced_tolerance=settings.coalesced_tolerance,
        cpu_s=out.cpu_s,
        offset_drift_ns=out.offset_drift_ns,
    )
    sends = [sorted(r.send_ns for r in result.measured if r.send_ns) for result in results]
    span_s = sum((s[-1] - s[0]) / 1e9 for s in sends if len(s) > 1)
    figures["achieved_request_rate"] = sum(max(len(s) - 1, 0) for s in sends) / span_s if span_s else None
    out.client = {**figures, "client_processes": results[0].client.get("client_processes")}
    if "client_workers" in results[0].client:  # over Dask workers: each repeat's, and the losses summed
        out.client.update(pooled_workers([result.client for result in results]))
    return out
