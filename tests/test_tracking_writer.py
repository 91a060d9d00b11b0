"""The tracking writer process (tasks.tracking.writer, issue 29): the same calls through it and
through an in-process Tracker leave the same MLflow runs; a failed write raises in the command;
what the command sent before a SIGKILL, and the KILLED end it sends after a Ctrl-C at the
terminal, land; the runs are owned by the command, not by the writer."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tasks.pipeline.stream_files import stage_plots
from tasks.report import plots
from tasks.tracking import PARENT_TAG, Tracker, TrackingTarget
from tasks.tracking import writer as tracking_writer
from tasks.tracking.run_owner import OWNER_TAG, process_identity

START_MS = 1_700_000_000_000


@pytest.fixture
def writer(tmp_path, monkeypatch):
    """A tracking writer for this test process, on a fresh SQLite store; closed after."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'remote.db'}")
    tracking_writer.start(("tasks.report.plots:_pyplot",))
    try:
        yield tracking_writer._WRITER
    finally:
        tracking_writer.close()


def _calls(tracker, folder: Path) -> tuple[str, str]:
    """Every kind of write a flow makes, the same through either tracker."""
    parent = tracker.start_run("parent", tags={"k": "v", "n": 3})
    child = tracker.start_run("child", parent, {"stage": "x"}, start_time_ms=START_MS)
    tracker.log_params(child, {f"p{i}": str(i) for i in range(150)})  # > one batch of 100
    tracker.log_metrics(child, {"a": 1.5, "b": None, "c": float("nan"), **{f"m{i}": i for i in range(1200)}})
    tracker.log_metric_series(child, "decode_step_ms", [1.0, 2.0, 3.0])
    tracker.set_tags(child, {"error": "x" * 600})
    tracker.log_text(child, "hello", "summary.md")
    tracker.log_dict(child, {"x": [1, 2]}, "config.yaml")
    tracker.log_table(child, [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}], "table.json")
    (folder / "f.csv").write_text("a\n1\n", encoding="utf-8")
    tracker.log_artifact(child, folder / "f.csv", "files")
    tracker.log_artifact(child, folder / "missing.csv", "files")  # skipped, as in process
    levels = [
        {"max_concurrency": c, "request_rate": None, "metrics": dict.fromkeys(plots._CURVE_KEYS, 10.0 * c)}
        for c in (1, 4)
    ]
    tracking_writer.run_job(
        tracker, stage_plots, child, levels, str(folder / "plots"), [str(folder / "f.csv")]
    )
    tracker.end_run(child, end_time_ms=START_MS + 1000)
    tracker.end_run(parent, "FAILED")
    return parent, child


