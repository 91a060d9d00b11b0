"""Pre-flight of the MLflow store a command writes to: the URI's scheme, a local store it would
fail on (a file store, a SQLite file that is no database), a tracking server that answers. Each
failure is a :class:`tasks.endpoint.preflight.PreflightError` naming the store (any password hidden) and
the fix, before any stage runs."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from tasks.endpoint.preflight import PreflightError, _error_text

#: The schemes of the tracking stores MLflow itself registers (``mlflow.tracking._tracking_service
#: .utils``): a local path (no scheme) or ``file:``, a tracking server, Databricks, and the
#: SQLAlchemy databases (also as ``engine+driver``, e.g. ``postgresql+psycopg2``).
TRACKING_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc")
DATABASE_ENGINES = ("sqlite", "postgresql", "mysql", "mssql")


def check_tracking_uri(uri: str) -> None:
    """``MLFLOW_TRACKING_URI`` must name a store MLflow can open: a known scheme (or one a
    plugin registers, entry point group ``mlflow.tracking_store``), and a host for a tracking
    server. Without this, ``htp:/oops`` ends in a long MLflow exception, after Prefect's start.

    Raises:
        PreflightError: (``tracking_uri``) an unknown scheme, or ``http(s):`` without a host.
    """
    from importlib.metadata import entry_points

    url = urlsplit(uri)
    scheme = url.scheme.lower()
    if scheme in ("http", "https") and not url.hostname:
        raise PreflightError(
            "tracking_uri",
            f"{uri!r} names no host; write {scheme}://HOST:PORT (e.g. {scheme}://127.0.0.1:5000)",
        )
    if (
        len(scheme) == 1  # a Windows drive letter: a local path
        or scheme in TRACKING_SCHEMES
        or scheme.partition("+")[0] in DATABASE_ENGINES
        or scheme in {entry.name for entry in entry_points(group="mlflow.tracking_store")}
    ):
        return
    raise PreflightError(
        "tracking_uri",
        f"{uri!r}: {scheme!r} is not a tracking store scheme MLflow knows; write http(s)://HOST:PORT "
        "(a tracking server), sqlite:///PATH/mlflow.db or a database URI (postgresql://...), or unset "
        "it for the local store",
    )


#: A local SQLite store larger than this is not read through (``PRAGMA quick_check``) before a
#: command: its header and schema are (a larger file's full read would cost seconds).
QUICK_CHECK_MAX_BYTES = 512 * 1024 * 1024


def check_local_store(uri: str) -> None:
    """A local tracking store MLflow would fail to open with a traceback, named in one line:
    a file store (``file:///DIR`` or a plain folder path), which MLflow 3 refuses unless
    ``MLFLOW_ALLOW_FILE_STORE=true`` (then it opens it: nothing to check), and a SQLite file
    that is not a database or is damaged (a text file named mlflow.db, a truncated copy:
    SQLite's header and schema are read, and a store of up to :data:`QUICK_CHECK_MAX_BYTES`
    read through by ``PRAGMA quick_check``). A store that does not exist yet is created by
    MLflow; one that is locked (another command writing) is not judged. Other stores (a
    tracking server, PostgreSQL) are not checked here.

    Raises:
        PreflightError: (``tracking_uri``) the store (its URI, any password hidden), why it
            cannot be opened, and the fix.
    """
    import sqlite3
    from pathlib import Path
    from urllib.parse import quote

    from tasks.tracking.values import shown_uri

    shown = shown_uri(uri)
    scheme = urlsplit(uri).scheme.lower()
    if scheme in ("", "file") or len(scheme) == 1:  # a Windows drive letter: a local path too
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1"):
            return
        raise PreflightError(
            "tracking_uri",
            f"{shown} is a file store (a folder of runs), which this MLflow no longer opens; write "
            "sqlite:///PATH/mlflow.db (`mlflow migrate-filestore` moves a folder's runs into one), "
            "or set MLFLOW_ALLOW_FILE_STORE=true to use the folder anyway",
        )
    if scheme.partition("+")[0] != "sqlite":
        return
    path = uri.partition("://")[2].removeprefix("/").partition("?")[0]
    if not path or path == ":memory:" or path.startswith("file:") or not Path(path).exists():
        return
    try:
        db = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=2)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            if Path(path).stat().st_size <= QUICK_CHECK_MAX_BYTES:
                said = db.execute("PRAGMA quick_check(1)").fetchone()[0]
                if said != "ok":
                    raise sqlite3.DatabaseError(said)
        finally:
            db.close()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):  # in use: another command writes to it
            return
        reason = f"SQLite cannot open it: {exc}"
    except sqlite3.DatabaseError as exc:
        reason = f"SQLite says: {exc}"
    else:
        return
    raise PreflightError(
        "tracking_uri",
        f"the MLflow store {shown} cannot be read ({reason}); restore the file from a copy, or "
        "point MLFLOW_TRACKING_URI at another store (a new sqlite:///PATH/mlflow.db starts empty)",
    )


def check_tracking_server(uri: str, timeout_s: float = 30.0) -> None:
    """An MLflow tracking server (``http(s)://``) that answers ``/health`` can still fail every
    call: its database refuses it (a wrong password in its ``--backend-store-uri``, a database
    that is down). One real read, ``GET /api/2.0/mlflow/experiments/search?max_results=1``,
    must answer 200 (no MLflow client: its retries take minutes).

    Raises:
        PreflightError: (``tracking_uri``) no answer, or an error status with the server's
            own message (``password authentication failed for user "x"``).
    """
    base = uri.rstrip("/")
    url = f"{base}/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:
        try:
            said = _error_text(exc.read(4096).decode(errors="replace"))
        except OSError:
            said = ""
        fatal = said.split("FATAL:", 1)[-1].split("(Background", 1)[0].strip(" :")
        raise PreflightError(
            "tracking_uri",
            f"the MLflow tracking server at {base} answered {exc.code} to GET "
            f"/api/2.0/mlflow/experiments/search ({fatal[:200]}); check the database URI the "
            "server was started with (--backend-store-uri), then restart it",
        ) from None
    except (urllib.error.URLError, OSError) as exc:  # e.g. a server retrying its database for minutes
        raise PreflightError(
            "tracking_uri",
            f"the MLflow tracking server at {base} does not answer GET /api/2.0/mlflow/experiments/search "
            f"({getattr(exc, 'reason', exc)} after {timeout_s:g} s); its log says why (a database that "
            "refuses it: check its --backend-store-uri)",
        ) from None
