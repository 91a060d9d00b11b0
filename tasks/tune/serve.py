"""One configuration's server: the embedded engine with its flags, or a user's own command.

Either way the server runs under :func:`tasks.engines.server.background_server`: its own session, its
whole process tree stopped when the block ends, and the lifeline that stops it when this process
dies in any way (SIGKILL included). ``server_startup_s`` is the time from the launch until
``/v1/models`` first answered 200 (for vLLM it includes its one-time conversion of the GGUF
into a Hugging Face folder when that is not cached yet).
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.config import EndpointConfig, ServerConfig
from tasks.endpoint.spec import Endpoint, EndpointError, open_endpoint
from tasks.engines.server import background_server, free_port


@dataclass
class Started:
    """What the block gets: the endpoint to measure and how long the server took to start."""

    endpoint: Endpoint
    server_startup_s: float


def command_line(template: str, model: str, port: int, flags: tuple[str, ...]) -> list[str]:
    """``serve_cmd`` filled in: ``{model}``, ``{port}``, ``{params}`` (the flags, shell-quoted),
    then split as a shell would (no shell runs it)."""
    return shlex.split(template.format(model=shlex.quote(model), port=port, params=shlex.join(flags)))


@contextmanager
def configuration_server(
    server: ServerConfig,
    endpoint: EndpointConfig,
    flags: tuple[str, ...],
    serve_cmd: str | None,
    log_dir: Path,
) -> Iterator[Started]:
    """Start the server for one configuration, yield it, stop it and all it started.

    Raises:
        ServerStartError: it exited or was not healthy within ``server.startup_timeout_s`` (the
            message ends with its log's last lines).
        EndpointError: ``serve_cmd`` without ``endpoint.model``.
    """
    start = time.perf_counter()
    if serve_cmd is None:
        with open_endpoint(
            EndpointConfig(**{**endpoint.model_dump(), "base_url": None}), server, flags
        ) as opened:
            yield Started(opened, time.perf_counter() - start)
        return
    if not endpoint.model:
        raise EndpointError("endpoint.model: tune.serve_cmd needs the model name its server serves (--model)")
    port = free_port()
    command = command_line(serve_cmd, endpoint.model, port, flags)
    log_dir.mkdir(parents=True, exist_ok=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    api_key = os.environ.get(endpoint.api_key_env) if endpoint.api_key_env else None
    with background_server(
        f"the server command ({command[0]})",
        command,
        dict(os.environ),
        f"{base_url}/models",
        api_key=api_key,
        startup_timeout_s=server.startup_timeout_s,
        log_path=log_dir / "server.log",
        timeout_hint="raise server.startup_timeout_s",
    ) as proc:
        yield Started(
            Endpoint(
                base_url=base_url,
                model=endpoint.model,
                api_key_env=endpoint.api_key_env,
                server_kind="openai-compatible",
                tokenizer=endpoint.tokenizer or "gguf:default",
                request_timeout_s=endpoint.request_timeout_s,
                server_pid=proc.pid,  # its requests after its death are server_died
            ),
            time.perf_counter() - start,
        )