def _contents(uri: str, folder: Path) -> dict:
    """The runs of a store by name: status, params, metrics (and the steps of two), tags (run
    ids made comparable) and the artifacts (the text ones' bytes)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    names = {run.info.run_id: run.info.run_name for run in runs}
    out = {}
    for run in runs:
        run_id = run.info.run_id
        history = {
            key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
            for key in {"a", "decode_step_ms"} & set(run.data.metrics)
        }
        files = {}
        for top in client.list_artifacts(run_id):
            for art in client.list_artifacts(run_id, top.path) if top.is_dir else [top]:
                local = Path(client.download_artifacts(run_id, art.path, str(folder)))
                files[art.path] = (
                    local.read_bytes()
                    if art.path.endswith((".md", ".yaml", ".json", ".csv"))
                    else local.stat().st_size > 0
                )
        tags = {k: names.get(v, v) if k == PARENT_TAG else v for k, v in run.data.tags.items()}
        out[run.info.run_name] = {
            "status": run.info.status,
            "start": run.info.start_time if run.info.run_name == "child" else None,
            "end": run.info.end_time if run.info.run_name == "child" else None,
            "params": run.data.params,
            "metrics": run.data.metrics,
            "history": history,
            "tags": tags,
            "files": files,
        }
    return out


def test_the_writer_leaves_the_same_runs_as_a_tracker_in_process(writer, tmp_path) -> None:
    remote_uri, local_uri = f"sqlite:///{tmp_path / 'remote.db'}", f"sqlite:///{tmp_path / 'local.db'}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    remote = TrackingTarget("e", remote_uri, True, str(tmp_path / "a")).open()
    assert isinstance(remote, tracking_writer.RemoteTracker)
    before_ms = time.time() * 1000
    parent, _ = _calls(remote, tmp_path / "a")
    after_ms = time.time() * 1000
    assert parent.startswith(tracking_writer.STAND_IN)  # a stand-in: the command did not wait
    parent = tracking_writer.real_run_id(remote, parent)
    tracking_writer.flush(remote)
    _calls(Tracker("e", local_uri, True, str(tmp_path / "b")), tmp_path / "b")

    got, want = _contents(remote_uri, tmp_path / "got"), _contents(local_uri, tmp_path / "want")
    for runs, folder in ((got, "a"), (want, "b")):  # the records folders and run keys differ, only they
        for run in runs.values():
            assert run["tags"].pop("records_folder") == str(tmp_path / folder)
            assert len(run["tags"].pop("infermeter_run_key")) == 32
    assert got == want
    from mlflow.tracking import MlflowClient

    assert got["child"]["tags"][OWNER_TAG] == process_identity()  # the command's, not the writer's
    assert got["child"]["tags"][PARENT_TAG] == "parent"  # the stand-in was put right
    assert MlflowClient(remote_uri).get_run(parent).info.run_name == "parent"
    assert sorted(got["child"]["files"]) == sorted(  # the job's plots too
        ["config.yaml", "files/f.csv", "plots/f.csv", "summary.md", "table.json"]
        + [f"plots/load_{name}.png" for name, _ in plots.LOAD_CHARTS]
    )
    assert len(got["child"]["metrics"]) == 1200 + 2  # the finite ones, and the series
    assert got["child"]["history"]["decode_step_ms"] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    # the metrics carry the command's time of the call, not the writer's
    client = MlflowClient(remote_uri)
    child = client.search_runs(
        [client.get_experiment_by_name("e").experiment_id], "attributes.run_name = 'child'"
    )
    stamp = client.get_metric_history(child[0].info.run_id, "a")[0].timestamp
    assert before_ms - 1 <= stamp <= after_ms + 1


def test_a_write_refused_in_the_writer_raises_in_the_command(writer, tmp_path) -> None:
    from mlflow.exceptions import MlflowException

    tracker = TrackingTarget("e", None, True, None).open()
    run = tracker.start_run("r")  # a stand-in id: put right in the writer
    tracker.log_params(run, {"p": "1"})
    tracker.log_params(run, {"p": "2"})  # MLflow params are write-once
    with pytest.raises(MlflowException, match="p"):
        tracking_writer.flush(tracker)
    tracker.end_run(run)  # the writer goes on after a failed call
    tracking_writer.flush(tracker)
    assert tracker.find_runs("", parents_only=True)[0]["status"] == "FINISHED"


def test_level_histogram_paths_are_the_files_drawn(tmp_path) -> None:
    level = {"max_concurrency": 2, "request_rate": None, "requests": [{"ttft_ms": 3.0, "itl_ms": [1.0, 2.0]}]}
    drawn = plots.level_histograms(level, tmp_path, "level2")
    assert drawn == plots.level_histogram_paths(tmp_path, "level2") and all(p.is_file() for p in drawn)


_COMMAND = textwrap.dedent(
    """
    import os, signal, sys, time
    from tasks.tracking import writer as tracking_writer
    from tasks.tracking import TrackingTarget

    tracking_writer.start()
    tracker = TrackingTarget("e", sys.argv[1], True, None).open()
    run = tracking_writer.real_run_id(tracker, tracker.start_run("r"))
    print(run, tracking_writer._WRITER.process.pid, flush=True)
    tracker.log_params(run, {f"p{i}": str(i) for i in range(300)})
    tracker.log_text(run, "x" * 200_000, "big.txt")
    if sys.argv[2].startswith("kill"):
        if sys.argv[2] == "kill":
            tracker.end_run(run)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        tracker.end_run(run, "KILLED")
    """
)


@pytest.mark.parametrize("how", ["kill", "kill-open", "ctrl-c"])
def test_what_the_command_sent_lands_after_a_sigkill_or_a_ctrl_c(how, tmp_path) -> None:
    """SIGKILL of the command right after its calls: the writer still makes them; a run the
    command had not ended (``kill-open``) the writer then ends KILLED, naming the process
    (issue 31; before: RUNNING until the next command). A Ctrl-C at the terminal (SIGINT to
    the whole process group): the writer ignores it, and the KILLED end the command sends then
    lands before the command exits."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _COMMAND, uri, how],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
        start_new_session=True,
    )
    try:
        run_id, writer_pid = proc.stdout.readline().split()
        writer = psutil.Process(int(writer_pid))
        if how == "ctrl-c":
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        writer.wait(timeout=120)  # gone once it has made every call it was sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == ("FINISHED" if how == "kill" else "KILLED")
    if how == "kill-open":
        assert run.data.tags["error"] == (
            f"killed: process {proc.pid} on {socket.gethostname()} ended without ending this run"
        )
    assert len(run.data.params) == 300 and run.data.tags[OWNER_TAG].split("/")[2] == str(proc.pid)
    assert [a.path for a in MlflowClient(uri).list_artifacts(run_id)] == ["big.txt"]


