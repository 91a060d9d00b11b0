"""`infermeter server`: the embedded server alone, in the foreground."""

from __future__ import annotations

import os
import signal
import time
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from flows.shared.common import fail_input
from flows.tables.common import console, err_console
from tasks.config import ServerConfig, describe_validation_error


def command(
    model: Annotated[str, typer.Option(help="GGUF model spec.")] = "gguf:default",
    engine: Annotated[str, typer.Option(help="llamacpp (default) or vllm (needs `make vllm`).")] = "llamacpp",
    n_ctx: Annotated[int, typer.Option(help="Context window in tokens.")] = 2048,
    api_key_env: Annotated[
        Optional[str], typer.Option(help="Require the key held in this environment variable.")
    ] = None,
) -> None:
    """Run the embedded server (llama.cpp, or vLLM with --engine vllm) on 127.0.0.1 in the
    foreground, to stream from or try by hand; it prints its base_url.

    Ctrl-C (or SIGTERM) stops it; should it die, the command says how and exits 1. Without
    --api-key-env it takes no key.
    """
    from tasks.engines.death import ServerDiedError, server_gone
    from tasks.engines.server import EngineNotInstalledError, ServerStartError, check_engine, embedded_server
    from tasks.models.sources import ModelSourceError

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
            cfg.model,
            engine=cfg.engine,
            n_ctx=cfg.n_ctx,
            startup_timeout_s=cfg.startup_timeout_s,
            api_key=key,
        ) as running:
            console.print(f"base_url: {running.base_url}", highlight=False)
            console.print(f"model: {running.model}", highlight=False)
            console.print("Ctrl-C stops it.")
            while not server_gone(running.pid):  # a death ends the block: named below
                time.sleep(0.5)
    except ModelSourceError as exc:
        fail_input(str(exc))
    except (ServerStartError, ServerDiedError) as exc:
        err_console.print(str(exc), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("stopped")


def _raise_interrupt(signum, frame):
    """SIGTERM as Ctrl-C: the server's context manager stops the child on the way out."""
    raise KeyboardInterrupt
