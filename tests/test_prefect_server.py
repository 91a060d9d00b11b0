"""infermeter's local Prefect API server (flows/prefect_server.py, issue 29): commands of one
PREFECT_HOME share one server, started once (two commands at once start one), recording every
flow run; a command killed outright leaves it serving the next command; it stops itself when
idle; a bad INFERMETER_PREFECT_IDLE_S exits 2 naming it. Real commands, a real server, the
ground-truth instrument as the endpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flows.prefect_server import running_server, stop_server
from tests.prefect_home import migrated_home

try:
    from tests import groundtruth_server as gt
except ImportError:  # run from tests/
    import groundtruth_server as gt

BIN = Path(sys.executable).parent / "infermeter"
STATE = "infermeter-prefect-server.json"


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


def _env(tmp_path: Path, idle_s: str = "120", migrated: bool = True) -> dict[str, str]:
    """A command's environment without the session's PREFECT_API_URL: its own PREFECT_HOME,
    with a migrated database unless ``migrated`` is False (tests/prefect_home.py)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    home = tmp_path / "prefect"
    env.update(
        PREFECT_HOME=str(migrated_home(home) if migrated else home),
        INFERMETER_WORK_DIR=str(tmp_path / "w"),
        INFERMETER_PREFECT_IDLE_S=idle_s,
    )
    return env


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie its new parent has not reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stream(server, *extra: str) -> list[str]:
    return [str(BIN), "stream", "--base-url", server.base_url, "--model", "ticks:5:5", *extra]


def _flow_runs(url: str) -> list[dict]:
    import urllib.request

    request = urllib.request.Request(
        f"{url}/flow_runs/filter", data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_commands_share_one_server_that_records_every_flow_run(server, tmp_path) -> None:
    """Two commands started at once on a fresh PREFECT_HOME start one server (the lock), a third
    reuses it (same pid, no "started" line), and it holds all three flow runs, COMPLETED. Then
    stop_server ends it and removes its state file."""
    home = tmp_path / "prefect"
    args = _stream(server, "--num-requests", "2", "--max-concurrency", "1", "--no-track")
    both = [
        subprocess.Popen(
            args,
            env=_env(tmp_path, migrated=False),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=300) for proc in both]
    assert [proc.returncode for proc in both] == [0, 0], outputs
    started = [err for _, err in outputs if "started infermeter's local API server" in err]
    assert len(started) == 1, outputs  # one of the two started it, the other waited and reused it
    first = running_server(home)
    assert first is not None and first.url in started[0]
    assert "flows.prefect_server" in " ".join(psutil.Process(first.pid).cmdline())

    third = subprocess.run(args, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr
    assert "started infermeter's local API server" not in third.stderr
    assert running_server(home).pid == first.pid

    runs = _flow_runs(first.url)
    assert len(runs) == 3 and {run["state_type"] for run in runs} == {"COMPLETED"}, runs
    # a second clone's environment (another Python, the same Prefect) uses the running server:
    # replacing it had ended it under the first clone's command mid-run
    state = json.loads((home / STATE).read_text())
    (home / STATE).write_text(json.dumps({**state, "python": "/elsewhere/clone/.venv/bin/python"}))
    assert running_server(home).pid == first.pid
    assert stop_server(home) and _gone(first.pid) and not (home / STATE).exists()


def test_a_killed_command_leaves_the_server_serving_the_next(server, tmp_path) -> None:
    """SIGKILL mid-level: the command's client process and fork server follow it, the local
    server (its own session) keeps serving, and the next command reuses it."""
    home = tmp_path / "prefect"
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *_stream(server, "--num-requests", "400", "--max-concurrency", "2", "--warmup", "0"),
                "--no-track",
            ],
            env=_env(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while not list((tmp_path / "w").glob("*-stream-*/requests.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        local = running_server(home)
        clients = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.pid != local.pid]
        assert any("multiprocessing.forkserver" in " ".join(p.cmdline()) for p in clients)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(clients, timeout=30)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        assert running_server(home) == local  # still up, still answering
        again = subprocess.run(
            [*_stream(server, "--num-requests", "1"), "--no-track"],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert again.returncode == 0, again.stderr
        assert running_server(home).pid == local.pid
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_server(home)


def test_the_server_stops_itself_when_idle(server, tmp_path) -> None:
    """INFERMETER_PREFECT_IDLE_S=3: a few seconds after the command, the server is gone and its
    state file with it."""
    home = tmp_path / "prefect"
    done = subprocess.run(
        [*_stream(server, "--num-requests", "1"), "--no-track"],
        env=_env(tmp_path, idle_s="3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    pid = json.loads((home / STATE).read_text())["pid"]
    try:
        deadline = time.monotonic() + 60
        while not _gone(pid):
            assert time.monotonic() < deadline, "the idle server did not stop"
            time.sleep(0.5)
        assert not (home / STATE).exists()
    finally:
        stop_server(home)


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_bad_idle_limit_exits_2_naming_it(server, tmp_path, value) -> None:
    done = subprocess.run(
        [*_stream(server, "--num-requests", "1"), "--no-track"],
        env=_env(tmp_path, idle_s=value),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "INFERMETER_PREFECT_IDLE_S" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "prefect" / STATE).exists()
