"""infermeter's local Prefect API server: started by the first command that needs one, reused
by every later command with the same ``PREFECT_HOME``, gone once it has been idle a while.

Why: without ``PREFECT_API_URL`` Prefect starts a temporary server for every process (the same
uvicorn app, on ``PREFECT_HOME``'s SQLite database) and stops it at the end. Measured through
``infermeter stream --no-track`` of 4 short requests on a 2-core machine (command
``python tests/benchmarks/command_phases.py``): that start was 6-8 s of a 20-25 s command,
and 17 s more on a fresh database (its migrations). Started once and reused, it costs one
health request.

The records are the same: the same app and database as Prefect's own temporary server
(``prefect.server.api.server.SubprocessASGIServer``: no UI, ephemeral settings), so flow and
task runs, their states and the MLflow links land where they always did.

Its life, in files under ``PREFECT_HOME`` (all named ``infermeter-prefect-server.*``):

- ``.json``: the running server (URL, pid, Prefect version, Python). Written by the server once
  it answers; a command reuses it only when all four match and ``/health`` answers.
- ``.lock``: ``flock``-ed while a command checks or starts the server and while the server
  retires, so two commands never start two servers and a server never retires between a
  command's check and its first call (the check is a request, and requests reset the idle
  clock).
- ``.log``: its output.

It runs in its own session (a Ctrl-C at the terminal does not reach it; the command's flow run
is reported as interrupted to a server that is still up), and stops itself when it has had no
request and no open connection for ``INFERMETER_PREFECT_IDLE_S`` seconds (default
:data:`DEFAULT_IDLE_S`), when its state file is removed or names another server, or on
SIGTERM/SIGINT. ``INFERMETER_PREFECT_IDLE_S=0`` turns it off: each command then starts and
stops a temporary server of its own (``flows.shared.prefect_api``), as Prefect would.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_IDLE_S",
    "IDLE_ENV",
    "LocalServer",
    "ensure_server",
    "idle_limit_s",
    "running_server",
    "stop_server",
]

#: Seconds without a request or an open connection after which the server stops itself.
DEFAULT_IDLE_S = 900.0
#: The environment variable that sets that limit (0: no shared server, one per command).
IDLE_ENV = "INFERMETER_PREFECT_IDLE_S"
_STEM = "infermeter-prefect-server"


@dataclass(frozen=True)
class LocalServer:
    """A running local Prefect API server.

    Attributes:
        url: its API URL, ``http://127.0.0.1:PORT/api``.
        pid: the server's process id.
        prefect_version: ``prefect.__version__`` of the server (a command of another version
            starts its own: the database schema follows the version).
        python: the interpreter it runs under. Another virtual environment of the same Prefect
            version (a second clone: a user's and CI's) uses it too: replacing it would end the
            server under the other clone's command mid-run (seen: an audit's task runs lost
            their API when a second clone's command started).
    """

    url: str
    pid: int
    prefect_version: str
    python: str


def idle_limit_s() -> float:
    """``INFERMETER_PREFECT_IDLE_S`` in seconds (unset: :data:`DEFAULT_IDLE_S`; 0: off).

    Raises:
        ValueError: not a number >= 0 (the message names the variable and the fix).
    """
    text = os.environ.get(IDLE_ENV, "").strip()
    if not text:
        return DEFAULT_IDLE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"{IDLE_ENV}={text!r}: give the seconds the local Prefect server may stay idle "
            f"(a number >= 0; 0 starts a temporary server for each command instead)"
        )
    return value


def _paths(home: Path) -> tuple[Path, Path, Path]:
    return home / f"{_STEM}.json", home / f"{_STEM}.lock", home / f"{_STEM}.log"


def _read_state(home: Path) -> LocalServer | None:
    try:
        return LocalServer(**json.loads(_paths(home)[0].read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _answers(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: kill(0) said it is there


def _this_prefect() -> tuple[str, str]:
    import prefect

    return prefect.__version__, sys.executable


@contextlib.contextmanager
def _locked(home: Path, blocking: bool = True) -> Iterator[bool]:
    """Hold ``home``'s lock file for the block; yields False when ``blocking`` is False and
    another process holds it."""
    home.mkdir(parents=True, exist_ok=True)
    with open(_paths(home)[1], "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def running_server(home: Path) -> LocalServer | None:
    """The server ``home``'s state file names, when it is alive, answers, and runs this
    Prefect version (under any Python); else None. The check is a request, so it also resets
    the server's idle clock."""
    state = _read_state(home)
    if state is None or state.prefect_version != _this_prefect()[0]:
        return None
    return state if _alive(state.pid) and _answers(state.url) else None


