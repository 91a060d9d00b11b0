"""`infermeter tune`: server configurations measured one after another, and the Pareto front.

Builds a ``TuneFlowConfig`` from YAML (``--config``) and the flags, settles the plan before any
server starts (exit 2, one line naming the parameter: an empty grid, a parameter or value the
engine's own parser refuses, more than ``--max-configurations`` without ``--yes``), runs the
flow (``flows.tune``), writes ``--json`` (``{"configurations": [...], "best", "pareto",
"order", "repeats", "mlflow_run_id"}``) and prints one row per configuration and level (the
means over the repeats, the objective's interval), the front, and the best by the rule of
``tasks.tune.rule`` (named only where its repeats separate it; else "tied within noise"). With
``--capacity``: one row per configuration, its capacity over its repeats (each repeat's search
probes rates of its own, so its levels are no rows to group; issue 49), marked ``best`` or
``tied`` by the same rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.shared.common import (
    JsonOption,
    NoTrackOption,
    apply_overrides,
    fail_input,
    load_or_fail,
    parse_list,
    parse_slos,
    rate,
    run_flow,
)
from flows.shared.options import (
    ApiKeyEnvOption,
    EngineOption,
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
from flows.shared.workload import check_dataset
from flows.tables.common import console, fmt_value, make_table, print_run_links
from tasks.config import TuneFlowConfig


def command(
    server_param: Annotated[
        Optional[list[str]],
        typer.Option(
            help="NAME=V1,V2: a server parameter's values (repeat for more; the grid is their product)."
        ),
    ] = None,
    engine: EngineOption = None,
    serve_cmd: Annotated[
        Optional[str],
        typer.Option(
            help="Your own server's command with {model} {port} {params}, instead of the embedded engine."
        ),
    ] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name sent (with --serve-cmd).")] = None,
    tokenizer: TokenizerOption = None,
    api_key_env: ApiKeyEnvOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Run a grid larger than --max-configurations.")] = False,
    max_configurations: Annotated[
        Optional[int], typer.Option(help="More configurations than this need --yes (default 64).")
    ] = None,
    no_resume: Annotated[
        bool, typer.Option("--no-resume", help="Measure every configuration, even ones FINISHED before.")
    ] = False,
    capacity: Annotated[
        bool, typer.Option("--capacity", help="Run the capacity search (under --goodput) per configuration.")
    ] = False,
    max_concurrency: MaxConcurrencyOption = None,
    request_rate: RequestRateOption = None,
    num_requests: NumRequestsOption = None,
    warmup: WarmupOption = None,
    repeats: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="Measure each configuration N times, a fresh server each, in interleaved rounds "
            "(default 3): each level's figure gets its interval, and the best is named only where "
            "it is separated from the rest (1: one pass, untested). Each level N times in a row on "
            "one server: stream.repeats in --config.",
        ),
    ] = None,
    max_tokens: MaxTokensOption = None,
    input_len: InputLenOption = None,
    output_len: OutputLenOption = None,
    dataset: Annotated[
        Optional[str], typer.Option(help="Workload file: sharegpt:PATH or jsonl:PATH.")
    ] = None,
    goodput: Annotated[
        Optional[str], typer.Option(help="SLOs, e.g. ttft_ms:500,tpot_ms:50 (ranks the best).")
    ] = None,
    seed: SeedOption = None,
    startup_timeout_s: Annotated[
        Optional[float], typer.Option(help="Seconds a server may take to become healthy.")
    ] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML config (TuneFlowConfig).")] = None,
    json_path: JsonOption = None,
    no_track: NoTrackOption = False,
) -> None:
    """Find the best server configuration: measure the server under each configuration of a grid,
    then show the Pareto front and the best."""
    from tasks.engines.server import ServerStartError
    from tasks.tune.grid import TuneInputError, parse_server_params
    from tasks.tune.plan import plan

    cfg = load_or_fail(config, TuneFlowConfig)
    try:
        grid = parse_server_params(server_param) if server_param else None
    except TuneInputError as exc:
        fail_input(str(exc))
    cfg = apply_overrides(
        cfg,
        "tune",
        {
            "server_params": grid,
            "serve_cmd": serve_cmd,
            "max_configurations": max_configurations,
            "yes": True if yes else None,
            "resume": False if no_resume else None,
            "capacity": True if capacity else None,
            "repeats": repeats,
        },
    )
    cfg = apply_overrides(cfg, "server", {"engine": engine, "startup_timeout_s": startup_timeout_s})
    cfg = apply_overrides(
        cfg, "endpoint", {"model": model, "tokenizer": tokenizer, "api_key_env": api_key_env}
    )
    cfg = apply_overrides(
        cfg,
        "stream",
        {
            "max_concurrency": parse_list("--max-concurrency", max_concurrency, int),
            "request_rate": parse_list("--request-rate", request_rate, rate),
            "num_requests": num_requests,
            "warmup": warmup,
            "max_tokens": max_tokens,
            "input_len": input_len,
            "output_len": output_len,
            "dataset": dataset,
            "goodput": parse_slos(goodput),
            "seed": seed,
            "enabled": True,
        },
    )
    if cfg.endpoint.base_url:
        fail_input(
            "endpoint.base_url: tune starts its own servers; leave it empty (use --serve-cmd for yours)"
        )
    if cfg.tune.capacity and not cfg.stream.goodput:
        fail_input("--capacity: the capacity search needs SLOs, e.g. --goodput ttft_ms:500,tpot_ms:50")
    check_dataset(cfg, input_len, allow_trace=False)
    try:
        planned = plan(cfg)  # the flow plans again; here a refusal costs seconds, not a server start
    except (TuneInputError, ServerStartError) as exc:
        fail_input(str(exc))
    repeats_text = f"{cfg.tune.repeats} interleaved rounds" if cfg.tune.repeats > 1 else "one pass"
    console.print(
        f"tune: {len(planned)} configurations x {repeats_text}, a fresh server each "
        f"({len(planned) * cfg.tune.repeats} starts)",
        highlight=False,
    )

    from flows.tune import tune

    _, result = run_flow(
        "tune",
        tune,
        cfg,
        track=not no_track,
        json_path=json_path,
        json_keys=("configurations", "best", "pareto", "order", "repeats"),
    )
    print_tune(result)
    print_run_links(result)
    if result["error"]:
        typer.echo(f"tune failed: {result['error']}", err=True)
        raise typer.Exit(1)


def print_tune(result: dict) -> None:
    """One row per configuration and level (a failed configuration: one row with its status):
    the means over the repeats (``n``), the objective's interval, a mark on the front's rows and
    on the best (or the points tied within noise); with ``--capacity`` one row per configuration
    instead, its capacity over its repeats (:func:`print_capacities`: what the best is decided
    on). Then the rule's outcome and why."""
    from tasks.tune.front import CAPACITY, CAPACITY_LEVEL

    chosen = result.get("best") or {}
    objective = chosen.get("objective") or "output_tokens_per_s"
    if objective == CAPACITY or any(c.get("capacity_over_repeats") for c in result["configurations"]):
        print_capacities(result)
    else:
        print_levels(result)
    for conf in result["configurations"]:
        if conf["error"]:
            first = conf["error"].splitlines()[0][:300]
            console.print(
                f"configuration {conf['index']} ({conf['label']}) {conf['status']}: {first}", highlight=False
            )
    if chosen.get("point"):
        p = chosen["point"]
        where = "" if p["level"] == CAPACITY_LEVEL else f" at concurrency {p['max_concurrency']}"
        console.print(f"best: {p['label']}{where}: {chosen['reason']}", highlight=False)
    elif chosen:
        console.print(f"best: none ({chosen['reason']})", highlight=False)


