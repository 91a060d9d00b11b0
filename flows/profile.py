"""The single-stage `profile` flow and the `infermeter profile` command.

The flow runs the profile stage (``tasks.pipeline.profile_stage``, the same task the audit's
local stage runs) under one MLflow parent run: parent -> ``profile`` child -> one child per
sweep point (prompt length x batch size x dtype x prefill chunk size x max_new_tokens), with
the points as
``profile_points.json`` and four PNG plots under ``plots/`` on the ``profile`` run.

The command builds the config from YAML (``--config``, an audit-shaped file; only its
``profile`` and ``tracking`` parts are used) and the flags, checks what can be checked before
anything is loaded (exit 2, one line: a spec that does not resolve, an unknown preset, a dtype
the device cannot run, a prompt longer than the model's context), runs the flow with a progress
bar between points, writes ``--json`` (``{"points": [...], "mlflow_run_id": ...}``) and prints
one table row per point. A point that failed (memory check, error) is in the points with
``failed`` and ``error``; the command then exits 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from prefect import flow, get_run_logger
from prefect.states import Completed, Failed
from rich.table import Table

from flows.cli_common import (
    apply_overrides, console, fail_input, load_or_fail, parse_list, print_run_links, run_flow,
)
from tasks.config import AuditConfig

# torch, transformers and tasks.pipeline are imported inside the functions that run the flow,
# so `infermeter --help` stays fast.

_SECTIONS = ("profile", "tracking")


def run_profile(config: AuditConfig, track: bool = True, show_progress: bool = False) -> dict:
    """The flow's body: ``{"points", "headline", "error", "mlflow_run_id", "workdir",
    "ui_command"}`` (``error`` None, or why the stage failed)."""
    from flows.stage_runs import finish_parent, new_workdir, run_tags, start_parent
    from tasks.models import resolve
    from tasks.pipeline import ProfileSweepFailed, profile_stage
    from tasks.tracking import TrackingTarget

    logger = get_run_logger()
    target = TrackingTarget(config.tracking.experiment, None, config.tracking.enabled and track)
    tracker, parent = start_parent(
        target, f"{config.name}-profile" if config.name != "audit" else "profile",
        config.model_dump(mode="json", include=set(_SECTIONS)),
        run_tags("profile", {"model": config.profile.model,
                             "random_weights": resolve(config.profile.model).random_weights}),
    )
    workdir = new_workdir("profile")
    logger.info("MLflow run %s; records in %s", parent or "(not tracked)", workdir)
    result: dict = {"points": [], "headline": {}, "error": None}
    try:
        stage = profile_stage(config.profile, target, parent, str(workdir), show_progress=show_progress)
        result.update(points=stage["points"], headline=stage["headline"])
    except ProfileSweepFailed as exc:
        result.update(points=exc.points, error=str(exc))
    except Exception as exc:  # recorded on the parent; the command exits 1
        result["error"] = f"{type(exc).__name__}: {exc}"
    if result["error"]:
        logger.error("profile failed: %s", result["error"])
    failed = sum(1 for point in result["points"] if point["failed"])
    summary = (f"# infermeter profile\n\n{config.profile.model}: {len(result['points'])} points, "
               f"{failed} failed\n" + (f"\nfailed: {result['error']}\n" if result["error"] else ""))
    finish_parent(tracker, parent, result["headline"], result["error"], summary)
    return {**result, "mlflow_run_id": parent, "workdir": str(workdir),
            "ui_command": tracker.ui_command() if parent else None}


@flow(name="profile", log_prints=True)
def profile(config: AuditConfig = AuditConfig(), track: bool = True, show_progress: bool = False):
    """Profile prefill and decode inside a model over prompt length x batch x dtype x chunk."""
    result = run_profile(config, track, show_progress)
    if result["error"]:
        return Failed(message=result["error"], data=result)
    return Completed(data=result)


def check_input(cfg: AuditConfig) -> None:
    """Exit 2 with one line for what fails before loading: the spec, the preset, the device,
    a dtype the device cannot run, a prompt length over the model's context."""
    from tasks.models import ModelSourceError
    from tasks.profile.grid import check_request

    p = cfg.profile
    try:
        check_request(p.model, p.dtypes, p.prompt_lengths, p.max_new_tokens_values, p.device, p.num_layers)
    except ModelSourceError as exc:
        fail_input(f"--model: {exc}")
    except ValueError as exc:
        fail_input(str(exc))


