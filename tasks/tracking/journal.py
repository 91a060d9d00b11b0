"""The tracking journal: MLflow writes a run could not deliver, kept in its work folder.

When the tracking server stops answering in the middle of a run, :class:`tasks.tracking.Tracker`
goes offline for the rest of the run (its first failed call is the only one that waits on
MLflow's retries) and appends every write from then on, the failed one included, here instead:
``<workdir>/tracking/journal-<pid>-<id>.jsonl``, one JSON line per call, flushed and fsynced as
written (a crash keeps every line before it). Files the calls upload are copied into
``<workdir>/tracking/files/`` first: the originals may be temporary. ``offline.json`` says
which server stopped answering, when, and why; its presence sends every tracker of the run,
in any process, straight to the journal. ``infermeter sync RUN_FOLDER`` replays the lines in
time order and appends each replayed line's id to ``synced.jsonl``, so a second sync (or one
after a sync that was itself cut off) sends only what is left.

An entry: ``{"id", "ns" (time.time_ns() when written), "op", "experiment", ...op's fields}``.
Ops: ``create_run`` (``key``, ``name``, ``tags``, ``start_time_ms``; the run is tagged
``infermeter_run_key`` = key, so a create that reached the server before it fell over is found
again, never duplicated), ``log_batch`` (``run_id``, ``metrics`` [[key, value, ts_ms, step]],
``params`` / ``tags`` [[key, value]]), ``artifact`` (``run_id``, ``path``, ``artifact_path``),
``text`` / ``dict`` / ``table`` (``run_id``, ``data``, ``file``), ``end`` (``run_id``,
``status``, ``end_time_ms``). A run created offline has the id ``offline-<key>`` until synced.
Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "OFFLINE_PREFIX",
    "Journal",
    "OfflineNote",
    "SyncResult",
    "mark_synced",
    "offline_note",
    "pending_entries",
    "sync",
]

#: The folder under a run's work folder that holds the journal.
FOLDER = "tracking"
#: Run ids handed out while offline: ``offline-<key>``.
OFFLINE_PREFIX = "offline-"
#: The tag that finds a run again by the key its journal gave it.
RUN_KEY_TAG = "infermeter_run_key"


@dataclass(frozen=True)
class OfflineNote:
    """Why a run's tracking went to its journal: the tracking ``uri``, the ``reason`` (the
    client's error, one line), ``since`` (ISO time, UTC) and the journal ``folder``."""

    uri: str
    reason: str
    since: str
    folder: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _write_line(path: Path, data: dict) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(data, ensure_ascii=False, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _read_lines(path: Path) -> list[dict]:
    """The JSON lines of ``path``; a last line cut by a crash is skipped."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def short_reason(text: str) -> str:
    """The cause in an MLflow client error, in a few words: ``Connection refused``, ``HTTP 500
    after retries``, ``timed out``; else its first 200 characters."""
    import re

    for pattern, form in (
        (r"\[Errno -?\d+\] ([^'\")]+)", "{0}"),
        (r"too many (\d{3}) error responses", "HTTP {0} after retries"),
        (r"error code (\d{3})", "HTTP {0}"),
        (r"(?i)(timed? ?out)", "timed out"),
    ):
        found = re.search(pattern, text)
        if found:
            return form.format(found.group(1).strip())
    return " ".join(text.split())[:200]


class Journal:
    """One tracker's journal file in ``<workdir>/tracking/`` (thread-safe appends)."""

    def __init__(self, workdir: str | Path) -> None:
        self.folder = Path(workdir) / FOLDER
        self._name = f"journal-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._seq = 0

    @property
    def offline(self) -> bool:
        """Whether any tracker of this run has found the server gone (``offline.json``)."""
        return (self.folder / "offline.json").is_file()

    def go_offline(self, uri: str, reason: str) -> None:
        """Record that the server at ``uri`` stopped answering (the first tracker's reason stays)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        note = OfflineNote(
            uri, short_reason(reason), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), str(self.folder)
        )
        try:
            with open(self.folder / "offline.json", "x", encoding="utf-8") as handle:
                json.dump(note.to_dict(), handle)
        except FileExistsError:
            pass

    def append(self, op: str, experiment: str, fields: dict[str, Any]) -> None:
        """Append one call; artifact ``path`` fields are copied into the journal first."""
        with self._lock:
            self._seq += 1
            entry_id = f"{self._name}:{self._seq}"
            if op == "artifact":
                keep = self.folder / "files" / f"{self._name}-{self._seq}"
                keep.mkdir(parents=True, exist_ok=True)
                fields = {**fields, "path": str(shutil.copy2(fields["path"], keep))}
            self.folder.mkdir(parents=True, exist_ok=True)
            entry = {"id": entry_id, "ns": time.time_ns(), "op": op, "experiment": experiment, **fields}
            _write_line(self.folder / f"{self._name}.jsonl", entry)


def offline_note(workdir: str | Path) -> OfflineNote | None:
    """The run's :class:`OfflineNote`, None when its tracking never went offline."""
    path = Path(workdir) / FOLDER / "offline.json"
    try:
        return OfflineNote(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def pending_entries(workdir: str | Path) -> tuple[list[dict], dict[str, str]]:
    """The journal's entries not yet synced, oldest first, and the ``offline-<key>`` -> run id
    map of the runs an earlier sync created."""
    folder = Path(workdir) / FOLDER
    synced = _read_lines(folder / "synced.jsonl")
    done = {s["id"] for s in synced}
    ids = {s["offline_id"]: s["run_id"] for s in synced if s.get("offline_id")}
    entries = [e for path in sorted(folder.glob("journal-*.jsonl")) for e in _read_lines(path)]
    return sorted((e for e in entries if e["id"] not in done), key=lambda e: e["ns"]), ids


def mark_synced(
    workdir: str | Path, entry_id: str, offline_id: str | None = None, run_id: str | None = None
) -> None:
    """Record that ``entry_id`` reached the server (for a created run: its real id)."""
    line: dict[str, str] = {"id": entry_id}
    if offline_id:
        line.update(offline_id=offline_id, run_id=run_id or "")
    _write_line(Path(workdir) / FOLDER / "synced.jsonl", line)


@dataclass(frozen=True)
class SyncResult:
    """What one sync sent to ``uri``: ``sent`` journal entries of the run folder ``folder``,
    ``runs_created`` of them runs (a run found again by its key counts too)."""

    folder: str
    uri: str
    sent: int
    runs_created: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sync(
    workdir: str | Path, uri: str, replay: Callable[[dict, Mapping[str, str]], str | None]
) -> SyncResult:
    """Send the run's unsynced journal entries, oldest first, through ``replay(entry, ids)``
    (:func:`tasks.tracking.sync.journal_replayer`), marking each as it lands: a sync cut off half
    way resumes after the last entry it sent.

    Raises:
        whatever ``replay`` raises (the server refused or is gone again); the entries sent
        before it stay marked.
    """
    entries, ids = pending_entries(workdir)
    created = 0
    for entry in entries:
        run_id = replay(entry, ids)
        if entry["op"] == "create_run":
            offline_id = OFFLINE_PREFIX + entry["key"]
            ids[offline_id] = run_id
            mark_synced(workdir, entry["id"], offline_id, run_id)
            created += 1
        else:
            mark_synced(workdir, entry["id"])
    return SyncResult(str(workdir), uri, len(entries), created)