def _mark(chosen: dict, key: tuple[int, int]) -> str:
    """``best`` on the named point, ``tied`` on the points tied within noise (the rule's
    outcome, ``tasks.tune.rule``), else empty; ``key``: ``(configuration, level)``."""
    best = chosen.get("point")
    if best and (best["configuration"], best["level"]) == key:
        return "best"
    return "tied" if key in {(p["configuration"], p["level"]) for p in chosen.get("tied") or []} else ""


def print_capacities(result: dict) -> None:
    """``--capacity``: one row per configuration over its repeats, whatever rates each
    repeat's search probed (those levels are each one repeat's own: ``--json``'s ``repeats``
    and MLflow keep them): the known repeats (``n``), the mean capacity with Student's t
    interval, each repeat's capacity, the output tokens/s at capacity, and ``best`` / ``tied``
    as the rule decided over the repeats' capacities (``tasks.tune.capacities``)."""
    from flows.tables.common import interval_text
    from tasks.tune.front import CAPACITY, CAPACITY_LEVEL

    chosen = result.get("best") or {}
    overs = [c.get("capacity_over_repeats") or {} for c in result["configurations"]]
    counts = {o.get("repeats", 0) for o in overs if o}
    each = f"; {counts.pop()} repeats each" if len(counts) == 1 else ""
    shown = any(o.get("ci_high") is not None for o in overs)
    plus = f"\n± {chosen.get('confidence', 0.95):.0%}" if shown else ""
    table = make_table(
        f"infermeter tune --capacity (req/s: the highest rate within the SLOs{each})",
        [
            ("#", "right"),
            ("configuration", "left"),
            ("status", "left"),
            ("startup s", "right"),
            ("n", "right"),
            ("capacity\nreq/s" + plus, "right"),
            ("rule", "left"),  # before the rest: a narrow terminal leaves out the last columns
            ("each repeat\nreq/s", "left"),
            ("tok/s at\ncapacity", "right"),
        ],
        compact=True,
    )
    for conf, over in zip(result["configurations"], overs):
        status = conf["status"] + (" (resumed)" if conf.get("resumed") else "")
        startup = fmt_value(conf["server_startup_s"])
        if not over:  # no repeat ran a search (its server never started)
            table.add_row(str(conf["index"]), conf["label"], status, startup, "0", *[""] * 4)
            continue
        mean = over.get(CAPACITY)
        table.add_row(
            str(conf["index"]),
            conf["label"],
            status,
            startup,
            str(over.get("repeats", 0)),
            interval_text(mean, over.get("ci_low"), over.get("ci_high")) if mean is not None else "n/a",
            _mark(chosen, (conf["index"], CAPACITY_LEVEL)),
            ", ".join(fmt_value(v) for v in over.get("per_repeat") or ()),
            fmt_value(over.get("capacity_output_tokens_per_s")),
        )
    console.print(table)


