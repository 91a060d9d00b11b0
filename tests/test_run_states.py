"""Run states never lie (issue 14, item 1): a command stopped by SIGTERM marks its MLflow runs
KILLED with what it measured logged and names its records folder; no server it started (the
temporary Prefect API server, the embedded llama.cpp server) outlives it, whether it ends by
SIGTERM or SIGKILL; a profile point whose child hangs is stopped after its limit and recorded
as failed while the sweep goes on. Real processes and a real MLflow SQLite store throughout."""

from __future__ import annotations

import json
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
from tests.prefect_home import migrated_home

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
        PREFECT_HOME=str(migrated_home(tmp_path / "prefect")),
        INFERMETER_WORK_DIR=str(tmp_path / "w"),
        INFERMETER_PREFECT_IDLE_S="0",  # the command's own temporary Prefect server, to watch it go
        **(env or {}),
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
    names = (
        "prefect.server.api.server",
        "llama_cpp.server",
        "tasks.engines.lifeline",
        "multiprocessing.forkserver",
    )
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


def test_server_command_whose_server_dies_says_so_and_exits_1(tmp_path) -> None:
    """`infermeter server` whose llama.cpp server is killed (the OOM killer's SIGKILL): the
    command names the signal and the log and exits 1 (before: it slept on for ever)."""
    proc, log = _start(["server", "--n-ctx", "512"], tmp_path)
    _wait_for(proc, log, lambda: "base_url:" in log.read_text())
    family = _servers(proc)
    (server,) = [p for p in family if p.cmdline()[1:3] == ["-m", "llama_cpp.server"]]
    server.kill()
    try:
        assert proc.wait(timeout=30) == 1, log.read_text()[-3000:]
    finally:
        _assert_all_gone(family, proc)
    out = log.read_text()
    assert f"the embedded llamacpp server (pid {server.pid}) died " in out
    assert "killed by SIGKILL (killed from outside: the kernel's out-of-memory killer, or a person)" in out


def test_sigterm_mid_stream_marks_the_runs_killed(server, tmp_path) -> None:
    """SIGTERM (what `timeout` sends) mid-run: exit 143 (128 + 15; before: 130), the message
    names the records folder, the parent and stream runs end KILLED (not RUNNING) with the
    journal logged, the temporary Prefect API server is gone, and no "View at" link to it was
    printed."""
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
    assert proc.returncode == 143, log.read_text()[-3000:]
    text = log.read_text()
    workdir = next((tmp_path / "w").glob("*-stream-*"))
    assert "Interrupted" in text and str(workdir) in text.replace("\n", "")
    assert "View at" not in text
    assert "Crash detected" not in text and "Crashed(" not in text  # Prefect's, beside ours
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    status = {run.info.run_name: run.info.status for run in runs}
    assert status["stream"] == "KILLED" and "RUNNING" not in status.values(), status
    stage = next(run for run in runs if run.info.run_name == "stream")
    assert stage.data.tags["error"].startswith("interrupted")
    assert "requests.jsonl" in [a.path for a in client.list_artifacts(stage.info.run_id)]
    parent = next(run for run in runs if "mlflow.parentRunId" not in run.data.tags)
    assert parent.info.status == "KILLED"


