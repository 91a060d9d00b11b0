"""The sampling sweep stage as a Prefect task: orchestration and tracking around ``tasks.sweep``
(one child run per point, resume by finished runs, the samples table and plot)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from prefect import task

from tasks import asyncrun
from tasks.config import SweepConfig
from tasks.endpoint.spec import Endpoint
from tasks.engines.death import server_died_error
from tasks.pipeline.common import STAGE, StageRun
from tasks.pipeline.fanout import (
    PointFailure,
    dask_runner,
    parse_task_runner,
    run_points_on_dask,
    worker_model,
)
from tasks.report import distribution_plots
from tasks.report import plots as plots_module
from tasks.stream.load import connect
from tasks.stream.settings import Connection
from tasks.sweep import (
    PointResult,
    SweepPoint,
    collect_outcomes,
    local_identity,
    pending_points,
    points_from_config,
    run_point_local,
    run_points,
    sweep_headline,
)
from tasks.tokenize import tokenizers
from tasks.tracking import TrackingTarget, flatten_params
from tasks.wire.errors import SERVER_DIED


@task(name="sweep", **STAGE)
def sweep_stage(
    cfg: SweepConfig,
    endpoint: Endpoint | None,
    target: TrackingTarget,
    parent_run_id: str | None,
    workdir: str,
    resume: bool = False,
) -> dict:
    """N samples per sweep point, against the endpoint or (``cfg.target == "local"``) the local
    model; one child run per point, logged as the point finishes (params = the point, samples
    as a table, tag ``point_key``). A point with failed requests is a FAILED child run tagged
    with its error class; the other points still run.

    ``resume``: points whose ``point_key`` (hash of the point, prompt, sample count and target
    identity) already has a FINISHED run in the experiment are skipped and reported as such,
    with that run's figures and samples read back.

    Returns ``{"points": [PointOutcome.to_dict()], "headline", "identity", "mlflow_run_id"}``.
    """
    local = cfg.target == "local"
    if not local and endpoint is None:
        raise ValueError("sweep.target endpoint needs an endpoint")
    identity = local_identity(cfg.local_model) if local else endpoint.identity()
    with StageRun(target, "sweep", parent_run_id, identity) as run:
        tokenizer = tokenizers.load("model", cfg.local_model if local else endpoint.tokenizer)
        points = points_from_config(cfg)
        context = {"prompt": cfg.prompt, "samples": cfg.samples, "target": cfg.target, **identity}
        keys = {p: p.key(context) for p in points}
        run.tracker.log_params(run.run_id, flatten_params(cfg.model_dump(mode="json")))
        done: dict[SweepPoint, dict] = {}
        if resume:
            for p in points:
                found = run.tracker.find_runs(
                    f"tags.point_key = '{keys[p]}' and attributes.status = 'FINISHED'", max_results=1
                )
                if found:
                    done[p] = found[0]
        todo = pending_points(points, done)
        finished: dict[SweepPoint, tuple[PointResult, str | None]] = {}
        distribution: list[dict] | None = None
        lock = threading.Lock()

        def keep(result: PointResult) -> None:  # as each point finishes (a worker thread)
            with lock:
                finished[result.point] = (result, _log_point(run, result, keys[result.point], cfg))

        dask = parse_task_runner(cfg.task_runner)
        if local and (cfg.distribution or dask is None):
            from tasks.models.sources import load_model

            model, hf_tokenizer = load_model(cfg.local_model)
            if cfg.distribution:  # the sampler's view (issue 12), before the samples
                distribution = _sampler_view(run, cfg, points, model, hf_tokenizer, Path(workdir))
        if dask is not None and todo:  # one Prefect task per point on the Dask workers
            with dask_runner(dask) as runner:
                params = [{"cfg": cfg, "point": p, "endpoint": endpoint, "key": keys[p]} for p in todo]
                run_points_on_dask(
                    runner,
                    sweep_point,
                    params,
                    on_done=lambda i, result: keep(result),
                    on_failed=lambda failure: keep(_lost_point(todo[failure.index], failure)),
                )
        elif local:
            for p in todo:
                keep(
                    run_point_local(
                        model,
                        hf_tokenizer,
                        p,
                        prompt=cfg.prompt,
                        samples=cfg.samples,
                        encode=tokenizer.encode,
                    )
                )
        elif todo:
            asyncrun.run(_sweep_points(cfg, endpoint, todo, tokenizer.encode, keys.__getitem__, keep))
        outcomes = collect_outcomes(
            points,
            keys,
            done,
            finished,
            load_samples=lambda run_id: run.tracker.load_table(run_id, "samples.json"),
        )
        out = [o.to_dict() for o in outcomes]
        path = Path(workdir) / "samples.json"
        path.write_text(json.dumps(out, ensure_ascii=False, indent=1, default=str), encoding="utf-8")
        run.tracker.log_artifact(run.run_id, path)
        for chart in plots_module.sweep_vs_temperature(out, Path(workdir) / "plots"):
            run.tracker.log_artifact(run.run_id, chart, "plots")
        headline = sweep_headline(outcomes)
        run.tracker.log_metrics(run.run_id, headline)
        records = [r for result, _ in finished.values() for r in result.records]
        cut = sum(r.error_class == SERVER_DIED for r in records)
        if cut:  # the points are kept (above); the stage ends naming the death
            answered = sum(r.succeeded for r in records)
            raise server_died_error(endpoint.server_pid, answered, cut, " during the sweep")
        out_keys = {"points": out, "headline": headline, "identity": identity, "mlflow_run_id": run.run_id}
        return out_keys if distribution is None else {**out_keys, "distribution": distribution}


def _sampler_view(run: StageRun, cfg: SweepConfig, points, model, tokenizer, workdir: Path) -> list[dict]:
    """The sampler's view at the first ``cfg.distribution_steps`` decode steps of the prompt,
    under every swept temperature and top_p (``StepDistribution.to_dict`` rows); logged on the
    stage run: ``sampler_view.json`` (table), ``plots/sampler_view.png``, and
    ``next_token_entropy_bits_t<temperature>`` with one step per decode step."""
    from tasks.sweep.distribution import entropy_series, next_token_distributions, table_rows
    from tasks.sweep.local import chat_input_ids

    temperatures = sorted({p.temperature for p in points})
    top_ps = sorted({p.top_p for p in points if p.top_p is not None}) or [1.0]
    ids = chat_input_ids(tokenizer, cfg.prompt).to(model.device)
    steps = next_token_distributions(
        model, tokenizer, ids, steps=cfg.distribution_steps, temperatures=temperatures, top_ps=top_ps
    )
    rows = [step.to_dict() for step in steps]
    run.tracker.log_table(run.run_id, table_rows(rows), "sampler_view.json")
    chart = distribution_plots.sampler_view(rows, workdir / "plots" / "sampler_view.png")
    run.tracker.log_artifact(run.run_id, chart, "plots")
    for name, values in entropy_series(rows).items():
        run.tracker.log_metric_series(run.run_id, name, values)
    return rows


def _log_point(run: StageRun, result: PointResult, key: str, cfg: SweepConfig) -> str | None:
    """The point's child run: params = the point, metrics, samples table; FAILED when any of
    its requests failed (tag ``error_class``)."""
    tags = {"stage": "sweep_point", "point_key": key}
    if result.failed:
        tags["error_class"] = result.error_class
    if result.error:  # a point lost with its Dask worker: the cause
        tags["error"] = result.error[:500]
    if result.determinism_note:
        tags["determinism_note"] = result.determinism_note
    child = run.tracker.start_run(f"sweep {result.point.label()}", run.run_id, tags)
    run.tracker.log_params(child, flatten_params({**result.point.params(), "samples": cfg.samples}))
    run.tracker.log_metrics(child, result.metrics)
    run.tracker.log_table(child, result.sample_rows(), "samples.json")
    if result.warmup is not None:  # recorded, outside the figures
        run.tracker.log_dict(child, result.warmup_row(), "warmup.json")
    run.tracker.end_run(child, "FAILED" if result.failed else "FINISHED")
    return child


@task(name="sweep-point", **STAGE)
def sweep_point(cfg: SweepConfig, point: SweepPoint, endpoint: Endpoint | None, key: str) -> PointResult:
    """One point of the sweep where a Dask worker runs it: the local model (loaded once per
    worker process, :func:`tasks.pipeline.fanout.worker_model`) or the endpoint (its own client,
    at most ``cfg.max_concurrency`` requests in flight within the point). The stage logs the
    result; nothing here writes to MLflow."""
    if cfg.target == "local":
        model, hf_tokenizer = worker_model(cfg.local_model)
        encode = tokenizers.load("model", cfg.local_model).encode
        return run_point_local(
            model, hf_tokenizer, point, prompt=cfg.prompt, samples=cfg.samples, encode=encode
        )
    encode = tokenizers.load("model", endpoint.tokenizer).encode
    return asyncrun.run(_sweep_points(cfg, endpoint, [point], encode, lambda p: key, None))[0]


def _lost_point(point: SweepPoint, failure: PointFailure) -> PointResult:
    """A point whose Dask task never came back (its workers died, or it raised): failed, with
    the cause, no samples."""
    return PointResult(point, error_class=failure.error_class, error=failure.cause)


async def _sweep_points(cfg: SweepConfig, endpoint: Endpoint, points, encode, key, keep):
    client = connect(Connection.of(endpoint), cfg.max_concurrency)
    try:
        return await run_points(
            client,
            points,
            model=endpoint.model,
            prompt=cfg.prompt,
            samples=cfg.samples,
            max_concurrency=cfg.max_concurrency,
            count_tokens=lambda text: len(encode(text)),
            encode=encode,
            api_key_env=endpoint.api_key_env,
            key=key,
            on_point=None if keep is None else lambda result: asyncio.to_thread(keep, result),
            warmup=cfg.warmup,
            server_pid=endpoint.server_pid,
        )
    finally:
        await client.close()
