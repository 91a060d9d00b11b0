"""Real servers for tests past one machine: PostgreSQL and an ``mlflow server`` on it.

Plain context managers (no pytest import), used by the session fixtures ``postgres`` and
``mlflow_pg_server`` in tests/conftest.py, and directly by tests that must kill and restart a
server (tests/test_tracking_server.py).

- :func:`postgres_cluster` runs the machine's PostgreSQL binaries (``/usr/lib/postgresql/*/bin``,
  Debian's ``postgresql`` package; ``PG_BIN`` overrides): ``initdb`` into a fresh folder with a
  password-authenticated (scram-sha-256) superuser, then ``postgres`` in the foreground on a
  free port of 127.0.0.1. PostgreSQL refuses to run as root: as root both run as ``nobody``
  (``setpriv``), the folder made in /tmp (pytest's own tmp folders are 0700 root) and chowned.
- :func:`mlflow_server` runs ``<venv>/bin/mlflow server`` on a backend URI with proxied
  artifacts (``--artifacts-destination``), ready once ``/health`` answers.

Both run under :mod:`tasks.engines.lifeline` (like the project's own servers): they die with the
process that started them however it ends, SIGKILL of pytest included.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.engines.server import background_server, free_port

__all__ = ["PgCluster", "mlflow_server", "pg_bin", "postgres_cluster", "wait_port"]

#: The unprivileged user PostgreSQL runs as when the tests run as root.
NOBODY_UID = 65534


def pg_bin() -> Path | None:
    """The folder of ``initdb``/``postgres``: ``PG_BIN``, else the newest
    ``/usr/lib/postgresql/<major>/bin``; None when neither exists."""
    if os.environ.get("PG_BIN"):
        return Path(os.environ["PG_BIN"])
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


@dataclass(frozen=True)
class PgCluster:
    """A running PostgreSQL: connect as ``user``/``password`` to 127.0.0.1:``port``.
    ``data_dir``: its data folder (``postgres.log`` beside it)."""

    host: str
    port: int
    user: str
    password: str
    data_dir: Path

    def uri(self, database: str, password: str | None = None) -> str:
        """``postgresql://user:pw@127.0.0.1:PORT/database``: SQLAlchemy 2.1 opens a plain
        ``postgresql://`` with psycopg 3 (``psycopg[binary]``, the dev extra), as a user's
        ``mlflow server --backend-store-uri postgresql://...`` would. ``password`` replaces the
        real one (a wrong-password test)."""
        pw = self.password if password is None else password
        return f"postgresql://{self.user}:{pw}@{self.host}:{self.port}/{database}"

    def execute(self, sql: str) -> None:
        """Run one statement as the superuser on database ``postgres`` (autocommit: CREATE
        DATABASE cannot run in a transaction)."""
        import psycopg

        with psycopg.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password,
            dbname="postgres",
            autocommit=True,
        ) as conn:
            conn.execute(sql)

    def create_database(self, name: str, owner: str | None = None, password: str | None = None) -> str:
        """Create database ``name``; with ``owner`` also that role (LOGIN, ``password``) owning
        it. Returns its URI as the owner (default the superuser) connects."""
        if owner:
            self.execute(f"CREATE ROLE \"{owner}\" LOGIN PASSWORD '{password}'")
            self.execute(f'CREATE DATABASE "{name}" OWNER "{owner}"')
            return f"postgresql://{owner}:{password}@{self.host}:{self.port}/{name}"
        self.execute(f'CREATE DATABASE "{name}"')
        return self.uri(name)


def _as_user_prefix() -> list[str]:
    """The command prefix that drops root to ``nobody`` (empty when not root)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups", "--"]


def wait_port(host: str, port: int, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Wait until ``host:port`` accepts TCP connections.

    Raises:
        RuntimeError: ``proc`` exited first, or ``timeout_s`` passed (the message ends with the
            log's tail).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}; {log_path}:\n{_tail(log_path)}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{host}:{port} not up after {timeout_s:.0f} s; {log_path}:\n{_tail(log_path)}")


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


def _stop_postgres(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGINT (PostgreSQL's fast shutdown: backends are ended, no waiting for clients) to the
    group, SIGKILL after ``grace_s``."""
    for signum in (signal.SIGINT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def postgres_cluster(user: str = "infermeter", password: str = "pw-infermeter") -> Iterator[PgCluster]:
    """initdb + ``postgres`` on a free port of 127.0.0.1 for the block; the data folder is
    removed afterwards.

    Raises:
        RuntimeError: no PostgreSQL binaries (install Debian's ``postgresql``), or initdb or
            the server failed (the message ends with the log).
    """
    bindir = pg_bin()
    if bindir is None or not (bindir / "initdb").exists():
        raise RuntimeError("no PostgreSQL binaries: apt-get install postgresql (or set PG_BIN)")
    root = Path(tempfile.mkdtemp(prefix="infermeter-pg-"))
    data, sockets, pwfile, log_path = root / "data", root / "sock", root / "pwfile", root / "postgres.log"
    sockets.mkdir()
    pwfile.write_text(password + "\n")
    if os.geteuid() == 0:
        for path in (root, sockets, pwfile):
            os.chown(path, NOBODY_UID, NOBODY_UID)
    env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "HOME": str(root)}
    prefix = _as_user_prefix()
    try:
        done = subprocess.run(
            [*prefix, str(bindir / "initdb"), "-D", str(data), "-U", user, f"--pwfile={pwfile}",
             "--auth=scram-sha-256", "--encoding=UTF8", "--no-sync"],
            env=env, capture_output=True, text=True, cwd=root,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr[-2000:]}")
        port = free_port()
        watch, hold = os.pipe()
        try:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-P", "-m", "tasks.engines.lifeline", str(watch), *prefix,
                     str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
                     "-k", str(sockets), "-c", "fsync=off", "-c", "max_connections=200"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    cwd=root, start_new_session=True, pass_fds=(watch,),
                )  # fmt: skip
        finally:
            os.close(watch)
        try:
            wait_port("127.0.0.1", port, proc, 60, log_path)
            yield PgCluster("127.0.0.1", port, user, password, data)
        finally:
            try:
                _stop_postgres(proc)
            finally:
                os.close(hold)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def mlflow_server(
    backend_uri: str,
    artifacts_dir: Path,
    port: int | None = None,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """``mlflow server --backend-store-uri BACKEND --artifacts-destination DIR`` (artifacts
    proxied through the server: clients never see DIR) on 127.0.0.1:``port`` (default a free
    one), one worker; yields ``http://127.0.0.1:PORT`` once ``/health`` answers 200, stops it
    (with its workers) when the block ends. A ``port`` given again after the block restarts
    the same server on the same database. ``env``: extra environment for the server (e.g.
    ``MLFLOW_SQLALCHEMYSTORE_POOLCLASS=NullPool``: a new database connection per request).

    Raises:
        tasks.engines.server.ServerStartError: it exited or did not answer in 120 s (with its log).
    """
    port = port or free_port()
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path or artifacts_dir.parent / f"mlflow-server-{port}.log"
    command = [
        str(Path(sys.executable).parent / "mlflow"), "server",
        "--backend-store-uri", backend_uri,
        "--artifacts-destination", str(artifacts_dir),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, **(env or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    url = f"http://127.0.0.1:{port}"
    with background_server(
        "mlflow server", command, env, f"{url}/health", startup_timeout_s=120, log_path=log_path
    ):
        yield url