def ensure_server(home: Path, env: dict[str, str], startup_timeout_s: float) -> tuple[LocalServer, bool]:
    """The local server of ``home``: the running one, or a new one started with ``env``.

    Returns:
        (the server, whether this call started it).

    Raises:
        tasks.engines.server.ServerStartError: a new server exited or did not answer within
            ``startup_timeout_s`` seconds (the message ends with its log's last lines).
    """
    from tasks.engines.server import ServerStartError, free_port, wait_healthy

    with _locked(home):
        server = running_server(home)
        if server is not None:
            return server, False
        state_path, _, log_path = _paths(home)
        state_path.unlink(missing_ok=True)  # a dead or foreign server's: this one replaces it
        port = free_port()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-P",
                    "-m",
                    "flows.prefect_server",
                    "--home",
                    str(home),
                    "--port",
                    str(port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=home,
                start_new_session=True,  # outlives the command; a Ctrl-C there does not reach it
            )
        url = f"http://127.0.0.1:{port}/api"
        wait_healthy(
            "infermeter's local Prefect API server",
            f"{url}/health",
            None,
            proc,
            startup_timeout_s,
            log_path,
            "or start one with `prefect server start` and set PREFECT_API_URL",
        )
        deadline = time.monotonic() + 10
        while (state := _read_state(home)) is None or state.pid != proc.pid:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.terminate()
                raise ServerStartError(f"infermeter's local Prefect API server wrote no {state_path}")
            time.sleep(0.02)
        return state, True


def stop_server(home: Path, timeout_s: float = 20.0) -> bool:
    """Stop ``home``'s local server, if one runs (SIGTERM; it removes its state file).
    Returns whether one was running."""
    state = _read_state(home)
    if state is None or not _alive(state.pid):
        _paths(home)[0].unlink(missing_ok=True)
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(state.pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(state.pid, os.WNOHANG)  # our own child (a test's): reap it
        time.sleep(0.05)
    if _alive(state.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.pid, signal.SIGKILL)
    return True


# --- the server process ---------------------------------------------------------------------


class _Activity:
    """ASGI middleware: counts open requests and connections (websockets: Prefect's event
    stream) and the monotonic time the last one ended, for the idle stop."""

    def __init__(self, app) -> None:
        self.app = app
        self.open = 0
        self.last_s = time.monotonic()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        self.open += 1
        self.last_s = time.monotonic()
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
            self.last_s = time.monotonic()


def _watch(server, activity: _Activity, home: Path, idle_s: float) -> None:
    """Publish the state file once the server answers; stop it when idle or replaced."""
    import prefect

    me = os.getpid()
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.01)
    state_path = _paths(home)[0]
    tmp = state_path.with_suffix(f".{me}.tmp")
    url = f"http://127.0.0.1:{server.config.port}/api"
    tmp.write_text(json.dumps(asdict(LocalServer(url, me, prefect.__version__, sys.executable))))
    tmp.replace(state_path)  # atomic: a reader sees the whole file or none
    while not server.should_exit:
        time.sleep(min(1.0, idle_s / 4))
        state = _read_state(home)
        if state is None or state.pid != me:  # removed, or another server took over
            server.should_exit = True
        elif activity.open == 0 and time.monotonic() - activity.last_s > idle_s:
            with _locked(home, blocking=False) as held:  # not while a command is checking
                if held and activity.open == 0 and time.monotonic() - activity.last_s > idle_s:
                    state_path.unlink(missing_ok=True)
                    server.should_exit = True


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.prefect_server --home DIR --port N``: serve until idle."""
    parser = argparse.ArgumentParser(prog="python -m flows.prefect_server")
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    idle_s = idle_limit_s() or DEFAULT_IDLE_S
    import uvicorn
    from prefect.server.api.server import create_app

    activity = _Activity(create_app())
    server = uvicorn.Server(
        uvicorn.Config(activity, host="127.0.0.1", port=args.port, log_level="error", lifespan="on")
    )
    threading.Thread(target=_watch, args=(server, activity, args.home, idle_s), daemon=True).start()

    def stop(signum, frame):
        # uvicorn shuts down on SIGTERM/SIGINT, then restores the handlers it found and sends
        # the signal again: this one turns it into an exit that runs the clean-up below
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.run()
    finally:
        state = _read_state(args.home)
        if state is not None and state.pid == os.getpid():
            _paths(args.home)[0].unlink(missing_ok=True)


if __name__ == "__main__":
    main()
