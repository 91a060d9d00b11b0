"""`infermeter stream`: the stream flow from the command line.

Builds the config from YAML (``--config``: stream-shaped, ``StreamFlowConfig``, or
audit-shaped, whose ``stream``, ``endpoint``, ``server`` and ``tracking`` parts are used) and
the flags, checks what can be checked before any request (exit 2, one line), runs the flow
(``flows.stream``), writes ``--json``
(``{"levels": [{"max_concurrency", "request_rate", "metrics", "requests"}], "mlflow_run_id"}``)
and prints one table row per level.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.shared.common import (
    ENDPOINT_FLAGS,
    JsonOption,
    NoTrackOption,
    apply_overrides,
    check_embedded_engine,
    check_remote_endpoint,
    fail_input,
    load_or_fail,
    parse_list,
    parse_slos,
    rate,
    run_flow,
)
from flows.shared.fanout import check_task_runner
from flows.shared.options import (
    ApiKeyEnvOption,
    CaBundleOption,
    EngineOption,
    GoodputOption,
    InputLenOption,
    MaxConcurrencyOption,
    MaxTokensOption,
    NumRequestsOption,
    OutputLenOption,
    RequestRateOption,
    SeedOption,
    TokenizerOption,
    WarmupOption,
)
from flows.shared.stream_writer import start_stream_writer
from flows.shared.workload import (
    KeepCacheOption,
    PrefixGroupsOption,
    PrefixLenOption,
    PrefixPopularityOption,
    RepeatsOption,
    SaltOption,
    ThinkTimeDistOption,
    ThinkTimeOption,
    TurnsOption,
    check_dataset,
    workload_overrides,
)
from flows.tables.common import console, fmt_interval, fmt_value, make_table, print_run_links
from flows.tables.stream import print_cache, print_outcomes, print_turns
from tasks.config import AuditConfig, StreamFlowConfig


def load_stream_config(path: Path | None) -> StreamFlowConfig:
    """A stream-shaped YAML (stream, endpoint, server, tracking, name), or an audit-shaped one
    (its stream / endpoint / server / tracking parts are used). Exits 2 with one line on error."""
    if path is not None and path.is_file():
        import yaml

        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError):  # load_or_fail below names what is wrong
            data = None
        if isinstance(data, dict) and set(data) - set(StreamFlowConfig.model_fields):
            audit = load_or_fail(path, AuditConfig)
            return StreamFlowConfig(
                stream=audit.stream, endpoint=audit.endpoint, server=audit.server, tracking=audit.tracking
            )
    return load_or_fail(path, StreamFlowConfig)


def check_endpoint_config(cfg: StreamFlowConfig) -> None:
    """What fails before any request: base_url without a scheme, base_url without --model, a
    named key variable that is not set (its value is never printed), a tokenizer spec that does
    not resolve or (hf:) is neither cached nor reachable, and the endpoint's pre-flight
    (``flows.shared.common.check_remote_endpoint``): nothing accepts a TCP connection, a base
    URL without /v1, a refused key, a model the server does not serve."""
    endpoint = cfg.endpoint
    if endpoint.base_url:
        if not endpoint.base_url.startswith(("http://", "https://")):
            fail_input(f"--base-url: {endpoint.base_url!r} has no scheme; write it like http://host:8000/v1")
        if not endpoint.model:
            fail_input("--model: required with --base-url (the model name the server serves)")
    if endpoint.api_key_env and not os.environ.get(endpoint.api_key_env):
        fail_input(
            f"--api-key-env: environment variable {endpoint.api_key_env} is not set; export it "
            "or name the variable that holds the key"
        )
    if endpoint.tokenizer:
        from tasks.models.sources import ModelSourceError, resolve

        try:
            resolve(endpoint.tokenizer)
        except ModelSourceError as exc:
            fail_input(f"--tokenizer: {exc}")
    check_remote_endpoint(cfg, ENDPOINT_FLAGS)


def _prompts(prompt: list[str] | None, prompts_file: Path | None) -> list[str] | None:
    from tasks.workload.prompts import PromptsError, read_prompts_file

    if prompt and prompts_file:
        fail_input("--prompt and --prompts: give one of them, not both")
    if prompts_file is not None:
        try:
            return read_prompts_file(prompts_file)
        except PromptsError as exc:
            fail_input(str(exc))
    if prompt:
        if any(not p.strip() for p in prompt):
            fail_input("--prompt: a prompt must not be empty")
        return prompt
    return None


def command(
    base_url: Annotated[
        Optional[str],
        typer.Option(help="OpenAI-compatible base URL (…/v1); none = start the embedded server (--engine)."),
    ] = None,
    engine: EngineOption = None,
    model: Annotated[
        Optional[str], typer.Option(help="Model name sent in requests (required with --base-url).")
    ] = None,
    api_key_env: ApiKeyEnvOption = None,
    ca_bundle: CaBundleOption = None,
    prompt: Annotated[Optional[list[str]], typer.Option(help="A prompt (repeat for several).")] = None,
    prompts: Annotated[
        Optional[Path], typer.Option(help="Prompts file: one per line, .json list, or .jsonl with 'prompt'.")
    ] = None,
    max_tokens: MaxTokensOption = None,
    request_timeout_s: Annotated[
        Optional[float], typer.Option(help="Per-request timeout in seconds.")
    ] = None,
    tokenizer: TokenizerOption = None,
    max_concurrency: MaxConcurrencyOption = None,
    request_rate: RequestRateOption = None,
    burstiness: Annotated[
        Optional[float], typer.Option(help="Gamma shape of the arrivals: 1 = Poisson.")
    ] = None,
    seed: SeedOption = None,
    num_requests: NumRequestsOption = None,
    warmup: WarmupOption = None,
    repeats: RepeatsOption = None,
    goodput: GoodputOption = None,
    input_len: InputLenOption = None,
    output_len: OutputLenOption = None,
    client_processes: Annotated[
        Optional[int], typer.Option(help="Client processes per level, for loads one core cannot drive.")
    ] = None,
    task_runner: Annotated[
        Optional[str],
        typer.Option(
            help="Where each level's client runs: threads (client processes here, default), or one "
            "client per Dask worker, each on its share of the streams and of the schedule, clocks "
            "aligned: dask (a LocalCluster, a worker per core), dask:N (N workers; a LocalCluster has "
            "at most one per stream) or dask:ADDRESS (a scheduler's workers, e.g. dask:tcp://10.0.0.5:8786)."
        ),
    ] = None,
    duration_s: Annotated[
        Optional[float],
        typer.Option(help="Seconds of sending per level (in-flight requests finish); with --num-requests."),
    ] = None,
    slice_s: Annotated[
        Optional[float],
        typer.Option(
            help="Seconds per window of each level's timeline (default 1): MLflow step series, plot."
        ),
    ] = None,
    api: Annotated[
        Optional[str],
        typer.Option(
            help="Endpoint: chat (/chat/completions, default), completions, or responses "
            "(/responses, OpenAI's Responses API)."
        ),
    ] = None,
    dataset: Annotated[
        Optional[str],
        typer.Option(
            help="Workload file: sharegpt:PATH, jsonl:PATH (prompt, output_len, input_len), a trace "
            "sent at its recorded times: mooncake:PATH (hash_ids shared), trace:PATH or azure:PATH "
            "(Azure's CSV), or whole "
            "conversations: sharegpt-multiturn:PATH (human turns replayed, replies live)."
        ),
    ] = None,
    time_scale: Annotated[
        Optional[float], typer.Option(help="A trace's speed: 2 = twice as fast as recorded.")
    ] = None,
    prefix_groups: PrefixGroupsOption = None,
    prefix_len: PrefixLenOption = None,
    prefix_popularity: PrefixPopularityOption = None,
    turns: TurnsOption = None,
    think_time_s: ThinkTimeOption = None,
    think_time_dist: ThinkTimeDistOption = None,
    keep_cache: KeepCacheOption = False,
    salt: SaltOption = None,
    cache_block_size_tokens: Annotated[
        Optional[int],
        typer.Option(
            help="The server's prefix-cache block size (tokens) where its /metrics do not say it: "
            "the expected cached share counts whole blocks only (default: the server's, else per token)."
        ),
    ] = None,
    config: Annotated[
        Optional[Path],
        typer.Option(
            help="YAML config: stream-shaped (stream, endpoint, server, tracking) or an audit config."
        ),
    ] = None,
    json_path: JsonOption = None,
    no_track: NoTrackOption = False,
) -> None:
    """Stream from an OpenAI-compatible endpoint under load and measure TTFT, ITL, TPOT and E2E
    latency per request, level by level."""
    cfg = load_stream_config(config)
    # a trace sends every row unless --num-requests (or the config's file) says how many
    num_requests_given = num_requests is not None or "num_requests" in cfg.stream.model_fields_set
    if input_len is not None and (prompt or prompts):
        fail_input("--input-len: synthetic prompts replace --prompt/--prompts; give one of them")
    cfg = apply_overrides(
        cfg,
        "endpoint",
        {
            "base_url": base_url,
            "model": model,
            "api_key_env": api_key_env,
            "ca_bundle": ca_bundle,
            "request_timeout_s": request_timeout_s,
            "tokenizer": tokenizer,
        },
    )
    cfg = apply_overrides(cfg, "server", {"engine": engine})
    cfg = apply_overrides(
        cfg,
        "stream",
        {
            "prompts": _prompts(prompt, prompts),
            "max_tokens": max_tokens,
            "max_concurrency": parse_list("--max-concurrency", max_concurrency, int),
            "request_rate": parse_list("--request-rate", request_rate, rate),
            "burstiness": burstiness,
            "seed": seed,
            "num_requests": num_requests,
            "warmup": warmup,
            "repeats": repeats,
            "goodput": parse_slos(goodput),
            "input_len": input_len,
            "output_len": output_len,
            "client_processes": client_processes,
            "task_runner": task_runner,
            "duration_s": duration_s,
            "slice_s": slice_s,
            "api": api,
            "dataset": dataset,
            "time_scale": time_scale,
            **workload_overrides(
                prefix_groups=prefix_groups,
                prefix_len=prefix_len,
                prefix_popularity=prefix_popularity,
                turns=turns,
                think_time_s=think_time_s,
                think_time_dist=think_time_dist,
                keep_cache=keep_cache,
                salt=salt,
            ),
            "cache_block_size_tokens": cache_block_size_tokens,
            "enabled": True,
        },
    )
    check_dataset(
        cfg,
        prompt or prompts or (input_len and not (cfg.stream.prefix_groups or cfg.stream.turns)),
        num_requests_given=num_requests_given,
    )
    if cfg.tracking.enabled and not no_track:  # (started already by flows.cli.main.main)
        start_stream_writer()
    check_task_runner(cfg.stream.task_runner)
    check_endpoint_config(cfg)
    check_embedded_engine(cfg)

    from flows.stream import stream

    _, result = run_flow(
        "stream", stream, cfg, track=not no_track, json_path=json_path, json_keys=("levels",)
    )
    if result["levels"]:
        print_levels(result["levels"])
    print_run_links(result)
    if result["error"]:
        from tasks.wire.errors import every_request_failed

        if result["error"] == every_request_failed(result["levels"]):  # measured, none succeeded
            typer.echo(result["error"], err=True)
        else:
            typer.echo(failure_message(result["error"], result["workdir"]), err=True)
        raise typer.Exit(1)


def failure_message(error: str, workdir: str | Path) -> str:
    """What a stream run whose flow failed says after its table: the failure, and how many
    requests finished before it with the file that holds them, or that none did (a client
    process that died at its start leaves an empty file, not one worth opening)."""
    path = Path(workdir) / "requests.jsonl"
    try:
        with path.open("rb") as lines:
            kept = sum(1 for line in lines if line.strip())
    except OSError:  # not written at all
        kept = 0
    if not kept:
        return f"stream failed: {error}; no request finished before it"
    finished = "1 request" if kept == 1 else f"{kept} requests"
    return f"stream failed: {error}; {finished} finished before it, kept in {path}"


def print_levels(levels: list[dict]) -> None:
    """One row per level: latencies (ms), TTFT p50 with its 95 % interval's half-width
    (``44.8 ± 1.2``; the others' are in --json and MLflow, 80 columns hold one), throughput,
    errors and the client-bound flag."""
    from tasks.report.plots import level_rate_label

    columns = [
        ("ttft_ms_p50", "TTFT\np50"),
        ("ttft_ms_p99", "TTFT\np99"),
        ("itl_ms_p50", "ITL\np50"),
        ("itl_ms_p99", "ITL\np99"),
        ("tpot_ms_mean", "TPOT\nmean"),
        ("e2e_ms_p50", "E2E\np50"),
        ("output_tokens_per_s", "tok/s"),
        ("num_errors", "errors"),
        ("client_loop_lag_ms_p99", "lag\np99"),
        ("coalesced_event_fraction", "coal-\nesced"),
    ]
    clocks = {lv["metrics"].get("arrival_clock") for lv in levels} - {None}
    table = make_table(
        f"infermeter stream (ms; arrivals on the {' / '.join(sorted(clocks)) or 'user'} clock; "
        "lag = client event-loop lag; coalesced = share of ITL gaps read late together)",
        [(title, "right") for title in ("conc", "rate", *(t for _, t in columns))],
        compact=True,
    )
    table.columns[1].no_wrap = True  # the rate: "trace" is one word, never folded
    table.add_column("client\nbound", no_wrap=True)
    for lv in levels:
        m = lv["metrics"]
        bound = {None: "n/a", 0: "no", 1: "YES"}.get(m.get("client_bound"), "n/a")
        table.add_row(
            str(lv["max_concurrency"]),
            level_rate_label(lv["request_rate"], lv["metrics"]),
            *(fmt_interval(m, key) if key == "ttft_ms_p50" else fmt_value(m.get(key)) for key, _ in columns),
            bound,
        )
    console.print(table)
    repeated = [  # --repeats N > 1: the spread between the runs, beside the pooled figures above
        f"conc {lv['max_concurrency']} rate {level_rate_label(lv['request_rate'], lv['metrics'])}: "
        f"{fmt_value(m['ttft_ms_p50_repeat_min'])}-{fmt_value(m['ttft_ms_p50_repeat_max'])}"
        for lv in levels
        if (m := lv["metrics"]).get("num_repeats")
    ]
    if repeated:
        runs = levels[0]["metrics"].get("num_repeats")
        console.print(
            f"repeats: TTFT p50 of each of the {runs} runs alone, least-greatest (ms): "
            + "; ".join(repeated),
            highlight=False,
        )
    print_outcomes(levels, console)
    print_cache(levels, console)
    print_turns(levels, console)