def print_levels(result: dict) -> None:
    """One row per configuration and level: the means over the repeats, the objective's
    interval, the front and the rule's marks (:func:`print_tune`)."""
    front = {(p["configuration"], p["level"]) for p in result["pareto"]["per_user_tokens_per_s"]}
    front |= {(p["configuration"], p["level"]) for p in result["pareto"]["ttft_ms_p99"]}
    chosen = result.get("best") or {}
    objective = chosen.get("objective") or "output_tokens_per_s"
    goodput = objective == "goodput_requests_per_s"
    figure = objective  # the levels' column with an interval
    levels = [lv for conf in result["configurations"] for lv in conf["levels"]]
    shown = any(lv.get(f"{figure}_ci_high") is not None for lv in levels)
    plus = f"\n± {chosen.get('confidence', 0.95):.0%}" if shown else ""  # the interval over the repeats
    counts = {lv.get("repeats", 1) for lv in levels}
    varied = len(counts) > 1  # a column only when some level has fewer repeats (a failed one)
    each = f", {counts.pop()} repeats each" if len(counts) == 1 and not counts & {1} else ""
    table = make_table(
        f"infermeter tune (ms{each})",
        [
            (t, j)
            for t, j in (
                ("#", "right"),
                ("configuration", "left"),
                ("status", "left"),
                ("startup s", "right"),
                ("conc", "right"),
                *((("n", "right"),) if varied else ()),
                ("tok/s" + ("" if goodput else plus), "right"),
                ("tok/s\nper user", "right"),
                ("TTFT\np99", "right"),
                *((("goodput\nreq/s" + plus, "right"),) if goodput else ()),
                ("front", "left"),
            )
        ],
        compact=True,
    )

    def with_interval(level: dict, figure: str) -> str:
        value = level["metrics"].get(figure)
        high = level.get(f"{figure}_ci_high")
        if value is None or high is None:
            return fmt_value(value)
        # Student's t interval is symmetric (its low end may be cut at 0: a rate is not negative)
        return f"{fmt_value(value)} ± {fmt_value(high - value)}"

    for conf in result["configurations"]:
        status = conf["status"] + (" (resumed)" if conf.get("resumed") else "")
        startup = fmt_value(conf["server_startup_s"])
        rows = conf["levels"] or [None]
        for level_index, level in enumerate(rows):
            if level is None:
                table.add_row(
                    str(conf["index"]), conf["label"], status, startup, *[""] * (7 if goodput else 6)
                )
                continue
            m = level["metrics"]
            tpot = m.get("tpot_ms_p50")
            key = (conf["index"], level_index)
            mark = " ".join(x for x in ("*" if key in front else "", _mark(chosen, key)) if x)
            table.add_row(
                str(conf["index"]),
                conf["label"],
                status,
                startup,
                str(level["max_concurrency"]),
                *((str(level.get("repeats", 1)),) if varied else ()),
                fmt_value(m.get("output_tokens_per_s")) if goodput else with_interval(level, figure),
                fmt_value(1000 / tpot if tpot else None),
                fmt_value(m.get("ttft_ms_p99")),
                *((with_interval(level, figure),) if goodput else ()),
                mark,
            )
    console.print(table)
