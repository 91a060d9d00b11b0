"""The capacity search as a Prefect task: each level a stream level (``tasks.scaleout.levels``),
the search itself plain logic (``tasks.stream.capacity``); MLflow: a child run per level under
the flow's parent run, and on the parent the capacity, its bracket and the plot."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

from prefect import task

from tasks.config import CapacityConfig, StreamConfig
from tasks.endpoint.spec import Endpoint
from tasks.models.sources import load_tokenizer
from tasks.pipeline.common import STAGE, _token_counter, stage_logger
from tasks.pipeline.timeline import log_timeline
from tasks.report import plots as plots_module
from tasks.report.capacity_plot import capacity_plot
from tasks.scaleout.levels import run_levels
from tasks.stream.capacity import CapacityLevel, search_capacity
from tasks.stream.level_figures import Level
from tasks.stream.records import RecordWriter, write_parquet
from tasks.stream.settings import Connection, settings_from_config
from tasks.tracking import TrackingTarget
from tasks.workload.stage import run_salt, stage_workload


@task(name="capacity", **STAGE)
def capacity_stage(
    cfg: StreamConfig,
    capacity: CapacityConfig,
    endpoint: Endpoint,
    target: TrackingTarget,
    parent_run_id: str | None,
    workdir: str,
) -> dict:
    """Search the capacity of ``endpoint`` under ``cfg.goodput`` (``tasks.stream.capacity``).

    Every level is a full stream level of ``cfg.num_requests`` requests after ``cfg.warmup``
    warm-up ones, with ``cfg``'s prompts / dataset, output length, API and client settings;
    level ``i`` draws its arrivals from ``cfg.seed + i``. Every request goes to
    ``requests.jsonl`` in ``workdir`` as it finishes.

    Returns ``{"capacity": CapacityResult.to_dict(), "levels": [Level.to_dict(), ...]}``.

    Raises:
        ValueError: no goodput SLO in ``cfg``.
        EndpointError: the endpoint's api_key_env names an unset variable (before any request).
    """
    connection = Connection.of(endpoint, cfg.arrival_clock)
    tracker = target.open()
    tokenizer = load_tokenizer(endpoint.tokenizer)
    workload = stage_workload(cfg, tokenizer, salt=run_salt(cfg))
    single = cfg.model_copy(update={"max_concurrency": [1], "request_rate": [None]})
    base = settings_from_config(single, endpoint, workload)[0]
    workdir_path = Path(workdir)
    counter, done, numbers = _token_counter(tokenizer), [], itertools.count()
    logger = stage_logger("capacity")

    with RecordWriter(workdir_path / "requests.jsonl") as writer:

        def measure(kind: str, rate: float | None, concurrency: int) -> Level:
            index = next(numbers)
            settings = replace(
                base, level=index, max_concurrency=concurrency, request_rate=rate, seed=cfg.seed + index
            )
            logger.info("capacity level %d (%s): rate %s, concurrency %d", index, kind, rate, concurrency)
            (level,) = run_levels(
                connection,
                [settings],
                count_tokens=counter,
                goodput=cfg.goodput,
                client_processes=cfg.client_processes,
                task_runner=cfg.task_runner,
                on_record=writer.write,
                logger=logger,
            )
            done.append(level)
            return level

        def log_level(level: CapacityLevel) -> None:
            rate = plots_module.rate_label(level.request_rate)
            child = tracker.start_run(
                f"capacity {len(done) - 1} {level.kind} rate={rate}",
                parent_run_id,
                {"stage": "capacity_level"},
            )
            params = {"kind": level.kind, "request_rate": rate, "max_concurrency": str(level.max_concurrency)}
            tracker.log_params(child, params)
            tracker.log_metrics(child, {**level.metrics, "capacity_level_passed": int(level.passed)})
            if not level.passed:
                tracker.set_tags(child, {"failed_because": level.reason(cfg.goodput, capacity.target)[:480]})
            # the timeline of the level just run (done[-1]): step series, gauges, a stacked plot
            log_timeline(tracker, child, done[-1], cfg.slice_s, workdir_path / "timeline")
            tracker.end_run(child)

        result = search_capacity(
            measure,
            cfg.goodput,
            num_requests=cfg.num_requests,
            target=capacity.target,
            tolerance=capacity.tolerance_pct / 100.0,
            max_levels=capacity.max_levels,
            on_level=log_level,
        )
    summary = result.to_dict()
    tracker.log_metrics(parent_run_id, result.metrics())
    tracker.set_tags(parent_run_id, {"capacity_stop_reason": result.stop_reason[:480]})
    tracker.log_dict(parent_run_id, summary, "capacity.json")
    requests_path, tokens_path = workdir_path / "requests.parquet", workdir_path / "tokens.parquet"
    write_parquet([r for level in done for r in level.records], requests_path, tokens_path)
    for path in (requests_path, tokens_path, workdir_path / "requests.jsonl"):
        tracker.log_artifact(parent_run_id, path)
    if tracker.enabled:
        tracker.log_artifact(
            parent_run_id, capacity_plot(summary, workdir_path / "plots/capacity.png"), "plots"
        )
    return {"capacity": summary, "levels": [level.to_dict() for level in done]}
