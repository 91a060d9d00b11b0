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
import logging
import os
import threading
import traceback
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks import profile, stats
from tasks.config import ProfileConfig, StreamConfig, SweepConfig, TokenizeConfig
from tasks.endpoint import Endpoint
from tasks.models import load_tokenizer
from tasks import plots as plots_module
from tasks.stream import prometheus
from tasks.stream.load import level_grid, make_client, run_level
from tasks.stream.multiproc import run_level_processes
from tasks.stream.prompts import synthetic_prompts
from tasks.stream.records import RecordWriter, write_parquet
from tasks import tokenizers
from tasks.sweep import PointResult, SweepPoint, grid, run_point_local, run_points
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
    """Token ids, pieces, counts and chars/bytes per token for every prompt x tokenizer
    (``model`` = the tokenizer of ``model_spec``); a table artifact, a bar chart PNG and
    ``token_count_<tokenizer>_total`` metrics.

    Raises:
        tasks.tokenizers.TokenizerError: a tokenizer cannot be loaded (data file missing,
            SHA-256 mismatch, unknown name).
    """
    with StageRun(target, "tokenize", parent_run_id) as run:
        loaded = [tokenizers.load(name, model_spec) for name in cfg.tokenizers]
        tokenized = tokenize_prompts(loaded, cfg.prompts)
        rows = [row.to_row() for row in tokenized]
        metrics = summary_metrics(tokenized)
        path = Path(workdir) / "tokenize.json"
        path.write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
        chart = plots_module.token_count_bars(rows, Path(workdir) / "token_counts.png")
        run.tracker.log_params(run.run_id, {
            "tokenizer": model_spec, "tokenizers": ",".join(cfg.tokenizers),
            "prompts.count": str(len(cfg.prompts)),
        })
        run.tracker.set_tags(run.run_id, {
            f"tokenizer_source.{tokenizers.metric_name(t.name)}": t.source for t in loaded
        })
        run.tracker.log_metrics(run.run_id, metrics)
        run.tracker.log_table(run.run_id, [
            {**row, "ids": json.dumps(row["ids"]), "pieces": json.dumps(row["pieces"], ensure_ascii=False)}
            for row in rows
        ], "tokens_table.json")
        for artifact in (path, chart):
            run.tracker.log_artifact(run.run_id, artifact)
        return {"rows": rows, "metrics": metrics, "mlflow_run_id": run.run_id}


class ProfileSweepFailed(RuntimeError):
    """Every point of a profile sweep failed; ``points`` keeps each point's recorded cause."""

    def __init__(self, message: str, points: list[dict]):
        super().__init__(message)
        self.points = points