def test_a_signal_while_a_client_process_waits_for_the_start_ends_the_command(server, tmp_path) -> None:
    """Two client processes: process 1 waits for the level's start while process 0 sends the
    warm-up (here 15 s long). A SIGTERM then ended process 1 in its wait, and the command hung
    for ever (the start was a multiprocessing Event, whose set() waits for every waiter to wake).
    Now it exits 143 and takes its processes with it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n", encoding="utf-8")
    args = ["stream", "--base-url", server.base_url, "--model", "ticks:1500:10", "--max-tokens", "1500"]
    args += ["--prompts", str(prompts), "--num-requests", "2", "--max-concurrency", "2"]
    server.reset()
    proc, log = _start([*args, "--client-processes", "2", "--no-track"], tmp_path)
    warm_up = lambda: any(r.get("max_completion_tokens") == 1500 for r in server.stats()["requests"])  # noqa: E731
    _wait_for(proc, log, warm_up)  # in flight (the pre-flight's request asks for 1 token)
    time.sleep(1.0)  # process 1 has opened its connection and waits for the start
    family = _servers(proc)
    assert sum("forkserver" in " ".join(p.cmdline()) for p in family) >= 3  # the server and both
    os.kill(proc.pid, signal.SIGTERM)
    _assert_all_gone(family, proc)
    assert proc.returncode == 143, log.read_text()[-3000:]


def test_sigkill_mid_stream_leaves_no_server(tmp_path) -> None:
    """SIGKILL (a test runner's kill, the OOM killer) of a stream against the embedded server:
    its watchers stop the llama.cpp server and the temporary Prefect API server (before: both
    stayed up for good, about 200 MB and 280 MB), and the level's client process follows its
    parent (before: it blocked for ever at exit, flushing records into a queue nobody read), as
    does the fork server it was forked from (tasks.scaleout.multiproc)."""
    proc, log = _start(
        ["stream", "--num-requests", "200", "--max-tokens", "16", "--warmup", "0", "--no-track"], tmp_path
    )
    _wait_for(proc, log, lambda: _journal_lines(tmp_path) >= 1)
    family = _servers(proc)
    cmdlines = " ".join(" ".join(p.cmdline()) for p in family)
    assert "llama_cpp.server" in cmdlines and "prefect.server.api.server" in cmdlines
    assert "multiprocessing.forkserver" in cmdlines  # the level's client process and its fork server
    os.kill(proc.pid, signal.SIGKILL)
    _assert_all_gone(family, proc)


def test_an_embedded_server_killed_mid_stream_is_named_and_the_command_fails(tmp_path) -> None:
    """SIGSEGV to the embedded llama.cpp server during a 400-request stream (issue 48; what an
    AMX build did on its first request): before, exit 0 half a second later, "379 of 400
    requests failed (connection 378, ...)" and "is the server running and the base_url right?".
    Now the level stops sending, the command exits 1 within seconds naming the signal, the
    answered requests and the server's log, and blames no connection on the endpoint."""
    proc, log = _start(
        ["stream", "--num-requests", "400", "--max-tokens", "16", "--warmup", "0", "--no-track"], tmp_path
    )
    _wait_for(proc, log, lambda: _journal_lines(tmp_path) >= 3)
    family = _servers(proc)
    (server,) = [p for p in family if p.cmdline()[1:3] == ["-m", "llama_cpp.server"]]  # not its watcher
    server.send_signal(signal.SIGSEGV)
    killed = time.monotonic()
    try:
        code = proc.wait(timeout=60)
    finally:
        _assert_all_gone(family, proc)
    waited_s = time.monotonic() - killed
    out = log.read_text()
    assert code == 1 and waited_s < 60, (code, waited_s, out[-3000:])
    said = out[out.index("stream failed: ServerDiedError: ") :]
    assert f"the embedded llamacpp server (pid {server.pid}) died " in said
    assert "killed by SIGSEGV (a crash inside the engine)" in said and "llamacpp_server.log):" in said
    assert "is the server running" not in out and "errors_connection" not in out
    records = [
        json.loads(line)
        for line in next((tmp_path / "w").glob("*-stream-*/requests.jsonl")).read_text().splitlines()
    ]
    answered = sum(r["error"] is None for r in records)
    assert f"; {answered} requests answered before it" in said
    assert {(r["error"] or {}).get("class") for r in records} <= {None, "server_died"} and len(records) < 400


def test_a_hung_profile_child_is_stopped_and_the_sweep_goes_on(monkeypatch) -> None:
    """A point's child that hangs (the test-only hook makes the N=16 child sleep 600 s) is
    killed at its limit and recorded as PointTimedOut; the N=8 point still runs (before: the
    sweep waited forever)."""
    from tasks.profile.runner import run_sweep

    monkeypatch.setenv("INFERMETER_TEST_CHILD_HANG_S", "600:16")
    monkeypatch.setenv("INFERMETER_PROFILE_CHILD_LIMIT_S", "30")
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
    assert by_length[16].error.startswith("PointTimedOut:") and "30 s" in by_length[16].error
    assert by_length[16].child_process and by_length[16].measurement is None
    assert by_length[8].error is None and by_length[8].measurement is not None
    assert took_s < 600
    assert not [c for c in psutil.Process().children() if "spawn_main" in " ".join(c.cmdline())]


def test_the_child_limit_follows_its_estimate(monkeypatch) -> None:
    from tasks.memory.formula import PointMemory
    from tasks.profile.limits import (
        CHILD_LOAD_BYTES_PER_S,
        CHILD_READ_BYTES_PER_S,
        CHILD_START_S,
        child_time_limit_s,
    )

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
    one at a time): exit 143, no run left RUNNING (the parent, the sweep stage and the point in
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
    assert proc.returncode == 143, log.read_text()[-3000:]
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


def _ended_within(uri: str, pid: int, timeout_s: float) -> list:
    """The runs of ``pid`` once none is RUNNING (polled; no command reads the store meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [run for run in _store_runs(uri) if _owner_pid(run) == pid]
        if runs and "RUNNING" not in {run.info.status for run in runs} or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_sigterm_mid_audit_marks_the_runs_killed(signum, server, tmp_path) -> None:
    """SIGTERM during an audit's stream stage (tokenize and profile off, the ground-truth server
    as the endpoint): exit 143, no run left RUNNING, the parent and the stream stage KILLED with
    the journal kept, and the sweep stage never started. SIGKILL (issue 31): the command cannot
    end its runs; its runs lifeline (tasks.engines.lifeline --runs) ends them KILLED within seconds,
    naming the process and the records folder, with no other command run (before: RUNNING
    until the next tracked command)."""
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
    os.kill(proc.pid, signum)
    _assert_all_gone(family, proc)
    if signum == signal.SIGKILL:
        ended = _ended_within(uri, proc.pid, 20)
        assert {run.info.status for run in ended} == {"KILLED"} and len(ended) == 2, ended
        workdir = next((tmp_path / "w").glob("*-audit-*"))
        for run in ended:
            assert run.data.tags["error"] == (
                f"killed: process {proc.pid} on {socket.gethostname()} ended without ending this "
                f"run; its records are in {workdir}"
            )
        assert f"left RUNNING by a killed command: marked KILLED; its records are in {workdir}" in (
            log.read_text()
        )
        return
    assert proc.returncode == 143, log.read_text()[-3000:]
    assert "Interrupted" in log.read_text()
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    status = {run.info.run_name: run.info.status for run in runs}
    assert "RUNNING" not in status.values() and "sweep" not in status, status
    stage = next(run for run in runs if run.info.run_name == "stream")
    parent = next(run for run in runs if "mlflow.parentRunId" not in run.data.tags)
    assert (stage.info.status, parent.info.status) == ("KILLED", "KILLED")
    assert "requests.jsonl" in [a.path for a in client.list_artifacts(stage.info.run_id)]


# Issue 23: failures that look green --------------------------------------------------------


def _store_runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _owner_pid(run) -> int:
    return int(run.data.tags["owner_process"].split("/")[2])


def test_stream_where_every_request_fails_ends_failed(server, tmp_path) -> None:
    """Every request answered with HTTP 500: exit 1 with the first error, and the parent and
    stream runs end FAILED with it as their error tag (item 9; before: both FINISHED, no tag,
    while the exit code said 1); the level's run and the records are kept."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["stream", "--base-url", server.base_url, "--model", "http_500", "--num-requests", "3"]
    proc, log = _start(
        [*args, "--max-concurrency", "1", "--warmup", "0"], tmp_path, {"MLFLOW_TRACKING_URI": uri}
    )
    assert proc.wait(timeout=600) == 1, log.read_text()[-3000:]
    expected = "every request failed; first error (server): "
    assert expected in log.read_text()
    runs = {run.info.run_name: run for run in _store_runs(uri)}
    parent = next(run for run in runs.values() if "mlflow.parentRunId" not in run.data.tags)
    stage = runs["stream"]
    assert (parent.info.status, stage.info.status) == ("FAILED", "FAILED")
    assert parent.data.tags["error"].startswith(expected) and "internal failure" in parent.data.tags["error"]
    assert stage.data.tags["error"] == parent.data.tags["error"]
    level = runs["stream c=1 rate=inf"]
    assert level.info.status == "FINISHED" and level.data.metrics["error_rate"] == 1.0


