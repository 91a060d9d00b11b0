"""Run states never lie (issue 14, item 1): a command stopped by SIGTERM marks its MLflow runs
KILLED with what it measured logged and names its records folder; no server it started (the
temporary Prefect API server, the embedded llama.cpp server) outlives it, whether it ends by
SIGTERM or SIGKILL; a profile point whose child hangs is stopped after its limit and recorded
as failed while the sweep goes on. Real processes and a real MLflow SQLite store throughout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tasks.profile.grid import profile_points

try:
    from tests import groundtruth_server as gt
except ImportError:  # run from tests/
    import groundtruth_server as gt

BIN = Path(sys.executable).parent / "infermeter"


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


def _start(args: list[str], tmp_path: Path, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """The command in its own session (a signal to it reaches only it), output to a log."""
    full_env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    full_env.update(
        PREFECT_HOME=str(tmp_path / "prefect"), INFERMETER_WORK_DIR=str(tmp_path / "w"), **(env or {})
    )
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(BIN), *args], env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, log


def _wait_for(proc: subprocess.Popen, log: Path, ready, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        if ready():
            return
        time.sleep(0.2)
    raise AssertionError(f"not ready after {timeout_s} s: {log.read_text()[-3000:]}")


def _journal_lines(tmp_path: Path) -> int:
    found = list((tmp_path / "w").glob("*-stream-*/requests.jsonl"))
    return len(found[0].read_text().splitlines()) if found else 0


def _servers(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every descendant of the command that is a server, its watcher, or a client process."""
    names = ("prefect.server.api.server", "llama_cpp.server", "tasks.lifeline", "multiprocessing.spawn")
    out = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if any(name in " ".join(child.cmdline()) for name in names):
                out.append(child)
        except psutil.Error:
            continue
    return out


