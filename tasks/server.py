"""The embedded llama.cpp OpenAI-compatible server: start, wait for health, key, stop.

The server is llama-cpp-python's ``python -m llama_cpp.server``, bound to 127.0.0.1 on a free
port, started with ``--interrupt_requests False`` (by default a new request cuts off the stream
in flight). Its API key is random, known only to this process, and reaches the child through
its environment (``API_KEY``, read by the server's pydantic settings), never its command line,
so it does not show in ``ps`` or in logs. It is stopped by PID when the context exits, also on
failure.

This server answers one request at a time (no continuous batching): at concurrency above 1 its
TTFT is mostly queueing. It runs the GGUF weights quantised, while the local profile stage runs
them dequantised in transformers: their numbers are not comparable.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.models import resolve

SERVER_KIND = "llama.cpp"
RANDOM_KEY = "<random>"  # sentinel: generate a fresh key for this server


class ServerStartError(RuntimeError):
    """The embedded server exited or did not become healthy in time."""


@dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded server.

    Attributes:
        base_url: ``http://127.0.0.1:PORT/v1``.
        model: the alias requests must name.
        api_key: the key, or None (keep it out of logs, params, tags and artifacts).
        pid: the server's process id.
        model_sha256: the GGUF file's hash (identifies the endpoint with the server kind).
        log_path: the server's combined stdout/stderr.
    """

    base_url: str
    model: str
    api_key: str | None
    pid: int
    model_sha256: str
    log_path: Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(
    url: str, api_key: str | None, proc: subprocess.Popen, timeout_s: float, log_path: Path
) -> None:
    # llama-cpp-python has no /health route; /v1/models answers once the model is loaded.
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url, headers=headers)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise ServerStartError(
                f"llama.cpp server exited with code {proc.returncode} before it was healthy; "
                f"its log ends:\n{tail}"
            )
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise ServerStartError(
        f"llama.cpp server not healthy after {timeout_s:.0f} s (server.startup_timeout_s); "
        f"see {log_path}"
    )


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


@contextmanager
def embedded_server(
    model_spec: str = "gguf:default",
    *,
    n_ctx: int = 2048,
    n_threads: int | None = None,
    startup_timeout_s: float = 120.0,
    log_dir: Path | None = None,
    api_key: str | None = RANDOM_KEY,
) -> Iterator[EmbeddedServer]:
    """Run the embedded llama.cpp server for the duration of the ``with`` block.

    ``api_key``: ``RANDOM_KEY`` (a fresh random key, the default for flows), a given key, or
    None for no authentication (the server listens on 127.0.0.1 only).

    Raises:
        ModelSourceError: the model spec is not a GGUF file.
        ServerStartError: the server exited early or did not answer /v1/models in time.
    """
    source = resolve(model_spec)
    if source.kind != "gguf":
        raise ServerStartError(f"server.model {model_spec!r}: the embedded server needs a gguf: model")
    port = free_port()
    if api_key is RANDOM_KEY:
        api_key = secrets.token_urlsafe(24)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="infermeter-server-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "llama_server.log"
    command = [
        sys.executable, "-m", "llama_cpp.server",
        "--model", source.location,
        "--model_alias", source.name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--n_ctx", str(n_ctx),
        "--interrupt_requests", "False",
    ]
    if n_threads:
        command += ["--n_threads", str(n_threads)]
    env = {k: v for k, v in os.environ.items() if k.upper() != "API_KEY"}
    if api_key:
        env["API_KEY"] = api_key
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,  # Ctrl-C in the terminal reaches us, and we stop it cleanly
        )
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        _wait_healthy(f"{base_url}/models", api_key, proc, startup_timeout_s, log_path)
        yield EmbeddedServer(
            base_url=base_url, model=source.name, api_key=api_key, pid=proc.pid,
            model_sha256=source.file_sha256() or "", log_path=log_path,
        )
    finally:
        _stop(proc)