def test_audit_whose_stream_requests_all_fail_fails_its_stream_stage(server, tmp_path) -> None:
    """The audit's stream stage (the only stage here) against an endpoint that answers every
    request with HTTP 500: the stage counts as failed (exit 1, parent and stage FAILED, the
    parent's error naming the stage), as the stream command says (before: exit 0, FINISHED)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = tmp_path / "audit.yaml"
    config.write_text(
        "name: audit-all-failed\ntokenize: {enabled: false}\nprofile: {enabled: false}\n"
        f"sweep: {{enabled: false}}\nendpoint: {{base_url: '{server.base_url}', model: 'http_500'}}\n"
        "stream: {num_requests: 2, max_concurrency: [1], warmup: 0}\n"
    )
    out = tmp_path / "audit.json"
    proc, log = _start(
        ["audit", "--config", str(config), "--json", str(out)], tmp_path, {"MLFLOW_TRACKING_URI": uri}
    )
    assert proc.wait(timeout=600) == 1, log.read_text()[-3000:]
    data = json.loads(out.read_text())
    assert data["errors"]["stream"].startswith("every request failed; first error (server): ")
    assert len(data["stages"]["stream"]["levels"][0]["requests"]) == 2  # the records are kept
    runs = {run.info.run_name: run for run in _store_runs(uri)}
    parent = next(run for run in runs.values() if "mlflow.parentRunId" not in run.data.tags)
    assert (parent.info.status, runs["stream"].info.status) == ("FAILED", "FAILED")
    assert parent.data.tags["error"] == f"stream: {data['errors']['stream']}"
    # no profile stage, no torch in this process tree: the versions from the packages' metadata
    import importlib.metadata

    tags = parent.data.tags
    assert (tags["torch_version"], tags["torch_num_threads"]) == (importlib.metadata.version("torch"), "n/a")


def test_close_abandoned_closes_only_runs_whose_owner_is_gone(tmp_path) -> None:
    """Runs whose owner (host + boot id + pid namespace + pid + start time) is certainly gone
    are marked KILLED with an error tag naming the process and the records folder, in every
    experiment of the store (item 10); a live owner's runs, this process's, another host's,
    another pid namespace's, and runs without the owner tags are left alone."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking import OWNER_HOST_TAG, OWNER_TAG, Tracker
    from tasks.tracking.run_owner import owner_gone, process_identity

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    host = socket.gethostname()
    alive = subprocess.Popen(["sleep", "300"])
    dead = subprocess.Popen(["sleep", "300"])
    alive_id, dead_id = process_identity(alive.pid), process_identity(dead.pid)
    dead.kill()
    time.sleep(0.3)
    assert owner_gone(dead_id)  # a zombie (not reaped yet) is gone
    dead.wait()
    boot, namespace, pid, start = process_identity().split("/")
    assert int(pid) == os.getpid() and not owner_gone(process_identity()) and not owner_gone(alive_id)
    reused = "/".join((boot, namespace, pid, str(int(start) + 1)))  # our pid, not our start time
    rebooted = "/".join(("another-boot-id", namespace, pid, start))
    other_namespace = "/".join((boot, "pid:[1]", str(dead.pid), dead_id.split("/")[3]))
    try:
        tracker = Tracker("owners", uri, journal=str(tmp_path / "records"))

        def run(name: str, owner: str, owner_host: str = host) -> str:
            return tracker.start_run(name, tags={OWNER_TAG: owner, OWNER_HOST_TAG: owner_host})

        ids = {
            "mine": tracker.start_run("mine"),
            "alive": run("alive", alive_id),
            "dead": run("dead", dead_id),
            "reused": run("reused", reused),
            "rebooted": run("rebooted", rebooted),
            "other host": run("other host", dead_id, "elsewhere"),
            "other namespace": run("other namespace", other_namespace),
        }
        ids["finished"] = run("finished", dead_id)
        tracker.end_run(ids["finished"])
        client = MlflowClient(uri)
        ids["untagged"] = client.create_run(tracker._experiment_id, run_name="untagged").info.run_id
        ids["dead elsewhere"] = Tracker("owners-2", uri).start_run(
            "dead elsewhere", tags={OWNER_TAG: dead_id}
        )

        closed = Tracker("owners", uri).close_abandoned()
        assert sorted(c["name"] for c in closed) == ["dead", "dead elsewhere", "rebooted", "reused"]
        status = {name: client.get_run(run_id).info.status for name, run_id in ids.items()}
        killed = {"dead", "dead elsewhere", "rebooted", "reused"}
        assert status == {
            n: "KILLED" if n in killed else "FINISHED" if n == "finished" else "RUNNING" for n in ids
        }
        assert client.get_run(ids["dead"]).data.tags["error"] == (
            f"killed: process {dead.pid} on {host} ended without ending this run; "
            f"its records are in {tmp_path / 'records'}"
        )
        assert client.get_run(ids["dead elsewhere"]).data.tags["error"] == (
            f"killed: process {dead.pid} on {host} ended without ending this run"
        )
        assert "error" not in client.get_run(ids["alive"]).data.tags
        assert Tracker("owners", uri).close_abandoned() == []  # nothing left to close
    finally:
        alive.kill()
        alive.wait()


