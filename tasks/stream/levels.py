"""The level loop of the stream stage: run each level, aggregate it, check it, say what is off.

Per level (:func:`run_levels`): the server's Prometheus ``/metrics`` is scraped after the
warm-up and after the measured requests (``tasks.stream.prometheus``; skipped when the server
has none), the level runs in this process or over client processes
(``StreamConfig.client_processes``, at most the level's concurrency), its records are
aggregated (``tasks.stats.aggregate_level``) beside the client's loop-lag figures, the server's
own view and the client/server cross-check, and the short outputs are counted. Three warnings
go to the logger passed in: the client and the server disagree on TTFT/E2E, ``ignore_eos`` was
sent but outputs came back short, and the level is client-bound.

A finished level is a :class:`Level` (settings, metrics, records); ``to_dict()`` is the
stage's JSON entry. Tracking (child runs, plots) is the caller's, through ``on_level``.

Imports neither prefect nor mlflow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks import cache, stats
from tasks.stream import prometheus, quality
from tasks.stream.load import LevelResult
from tasks.stream.multiproc import auto_processes, run_level_processes
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings

_LOG = logging.getLogger("infermeter.stream")


@dataclass(frozen=True)
class Level:
    """One finished load level.

    Attributes:
        settings: what it ran (:class:`tasks.stream.settings.LevelSettings`).
        metrics: flat figures: ``tasks.stats.aggregate_level``'s (``ttft_ms_p50`` ...), the
            client's loop lag (``client_loop_lag_ms_p99``, ``client_bound``, and
            ``client_processes`` over several processes), the server's ``server_*`` view and
            cross-check where it has ``/metrics``, and ``num_short_outputs``.
        records: every request, warm-up first (flagged), then the measured ones by send time.
        wall_s: first measured send to last measured completion (s).
    """

    settings: LevelSettings
    metrics: dict[str, Any]
    records: tuple[RequestRecord, ...]
    wall_s: float

    @property
    def level(self) -> int:
        return self.settings.level

    @property
    def max_concurrency(self) -> int:
        return self.settings.max_concurrency

    @property
    def request_rate(self) -> float | None:
        return self.settings.request_rate

    @property
    def measured(self) -> list[RequestRecord]:
        """The non-warm-up records."""
        return [r for r in self.records if not r.warmup]

    def to_dict(self) -> dict[str, Any]:
        """The stage's JSON entry: ``{"max_concurrency", "request_rate" (None = inf),
        "metrics", "requests" (``RequestRecord.to_json`` each)}``."""
        return {
            "max_concurrency": self.max_concurrency,
            "request_rate": self.request_rate,
            "metrics": self.metrics,
            "requests": [r.to_json() for r in self.records],
        }


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
            None: ``tasks.stream.multiproc.auto_processes`` (one per 128 streams).
        on_record: every finished record, as it finishes (the crash-safe journal).
        on_level: every finished level, before the next starts (child runs, plots).
        logger: where the warnings go (default ``infermeter.stream``).

    Synchronous: each level runs its own event loop (``asyncio.run``) or its own processes, so
    call it from a thread without a running loop.
    """
    logger = logger or _LOG
    done: list[Level] = []
    said_user_clock = connection.arrival_clock != "kernel"  # asked for: nothing to say
    cached = _CacheState()  # what a perfect prefix cache holds, across the levels
    for settings in levels:
        level = _run_one(
            connection, settings, count_tokens, goodput, client_processes, on_record, logger, cached
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
    return done


def _run_one(
    connection: Connection,
    settings: LevelSettings,
    count_tokens: Callable[[str], int] | None,
    goodput: Mapping[str, float] | None,
    client_processes: int | None,
    on_record: Callable[[RequestRecord], None] | None,
    logger: logging.Logger | logging.LoggerAdapter,
    cached: _CacheState,
) -> Level:
    """One level of :func:`run_levels`: reset the prefix cache, scrape, run, scrape, aggregate
    and check."""
    scrapes: dict[str, dict[str, float] | None] = {}
    refused: list[str] = []

    def scrape_before() -> None:  # after the warm-up, nothing in flight
        if settings.reset_cache:
            why = cache.reset_prefix_cache(connection.base_url, connection.api_key)
            if why is not None:
                refused.append(why)
        scrapes["before"] = prometheus.scrape(connection.base_url, connection.api_key)

    # always in client processes, one at the least: the measuring loop gets a process with
    # nothing else on its GIL (measured, README "Stream": in the flow's own process the
    # user-clock ITL error p99 at 64 streams was twice the bare client's)
    asked = client_processes or auto_processes(settings.max_concurrency)
    result = run_level_processes(
        max(1, min(asked, settings.max_concurrency)),
        connection,
        settings,
        count_tokens=count_tokens,
        on_record=on_record,
        on_measure_start=scrape_before,
    )
    before = scrapes.get("before")
    after = prometheus.scrape(connection.base_url, connection.api_key) if before else None
    metrics = _level_metrics(result, before, after, settings, goodput, logger)
    reset = settings.reset_cache and not refused
    metrics.update(cached.level(result, settings, reset))
    if settings.reset_cache and refused and not cached.said_no_reset:
        cached.said_no_reset = True
        logger.warning(
            "the server offers no prefix-cache reset (%s at /reset_prefix_cache): its cache is kept "
            "between levels; random prompts are salted per run, so another run does not reuse them",
            refused[0],
        )
    _warn_cache(metrics, settings.level, logger)
    return Level(settings, metrics, tuple(result.records), result.wall_s)


class _CacheState:
    """The blocks a perfect prefix cache holds during a run of levels (for each level's expected
    share, ``tasks.cache.expected_cached_token_fraction``), and whether the missing reset was
    said."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.said_no_reset = False

    def level(self, result: LevelResult, settings: LevelSettings, reset: bool) -> dict[str, Any]:
        """``prefix_cache_reset`` (1 reset before the measured requests, 0 asked but refused,
        None not asked) and ``expected_cached_token_fraction`` of the level's measured requests
        in send order (None without the workload's blocks)."""
        blocks = settings.prompt_blocks
        out: dict[str, Any] = {"prefix_cache_reset": int(reset) if settings.reset_cache else None}
        if not blocks:
            return out | {"expected_cached_token_fraction": None}
        for r in result.records:  # the warm-up went first: in the cache unless it was reset
            if r.warmup:
                self.seen.update(key for key, _ in blocks[settings.prompt_index(r.request_id) % len(blocks)])
        if reset:
            self.seen.clear()
        order = sorted(result.measured, key=lambda r: r.send_ns)
        expected = cache.expected_cached_token_fraction(
            (blocks[settings.prompt_index(r.request_id) % len(blocks)] for r in order), self.seen
        )
        return out | {"expected_cached_token_fraction": expected}


def _warn_cache(
    metrics: Mapping[str, Any], index: int, logger: logging.Logger | logging.LoggerAdapter
) -> None:
    """A level of a workload built to share nothing that found its prompts in the server's
    cache: its TTFT describes the cache, not the server (vLLM PR #53920)."""
    if metrics.get("expected_cached_token_fraction") != 0.0:
        return
    for name in ("prefix_cache_hit_rate", "cached_token_fraction"):
        value = metrics.get(name)
        if value is not None and value >= cache.UNEXPECTED_HIT_RATE:
            logger.warning(
                "level %d shares nothing by construction, but %s = %.1f %% (>= %g %%): the server "
                "had these prompts cached, so its TTFT describes the cache (reset it between runs, "
                "or let infermeter salt the prompts: no fixed --salt)",
                index,
                name,
                100 * value,
                100 * cache.UNEXPECTED_HIT_RATE,
            )
            return


def _level_metrics(
    result: LevelResult,
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    settings: LevelSettings,
    goodput: Mapping[str, float] | None,
    logger: logging.Logger | logging.LoggerAdapter,
) -> dict[str, Any]:
    """The level's figures (:class:`Level`'s ``metrics``), warning on what is off."""
    index = settings.level
    metrics = stats.aggregate_level(result.records, result.wall_s, goodput)
    metrics.update(result.client)
    metrics.update(prometheus.level_view(before, after))
    metrics.update(cache.level_figures(result.measured, before, after))
    metrics.update(prometheus.cross_check(metrics))
    if metrics.get("server_client_disagree"):
        logger.warning(
            "level %d: the client's TTFT/E2E means differ from the server's own "
            "(/metrics) by more than network and queue explain: TTFT client - server "
            "= %s ms, E2E %s ms",
            index,
            metrics.get("ttft_ms_mean_client_minus_server"),
            metrics.get("e2e_ms_mean_client_minus_server"),
        )
    short = sum(  # each request against its own max_tokens (a dataset's per-request lengths)
        stats.count_short_outputs([r], settings.asked_max_tokens(r.request_id)) for r in result.measured
    )
    metrics["num_short_outputs"] = short
    if short and settings.ignore_eos:
        logger.warning(
            "level %d: %d of %d requests returned fewer output tokens than asked (%s) "
            "although ignore_eos was sent (the server may not take it)",
            index,
            short,
            len(result.measured),
            "per request" if settings.output_lens else settings.max_tokens,
        )
    if settings.schedule_s is not None:  # a recorded schedule: did the sends keep it?
        metrics.update(quality.schedule_fidelity(metrics, settings.schedule_s[: settings.num_requests]))
        if metrics["schedule_faithful"] == 0:
            logger.warning(
                "level %d did not keep the recorded schedule: sends were %.1f ms late at p99 (> %g ms; "
                "achieved %s requests/s against the recorded %s): raise --max-concurrency, or more "
                "--client-processes, or replay slower (--time-scale)",
                index,
                metrics["send_lateness_ms_p99"],
                quality.SCHEDULE_LATENESS_TOLERANCE_MS,
                _rate(metrics.get("achieved_request_rate")),
                _rate(metrics.get("recorded_request_rate")),
            )
    _warn_client(metrics, settings, logger)
    return metrics


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _warn_client(
    metrics: Mapping[str, Any], settings: LevelSettings, logger: logging.Logger | logging.LoggerAdapter
) -> None:
    """The client-side warnings of a level: client-bound (on the clock in use) and a drift of
    the realtime-to-monotonic offset that could move kernel stamps."""
    index = settings.level
    drift = metrics.get("clock_offset_drift_ms")
    if metrics.get("arrival_clock") == "kernel" and drift is not None and drift > quality.DRIFT_WARN_MS:
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
            "level %d is client-bound: %s %% of its ITL gaps came coalesced (several chunks in one "
            "read, > %s %%): the client read too late to separate them; its ITL figures describe "
            "the client, not the server (more --client-processes, or fewer streams)",
            index,
            share,
            limit,
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


def distinct_texts(value: float, limit: float) -> tuple[str, str]:
    """``value`` and ``limit`` with two decimals, or as many more (up to 9) as it takes for
    them to read differently: a warning must never say "1.00 ms (> 1.00 ms)"."""
    for decimals in range(2, 10):
        texts = f"{value:.{decimals}f}", f"{limit:.{decimals}f}"
        if texts[0] != texts[1]:
            break
    return texts
