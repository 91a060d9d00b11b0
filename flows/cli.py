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

from flows.cli_common import console, fail_input, load_or_fail, print_headline, write_json
from tasks.config import AuditConfig, ServerConfig, describe_validation_error

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
) -> None:
    """Run the full audit: tokenize, local profile, remote stream, sampling sweep, report."""
    cfg = load_or_fail(config, AuditConfig)
    from flows.audit import audit as audit_flow

    state = audit_flow(cfg, track=not no_track, return_state=True)
    result = state.result(raise_on_failure=False)
    if not isinstance(result, dict):  # the flow itself crashed before producing a result
        err_console.print(f"audit failed: {result}", markup=False)
        raise typer.Exit(1)
    write_json(json_path, {k: result[k] for k in ("stages", "headline", "errors", "mlflow_run_id")})
    print_headline("infermeter audit: headline", result["headline"])
    if result["mlflow_run_id"]:
        console.print(f"MLflow run: {result['mlflow_run_id']}")
        console.print(f"Open the UI: {result['ui_command']}")
    if result["errors"]:
        for stage, message in result["errors"].items():
            err_console.print(f"stage {stage} failed: {message}", markup=False)
        raise typer.Exit(1)


@app.command()
def server(
    model: Annotated[str, typer.Option(help="GGUF model spec.")] = "gguf:default",
    n_ctx: Annotated[int, typer.Option(help="Context window in tokens.")] = 2048,
    api_key_env: Annotated[
        Optional[str], typer.Option(help="Require the key held in this environment variable.")
    ] = None,
) -> None:
    """Run the embedded llama.cpp server in the foreground (127.0.0.1); prints its base_url.

    Ctrl-C (or SIGTERM) stops it. Without --api-key-env it takes no key.
    """
    from tasks.models import ModelSourceError
    from tasks.server import ServerStartError, embedded_server

    try:
        cfg = ServerConfig(model=model, n_ctx=n_ctx)
    except ValidationError as exc:
        fail_input(describe_validation_error(exc, "server"))
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            fail_input(f"--api-key-env: environment variable {api_key_env} is not set")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with embedded_server(
            cfg.model, n_ctx=cfg.n_ctx, startup_timeout_s=cfg.startup_timeout_s, api_key=key
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
