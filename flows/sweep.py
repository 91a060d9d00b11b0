"""The sampling sweep alone: `infermeter sweep`.

One MLflow parent run per flow run, the sweep stage's child run under it, and one child per
point under that (params = the point, samples as a table). Against the embedded llama.cpp
server by default (started for the flow, stopped when it ends), a remote endpoint with
--base-url, or the local model with --target local. A rerun of the same config skips the points
already FINISHED (matched by point_key: the point, prompt, samples and the target's identity,
never its URL or port) and says how many it skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from prefect import flow
from prefect.states import Completed, Failed
from rich.table import Table

from flows.cli_common import (
    apply_overrides, check_embedded_engine, console, load_or_fail, parse_list, print_run_links, run_flow,
)
from flows.stage_runs import finish_parent, new_workdir, run_tags, start_parent
from tasks.config import SweepFlowConfig
from tasks.tracking import TrackingTarget


@flow(name="sweep", log_prints=True)
def sweep(config: SweepFlowConfig = SweepFlowConfig(), track: bool = True):
    """N samples per sampling point (temperature / top_p / top_k / seed / max_tokens)."""
    # imported here, not at the top: they pull in torch and transformers, which
    # `infermeter --help` does not need
    from tasks.report import summary as report
    from tasks.endpoint import open_endpoint
    from tasks.pipeline import sweep_stage

    target = TrackingTarget(config.tracking.experiment, None, config.tracking.enabled and track)
    local = config.sweep.target == "local"
    tracker, parent = start_parent(target, config.name, config.model_dump(mode="json"), run_tags("sweep", {
        "model": config.sweep.local_model if local else config.server.model,
        "endpoint": "local" if local else (config.endpoint.base_url or "embedded"),
    }))
    common = dict(target=target, parent_run_id=parent, workdir=str(new_workdir("sweep")),
                  resume=config.resume)
    result, error, kind = None, None, None
    try:
        if local:
            result = sweep_stage(config.sweep, None, **common)
        else:
            with open_endpoint(config.endpoint, config.server) as endpoint:
                kind = endpoint.server_kind
                tracker.set_tags(parent, endpoint.identity())
                result = sweep_stage(config.sweep, endpoint, **common)
    except Exception as exc:  # the stage run records the traceback; the parent the cause
        error = f"{type(exc).__name__}: {exc}"
    stages = {"sweep": result} if result else {}
    summary = report.summary_markdown(stages, {"sweep": error} if error else {}, kind)
    finish_parent(tracker, parent, (result or {}).get("headline", {}), error, summary)
    data = {"points": (result or {}).get("points", []), "headline": (result or {}).get("headline", {}),
            "error": error, "mlflow_run_id": parent,
            "ui_command": tracker.ui_command() if parent else None}
    return Failed(message=error, data=data) if error else Completed(data=data)


def _cell(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.3g}" if isinstance(value, float) else str(value)


def command(
    config: Annotated[Optional[Path], typer.Option(help="YAML config (sweep, endpoint, server, tracking; see configs/sweep.yaml).")] = None,
    temperature: Annotated[Optional[str], typer.Option(help="Temperatures, e.g. 0,0.7,1.2 (each in [0, 2]).")] = None,
    top_p: Annotated[Optional[str], typer.Option(help="top_p values, e.g. 0.9,1.0 (each in (0, 1]).")] = None,
    top_k: Annotated[Optional[str], typer.Option(help="top_k values, e.g. 0,40 (0 = off; >= 0).")] = None,
    samples: Annotated[Optional[int], typer.Option(help="Samples per point (>= 1); sample i uses seed + i.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Base seed.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="max_completion_tokens per sample.")] = None,
    max_concurrency: Annotated[Optional[int], typer.Option(help="Requests in flight across the sweep.")] = None,
    prompt: Annotated[Optional[str], typer.Option(help="The prompt every sample gets.")] = None,
    target: Annotated[Optional[str], typer.Option(help="endpoint (default) or local (transformers).")] = None,
    base_url: Annotated[Optional[str], typer.Option(help="OpenAI-compatible base URL (default: the embedded server, --engine).")] = None,
    engine: Annotated[Optional[str], typer.Option(help="Embedded server: llamacpp (default) or vllm (needs `make vllm`).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name sent to --base-url.")] = None,
    api_key_env: Annotated[Optional[str], typer.Option(help="NAME of the env variable holding the key.")] = None,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Run every point, even finished ones.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the result here.")] = None,
    no_track: Annotated[bool, typer.Option("--no-track", help="Do not record in MLflow.")] = False,
) -> None:
    """Sampling sweep: what temperature / top_p / top_k / seed do to the output and to speed."""
    cfg = load_or_fail(config, SweepFlowConfig)
    cfg = apply_overrides(cfg, "sweep", {
        "temperature": parse_list("--temperature", temperature, float),
        "top_p": parse_list("--top-p", top_p, float),
        "top_k": parse_list("--top-k", top_k, int),
        "samples": samples, "seed": seed, "max_tokens": max_tokens,
        "max_concurrency": max_concurrency, "prompt": prompt, "target": target,
    })
    cfg = apply_overrides(cfg, "endpoint", {"base_url": base_url, "model": model, "api_key_env": api_key_env})
    cfg = apply_overrides(cfg, "server", {"engine": engine})
    if cfg.sweep.target != "local":
        check_embedded_engine(cfg)
    if no_resume:
        cfg = apply_overrides(cfg, None, {"resume": False})
    _, result = run_flow("sweep", sweep, cfg, track=not no_track, json_path=json_path,
                         json_keys=("points", "headline"))
    table = Table(title="infermeter sweep", header_style="bold")
    columns = {"temperature": "T", "top_p": "top_p", "top_k": "top_k", "status": "status",
               "identical_fraction": "identical", "distinct_2": "distinct-2",
               "output_tokens_mean": "tokens", "ttft_ms_mean": "TTFT ms",
               "determinism_violated": "det. violated"}
    for key, header in columns.items():
        table.add_column(header, justify="left" if key == "status" else "right")
    for p in result["points"]:
        status = p["status"] + (f" ({p['error_class']})" if p.get("error_class") else "")
        table.add_row(*(status if k == "status" else _cell(p.get(k)) for k in columns))
    console.print(table)
    headline = result["headline"]
    if headline:
        console.print(f"points: {headline['sweep_points']}, skipped (already finished): "
                      f"{headline['sweep_points_skipped']}, failed: {headline['sweep_points_failed']}")
    print_run_links(result)
    if result["error"]:
        typer.echo(f"sweep failed: {result['error']}", err=True)
        raise typer.Exit(1)