def test_an_answer_read_later_is_kept_while_other_calls_wait(writer, tmp_path) -> None:
    """close_abandoned_later: the command goes on; the writer's answer, read after another
    waiting call, still holds the run a dead process left RUNNING (flows.runs.parent_run)."""
    from tasks.tracking.run_owner import OWNER_HOST_TAG

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    uri = f"sqlite:///{tmp_path / 'remote.db'}"
    owner = {OWNER_TAG: process_identity(dead.pid), OWNER_HOST_TAG: socket.gethostname()}
    Tracker("e", uri, True, str(tmp_path)).start_run("ghost", tags=owner)
    tracker = TrackingTarget("e", uri, True, str(tmp_path)).open()
    abandoned = tracking_writer.close_abandoned_later(tracker)
    run = tracker.start_run("r")
    assert tracking_writer.real_run_id(tracker, run) != run  # a waiting call read past the answer
    assert [gone["name"] for gone in abandoned()] == ["ghost"]
    tracker.end_run(run)
    tracking_writer.flush(tracker)
    assert {r["name"]: r["status"] for r in tracker.find_runs("")} == {"ghost": "KILLED", "r": "FINISHED"}


class OnlyHere:
    """Pickled by reference to this test module, which the writer process cannot import."""


def test_a_call_the_writer_cannot_read_ends_it_and_the_command_is_told(writer, tmp_path) -> None:
    """A call the writer cannot unpickle: it ends (exit 1, the traceback on its stderr) and the
    command's next wait raises WriterGone. Before, its reading thread died of the error and both
    processes waited for ever (a command SIGKILLed then left the writer running, parent 1)."""
    uri = f"sqlite:///{tmp_path / 'remote.db'}"
    tracker = TrackingTarget("e", uri, True, str(tmp_path)).open()
    run = tracker.start_run("r")
    tracker.set_tags(run, {"what": OnlyHere()})
    raised: list[BaseException] = []

    def wait() -> None:  # the wait hung before: in a thread, so that a hang fails the test
        try:
            tracking_writer.flush(tracker)
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    waiting.join(60)
    if waiting.is_alive():
        writer.process.kill()  # ends the wait (the answers' pipe closes), and the fixture's close
        pytest.fail("the command still waits on a writer that could not read a call")
    assert len(raised) == 1 and isinstance(raised[0], tracking_writer.WriterGone), raised
    assert "exited (code 1)" in str(raised[0])
    assert writer.process.wait(timeout=10) == 1
    with pytest.raises(tracking_writer.WriterGone):  # and the command's close says so too
        tracking_writer.close()
