"""The Prefect API a CLI command runs its flow against.

1. With ``PREFECT_API_URL`` set (a ``prefect server start`` of the user's, or Prefect Cloud),
   that one.
2. Otherwise infermeter's local server of this ``PREFECT_HOME`` (:mod:`flows.prefect_server`):
   started by the first command, reused by the next ones, stopped after it has been idle
   ``INFERMETER_PREFECT_IDLE_S`` seconds. This saves the 6-8 s (17 s more on a fresh
   database) that a temporary server costs every command.
3. With ``INFERMETER_PREFECT_IDLE_S=0``, a temporary server for this command alone. Prefect
   would start one itself on the first API call, as a child in our process group: a Ctrl-C at
   the terminal then stops that server too, and Prefect's client spends minutes retrying it to
   report the interrupted run before the command exits. So the command starts the same
   temporary server itself (the same uvicorn app and settings as
   ``prefect.server.api.server.SubprocessASGIServer``), in its own session: a Ctrl-C reaches
   only the command, the flow run is marked as interrupted, and then the server is stopped.

Both servers of our own run in their own session, so an interrupted flow run is still reported.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from flows.prefect_server import DEFAULT_IDLE_S, IDLE_ENV, ensure_server, idle_limit_s

__all__ = ["STARTUP_TIMEOUT_S", "local_api_url", "prefect_api"]

#: How long the temporary server may take to answer /health, in seconds, unless
#: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS says otherwise.
STARTUP_TIMEOUT_S = 120.0


def _server_env() -> dict[str, str]:
    """The environment of a Prefect API server of ours: this process's settings, and what
    Prefect's own temporary server sets (no UI, the local ephemeral database)."""
    from prefect.settings import get_current_settings

    return {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }


def _startup_timeout_s(given_s: float | None) -> float:
    """Prefect's default (20 s) is too short on a busy 2-core machine, where a fresh database's
    migrations alone took longer (seen in tests and a first audit); a dead server still fails
    at once (the start watches the process). A value the user set is kept."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    if given_s:
        return given_s
    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in os.environ:
        return PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    return STARTUP_TIMEOUT_S


def local_api_url(startup_timeout_s: float | None = None) -> str:
    """The API URL of infermeter's local Prefect server for ``PREFECT_HOME``, started when
    none runs (a line on stderr says so: :mod:`flows.prefect_server`).

    Raises:
        tasks.engines.server.ServerStartError: it did not start (the message ends with its log).
    """
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value()).expanduser()
    server, started = ensure_server(home, _server_env(), _startup_timeout_s(startup_timeout_s))
    if started:
        print(
            f"Prefect: started infermeter's local API server ({server.url}, database in {home}); "
            f"later commands reuse it; it stops after {idle_limit_s() or DEFAULT_IDLE_S:.0f} s idle "
            f"({IDLE_ENV} sets that, 0 turns it off)",
            file=sys.stderr,
        )
    return server.url


@contextlib.contextmanager
def prefect_api(startup_timeout_s: float | None = None) -> Iterator[str]:
    """Yield the API URL flows run against inside the block.

    Raises:
        tasks.engines.server.ServerStartError: the local or temporary server did not start (the
            message ends with its log).
        ValueError: ``INFERMETER_PREFECT_IDLE_S`` is not a number >= 0.
    """
    import prefect
    from prefect.settings import PREFECT_API_URL

    from tasks.engines.server import background_server, free_port

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    if idle_limit_s() > 0:
        url = local_api_url(startup_timeout_s)
        with _api(url, own=True):
            yield url
        return
    env, timeout_s = _server_env(), _startup_timeout_s(startup_timeout_s)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(Path(prefect.__file__).parent.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    url = f"http://127.0.0.1:{port}/api"
    log_path = Path(tempfile.mkdtemp(prefix="infermeter-prefect-")) / "prefect_server.log"
    with (
        background_server(
            "Prefect's temporary API server",
            command,
            env,
            f"{url}/health",
            startup_timeout_s=timeout_s,
            log_path=log_path,
            timeout_hint="or start one with `prefect server start` and set PREFECT_API_URL",
        ),
        _api(url, own=True),
    ):
        yield url


@contextlib.contextmanager
def _api(url: str, own: bool = False) -> Iterator[None]:
    """Flows in the block call ``url`` (``own``: a server of ours); the logs and events they
    queued are sent before it ends."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_UI_URL,
        temporary_settings,
    )

    # no UI URL: Prefect would log "View at http://127.0.0.1:PORT/runs/..." for a server
    # without a UI; a lasting PREFECT_API_URL (a `prefect server start`) keeps it
    updates: dict = {PREFECT_API_URL: url, PREFECT_UI_URL: ""}
    if own and "PREFECT_FLOWS_HEARTBEAT_FREQUENCY" not in os.environ:
        # Flow-run heartbeats are events a server-side automation may watch to find crashed
        # runs; on a server of ours none does unless the user adds one (they can set the
        # variable). Their thread sleeps in 1 s steps and the flow joins it: 0-1 s (0.5 s on
        # average) of every command's end (tests/benchmarks/command_phases.py).
        updates[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] = None
    with temporary_settings(updates=updates):
        try:
            yield
        finally:
            # logs and events still queued go out while the server is up (after a temporary
            # one stops, the workers would retry a dead URL at exit)
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            for worker in (APILogWorker, EventsWorker):
                worker.drain_all(timeout=5)