_OWNER = """
import os, signal, sys
from tasks.tracking import Tracker
from tasks.tracking.run_owner import start_runs_lifeline

tracker = Tracker("lifeline", sys.argv[1], journal=sys.argv[2])
parent = tracker.start_run("parent")
tracker.start_run("stage", parent_run_id=parent)
if sys.argv[3] == "release":  # an MLflow that says so when imported: the watcher must not
    os.environ["PYTHONPATH"] = sys.argv[4]
release = start_runs_lifeline(tracker.owner, tracker.tracking_uri, tracker.experiment)
print(max(child.pid for child in __import__("psutil").Process().children()), flush=True)
if sys.argv[3] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
for run_id in tracker.find_runs("", parents_only=False):
    tracker.end_run(run_id["run_id"])
release()
"""


@pytest.mark.parametrize("how", ["kill", "release"])
def test_the_runs_lifeline_ends_a_sigkilled_owners_runs_and_else_goes_quietly(how, tmp_path) -> None:
    """``tasks.engines.lifeline --runs`` (issue 31): its owner killed with two runs open, it ends them
    KILLED within seconds, naming the process and the records folder; released by an owner that
    ended its runs, it exits at once, without importing MLflow (it stays light)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "fake" / "mlflow").mkdir(parents=True)
    imported = tmp_path / "mlflow-imported"
    (tmp_path / "fake" / "mlflow" / "__init__.py").write_text(
        f"open({str(imported)!r}, 'w').close()\nraise ImportError('the watcher imported MLflow')\n"
    )
    args = [uri, str(tmp_path / "records"), how, str(tmp_path / "fake")]
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, *args], stdout=subprocess.PIPE, text=True)
    watcher = psutil.Process(int(owner.stdout.readline()))
    assert "--runs" in watcher.cmdline()
    owner.wait(timeout=120)
    watcher.wait(timeout=60)  # gone: at once when released, once its work is done when not
    started = time.monotonic()
    runs = _ended_within(uri, owner.pid, 20)
    assert {run.info.status for run in runs} == ({"KILLED"} if how == "kill" else {"FINISHED"})
    assert len(runs) == 2 and time.monotonic() - started < 20
    if how == "kill":
        assert {run.data.tags["error"] for run in runs} == {
            f"killed: process {owner.pid} on {socket.gethostname()} ended without ending this run; "
            f"its records are in {tmp_path / 'records'}"
        }
    else:
        assert not any("error" in run.data.tags for run in runs)
        assert not imported.exists()  # released: it never imported MLflow


def test_a_sigkilled_commands_runs_end_killed_at_once_and_a_read_only_command_closes_a_ghost(
    server, tmp_path
) -> None:
    """Two streams tracked in one store at once; one is killed by SIGKILL mid-level. It cannot
    end its runs; its tracking writer process can: within seconds, with no other command run,
    they are KILLED with an error tag naming the process and its records folder, while the live
    command's runs stay RUNNING (issue 31; before: RUNNING until the next tracked command, and
    item 10's before that: for ever). A ghost no process ended (a run left RUNNING by the dead
    process) is closed by a read-only command, ``compare``, which names it; the live command's
    runs are left alone. SIGTERM then ends the live one: exit 143, its runs KILLED by itself."""
    from tasks.tracking import OWNER_TAG, Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    args = ["stream", "--base-url", server.base_url, "--model", "ticks:50:20", "--num-requests", "400"]
    args += ["--max-concurrency", "2", "--warmup", "0"]
    for name in ("live", "killed", "next"):
        (tmp_path / name).mkdir()
    _store_runs(uri)  # the store's tables first: two commands creating them at once collide
    live, live_log = _start(args, tmp_path / "live", env)
    killed, killed_log = _start(args, tmp_path / "killed", env)
    try:
        _wait_for(killed, killed_log, lambda: _journal_lines(tmp_path / "killed") >= 3)
        _wait_for(live, live_log, lambda: _journal_lines(tmp_path / "live") >= 3)
        family = _servers(killed)
        os.kill(killed.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _assert_all_gone(family, killed)
        gone = _ended_within(uri, killed.pid, 20)
        assert time.monotonic() - killed_at < 20
        assert sorted(run.data.tags.get("stage", "parent") for run in gone) == ["parent", "stream"]
        assert {run.info.status for run in gone} == {"KILLED"}, [
            (r.info.run_name, r.info.status) for r in gone
        ]
        workdir = next((tmp_path / "killed" / "w").glob("*-stream-*"))
        for run in gone:
            assert run.data.tags["error"] == (
                f"killed: process {killed.pid} on {socket.gethostname()} ended without ending this "
                f"run; its records are in {workdir}"
            )
        assert str(workdir) in killed_log.read_text()  # the writer said what it ended
        assert {run.info.status for run in _store_runs(uri) if _owner_pid(run) == live.pid} == {"RUNNING"}

        # a ghost: a run the dead process left RUNNING that nothing ended
        owner = gone[0].data.tags[OWNER_TAG]
        ghost = Tracker("infermeter", uri, journal=str(workdir)).start_run("ghost", tags={OWNER_TAG: owner})
        read = subprocess.run(
            [str(BIN), "compare", ghost],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )
        assert read.returncode == 0, read.stderr[-3000:]
        assert f"MLflow run {ghost} (ghost) was left RUNNING by a process that is gone: marked KILLED" in (
            " ".join(read.stderr.split())
        )
        runs = _store_runs(uri)
        assert next(run for run in runs if run.info.run_id == ghost).info.status == "KILLED"
        assert {run.info.status for run in runs if _owner_pid(run) == live.pid} == {"RUNNING"}

        family = _servers(live)
        os.kill(live.pid, signal.SIGTERM)
        _assert_all_gone(family, live)
        assert live.returncode == 143, live_log.read_text()[-3000:]
        mine = [run for run in _store_runs(uri) if _owner_pid(run) == live.pid]
        assert {run.info.status for run in mine} == {"KILLED"} and len(mine) == 2
        assert not any(run.data.tags["error"].startswith("killed: process") for run in mine)
    finally:
        for proc in (live, killed):
            if proc.poll() is None:
                proc.kill()
