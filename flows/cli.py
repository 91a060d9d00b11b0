"""The `infermeter` command: one command per flow, plus the embedded server.

Conventions (DESIGN.md): errors in input exit 2 with one line; `--json PATH` writes the
command's result; `mlflow_run_id` is null under `--no-track`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from flows.cli_common import (
    apply_overrides, check_embedded_engine, console, fail_input, load_or_fail, preflight,
    print_headline, print_run_links, run_flow,
)
from tasks.config import AuditConfig, ServerConfig, describe_validation_error
from flows import compare, deploy
from flows import stream as stream_flow
from flows import profile as profile_flow
from flows import sweep as sweep_flow
from flows import tokenize as tokenize_flow

app = typer.Typer(
    name="infermeter", no_args_is_help=True, add_completion=False,
    help="Measure LLM inference: tokenize, profile, stream, sweep; tracked in MLflow.",
)
err_console = Console(stderr=True)


@app.command()
def audit(
    config: Annotated[Optional[Path], typer.Option(help="YAML config (default: built-in defaults).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the result here.")] = None,
    no_track: Annotated[bool, typer.Option("--no-track", help="Do not record in MLflow.")] = False,
    baseline: Annotated[
        Optional[str], typer.Option(help="MLflow run id to compare with (default: median of the last audits).")
    ] = None,
    fail_on_regression: Annotated[
        Optional[bool], typer.Option("--fail-on-regression/--no-fail-on-regression", help="Exit 1 on a regression.")
    ] = None,
) -> None:
    """Run the full audit: tokenize, local profile, remote stream, sampling sweep, report."""
    cfg = load_or_fail(config, AuditConfig)
    cfg = apply_overrides(cfg, "regression", {
        "baseline_run_id": baseline, "fail_on_regression": fail_on_regression,
    })
    preflight(track=not no_track)
    if cfg.stream.enabled or cfg.sweep.enabled:
        check_embedded_engine(cfg)
    if cfg.regression.baseline_run_id and not no_track:
        from tasks.tracking import Tracker

        try:
            Tracker(cfg.tracking.experiment).run_metrics(cfg.regression.baseline_run_id)
        except LookupError as exc:
            fail_input(f"--baseline: {exc}")
    from flows.audit import audit as audit_flow

    state, result = run_flow("audit", audit_flow, cfg, track=not no_track, json_path=json_path,
                             json_keys=("stages", "headline", "errors", "regression"))
    print_headline("infermeter audit: headline", result["headline"])
    console.print(f"Records on disk: {result['workdir']}", highlight=False)
    print_run_links(result)
    verdict = result.get("regression")
    if not verdict and result["mlflow_run_id"] and not result["errors"]:
        console.print("Regression verdict: no baseline yet (the first audit of this endpoint and "
                      "model; later audits compare with it)")
    if verdict:
        console.print(f"Regression verdict ({verdict['baseline']}): "
                      f"{'REGRESSION' if verdict['regressed'] else 'no regression'}", highlight=False)
    if result["errors"]:
        for stage, message in result["errors"].items():
            err_console.print(f"stage {stage} failed: {message}", markup=False)
        raise typer.Exit(1)
    if state.is_failed():  # fail_on_regression
        raise typer.Exit(1)


@app.command()
def server(
    model: Annotated[str, typer.Option(help="GGUF model spec.")] = "gguf:default",
    engine: Annotated[str, typer.Option(help="llamacpp (default) or vllm (needs `make vllm`).")] = "llamacpp",
    n_ctx: Annotated[int, typer.Option(help="Context window in tokens.")] = 2048,
    api_key_env: Annotated[
        Optional[str], typer.Option(help="Require the key held in this environment variable.")
    ] = None,
) -> None:
    """Run the embedded server (llama.cpp, or vLLM with --engine vllm) in the foreground
    (127.0.0.1); prints its base_url.

    Ctrl-C (or SIGTERM) stops it. Without --api-key-env it takes no key.
    """
    from tasks.models import ModelSourceError
    from tasks.server import EngineNotInstalledError, ServerStartError, check_engine, embedded_server

    try:
        cfg = ServerConfig(model=model, n_ctx=n_ctx, engine=engine)
        check_engine(cfg.engine)
    except ValidationError as exc:
        fail_input(describe_validation_error(exc, "server"))
    except EngineNotInstalledError as exc:
        fail_input(str(exc))
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            fail_input(f"--api-key-env: environment variable {api_key_env} is not set")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with embedded_server(
            cfg.model, engine=cfg.engine, n_ctx=cfg.n_ctx, startup_timeout_s=cfg.startup_timeout_s,
            api_key=key,
        ) as running:
            console.print(f"base_url: {running.base_url}", highlight=False)
            console.print(f"model: {running.model}", highlight=False)
            console.print("Ctrl-C stops it.")
            while True:
                time.sleep(3600)
    except ModelSourceError as exc:
        fail_input(str(exc))
    except ServerStartError as exc:
        err_console.print(str(exc), markup=False)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        console.print("stopped")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


# Commands of the single-stage flows register here, one line each.
app.command("compare")(compare.command)
app.command("serve")(deploy.command)
app.command("stream")(stream_flow.command)
app.command("profile")(profile_flow.command)
app.command("tokenize")(tokenize_flow.command)
app.command("sweep")(sweep_flow.command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
