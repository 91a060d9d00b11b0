"""The stages as Prefect tasks: orchestration and tracking around the plain measurement code.

Each task takes configs and plain values (never a live model, client or DataFrame, which
Prefect cannot hash), builds what it needs inside, measures through the plain modules, writes
its records to the work folder as it goes, and logs to MLflow under the parent run id it was
given. Measurement tasks have no cache and no retries: a retried measurement is a different
measurement.
"""

from __future__ import annotations

import asyncio
import json
import traceback
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import memory, profile, stats
from tasks.config import ProfileConfig, StreamConfig, SweepConfig, TokenizeConfig
from tasks.endpoint import Endpoint
from tasks.models import load_model, load_tokenizer
from tasks.stream.load import make_client, run_level
from tasks.stream.records import RecordWriter, write_parquet
from tasks.sweep import grid, run_point
from tasks.tokenize import summary_metrics, tokenize_prompts
from tasks.tracking import TrackingTarget, flatten_params

STAGE = dict(cache_policy=NO_CACHE, retries=0)

PROFILE_HEADLINE = (
    "prefill_ms", "prefill_tokens_per_s", "decode_ms_p50", "decode_tokens_per_s",
    "weights_bytes", "kv_cache_bytes", "kv_cache_bytes_formula", "peak_memory_bytes",
)
STREAM_HEADLINE = (
    "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_mean", "e2e_ms_p50",
    "output_tokens_per_s", "requests_per_s", "error_rate",
)


