"""The remote stream stage as a Prefect task."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prefect import task

from tasks import stats
from tasks.config import StreamConfig
from tasks.endpoint import Endpoint
from tasks.models import load_tokenizer
from tasks.report import plots as plots_module
from tasks.stream import prometheus
from tasks.stream.load import level_grid, make_client, run_level
from tasks.stream.multiproc import run_level_processes
from tasks.stream.prompts import synthetic_prompts
from tasks.stream.records import RecordWriter, write_parquet
from tasks.tracking import TrackingTarget, flatten_params

from tasks.pipeline.common import STAGE, StageRun, _token_counter, stage_logger

STREAM_HEADLINE = (
    "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_mean", "e2e_ms_p50",
    "output_tokens_per_s", "requests_per_s", "error_rate",
)



@task(name="stream", **STAGE)
def stream_stage(
    cfg: StreamConfig, endpoint: Endpoint, target: TrackingTarget, parent_run_id: str | None,
    workdir: str,
) -> dict:
    """Stream the prompts at each load level (concurrency x rate); every finished request is
    kept at once (``requests.jsonl``), Parquet and plots at the end. The audit's remote stage
    and ``infermeter stream`` both run this. When the server exposes Prometheus ``/metrics``
    it is scraped before and after each level's measured requests (``server_*`` metrics,
    ``tasks.stream.prometheus``).

    Returns ``{"levels": [{"max_concurrency", "request_rate", "metrics", "requests"}],
    "headline", "mlflow_run_id"}``.

    Raises:
        EndpointError: the endpoint's api_key_env names an unset variable (before any request).
    """
    endpoint.api_key()  # a named key missing from the environment fails before any request
    with StageRun(target, "stream", parent_run_id, endpoint.identity()) as run:
        logger = stage_logger("stream")
        tokenizer = load_tokenizer(endpoint.tokenizer)
        count_tokens = _token_counter(tokenizer)
        prompts, prompt_tokens = stream_prompts(cfg, tokenizer)
        max_tokens = cfg.output_len or cfg.max_tokens
        key = endpoint.api_key()
        workdir_path = Path(workdir)
        journal = workdir_path / "requests.jsonl"
        levels, all_records, plots = [], [], []
        run.tracker.log_params(run.run_id, flatten_params(cfg.model_dump(mode="json")))
        with RecordWriter(journal) as writer:
            for index, (concurrency, rate) in enumerate(level_grid(cfg.max_concurrency, cfg.request_rate)):
                scrapes: dict[str, dict | None] = {}
                level_args = dict(
                    model=endpoint.model, prompts=prompts, max_tokens=max_tokens,
                    max_concurrency=concurrency, num_requests=cfg.num_requests,
                    warmup=cfg.warmup, count_tokens=count_tokens,
                    sampling={"temperature": cfg.temperature}, level=index,
                    on_record=writer.write, api_key_env=endpoint.api_key_env,
                    prompt_tokens=prompt_tokens,
                    extra_body={"ignore_eos": True} if (cfg.ignore_eos or cfg.output_len) else None,
                    request_rate=rate, burstiness=cfg.burstiness, seed=cfg.seed + index,
                    lag_tolerance_ms=cfg.client_bound_tolerance_ms,
                    on_measure_start=lambda: scrapes.update(
                        before=prometheus.scrape(endpoint.base_url, key)),
                )
                processes = min(cfg.client_processes, concurrency)
                if processes > 1:
                    result = run_level_processes(
                        processes, base_url=endpoint.base_url, api_key=key,
                        request_timeout_s=endpoint.request_timeout_s, **level_args)
                else:
                    result = asyncio.run(_stream_level(endpoint, key, level_args))
                scrapes["after"] = prometheus.scrape(endpoint.base_url, key) if scrapes.get("before") else None
                metrics = stats.aggregate_level(result.records, result.wall_s, cfg.goodput)
                metrics.update(result.client)
                metrics.update(prometheus.level_view(scrapes.get("before"), scrapes["after"]))
                metrics.update(prometheus.cross_check(metrics))
                if metrics.get("server_client_disagree"):
                    logger.warning(
                        "level %d: the client's TTFT/E2E means differ from the server's own "
                        "(/metrics) by more than network and queue explain: TTFT client - server "
                        "= %s ms, E2E %s ms", index, metrics.get("ttft_ms_mean_client_minus_server"),
                        metrics.get("e2e_ms_mean_client_minus_server"),
                    )
                short = stats.count_short_outputs(result.measured, max_tokens)
                metrics["num_short_outputs"] = short
                if short and (cfg.output_len or cfg.ignore_eos):
                    logger.warning(
                        "level %d: %d of %d requests returned fewer than %d output tokens "
                        "although ignore_eos was sent (the server may not take it)",
                        index, short, len(result.measured), max_tokens,
                    )
                if metrics.get("client_bound"):
                    logger.warning(
                        "level %d is client-bound: the client's event-loop lag p99 is %.2f ms "
                        "(> %.2f ms); its latencies describe the client, not the server",
                        index, metrics["client_loop_lag_ms_p99"], cfg.client_bound_tolerance_ms,
                    )
                all_records.extend(result.records)
                level = {
                    "max_concurrency": concurrency, "request_rate": rate, "metrics": metrics,
                    "requests": [r.to_json() for r in result.records],
                }
                levels.append(level)
                rate_text = plots_module.rate_label(rate)
                child = run.tracker.start_run(
                    f"stream c={concurrency} rate={rate_text}", run.run_id, {"stage": "stream_level"}
                )
                run.tracker.log_params(child, {
                    "max_concurrency": str(concurrency), "request_rate": rate_text,
                    "burstiness": str(cfg.burstiness), "seed": str(cfg.seed),
                })
                run.tracker.log_metrics(child, metrics)
                if run.tracker.enabled:
                    hist = plots_module.level_histograms(
                        level, workdir_path / f"plots/level{index}_latency_hist.png")
                    run.tracker.log_artifact(child, hist, "plots")
                    plots.append(hist)
                run.tracker.end_run(child)
        requests_path, tokens_path = workdir_path / "requests.parquet", workdir_path / "tokens.parquet"
        write_parquet(all_records, requests_path, tokens_path)
        for path in (requests_path, tokens_path, journal):
            run.tracker.log_artifact(run.run_id, path)
        if run.tracker.enabled:
            curves = plots_module.load_curves(levels, workdir_path / "plots/load_curves.png")
            for path in (curves, *plots):
                run.tracker.log_artifact(run.run_id, path, "plots")
        headline = {k: levels[0]["metrics"].get(k) for k in STREAM_HEADLINE}
        run.tracker.log_metrics(run.run_id, headline)
        return {"levels": levels, "headline": headline, "mlflow_run_id": run.run_id}


def stream_prompts(cfg: StreamConfig, tokenizer) -> tuple[list[str], list[int] | None]:
    """The stage's prompts and their token counts: synthetic (``input_len``, one per warm-up
    and measured request, from ``cfg.seed``) or the configured ones (counts left to the
    server's usage)."""
    if cfg.input_len:
        return synthetic_prompts(tokenizer, cfg.input_len, cfg.num_requests + cfg.warmup, cfg.seed)
    return list(cfg.prompts), None


async def _stream_level(endpoint: Endpoint, key: str, level_args: dict):
    client = make_client(endpoint.base_url, key, endpoint.request_timeout_s, level_args["max_concurrency"])
    try:
        return await run_level(client, **level_args)
    finally:
        await client.close()


