"""The Prefect API a CLI command runs its flow against.

With ``PREFECT_API_URL`` set (a ``prefect server start`` of the user's, or Prefect Cloud), that
one. Without it Prefect would start its own temporary server on the first API call, as a child
in our process group: a Ctrl-C at the terminal then stops that server too, and Prefect's client
spends minutes retrying it to report the interrupted run before the command exits. So the
command starts the same temporary server itself (the same uvicorn app and settings as
``prefect.server.api.server.SubprocessASGIServer``), in its own session: a Ctrl-C reaches only
the command, the flow run is marked as interrupted, and then the server is stopped.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["STARTUP_TIMEOUT_S", "prefect_api"]

#: How long the temporary server may take to answer /health, in seconds, unless
#: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS says otherwise.
STARTUP_TIMEOUT_S = 120.0


@contextlib.contextmanager
def prefect_api(startup_timeout_s: float | None = None) -> Iterator[str]:
    """Yield the API URL flows run against inside the block.

    Raises:
        tasks.server.ServerStartError: the temporary server did not start (the message ends
            with its log).
    """
    import prefect
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        PREFECT_UI_URL,
        get_current_settings,
        temporary_settings,
    )

    from tasks.server import background_server, free_port

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
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
    env = {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        # what Prefect's own temporary server sets: no UI, the local ephemeral database
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    url = f"http://127.0.0.1:{port}/api"
    log_path = Path(tempfile.mkdtemp(prefix="infermeter-prefect-")) / "prefect_server.log"
    # Prefect's default (20 s) is too short on a busy 2-core machine, where a fresh database's
    # migrations alone took longer (seen in tests and a first audit); a dead server still fails
    # at once (background_server watches the process). A value the user set is kept.
    user_set = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in os.environ
    timeout_s = startup_timeout_s or (
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() if user_set else STARTUP_TIMEOUT_S
    )
    with background_server(
        "Prefect's temporary API server",
        command,
        env,
        f"{url}/health",
        startup_timeout_s=timeout_s,
        log_path=log_path,
        timeout_hint="or start one with `prefect server start` and set PREFECT_API_URL",
    ):
        # no UI URL: Prefect would log "View at http://127.0.0.1:PORT/runs/..." for a server
        # (without a UI) that is gone when the command ends; a lasting PREFECT_API_URL keeps it
        with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_UI_URL: ""}):
            try:
                yield url
            finally:
                # logs and events still queued go out while the server is up (after it stops,
                # the workers would retry a dead URL at exit)
                from prefect.events.worker import EventsWorker
                from prefect.logging.handlers import APILogWorker

                for worker in (APILogWorker, EventsWorker):
                    worker.drain_all(timeout=5)
