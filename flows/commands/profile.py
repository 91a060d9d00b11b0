"""`infermeter profile`: the profile flow from the command line.

Builds the config from YAML (``--config``, an audit-shaped file; only its ``profile`` and
``tracking`` parts are used) and the flags, checks what can be checked before anything is
loaded (exit 2, one line: a spec that does not resolve, an unknown preset, a dtype the device
cannot run, a prompt longer than the model's context), runs the flow (``flows.profile``) with a
progress bar between points, writes ``--json`` (``{"points": [...], "mlflow_run_id": ...}``)
and prints one table row per point. A point that failed (memory check, error) is in the points
with ``failed`` and ``error``; the command then exits 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.shared.common import (
    JsonOption,
    NoTrackOption,
    apply_overrides,
    check_hf_model,
    fail_input,
    load_or_fail,
    parse_list,
    run_flow,
)
from flows.shared.fanout import TaskRunnerOption, check_task_runner
from flows.tables.common import console, fmt_value, make_table, print_run_links
from tasks.config import AuditConfig, ProfileFlowConfig

# torch, transformers and the flow are imported inside the functions that run it, so
# `infermeter --help` stays fast.


def load_profile_config(path: Path | None) -> ProfileFlowConfig:
    """The profile flow's config from an audit-shaped YAML (None: the defaults): its
    ``profile`` and ``tracking`` parts, and the run name ``profile`` (``<name>-profile`` when
    the file names its audit). Exits 2 with one line on error."""
    audit = load_or_fail(path, AuditConfig)
    return ProfileFlowConfig(
        name=f"{audit.name}-profile" if audit.name != "audit" else "profile",
        profile=audit.profile,
        tracking=audit.tracking,
    )


def check_input(cfg: ProfileFlowConfig) -> None:
    """Exit 2 with one line for what fails before loading: the spec, the preset, the device,
    a dtype the device cannot run, a prompt length over the model's context."""
    from tasks.models.sources import ModelSourceError
    from tasks.profile.grid import check_request

    p = cfg.profile
    check_hf_model(p.model, "--model")
    try:
        check_request(p.model, p.dtypes, p.prompt_lengths, p.max_new_tokens_values, p.device, p.num_layers)
    except ModelSourceError as exc:
        fail_input(f"--model: {exc}")
    except ValueError as exc:
        fail_input(str(exc))


def check_breakdown(cfg: ProfileFlowConfig) -> None:
    """--breakdown needs decoder layers it can find: checked on the model built on the meta
    device (no weights); exit 2 with the one line naming what it looked for."""
    from tasks.profile.breakdown import DecoderLayersNotFound, check_decoder_layers

    try:
        check_decoder_layers(cfg.profile.model, cfg.profile.num_layers)
    except DecoderLayersNotFound as exc:
        fail_input(str(exc))


