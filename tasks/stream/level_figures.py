"""A finished load level and its figures: what the level loop (:func:`tasks.scaleout.levels.run_levels`)
makes of a level's pooled records, wherever they were run.

:class:`Level` (settings, metrics, records, gauges; ``to_dict()`` is the stream stage's JSON
entry); :func:`level_metrics`, the level's figures with the warnings on what is off (the
records aggregated, ``tasks.stats.aggregate_level``, with each figure's 95 % interval, the
client's own figures, the server's ``/metrics`` view and cross-check, the prefix cache's share,
short outputs, a recorded schedule's fidelity); :func:`repeat_spread`, the range of the figures
over a level's repeats (``<figure>_repeat_min`` / ``_max``).

Imports neither prefect nor mlflow.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks import stats
from tasks.endpoint import cache, prometheus
from tasks.endpoint.gauges import GaugeSample
from tasks.metrics.registry import REPEAT_SPREAD
from tasks.stats.interval import LEVEL_INTERVAL_FIGURES, figure_intervals
from tasks.stats.samples import stream_units
from tasks.stream import quality
from tasks.stream.level_result import LevelResult
from tasks.stream.quality import rate_text
from tasks.stream.records import RequestRecord
from tasks.stream.settings import LevelSettings


@dataclass(frozen=True)
class Level:
    """One finished load level.

    Attributes:
        settings: what it ran (:class:`tasks.stream.settings.LevelSettings`).
        metrics: flat figures: ``tasks.stats.aggregate_level``'s (``ttft_ms_p50`` ...), the
            client's loop lag (``client_loop_lag_ms_p99``, ``client_bound``, and
            ``client_processes`` over several processes), the server's ``server_*`` view and
            cross-check where it has ``/metrics``, ``num_short_outputs``, each mean and
            percentile's ``_ci_low`` / ``_ci_high`` (``tasks.stats.interval``); repeated, over
            every repeat's records pooled, with ``num_repeats`` and each repeat's range of
            the figures of ``tasks.metrics.registry.REPEAT_SPREAD`` (``ttft_ms_p50_repeat_min``).
        records: every request, warm-up first (flagged), then the measured ones by send time
            (repeated, ``settings.repeats > 1``: so each repeat in turn, ``repeat`` set).
        wall_s: first measured send to last measured completion (s); repeated: the repeats'
            summed (the throughput figures' denominator).
        gauges: the server's gauges every 250 ms of the measured part (``tasks.endpoint.gauges``).
    """

    settings: LevelSettings
    metrics: dict[str, Any]
    records: tuple[RequestRecord, ...]
    wall_s: float
    gauges: tuple[GaugeSample, ...] = ()

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


def level_metrics(
    result: LevelResult,
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    settings: LevelSettings,
    goodput: Mapping[str, float] | None,
    logger: logging.Logger | logging.LoggerAdapter,
    same_host: bool = False,
) -> dict[str, Any]:
    """The level's figures (:class:`Level`'s ``metrics``), warning on what is off (``same_host``:
    the endpoint is this machine's loopback, the server on the client's cores)."""
    index = settings.level
    metrics = stats.aggregate_level(result.records, result.wall_s, goodput)
    # each mean and percentile's 95 % interval: over requests, and over repeats when several
    metrics.update(figure_intervals(stream_units(result.records), LEVEL_INTERVAL_FIGURES))
    metrics.update(result.client)
    metrics.update(prometheus.level_view(before, after))
    metrics.update(cache.level_figures(result.measured, before, after))
    metrics.update(prometheus.cross_check(metrics))
    failures = quality.failures_message(index, result.records)
    if failures:
        logger.warning("%s", failures)
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
                "achieved %s requests/s against the recorded %s): %s",
                index,
                metrics["send_lateness_ms_p99"],
                quality.SCHEDULE_LATENESS_TOLERANCE_MS,
                rate_text(metrics.get("achieved_request_rate")),
                rate_text(metrics.get("recorded_request_rate")),
                quality.schedule_advice(
                    result.measured, settings.max_concurrency, quality.more_clients(metrics)
                ),
            )
    quality.warn_client(metrics, settings, logger, same_host)
    return metrics


def repeat_spread(results: Sequence[LevelResult], goodput: Mapping[str, float] | None) -> dict[str, Any]:
    """``num_repeats`` and, for each figure of ``tasks.metrics.registry.REPEAT_SPREAD``, its
    least and greatest value over the repeats, each aggregated alone
    (``<figure>_repeat_min`` / ``_max``; None where no repeat had the figure)."""
    each = [stats.aggregate_level(result.records, result.wall_s, goodput) for result in results]
    out: dict[str, Any] = {"num_repeats": len(results)}
    for name in REPEAT_SPREAD:
        values = [figures[name] for figures in each if figures.get(name) is not None]
        out[f"{name}_repeat_min"] = min(values) if values else None
        out[f"{name}_repeat_max"] = max(values) if values else None
    return out