def _assert_all_gone(family: list[psutil.Process], proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=120)
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        for member in family:  # never leave one behind, even when the test fails
            try:
                member.kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_server_command_takes_its_server_with_it(signum, tmp_path) -> None:
    """`infermeter server` killed by SIGTERM or SIGKILL: the llama.cpp server is gone and its
    port closed (before: SIGKILL left it serving, 280 MB)."""
    proc, log = _start(["server", "--n-ctx", "512"], tmp_path)
    _wait_for(proc, log, lambda: "base_url:" in log.read_text())
    port = int(log.read_text().split("base_url: http://127.0.0.1:")[1].split("/")[0])
    family = _servers(proc)
    assert any("llama_cpp.server" in " ".join(p.cmdline()) for p in family)
    os.kill(proc.pid, signum)
    _assert_all_gone(family, proc)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_sigterm_mid_stream_marks_the_runs_killed(server, tmp_path) -> None:
    """SIGTERM (what `timeout` sends) mid-run: exit 130, the message names the records folder,
    the parent and stream runs end KILLED (not RUNNING) with the journal logged, the temporary
    Prefect API server is gone, and no "View at" link to it was printed."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["stream", "--base-url", server.base_url, "--model", "ticks:50:20", "--num-requests", "400"]
    proc, log = _start(
        [*args, "--max-concurrency", "2", "--warmup", "0"], tmp_path, {"MLFLOW_TRACKING_URI": uri}
    )
    _wait_for(proc, log, lambda: _journal_lines(tmp_path) >= 3)
    family = _servers(proc)
    assert any("prefect.server.api.server" in " ".join(p.cmdline()) for p in family)
    os.kill(proc.pid, signal.SIGTERM)
    _assert_all_gone(family, proc)
    assert proc.returncode == 130, log.read_text()[-3000:]
    text = log.read_text()
    workdir = next((tmp_path / "w").glob("*-stream-*"))
    assert "Interrupted" in text and str(workdir) in text.replace("\n", "")
    assert "View at" not in text
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    status = {run.info.run_name: run.info.status for run in runs}
    assert status["stream"] == "KILLED" and "RUNNING" not in status.values(), status
    stage = next(run for run in runs if run.info.run_name == "stream")
    assert stage.data.tags["error"].startswith("interrupted")
    assert "requests.jsonl" in [a.path for a in client.list_artifacts(stage.info.run_id)]
    parent = next(run for run in runs if "mlflow.parentRunId" not in run.data.tags)
    assert parent.info.status == "KILLED"


def test_sigkill_mid_stream_leaves_no_server(tmp_path) -> None:
    """SIGKILL (a test runner's kill, the OOM killer) of a stream against the embedded server:
    its watchers stop the llama.cpp server and the temporary Prefect API server (before: both
    stayed up for good, about 200 MB and 280 MB), and the level's client process follows its
    parent (before: it blocked for ever at exit, flushing records into a queue nobody read)."""
    proc, log = _start(
        ["stream", "--num-requests", "200", "--max-tokens", "16", "--warmup", "0", "--no-track"], tmp_path
    )
    _wait_for(proc, log, lambda: _journal_lines(tmp_path) >= 1)
    family = _servers(proc)
    cmdlines = " ".join(" ".join(p.cmdline()) for p in family)
    assert "llama_cpp.server" in cmdlines and "prefect.server.api.server" in cmdlines
    assert "multiprocessing.spawn" in cmdlines  # the level's client process
    os.kill(proc.pid, signal.SIGKILL)
    _assert_all_gone(family, proc)


def test_a_hung_profile_child_is_stopped_and_the_sweep_goes_on(monkeypatch) -> None:
    """A point's child that hangs (the test-only hook makes the N=16 child sleep 600 s) is
    killed at its limit and recorded as PointTimedOut; the N=8 point still runs (before: the
    sweep waited forever)."""
    from tasks.profile.runner import run_sweep

    monkeypatch.setenv("INFERMETER_TEST_CHILD_HANG_S", "600:16")
    monkeypatch.setenv("INFERMETER_PROFILE_CHILD_LIMIT_S", "60")
    points = profile_points([16, 8], [1], ["float32"], [0], [2])
    began = time.monotonic()
    results = run_sweep(
        "arch:smollm2-135m",
        points,
        repeats=1,
        warmup=0,
        device="cpu",
        num_layers=1,
        child_fraction=0,
    )
    took_s = time.monotonic() - began
    by_length = {r.point.prompt_tokens: r for r in results}
    assert by_length[16].error.startswith("PointTimedOut:") and "60 s" in by_length[16].error
    assert by_length[16].child_process and by_length[16].measurement is None
    assert by_length[8].error is None and by_length[8].measurement is not None
    assert took_s < 600
    assert not [c for c in psutil.Process().children() if "spawn_main" in " ".join(c.cmdline())]


def test_the_child_limit_follows_its_estimate(monkeypatch) -> None:
    from tasks.profile.limits import (
        CHILD_LOAD_BYTES_PER_S,
        CHILD_READ_BYTES_PER_S,
        CHILD_START_S,
        child_time_limit_s,
    )
    from tasks.profile.memory import PointMemory

    monkeypatch.delenv("INFERMETER_PROFILE_CHILD_LIMIT_S", raising=False)
    (point,) = profile_points([100], [2], ["float32"], [40], [10])
    need = PointMemory(weights_bytes=10**9, kv_cache_bytes=10**8, activation_bytes=10**8)
    passes = 3 + 10  # ceil(100 / 40) prefill chunks + 10 decode steps
    expected = (
        CHILD_START_S + 1.2e9 / CHILD_LOAD_BYTES_PER_S + (1 + 3) * passes * 1e9 / CHILD_READ_BYTES_PER_S
    )
    assert child_time_limit_s(point, need, repeats=3, warmup=1) == pytest.approx(expected)
    monkeypatch.setenv("INFERMETER_PROFILE_CHILD_LIMIT_S", "7")
    assert child_time_limit_s(point, need, repeats=3, warmup=1) == 7.0


def _finished_points(uri: str) -> int:
    """FINISHED sweep point runs (tag ``point_key``) in the store so far; 0 before it exists."""
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(uri)
        ids = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(ids, "attributes.status = 'FINISHED'") if ids else []
    except Exception:  # the command is still creating the store's tables
        return 0
    return sum("point_key" in run.data.tags for run in runs)


def test_sigterm_mid_sweep_marks_the_runs_killed_and_keeps_finished_points(server, tmp_path) -> None:
    """SIGTERM mid-sweep (ten points of two ~1 s samples each against the ground-truth server,
    one at a time): exit 130, no run left RUNNING (the parent, the sweep stage and the point in
    flight end KILLED), and the points that finished stay FINISHED with their samples."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    temperatures = ",".join(f"{0.1 * k:.1f}" for k in range(10))
    args = ["sweep", "--base-url", server.base_url, "--model", "ticks:40:25", "--temperature", temperatures]
    proc, log = _start(
        [*args, "--samples", "2", "--max-concurrency", "1", "--max-tokens", "40"],
        tmp_path,
        {"MLFLOW_TRACKING_URI": uri},
    )
    _wait_for(proc, log, lambda: _finished_points(uri) >= 1)
    family = _servers(proc)
    os.kill(proc.pid, signal.SIGTERM)
    _assert_all_gone(family, proc)
    assert proc.returncode == 130, log.read_text()[-3000:]
    assert "Interrupted" in log.read_text()
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    status = [run.info.status for run in runs]
    assert "RUNNING" not in status, [(r.info.run_name, r.info.status) for r in runs]
    points = [run for run in runs if "point_key" in run.data.tags]
    finished = [run for run in points if run.info.status == "FINISHED"]
    assert 1 <= len(finished) < 10 and len(points) < 10 + 1
    for run in finished:  # what finished is kept, whole
        assert "samples.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
        assert run.data.metrics["identical_fraction"] == 1.0  # the ticks text ignores temperature
    stage = next(run for run in runs if run.info.run_name == "sweep")
    parent = next(run for run in runs if "mlflow.parentRunId" not in run.data.tags)
    assert (stage.info.status, parent.info.status) == ("KILLED", "KILLED")


def test_sigterm_mid_audit_marks_the_runs_killed(server, tmp_path) -> None:
    """SIGTERM during an audit's stream stage (tokenize and profile off, the ground-truth server
    as the endpoint): exit 130, no run left RUNNING, the parent and the stream stage KILLED with
    the journal kept, and the sweep stage never started."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = tmp_path / "audit.yaml"
    config.write_text(
        "name: audit-sigterm\ntokenize: {enabled: false}\nprofile: {enabled: false}\n"
        f"endpoint: {{base_url: '{server.base_url}', model: 'ticks:50:20'}}\n"
        "stream: {num_requests: 400, max_concurrency: [2], warmup: 0}\n"
    )
    proc, log = _start(["audit", "--config", str(config)], tmp_path, {"MLFLOW_TRACKING_URI": uri})

    def journal_lines() -> int:
        found = list((tmp_path / "w").rglob("requests.jsonl"))
        return len(found[0].read_text().splitlines()) if found else 0

    _wait_for(proc, log, lambda: journal_lines() >= 3)
    family = _servers(proc)
    os.kill(proc.pid, signal.SIGTERM)
    _assert_all_gone(family, proc)
    assert proc.returncode == 130, log.read_text()[-3000:]
    assert "Interrupted" in log.read_text()
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    status = {run.info.run_name: run.info.status for run in runs}
    assert "RUNNING" not in status.values() and "sweep" not in status, status
    stage = next(run for run in runs if run.info.run_name == "stream")
    parent = next(run for run in runs if "mlflow.parentRunId" not in run.data.tags)
    assert (stage.info.status, parent.info.status) == ("KILLED", "KILLED")
    assert "requests.jsonl" in [a.path for a in client.list_artifacts(stage.info.run_id)]
