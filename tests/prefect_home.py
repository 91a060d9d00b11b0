"""A fresh ``PREFECT_HOME`` whose database is already migrated, for the tests of a command's
own Prefect server (tests/test_run_states.py, tests/test_prefect_server.py, the Ctrl-C test of
tests/test_stream_load.py).

Why: on an empty ``PREFECT_HOME`` the server a command starts first runs Prefect's migrations:
``infermeter stream --no-track`` of 4 requests with ``INFERMETER_PREFECT_IDLE_S=0`` took 23-25 s
there against 13-14 s on a copy of a migrated database (2 cores), and a dozen tests start such
a server. What they check (the server's start, reuse, idle stop, and that it dies with the
command) does not depend on the migrations; tests/test_prefect_server.py's concurrent-start
test keeps an empty home, where the start is slowest and the lock matters most.

The session fixture ``shared_prefect_api`` (tests/conftest.py) saves the template once its own
server answers (migrated, before any test records a flow run in it).
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

#: Where the template was saved this session (None before, or when saving failed).
_template: list[Path] = []


def save_template(home: Path, to: Path) -> None:
    """Copy ``home``'s live ``prefect.db`` (WAL mode, its server running) into ``to`` with
    SQLite's online backup, which reads a consistent snapshot."""
    source = sqlite3.connect(f"file:{home / 'prefect.db'}?mode=ro", uri=True)
    target = sqlite3.connect(to)
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()
    _template[:] = [to]


def migrated_home(folder: Path) -> Path:
    """Create ``folder`` as a ``PREFECT_HOME`` holding a copy of the migrated template (an empty
    home if the session saved none); a home that has a database already keeps it (a test's
    second command finds the first one's runs); returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if _template and not (folder / "prefect.db").exists():
        shutil.copyfile(_template[0], folder / "prefect.db")
    return folder