def _profile_progress(total: int):
    """A rich progress bar on stderr, redrawn only between points (no refresh thread runs
    beside the timed region)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("profile"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=Console(stderr=True), auto_refresh=False,
    )
    return bar, bar.add_task("loading the model", total=total)


@task(name="profile", **STAGE)
def profile_stage(
    cfg: ProfileConfig, target: TrackingTarget, parent_run_id: str | None, workdir: str,
    show_progress: bool = False,
) -> dict:
    """Prefill and per-token decode over prompt length x batch size x dtype x prefill chunk size
    x max_new_tokens (points that may not fit run in a child process: :func:`run_sweep`).

    One child run per point (FAILED with an ``error`` tag for a point that failed), the points
    as ``profile_points.json`` and four PNG plots under ``plots/`` on the stage's run. Each
    finished point is also appended to ``profile_points.jsonl`` in ``workdir`` at once.
    Returns {"points", "headline" (the first successful point's), "failed_points",
    "mlflow_run_id"}.

    Raises:
        ProfileSweepFailed: no point succeeded (its ``points`` say why each failed).
    """
    from tasks.profile_plots import write_profile_plots
    from tasks import profile_sweep
    from tasks.profile_sweep import point_label, run_sweep, steps_swept
    from tasks.models import default_dtype, resolve

    source = resolve(cfg.model)
    with StageRun(target, "profile", parent_run_id, {"random_weights": source.random_weights}) as run:
        device = profile.resolve_device(cfg.device)
        dtypes = cfg.dtypes or [default_dtype(cfg.model)]
        run.tracker.log_params(run.run_id, flatten_params(cfg.model_dump()))
        run.tracker.set_tags(run.run_id, {"device": device, "dtypes": ",".join(dtypes), "model": cfg.model})
        points = profile_sweep.sweep_points(
            cfg.prompt_lengths, cfg.batch_sizes, dtypes, cfg.prefill_chunk_sizes,
            cfg.max_new_tokens_values,
        )
        show_steps = steps_swept(points)
        bar, bar_task = _profile_progress(len(points)) if show_progress else (None, None)

        journal = Path(workdir) / "profile_points.jsonl"

        def on_point(index: int, total: int, row: dict) -> None:
            # kept at once, so a crash or Ctrl-C keeps every finished point (also untracked)
            with open(journal, "a", encoding="utf-8") as out:
                out.write(json.dumps(row, default=str) + "\n")
                out.flush()
                os.fsync(out.fileno())
            label = point_label(row, show_steps)
            child = run.tracker.start_run(f"profile {label}", run.run_id, {
                "stage": "profile_point", "random_weights": row["random_weights"],
                "child_process": row["child_process"],
                **({"error": row["error"]} if row["failed"] else {}),
            })
            run.tracker.log_params(child, {k: str(row[k]) for k in (
                "model", "prompt_tokens", "batch_size", "dtype", "prefill_chunk_size",
                "max_new_tokens", "device", "random_weights",
            )})
            run.tracker.log_metrics(child, _scalars(row))
            if not row["failed"]:
                run.tracker.log_metric_series(child, "decode_step_ms", row["decode_ms"])
            run.tracker.end_run(child, "FAILED" if row["failed"] else "FINISHED")
            if bar is not None:
                bar.update(bar_task, advance=1, description=label + (" FAILED" if row["failed"] else ""))
                bar.refresh()

        if bar is not None:
            bar.start()
            bar.refresh()
        try:
            rows = run_sweep(
                cfg.model, points, repeats=cfg.repeats, warmup=cfg.warmup, device=device,
                num_layers=cfg.num_layers, on_point=on_point,
            )
        finally:
            if bar is not None:
                bar.stop()
        path = Path(workdir) / "profile_points.json"
        path.write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")
        run.tracker.log_artifact(run.run_id, path)
        for png in write_profile_plots(rows, Path(workdir) / "profile_plots"):
            run.tracker.log_artifact(run.run_id, png, "plots")
        ok = [r for r in rows if not r["failed"]]
        failed = len(rows) - len(ok)
        if ok:
            run.tracker.set_tags(run.run_id, {"attn_implementation": str(ok[0]["attn_implementation"])})
        run.tracker.log_metrics(run.run_id, {"profile_points": len(rows), "profile_failed_points": failed})
        if not ok:
            raise ProfileSweepFailed(f"every profile point failed; first: {rows[0]['error']}", rows)
        headline = {k: ok[0].get(k) for k in PROFILE_HEADLINE}
        run.tracker.log_metrics(run.run_id, headline)
        return {"points": rows, "headline": headline, "failed_points": failed, "mlflow_run_id": run.run_id}


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
        logger = _logger()
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


def _logger():
    try:
        return get_run_logger()
    except Exception:  # outside a Prefect run (plain call in a test)
        return logging.getLogger("infermeter.stream")


async def _stream_level(endpoint: Endpoint, key: str, level_args: dict):
    client = make_client(endpoint.base_url, key, endpoint.request_timeout_s, level_args["max_concurrency"])
    try:
        return await run_level(client, **level_args)
    finally:
        await client.close()


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
