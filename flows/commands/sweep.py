"""`infermeter sweep`: the sampling sweep flow from the command line.

Builds the config from YAML (``--config``, sweep-shaped: ``SweepFlowConfig``) and the flags,
runs the flow (``flows.sweep``) against the embedded llama.cpp server by default, a remote
endpoint with --base-url, or the local model with --target local, writes ``--json``
(``{"points", "headline", "mlflow_run_id"}``, plus ``"distribution"`` when a local sweep takes
the sampler's view) and prints one table row per point, and how many points a rerun skipped as
already finished (after the sampler's view, one table per temperature).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.shared.common import (
    ENDPOINT_FLAGS,
    JsonOption,
    NoTrackOption,
    apply_overrides,
    check_embedded_engine,
    check_hf_model,
    check_remote_endpoint,
    fail_input,
    load_or_fail,
    parse_list,
    run_flow,
    write_json,
)
from flows.shared.fanout import TaskRunnerOption, check_task_runner, compare_workers, print_comparison
from flows.shared.options import CaBundleOption
from flows.tables.common import console, fmt_value, make_table, print_run_links
from flows.tables.distribution import print_distribution
from tasks.config import SweepFlowConfig


def command(
    config: Annotated[
        Optional[Path],
        typer.Option(help="YAML config (sweep, endpoint, server, tracking; see configs/sweep.yaml)."),
    ] = None,
    temperature: Annotated[
        Optional[str], typer.Option(help="Temperatures, e.g. 0,0.7,1.2 (each in [0, 2]).")
    ] = None,
    top_p: Annotated[Optional[str], typer.Option(help="top_p values, e.g. 0.9,1.0 (each in (0, 1]).")] = None,
    top_k: Annotated[Optional[str], typer.Option(help="top_k values, e.g. 0,40 (0 = off; >= 0).")] = None,
    samples: Annotated[
        Optional[int], typer.Option(help="Samples per point (>= 1); sample i uses seed + i.")
    ] = None,
    seed: Annotated[Optional[int], typer.Option(help="Base seed.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="max_completion_tokens per sample.")] = None,
    max_concurrency: Annotated[
        Optional[int], typer.Option(help="Requests in flight across the sweep.")
    ] = None,
    prompt: Annotated[Optional[str], typer.Option(help="The prompt every sample gets.")] = None,
    target: Annotated[Optional[str], typer.Option(help="endpoint (default) or local (transformers).")] = None,
    base_url: Annotated[
        Optional[str],
        typer.Option(help="OpenAI-compatible base URL (default: the embedded server, --engine)."),
    ] = None,
    engine: Annotated[
        Optional[str], typer.Option(help="Embedded server: llamacpp (default) or vllm (needs `make vllm`).")
    ] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name sent to --base-url.")] = None,
    api_key_env: Annotated[
        Optional[str], typer.Option(help="NAME of the env variable holding the key.")
    ] = None,
    ca_bundle: CaBundleOption = None,
    no_resume: Annotated[
        bool, typer.Option("--no-resume", help="Run every point, even finished ones.")
    ] = False,
    distribution: Annotated[
        Optional[bool],
        typer.Option(
            "--distribution/--no-distribution",
            help="--target local: the sampler's view (top-20 next tokens per temperature, the "
            "top_p nucleus, entropy) at the first decode steps (default on).",
        ),
    ] = None,
    distribution_steps: Annotated[
        Optional[int], typer.Option(help="Decode steps of the sampler's view (1..64, default 3).")
    ] = None,
    task_runner: TaskRunnerOption = None,
    compare_workers_: Annotated[
        Optional[str],
        typer.Option(
            "--compare-workers",
            help="With --task-runner dask: run the sweep once per Dask LocalCluster size (e.g. "
            "1,2) and print wall time and the points' figures side by side.",
        ),
    ] = None,
    json_path: JsonOption = None,
    no_track: NoTrackOption = False,
) -> None:
    """Sweep sampling parameters (temperature, top_p, top_k, seed) to see what they do to the
    output and to speed."""
    cfg = load_or_fail(config, SweepFlowConfig)
    cfg = apply_overrides(
        cfg,
        "sweep",
        {
            "temperature": parse_list("--temperature", temperature, float),
            "top_p": parse_list("--top-p", top_p, float),
            "top_k": parse_list("--top-k", top_k, int),
            "samples": samples,
            "seed": seed,
            "max_tokens": max_tokens,
            "max_concurrency": max_concurrency,
            "prompt": prompt,
            "target": target,
            "distribution": distribution,
            "distribution_steps": distribution_steps,
            "task_runner": task_runner,
        },
    )
    if distribution and cfg.sweep.target != "local":  # the view reads the local model's logits
        fail_input("--distribution needs --target local (an endpoint does not return the logits)")
    cfg = apply_overrides(
        cfg,
        "endpoint",
        {"base_url": base_url, "model": model, "api_key_env": api_key_env, "ca_bundle": ca_bundle},
    )
    cfg = apply_overrides(cfg, "server", {"engine": engine})
    if cfg.sweep.target != "local":
        check_embedded_engine(cfg)
        check_remote_endpoint(cfg, ENDPOINT_FLAGS)
    else:
        check_hf_model(cfg.sweep.local_model, "sweep.local_model")
    check_task_runner(cfg.sweep.task_runner)
    counts = parse_list("--compare-workers", compare_workers_, int)
    if counts and (not cfg.sweep.task_runner.startswith("dask") or any(n < 1 for n in counts)):
        fail_input("--compare-workers: give worker counts >= 1 (e.g. 1,2) with --task-runner dask")
    if no_resume or counts:  # a comparison measures every point on every cluster size
        cfg = apply_overrides(cfg, None, {"resume": False})
    from flows.sweep import sweep

    if counts:
        rows = compare_workers(
            counts,
            lambda runner: run_flow(
                "sweep", sweep, apply_overrides(cfg, "sweep", {"task_runner": runner}), track=not no_track
            )[1],
        )
        print_comparison(rows)
        write_json(json_path, {"comparison": rows})
        raise typer.Exit(1 if any(row["error"] for row in rows) else 0)

    viewed = cfg.sweep.target == "local" and cfg.sweep.distribution  # --json key only then
    _, result = run_flow(
        "sweep",
        sweep,
        cfg,
        track=not no_track,
        json_path=json_path,
        json_keys=("points", "headline", "distribution") if viewed else ("points", "headline"),
    )
    if result.get("distribution"):
        print_distribution(result["distribution"])
    print_points(result["points"])
    headline = result["headline"]
    if headline:
        console.print(
            f"points: {headline['sweep_points']}, skipped (already finished): "
            f"{headline['sweep_points_skipped']}, failed: {headline['sweep_points_failed']}"
        )
    print_run_links(result)
    if result["error"]:
        typer.echo(f"sweep failed: {result['error']}", err=True)
        raise typer.Exit(1)


#: point key -> column header of the sweep table
_COLUMNS = {
    "temperature": "T",
    "top_p": "top_p",
    "top_k": "top_k",
    "status": "status",
    "identical_fraction": "identical",
    "distinct_2": "distinct-2",
    "output_tokens_mean": "tokens",
    "ttft_ms_mean": "TTFT ms",
    "determinism_violated": "det. violated",
}


def print_points(points: list[dict]) -> None:
    """One row per sampling point: its settings, status (with the error class of a failed
    one), determinism and diversity figures, mean output tokens and TTFT (ms)."""
    table = make_table(
        "infermeter sweep",
        [(header, "left" if key == "status" else "right") for key, header in _COLUMNS.items()],
        compact=True,
    )
    for p in points:
        status = p["status"] + (f" ({p['error_class']})" if p.get("error_class") else "")
        table.add_row(*(status if k == "status" else fmt_value(p.get(k), ",.3g") for k in _COLUMNS))
    console.print(table)
    for p in points:  # why a greedy point's first (cold) answer differed: not the sampler
        if p.get("determinism_note"):
            console.print(
                f"T={p['temperature']} top_p={p.get('top_p')}: {p['determinism_note']}", highlight=False
            )
