"""`infermeter capacity`: the highest request rate an endpoint serves within its SLOs.

Builds a ``CapacityFlowConfig`` from YAML (``--config``) and the flags, checks what can be
checked before any request (exit 2, one line: no SLO, a bad endpoint or dataset), runs the flow
(``flows.capacity``), writes ``--json`` (``{"capacity": CapacityResult.to_dict(), "levels":
[...], "mlflow_run_id"}``) and prints one row per level, then the capacity, its bracket, why the
search stopped and why the last failing level failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.commands.stream import check_endpoint_config
from flows.shared.common import (
    JsonOption,
    NoTrackOption,
    apply_overrides,
    check_embedded_engine,
    fail_input,
    load_or_fail,
    parse_slos,
    run_flow,
)
from flows.shared.options import (
    ApiKeyEnvOption,
    CaBundleOption,
    EngineOption,
    InputLenOption,
    MaxTokensOption,
    NumRequestsOption,
    OutputLenOption,
    SeedOption,
    TokenizerOption,
    WarmupOption,
)
from flows.shared.workload import (
    KeepCacheOption,
    PrefixGroupsOption,
    PrefixLenOption,
    PrefixPopularityOption,
    RepeatsOption,
    SaltOption,
    check_dataset,
    workload_overrides,
)
from flows.tables.common import console, fmt_value, make_table, print_run_links
from tasks.config import CapacityFlowConfig


def command(
    goodput: Annotated[
        Optional[str], typer.Option(help="SLOs, e.g. ttft_ms:500,tpot_ms:50 (required here or in --config).")
    ] = None,
    target: Annotated[
        Optional[float], typer.Option(help="Goodput fraction a rate must reach (default 0.95).")
    ] = None,
    max_levels: Annotated[
        Optional[int], typer.Option(help="Most levels in all, synchronous and saturation included.")
    ] = None,
    tolerance_pct: Annotated[
        Optional[float], typer.Option(help="Stop when the bracket is within this % (default 5).")
    ] = None,
    base_url: Annotated[
        Optional[str], typer.Option(help="OpenAI-compatible base URL (…/v1); none = the embedded server.")
    ] = None,
    engine: EngineOption = None,
    model: Annotated[Optional[str], typer.Option(help="Model name sent (required with --base-url).")] = None,
    api_key_env: ApiKeyEnvOption = None,
    ca_bundle: CaBundleOption = None,
    tokenizer: TokenizerOption = None,
    api: Annotated[Optional[str], typer.Option(help="chat (default), completions or responses.")] = None,
    num_requests: NumRequestsOption = None,
    warmup: WarmupOption = None,
    repeats: RepeatsOption = None,
    max_tokens: MaxTokensOption = None,
    input_len: InputLenOption = None,
    output_len: OutputLenOption = None,
    dataset: Annotated[
        Optional[str],
        typer.Option(
            help="Workload file: sharegpt:PATH, jsonl:PATH or sharegpt-multiturn:PATH (conversations)."
        ),
    ] = None,
    prefix_groups: PrefixGroupsOption = None,
    prefix_len: PrefixLenOption = None,
    prefix_popularity: PrefixPopularityOption = None,
    keep_cache: KeepCacheOption = False,
    salt: SaltOption = None,
    burstiness: Annotated[
        Optional[float], typer.Option(help="Gamma shape of the arrivals: 1 = Poisson.")
    ] = None,
    seed: SeedOption = None,
    client_processes: Annotated[Optional[int], typer.Option(help="Client processes per level.")] = None,
    client_bound_tolerance_ms: Annotated[
        Optional[float], typer.Option(help="Client-bound above this event-loop lag p99 (ms, default 1).")
    ] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML config (CapacityFlowConfig).")] = None,
    json_path: JsonOption = None,
    no_track: NoTrackOption = False,
) -> None:
    """Find the highest request rate an endpoint serves within its SLOs: the rate whose goodput
    fraction still meets the target."""
    cfg = load_or_fail(config, CapacityFlowConfig)
    cfg = apply_overrides(
        cfg, "capacity", {"target": target, "max_levels": max_levels, "tolerance_pct": tolerance_pct}
    )
    cfg = apply_overrides(
        cfg,
        "endpoint",
        {
            "base_url": base_url,
            "model": model,
            "api_key_env": api_key_env,
            "tokenizer": tokenizer,
            "ca_bundle": ca_bundle,
        },
    )
    cfg = apply_overrides(cfg, "server", {"engine": engine})
    cfg = apply_overrides(
        cfg,
        "stream",
        {
            "goodput": parse_slos(goodput),
            "api": api,
            "num_requests": num_requests,
            "warmup": warmup,
            "repeats": repeats,
            "max_tokens": max_tokens,
            "input_len": input_len,
            "output_len": output_len,
            "dataset": dataset,
            "burstiness": burstiness,
            "seed": seed,
            "client_processes": client_processes,
            "client_bound_tolerance_ms": client_bound_tolerance_ms,
            **workload_overrides(
                prefix_groups=prefix_groups,
                prefix_len=prefix_len,
                prefix_popularity=prefix_popularity,
                turns=None,
                think_time_s=None,
                think_time_dist=None,
                keep_cache=keep_cache,
                salt=salt,
            ),
        },
    )
    if not cfg.stream.goodput:
        fail_input("--goodput: the capacity search needs SLOs, e.g. --goodput ttft_ms:500,tpot_ms:50")
    if cfg.stream.turns or (cfg.stream.dataset or "").startswith("sharegpt-multiturn:"):
        # its rate would start conversations of several requests each while its bracket is
        # measured in requests/s: one figure in two units
        fail_input(
            "capacity searches a request rate; a conversation's turns follow their replies, so a "
            "rate of conversations is not one: measure them with `infermeter stream --turns N "
            "--request-rate R` (or --dataset sharegpt-multiturn:PATH) at the rates you want"
        )
    check_dataset(cfg, input_len and not (cfg.stream.prefix_groups or cfg.stream.turns), allow_trace=False)
    check_endpoint_config(cfg)
    check_embedded_engine(cfg)

    from flows.capacity import capacity

    _, result = run_flow(
        "capacity", capacity, cfg, track=not no_track, json_path=json_path, json_keys=("capacity", "levels")
    )
    if result["capacity"]:
        print_capacity(result["capacity"])
    print_run_links(result)
    if result["error"]:
        typer.echo(f"capacity failed: {result['error']}", err=True)
        raise typer.Exit(1)


def print_capacity(capacity: dict) -> None:
    """One row per level, then the answer and why the search stopped."""
    from tasks.report.plots import rate_label

    columns = [
        ("goodput_fraction", "goodput\nfraction"),
        ("requests_per_s", "req/s"),
        ("output_tokens_per_s", "tok/s"),
        ("ttft_ms_p99", "TTFT\np99"),
        ("tpot_ms_p99", "TPOT\np99"),
        ("num_errors", "errors"),
        ("client_loop_lag_ms_p99", "lag\np99"),
    ]
    table = make_table(
        "infermeter capacity (ms)",
        [(title, "right") for title in ("level", "rate", "conc", *(t for _, t in columns))],
        compact=True,
    )
    table.add_column("pass", no_wrap=True)
    for lv in capacity["levels"]:
        m = lv["metrics"]
        table.add_row(
            {"synchronous": "sync", "saturation": "saturate"}.get(lv["kind"], lv["kind"]),
            rate_label(lv["request_rate"]),
            str(lv["max_concurrency"]),
            *(fmt_value(m.get(key)) for key, _ in columns),
            "yes" if lv["passed"] else "NO",
        )
    console.print(table)
    rate, tokens = capacity["capacity_requests_per_s"], capacity["capacity_output_tokens_per_s"]
    console.print(
        f"capacity: {fmt_value(rate)} req/s, {fmt_value(tokens)} output tokens/s; bracket "
        f"[{', '.join(fmt_value(v) for v in capacity['bracket_requests_per_s'] or ())}] req/s",
        highlight=False,
    )
    console.print(f"stopped: {capacity['stop_reason']}", highlight=False)
    if capacity["last_failure"]:
        console.print(f"last failing level: {capacity['last_failure']}", highlight=False)
