"""The sampling sweep stage as a Prefect task."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from prefect import task

from tasks.config import SweepConfig
from tasks.endpoint import Endpoint
from tasks.report import plots as plots_module
from tasks.stream.load import make_client
from tasks import tokenizers
from tasks.sweep import PointResult, SweepPoint, grid, run_point_local, run_points
from tasks.tracking import TrackingTarget, flatten_params

from tasks.pipeline.common import STAGE, StageRun

#: The per-point figures of ``tasks.sweep.point_metrics`` carried into each point's result.
SWEEP_METRICS = (
    "num_samples", "num_samples_failed", "identical_fraction", "distinct_1", "distinct_2",
    "output_tokens_mean", "output_tokens_std", "ttft_ms_mean", "e2e_ms_mean",
    "determinism_violated",
)


def sweep_points(cfg: SweepConfig) -> list[SweepPoint]:
    """The sweep's points: the explicit ``points`` when given (unset seed / max_tokens = the
    sweep's; top_p / top_k unset = not sent), else the grid temperature x top_p x top_k with
    the sweep's seed, max_tokens and extra_body."""
    if cfg.points:
        return [
            SweepPoint.make(
                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                seed=cfg.seed if p.seed is None else p.seed,
                max_tokens=p.max_tokens or cfg.max_tokens, extra_body=p.extra_body,
            )
            for p in cfg.points
        ]
    return grid(cfg.temperature, cfg.top_p, cfg.top_k, seed=cfg.seed, max_tokens=cfg.max_tokens,
                extra_body=cfg.extra_body)


def local_identity(spec: str) -> dict[str, str]:
    """What identifies a local (transformers) sweep target across runs, in the keys of
    ``Endpoint.identity``: kind, model name, and the GGUF file's hash when there is one."""
    from tasks.models import resolve

    source = resolve(spec)
    ident = {"endpoint_kind": "local-transformers", "endpoint_model": source.name}
    digest = source.file_sha256()
    if digest:
        ident["endpoint_model_sha256"] = digest
    return ident


@task(name="sweep", **STAGE)
def sweep_stage(
    cfg: SweepConfig, endpoint: Endpoint | None, target: TrackingTarget, parent_run_id: str | None,
    workdir: str, resume: bool = False,
) -> dict:
    """N samples per sweep point, against the endpoint or (``cfg.target == "local"``) the local
    model; one child run per point, logged as the point finishes (params = the point, samples
    as a table, tag ``point_key``). A point with failed requests is a FAILED child run tagged
    with its error class; the other points still run.

    ``resume``: points whose ``point_key`` (hash of the point, prompt, sample count and target
    identity) already has a FINISHED run in the experiment are skipped and reported as such,
    with that run's figures and samples read back.
    """
    local = cfg.target == "local"
    if not local and endpoint is None:
        raise ValueError("sweep.target endpoint needs an endpoint")
    identity = local_identity(cfg.local_model) if local else endpoint.identity()
    with StageRun(target, "sweep", parent_run_id, identity) as run:
        tokenizer = tokenizers.load("model", cfg.local_model if local else endpoint.tokenizer)
        points = sweep_points(cfg)
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
        todo = [p for p in dict.fromkeys(points) if p not in done]
        finished: dict[SweepPoint, tuple[PointResult, str | None]] = {}
        lock = threading.Lock()

        def keep(result: PointResult) -> None:  # as each point finishes (a worker thread)
            with lock:
                finished[result.point] = (result, _log_point(run, result, keys[result.point], cfg))

        if local:
            from tasks.models import load_model

            model, hf_tokenizer = load_model(cfg.local_model)
            for p in todo:
                keep(run_point_local(model, hf_tokenizer, p, prompt=cfg.prompt,
                                     samples=cfg.samples, encode=tokenizer.encode))
        elif todo:
            asyncio.run(_sweep_points(cfg, endpoint, todo, tokenizer.encode, keys, keep))
        out = []
        for p in points:
            row = {**p.params(), "point_key": keys[p]}
            if p in done:
                prior = done[p]
                samples = run.tracker.load_table(prior["run_id"], "samples.json")
                out.append({**row, "status": "skipped", "error_class": None, "samples": samples,
                            **_prior_metrics(prior["metrics"]),
                            "mlflow_run_id": prior["run_id"]})
                continue
            result, child = finished[p]
            out.append({**row, "status": "failed" if result.failed else "finished",
                        "error_class": result.error_class, "samples": result.sample_rows(),
                        **{k: result.metrics.get(k) for k in SWEEP_METRICS}, "mlflow_run_id": child})
        path = Path(workdir) / "samples.json"
        path.write_text(json.dumps(out, ensure_ascii=False, indent=1, default=str), encoding="utf-8")
        chart = plots_module.sweep_vs_temperature(out, Path(workdir) / "sweep_vs_temperature.png")
        for artifact in (path, chart):
            run.tracker.log_artifact(run.run_id, artifact)
        headline = {
            "sweep_points": len(out),
            "sweep_points_skipped": sum(p["status"] == "skipped" for p in out),
            "sweep_points_failed": sum(p["status"] == "failed" for p in out),
            "sweep_determinism_violations": sum(int(p["determinism_violated"] or 0) for p in out),
        }
        run.tracker.log_metrics(run.run_id, headline)
        return {"points": out, "headline": headline, "identity": identity, "mlflow_run_id": run.run_id}


def _prior_metrics(metrics: dict[str, float]) -> dict[str, Any]:
    """A skipped point's figures as read back from its FINISHED run (counts as ints)."""
    counts = {"num_samples", "num_samples_failed", "determinism_violated"}
    return {k: (int(metrics[k]) if k in counts else metrics[k]) if k in metrics else None
            for k in SWEEP_METRICS}


def _log_point(run: StageRun, result: PointResult, key: str, cfg: SweepConfig) -> str | None:
    """The point's child run: params = the point, metrics, samples table; FAILED when any of
    its requests failed (tag ``error_class``)."""
    tags = {"stage": "sweep_point", "point_key": key}
    if result.failed:
        tags["error_class"] = result.error_class
    child = run.tracker.start_run(f"sweep {result.point.label()}", run.run_id, tags)
    run.tracker.log_params(child, flatten_params({**result.point.params(), "samples": cfg.samples}))
    run.tracker.log_metrics(child, result.metrics)
    run.tracker.log_table(child, result.sample_rows(), "samples.json")
    run.tracker.end_run(child, "FAILED" if result.failed else "FINISHED")
    return child


async def _sweep_points(cfg: SweepConfig, endpoint: Endpoint, points, encode, keys, keep):
    client = make_client(endpoint.base_url, endpoint.api_key(), endpoint.request_timeout_s, cfg.max_concurrency)
    try:
        return await run_points(
            client, points, model=endpoint.model, prompt=cfg.prompt, samples=cfg.samples,
            max_concurrency=cfg.max_concurrency, count_tokens=lambda text: len(encode(text)),
            encode=encode, api_key_env=endpoint.api_key_env, key=keys.__getitem__,
            on_point=lambda result: asyncio.to_thread(keep, result),
        )
    finally:
        await client.close()