def _scalars(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _token_counter(tokenizer):
    """Output tokens by the tokenizer, without special tokens (no BOS), per DESIGN.md."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


class StageRun:
    """A stage's child run: ended FINISHED, or FAILED with the error recorded on it."""

    def __init__(self, target: TrackingTarget, name: str, parent_run_id: str | None, tags=None):
        self.tracker = target.open()
        self.run_id = self.tracker.start_run(name, parent_run_id, {"stage": name, **(tags or {})})

    def __enter__(self) -> "StageRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.tracker.set_tags(self.run_id, {"error": f"{exc_type.__name__}: {exc}"[:500]})
            self.tracker.log_text(self.run_id, "".join(traceback.format_exception(exc)), "error.txt")
        self.tracker.end_run(self.run_id, "FAILED" if exc is not None else "FINISHED")


@task(name="tokenize", **STAGE)
def tokenize_stage(
    cfg: TokenizeConfig, model_spec: str, target: TrackingTarget, parent_run_id: str | None,
    workdir: str,
) -> dict:
    """Token ids, pieces, counts and chars/bytes per token for every prompt."""
    with StageRun(target, "tokenize", parent_run_id) as run:
        tokenizer = load_tokenizer(model_spec)
        tokenized = tokenize_prompts(tokenizer, cfg.prompts)
        rows = [row.to_row() for row in tokenized]
        metrics = summary_metrics(tokenized)
        path = Path(workdir) / "tokenize.json"
        path.write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
        run.tracker.log_params(run.run_id, {"tokenizer": model_spec, "prompts.count": str(len(rows))})
        run.tracker.log_metrics(run.run_id, metrics)
        run.tracker.log_artifact(run.run_id, path)
        return {"rows": rows, "metrics": metrics, "mlflow_run_id": run.run_id}


@task(name="profile", **STAGE)
def profile_stage(
    cfg: ProfileConfig, target: TrackingTarget, parent_run_id: str | None, workdir: str
) -> dict:
    """Prefill and per-token decode over the prompt-length x batch-size grid."""
    with StageRun(target, "profile", parent_run_id) as run:
        device = profile.resolve_device(cfg.device)
        model, tokenizer = load_model(cfg.model, cfg.dtype, device)
        run.tracker.log_params(run.run_id, flatten_params(cfg.model_dump()))
        run.tracker.set_tags(run.run_id, {
            "device": device, "dtype": cfg.dtype,
            "attn_implementation": str(getattr(model.config, "_attn_implementation", "unknown")),
        })
        points = []
        for length in cfg.prompt_lengths:
            for batch in cfg.batch_sizes:
                prompt_ids = profile.make_prompt_ids(tokenizer, length)
                point = profile.profile_point(
                    model, prompt_ids=prompt_ids, batch_size=batch,
                    max_new_tokens=cfg.max_new_tokens, repeats=cfg.repeats,
                    warmup=cfg.warmup, device=device,
                )
                point["generated_text"] = tokenizer.decode(point.get("generated_token_ids", []))
                points.append(point)
                child = run.tracker.start_run(
                    f"profile N={length} B={batch}", run.run_id, {"stage": "profile_point"}
                )
                run.tracker.log_params(child, {
                    "prompt_tokens": str(length), "batch_size": str(batch),
                    "max_new_tokens": str(cfg.max_new_tokens), "dtype": cfg.dtype, "device": device,
                })
                run.tracker.log_metrics(child, _scalars(point))
                run.tracker.log_metric_series(child, "decode_step_ms", point["decode_ms"])
                run.tracker.end_run(child)
        path = Path(workdir) / "profile_points.json"
        path.write_text(json.dumps(points, indent=1, default=str), encoding="utf-8")
        run.tracker.log_artifact(run.run_id, path)
        headline = {k: points[0].get(k) for k in PROFILE_HEADLINE}
        run.tracker.log_metrics(run.run_id, headline)
        return {"points": points, "headline": headline, "mlflow_run_id": run.run_id}


@task(name="stream", **STAGE)
def stream_stage(
    cfg: StreamConfig, endpoint: Endpoint, target: TrackingTarget, parent_run_id: str | None,
    workdir: str,
) -> dict:
    """Stream the prompts at each concurrency level; every finished request is kept at once."""
    with StageRun(target, "stream", parent_run_id, endpoint.identity()) as run:
        count_tokens = _token_counter(load_tokenizer(endpoint.tokenizer))
        journal = Path(workdir) / "requests.jsonl"
        levels, all_records = [], []
        with RecordWriter(journal) as writer:
            for index, concurrency in enumerate(cfg.max_concurrency):
                result = asyncio.run(_stream_level(cfg, endpoint, concurrency, index, count_tokens, writer))
                metrics = stats.aggregate_level(result.records, result.wall_s, cfg.goodput)
                all_records.extend(result.records)
                levels.append({
                    "max_concurrency": concurrency, "request_rate": None, "metrics": metrics,
                    "requests": [r.to_json() for r in result.records],
                })
                child = run.tracker.start_run(
                    f"stream c={concurrency}", run.run_id, {"stage": "stream_level"}
                )
                run.tracker.log_params(child, {"max_concurrency": str(concurrency), "request_rate": "inf"})
                run.tracker.log_metrics(child, metrics)
                run.tracker.end_run(child)
        requests_path, tokens_path = Path(workdir) / "requests.parquet", Path(workdir) / "tokens.parquet"
        write_parquet(all_records, requests_path, tokens_path)
        for path in (requests_path, tokens_path, journal):
            run.tracker.log_artifact(run.run_id, path)
        headline = {k: levels[0]["metrics"].get(k) for k in STREAM_HEADLINE}
        run.tracker.log_params(run.run_id, {
            "max_tokens": str(cfg.max_tokens), "num_requests": str(cfg.num_requests),
            "warmup": str(cfg.warmup), "max_concurrency": json.dumps(cfg.max_concurrency),
        })
        run.tracker.log_metrics(run.run_id, headline)
        return {"levels": levels, "headline": headline, "mlflow_run_id": run.run_id}


async def _stream_level(cfg: StreamConfig, endpoint: Endpoint, concurrency, index, count_tokens, writer):
    client = make_client(endpoint.base_url, endpoint.api_key(), endpoint.request_timeout_s, concurrency)
    try:
        return await run_level(
            client, model=endpoint.model, prompts=cfg.prompts, max_tokens=cfg.max_tokens,
            max_concurrency=concurrency, num_requests=cfg.num_requests, warmup=cfg.warmup,
            count_tokens=count_tokens, sampling={"temperature": cfg.temperature}, level=index,
            on_record=writer.write, api_key_env=endpoint.api_key_env,
        )
    finally:
        await client.close()


@task(name="sweep", **STAGE)
def sweep_stage(
    cfg: SweepConfig, endpoint: Endpoint, target: TrackingTarget, parent_run_id: str | None,
    workdir: str,
) -> dict:
    """N samples per (temperature, top_p) point; one child run per point."""
    with StageRun(target, "sweep", parent_run_id, endpoint.identity()) as run:
        tokenizer = load_tokenizer(endpoint.tokenizer)
        count_tokens = _token_counter(tokenizer)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        run.tracker.log_params(run.run_id, flatten_params(cfg.model_dump()))
        points, sample_rows = [], []
        for point in grid(cfg.temperature, cfg.top_p):
            result = asyncio.run(_sweep_point(cfg, endpoint, point, count_tokens, encode))
            child = run.tracker.start_run(
                f"sweep T={point.temperature} top_p={point.top_p}", run.run_id,
                {"stage": "sweep_point", "point_key": point.key()},
            )
            run.tracker.log_params(child, {
                "temperature": str(point.temperature), "top_p": str(point.top_p),
                "samples": str(cfg.samples), "seed": str(cfg.seed), "max_tokens": str(cfg.max_tokens),
            })
            run.tracker.log_metrics(child, result.metrics)
            rows = [
                {"temperature": point.temperature, "top_p": point.top_p, "sample": i,
                 "seed": cfg.seed + i, **_sample_row(r)}
                for i, r in enumerate(result.records)
            ]
            run.tracker.log_dict(child, {"samples": rows}, "samples.json")
            run.tracker.end_run(child)
            sample_rows.extend(rows)
            points.append({**point.params(), "samples": [r["output_text"] for r in rows],
                           **result.metrics, "mlflow_run_id": child})
        path = Path(workdir) / "samples.json"
        path.write_text(json.dumps(sample_rows, ensure_ascii=False, indent=1), encoding="utf-8")
        run.tracker.log_artifact(run.run_id, path)
        violations = sum(p["determinism_violated"] for p in points)
        headline = {"sweep_points": len(points), "sweep_determinism_violations": violations}
        run.tracker.log_metrics(run.run_id, headline)
        return {"points": points, "headline": headline, "mlflow_run_id": run.run_id}


def _sample_row(record) -> dict:
    data = record.to_json()
    return {k: data[k] for k in ("output_text", "output_tokens", "ttft_ms", "e2e_ms", "error")}


async def _sweep_point(cfg: SweepConfig, endpoint: Endpoint, point, count_tokens, encode):
    client = make_client(endpoint.base_url, endpoint.api_key(), endpoint.request_timeout_s, cfg.max_concurrency)
    try:
        return await run_point(
            client, point, model=endpoint.model, prompt=cfg.prompt, samples=cfg.samples,
            seed=cfg.seed, max_tokens=cfg.max_tokens, max_concurrency=cfg.max_concurrency,
            count_tokens=count_tokens, encode=encode, api_key_env=endpoint.api_key_env,
        )
    finally:
        await client.close()
