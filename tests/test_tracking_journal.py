"""The tracking journal without a server: a tracker whose server refuses connections journals
its writes in the run folder, and a sync replays them into a real MLflow store, once.

(The same against a real ``mlflow server`` on PostgreSQL, killed mid-sweep and restarted:
tests/test_tracking_server.py.)
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from tasks.engines.server import free_port
from tasks.tracking import PARENT_TAG, Tracker
from tasks.tracking.journal import offline_note, pending_entries, short_reason, sync
from tasks.tracking.sync import journal_replayer


def test_gone_server_journals_then_sync_replays_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once, no backoff
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tracker = Tracker("journal-test", gone, journal=str(tmp_path))
    assert tracker.offline
    parent = tracker.start_run("parent", tags={"flow": "sweep"})
    child = tracker.start_run("child", parent_run_id=parent)
    assert parent.startswith("offline-") and child.startswith("offline-")
    tracker.log_params(child, {"temperature": "0.5"})
    tracker.log_metrics(child, {"ttft_ms_p50": 12.5, "skipped": None})
    tracker.log_metric_series(child, "decode_step_ms", [1.0, 2.0, 3.0])
    tracker.log_table(child, [{"sample": 0, "text": "a"}, {"sample": 1, "text": "b"}], "samples.json")
    (tmp_path / "requests.parquet").write_bytes(b"PAR1")
    tracker.log_artifact(child, tmp_path / "requests.parquet")
    tracker.end_run(child, "FINISHED")
    tracker.end_run(parent, "FINISHED")

    note = offline_note(tmp_path)
    assert note.uri == gone and note.reason == "Connection refused"
    entries, _ = pending_entries(tmp_path)
    assert [e["op"] for e in entries] == [
        "create_run", "create_run", "log_batch", "log_batch", "log_batch", "table", "artifact", "end", "end",
    ]  # fmt: skip
    assert tracker.find_runs("attributes.status = 'FINISHED'") == []  # offline: no reads

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = sync(tmp_path, store, journal_replayer(store))
    assert (first.sent, first.runs_created) == (9, 2)
    client = MlflowClient(tracking_uri=store)
    runs = {
        r.info.run_name: r
        for r in client.search_runs([client.get_experiment_by_name("journal-test").experiment_id])
    }
    assert set(runs) == {"parent", "child"}
    got = runs["child"]
    assert got.data.tags[PARENT_TAG] == runs["parent"].info.run_id
    assert got.data.params == {"temperature": "0.5"} and got.data.metrics["ttft_ms_p50"] == 12.5
    assert [m.value for m in client.get_metric_history(got.info.run_id, "decode_step_ms")] == [1.0, 2.0, 3.0]
    assert {a.path for a in client.list_artifacts(got.info.run_id)} == {"samples.json", "requests.parquet"}
    assert got.info.status == "FINISHED" and runs["parent"].info.status == "FINISHED"

    again = sync(tmp_path, store, journal_replayer(store))
    assert again.sent == 0 and len(client.search_runs([got.info.experiment_id])) == 2


def test_short_reason_names_the_cause():
    refused = (
        "API request to http://h/api failed with exception HTTPConnectionPool(host='h', port=1): Max retries "
        "exceeded (Caused by NewConnectionError('...: Failed to establish a new connection: [Errno 111] "
        "Connection refused'))"
    )
    assert short_reason(refused) == "Connection refused"
    assert short_reason("Caused by ResponseError('too many 503 error responses')") == "HTTP 503 after retries"
