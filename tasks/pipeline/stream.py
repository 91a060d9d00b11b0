"""The remote stream stage as a Prefect task: orchestration and tracking around the level loop
of ``tasks.scaleout.levels`` (child runs, params, plots, artifacts)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task

from tasks import metrics
from tasks.config import StreamConfig
from tasks.endpoint import cache
from tasks.endpoint.spec import Endpoint
from tasks.models.sources import load_tokenizer
from tasks.phases import mark
from tasks.pipeline.common import STAGE, StageRun, _token_counter, stage_logger
from tasks.pipeline.stream_files import level_files, stage_plots
from tasks.report import plots as plots_module
from tasks.scaleout.levels import run_levels
from tasks.stats.interval import with_intervals
from tasks.stream.level_figures import Level
from tasks.stream.records import RecordWriter, write_parquet
from tasks.stream.settings import Connection, settings_from_config
from tasks.tracking import TrackingTarget, flatten_params
from tasks.tracking.writer import measuring, real_run_id, run_job
from tasks.wire.errors import every_request_failed
from tasks.workload.stage import run_salt, stage_workload

STREAM_HEADLINE = metrics.headline("stream")


@task(name="stream", **STAGE)
def stream_stage(
    cfg: StreamConfig,
    endpoint: Endpoint,
    target: TrackingTarget,
    parent_run_id: str | None,
    workdir: str,
) -> dict:
    """Stream the prompts at each load level (concurrency x rate); every finished request is
    kept at once (``requests.jsonl``), Parquet and plots at the end. The audit's remote stage
    and ``infermeter stream`` both run this. When the server exposes Prometheus ``/metrics``
    it is scraped before and after each level's measured requests (``server_*`` metrics,
    ``tasks.scaleout.levels``), and its gauges sampled every 250 ms for each level's timeline of
    ``cfg.slice_s``-second windows (``tasks.pipeline.timeline``: step series, CSV, a stacked
    plot). One child run per level, logged as the level finishes; its plots and timeline are
    drawn and logged by ``tasks.pipeline.stream_files`` (off the timed path when the command
    started a tracking writer: ``tasks.tracking.writer.run_job``). When
    every measured request failed the stage's run ends FAILED (``error`` tag: the first error),
    its records logged and returned all the same.

    Returns ``{"levels": [{"max_concurrency", "request_rate", "metrics", "requests"}],
    "headline", "mlflow_run_id"}``.

    Raises:
        EndpointError: the endpoint's api_key_env names an unset variable (before any request).
    """
    # a named key missing from the environment fails here
    connection = Connection.of(endpoint, cfg.arrival_clock)
    mark("stage_start")
    with StageRun(target, "stream", parent_run_id, endpoint.identity()) as run:
        mark("tokenizer")
        tokenizer = load_tokenizer(endpoint.tokenizer)
        workload = stage_workload(cfg, tokenizer, salt=run_salt(cfg))
        workdir_path = Path(workdir)
        journal = workdir_path / "requests.jsonl"
        run.keep(journal)
        plots: list[str] = []  # the levels' histograms, for the stage's run too
        run.tracker.log_params(
            run.run_id,
            {**flatten_params(cfg.model_dump(mode="json")), **workload.params()},
        )
        if workload.source:  # the file the requests came from, beside their records
            run.tracker.log_artifact(run.run_id, Path(workload.source), "workload")

        def log_level(level: Level) -> None:
            """The level's child run: params, metrics, latency histograms, the timeline."""
            rate_text = plots_module.rate_label(level.request_rate)
            start_ms, end_ms = level_wall_ms(level)
            child = run.tracker.start_run(
                f"stream c={level.max_concurrency} "
                + (f"rate={rate_text}" if "schedule_faithful" not in level.metrics else "trace"),
                run.run_id,
                {"stage": "stream_level"},
                start_time_ms=start_ms,
            )
            run.tracker.log_params(
                child,
                {
                    "max_concurrency": str(level.max_concurrency),
                    "request_rate": rate_text,
                    "burstiness": str(cfg.burstiness),
                    "seed": str(cfg.seed),
                    # not a number: a param, so the UI can filter levels by the clock they used
                    "arrival_clock": str(level.metrics.get("arrival_clock")),
                },
            )
            run.tracker.log_metrics(child, level.metrics)
            # histograms, the timeline (step series, the server's gauges, a stacked plot), the end
            run_job(run.tracker, level_files, child, level, cfg.slice_s, workdir, end_ms)
            if run.tracker.enabled:
                stem = f"level{level.level}"
                plots.extend(map(str, plots_module.level_histogram_paths(workdir_path / "plots", stem)))

        mark("levels")
        measuring(run.tracker)  # the tracking writer's plots then yield the CPU to the levels
        with RecordWriter(journal) as writer:
            done = run_levels(
                connection,
                settings_from_config(cfg, endpoint, workload),
                count_tokens=_token_counter(tokenizer),
                goodput=cfg.goodput,
                client_processes=cfg.client_processes,
                task_runner=cfg.task_runner,
                on_record=writer.write,
                on_level=log_level,
                logger=stage_logger("stream"),
            )
        mark("stage_records")
        levels = [level.to_dict() for level in done]
        requests_path, tokens_path = workdir_path / "requests.parquet", workdir_path / "tokens.parquet"
        write_parquet([r for level in done for r in level.records], requests_path, tokens_path)
        for path in (requests_path, tokens_path, journal):
            run.tracker.log_artifact(run.run_id, path)
        curves = [{k: lv[k] for k in ("max_concurrency", "request_rate", "metrics")} for lv in levels]
        run_job(run.tracker, stage_plots, run.run_id, curves, str(workdir_path / "plots"), plots)
        headline = with_intervals(STREAM_HEADLINE, levels[0]["metrics"])
        # the first level's prefix-cache figures too (the flow's parent run carries them as well)
        run.tracker.log_metrics(run.run_id, {**headline, **cache.first_level_figures(levels)})
        failed = every_request_failed(levels)
        if failed:  # the records are kept and returned; the run says it measured nothing
            run.fail(failed)
        return {"levels": levels, "headline": headline, "mlflow_run_id": real_run_id(run.tracker, run.run_id)}


def level_wall_ms(level: Level) -> tuple[int | None, int | None]:
    """(start, end) of a finished level in Unix ms, for its MLflow run's duration: its first
    send (warm-ups included) and its last measured completion (first measured send + ``wall_s``).
    The records' ``send_ns`` are ``perf_counter_ns`` (CLOCK_MONOTONIC, one clock for all client
    processes), turned into wall time by one (time.time, perf_counter_ns) pair read now.
    (None, None) when no request was sent."""
    sends = [r.send_ns for r in level.records if r.send_ns]
    if not sends:
        return None, None
    offset_ms = time.time() * 1000 - time.perf_counter_ns() / 1e6
    measured = [r.send_ns for r in level.records if r.send_ns and not r.warmup] or sends
    start_ms = min(sends) / 1e6 + offset_ms
    end_ms = min(measured) / 1e6 + level.wall_s * 1000 + offset_ms
    if level.settings.repeats > 1:  # wall_s sums the repeats: the pauses between them left out
        end_ms = max(r.send_ns / 1e6 + (r.stream_close_ms or 0.0) for r in level.records if r.send_ns)
        end_ms += offset_ms
    return int(start_ms), int(max(end_ms, start_ms))