def command(
    model: Annotated[
        Optional[str],
        typer.Option(
            help="gguf:default, gguf:PATH, hf:PATH_OR_ID, arch:NAME (smollm2-135m, llama-2-7b, llama-3-8b) or arch:PATH/config.json."
        ),
    ] = None,
    prompt_lengths: Annotated[
        Optional[str], typer.Option(help="Prompt lengths in tokens, e.g. 32,128,512.")
    ] = None,
    batch_sizes: Annotated[Optional[str], typer.Option(help="Batch sizes, e.g. 1,4.")] = None,
    dtypes: Annotated[
        Optional[str], typer.Option(help="float32, bfloat16, float16 (default: the model's).")
    ] = None,
    max_new_tokens: Annotated[
        Optional[str],
        typer.Option(
            help="Decode steps per point, each one token after the prefill's first (EOS ignored); a list sweeps it, e.g. 8,32."
        ),
    ] = None,
    prefill_chunk_sizes: Annotated[
        Optional[str], typer.Option(help="Chunked prefill sizes in tokens; 0 = none, e.g. 0,64,256.")
    ] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda.")] = None,
    repeats: Annotated[Optional[int], typer.Option(help="Timed repeats per point (median reported).")] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Untimed warm-up runs per point.")] = None,
    num_layers: Annotated[Optional[int], typer.Option(help="arch: only: keep the first N layers.")] = None,
    config: Annotated[
        Optional[Path], typer.Option(help="YAML config (audit-shaped; its profile/tracking parts).")
    ] = None,
    breakdown: Annotated[
        Optional[bool],
        typer.Option(
            "--breakdown/--no-breakdown",
            help="Per-part time of one profiled prefill and decode steps (torch.profiler, apart from the timed repeats) and the roofline.",
        ),
    ] = None,
    task_runner: TaskRunnerOption = None,
    json_path: JsonOption = None,
    no_track: NoTrackOption = False,
) -> None:
    """Profile a model on this machine: where prefill and decode time go, and how much memory its
    weights and KV cache take."""
    cfg = load_profile_config(config)
    if device is not None and device not in ("auto", "cpu", "cuda"):
        fail_input(f"--device: {device!r} is not one of auto, cpu, cuda")
    cfg = apply_overrides(
        cfg,
        "profile",
        {
            "model": model,
            "prompt_lengths": parse_list("--prompt-lengths", prompt_lengths, int),
            "batch_sizes": parse_list("--batch-sizes", batch_sizes, int),
            "dtypes": parse_list("--dtypes", dtypes, str),
            "prefill_chunk_sizes": parse_list("--prefill-chunk-sizes", prefill_chunk_sizes, int),
            "max_new_tokens": parse_list("--max-new-tokens", max_new_tokens, int),
            "device": device,
            "repeats": repeats,
            "warmup": warmup,
            "num_layers": num_layers,
            "breakdown": breakdown,
            "task_runner": task_runner,
            "enabled": True,
        },
    )
    check_input(cfg)
    check_task_runner(cfg.profile.task_runner)
    if cfg.profile.breakdown:
        check_breakdown(cfg)

    from flows.profile import profile

    _, result = run_flow(
        "profile",
        profile,
        cfg,
        track=not no_track,
        show_progress=True,
        json_path=json_path,
        json_keys=("points",),
    )
    if result["points"]:
        print_points(result["points"])
        if cfg.profile.breakdown:
            from flows.tables.breakdown import print_analysis

            print_analysis(result["points"])
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


_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def print_points(points: list[dict]) -> None:
    """One row per point: times in ms, rates per second, sizes in MiB; a T column
    (max_new_tokens) when more than one value was swept."""
    from tasks.profile.grid import steps_swept

    steps = steps_swept(points)
    mib = 2**20
    titles = (
        "N",
        "B",
        "dtype",
        "chunk",
        *(("T",) if steps else ()),
        "prefill",
        "decode",
        "tok/s",
        "KV",
        "KV calc",
        "peak",
    )
    table = make_table(
        "infermeter profile (ms, tokens/s, MiB)",
        [(title, "left" if title == "dtype" else "right") for title in titles],
        compact=True,
        no_wrap=True,
    )
    for p in points:
        head = [
            str(p["prompt_tokens"]),
            str(p["batch_size"]),
            _SHORT_DTYPE.get(p["dtype"], p["dtype"]),
            str(p["prefill_chunk_size"]),
            *((str(p["max_new_tokens"]),) if steps else ()),
        ]
        if p["failed"]:
            table.add_row(*head, "FAILED", *[""] * 5)
            continue
        table.add_row(
            *head,
            fmt_value(p["prefill_ms"]),
            fmt_value(p["decode_ms_p50"]),
            fmt_value(p["decode_tokens_per_s"]),
            fmt_value(p["kv_cache_bytes"], scale=mib),
            fmt_value(p["kv_cache_bytes_formula"], scale=mib),
            fmt_value(p["peak_memory_bytes"], scale=mib),
        )
    console.print(table)
    first = next((p for p in points if not p["failed"]), None)
    if first:
        console.print(
            f"prefill = local TTFT; decode = p50 per step; {'T = max_new_tokens; ' if steps else ''}"
            f"KV calc = GQA-aware formula; weights "
            f"{first['weights_bytes'] / mib:,.1f} MiB; the seed's hidden_size KV form is "
            f"{first['kv_seed_formula_ratio']:.2f}x the formula",
            highlight=False,
        )
