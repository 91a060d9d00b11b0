"""Sending a journal (``tasks.tracking.journal``) to a tracking store again: ``infermeter sync``.

Each entry goes through a :class:`tasks.tracking.Tracker` of its experiment (no journal: a
failure raises, and the entry is tried again next time); ``offline-<key>`` run ids are mapped to
the runs created for them, and a ``create_run`` finds the run an earlier try made by its key tag,
so nothing is created twice. Apart from ``tasks.tracking`` (which it drives, and which keeps the
writes a run makes); it imports no mlflow itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from tasks.tracking import PARENT_TAG, Tracker
from tasks.tracking.journal import OFFLINE_PREFIX


def replay(tracker: Tracker, entry: dict, ids: Mapping[str, str]) -> str | None:
    """Send one journal entry to ``tracker``'s store, ``offline-<key>`` run ids mapped through
    ``ids``. A ``create_run`` returns the run's id: the run its key tag finds (an earlier try
    that reached the server), else a new one.

    Raises:
        LookupError: the entry names an offline run that was never created.
        mlflow.exceptions.MlflowException: the server refused or did not answer.
    """

    def real(value: str) -> str:
        return ids.get(value, value)

    if entry["op"] == "create_run":
        tags = {k: real(v) if k == PARENT_TAG else v for k, v in entry["tags"].items()}
        found = tracker.find_run_by_key(entry["key"])
        return found or tracker.create_run(entry["name"], tags, entry["start_time_ms"])
    run_id = real(entry["run_id"])
    if run_id.startswith(OFFLINE_PREFIX):
        raise LookupError(f"journal entry {entry['id']}: run {run_id} was never created")
    op, data, file, client = entry["op"], entry.get("data"), entry.get("file"), tracker.client
    if op == "log_batch":
        tags = [[k, real(v) if k == PARENT_TAG else v] for k, v in entry["tags"]]
        tracker.send_batch(run_id, entry["metrics"], entry["params"], tags)
    elif op == "artifact":
        client.log_artifact(run_id, entry["path"], entry["artifact_path"])
    elif op in ("text", "dict", "table"):
        getattr(client, f"log_{op}")(run_id, data, file)
    elif op == "end":
        client.set_terminated(run_id, status=entry["status"], end_time=entry["end_time_ms"])
    return None


def journal_replayer(tracking_uri: str):
    """``replay(entry, ids)`` for :func:`tasks.tracking.journal.sync`: each entry through a
    tracker (no journal: failures raise) of its own experiment at ``tracking_uri``."""
    trackers: dict[str, Tracker] = {}

    def send(entry: dict, ids: Mapping[str, str]) -> str | None:
        name = entry["experiment"]
        if name not in trackers:
            trackers[name] = Tracker(name, tracking_uri)
        return replay(trackers[name], entry, ids)

    return send