def command(
    model: Annotated[Optional[str], typer.Option(help="gguf:default, gguf:PATH, hf:PATH_OR_ID, arch:NAME (smollm2-135m, llama-2-7b, llama-3-8b) or arch:PATH/config.json.")] = None,
    prompt_lengths: Annotated[Optional[str], typer.Option(help="Prompt lengths in tokens, e.g. 32,128,512.")] = None,
    batch_sizes: Annotated[Optional[str], typer.Option(help="Batch sizes, e.g. 1,4.")] = None,
    dtypes: Annotated[Optional[str], typer.Option(help="float32, bfloat16, float16 (default: the model's).")] = None,
    max_new_tokens: Annotated[Optional[str], typer.Option(help="Decode steps per point, each one token after the prefill's first (EOS ignored); a list sweeps it, e.g. 8,32.")] = None,
    prefill_chunk_sizes: Annotated[Optional[str], typer.Option(help="Chunked prefill sizes in tokens; 0 = none, e.g. 0,64,256.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda.")] = None,
    repeats: Annotated[Optional[int], typer.Option(help="Timed repeats per point (median reported).")] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Untimed warm-up runs per point.")] = None,
    num_layers: Annotated[Optional[int], typer.Option(help="arch: only: keep the first N layers.")] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML config (audit-shaped; its profile/tracking parts).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the result here.")] = None,
    no_track: Annotated[bool, typer.Option("--no-track", help="Do not record in MLflow.")] = False,
) -> None:
    """Profile prefill / decode, weights and KV cache inside a model, on this machine."""
    cfg = load_or_fail(config, AuditConfig)
    if device is not None and device not in ("auto", "cpu", "cuda"):
        fail_input(f"--device: {device!r} is not one of auto, cpu, cuda")
    cfg = apply_overrides(cfg, "profile", {
        "model": model,
        "prompt_lengths": parse_list("--prompt-lengths", prompt_lengths, int),
        "batch_sizes": parse_list("--batch-sizes", batch_sizes, int),
        "dtypes": parse_list("--dtypes", dtypes, str),
        "prefill_chunk_sizes": parse_list("--prefill-chunk-sizes", prefill_chunk_sizes, int),
        "max_new_tokens": parse_list("--max-new-tokens", max_new_tokens, int),
        "device": device, "repeats": repeats, "warmup": warmup,
        "num_layers": num_layers, "enabled": True,
    })
    check_input(cfg)

    _, result = run_flow("profile", profile, cfg, track=not no_track, show_progress=True,
                         json_path=json_path, json_keys=("points",))
    if result["points"]:
        print_points(result["points"])
    print_run_links(result)
    failed = [p for p in result["points"] if p["failed"]]
    for point in failed:
        typer.echo(f"point {_label(point, result['points'])} failed: {point['error']}", err=True)
    if result["error"] and not failed:
        typer.echo(f"profile failed: {result['error']}", err=True)
    if result["error"] or failed:
        raise typer.Exit(1)


def _label(point: dict, points: list[dict]) -> str:
    from tasks.profile.grid import point_label, steps_swept

    return point_label(point, steps_swept(points))


def _fmt(value, scale: float = 1.0) -> str:
    if value is None:
        return "n/a"
    value = value / scale
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def print_points(points: list[dict]) -> None:
    """One row per point: times in ms, rates per second, sizes in MiB; a T column
    (max_new_tokens) when more than one value was swept."""
    from rich import box

    from tasks.profile.grid import steps_swept

    steps = steps_swept(points)
    mib = 2**20
    table = Table(title="infermeter profile (ms, tokens/s, MiB)", header_style="bold",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    titles = ("N", "B", "dtype", "chunk", *(("T",) if steps else ()), "prefill", "decode", "tok/s",
              "KV", "KV calc", "peak")
    for title in titles:
        table.add_column(title, justify="left" if title == "dtype" else "right", no_wrap=True)
    for p in points:
        head = [str(p["prompt_tokens"]), str(p["batch_size"]), _SHORT_DTYPE.get(p["dtype"], p["dtype"]),
                str(p["prefill_chunk_size"]), *((str(p["max_new_tokens"]),) if steps else ())]
        if p["failed"]:
            table.add_row(*head, "FAILED", *[""] * 5)
            continue
        table.add_row(
            *head, _fmt(p["prefill_ms"]), _fmt(p["decode_ms_p50"]), _fmt(p["decode_tokens_per_s"]),
            _fmt(p["kv_cache_bytes"], mib), _fmt(p["kv_cache_bytes_formula"], mib),
            _fmt(p["peak_memory_bytes"], mib),
        )
    console.print(table)
    first = next((p for p in points if not p["failed"]), None)
    if first:
        console.print(
            f"prefill = local TTFT; decode = p50 per step; {'T = max_new_tokens; ' if steps else ''}"
            f"KV calc = GQA-aware formula; weights "
            f"{first['weights_bytes'] / mib:,.1f} MiB; the seed's hidden_size KV form is "
            f"{first['kv_seed_formula_ratio']:.2f}x the formula", highlight=False,
        )
