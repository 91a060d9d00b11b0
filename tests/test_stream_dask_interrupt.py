"""Load that ends when it is told (issue 50, part 6): ``infermeter stream --task-runner dask...``
interrupted mid-level by a Ctrl-C, against the ground-truth instrument, which counts the
requests it reads; the worker's side of the link (``tasks.scaleout.dask_wire._Wire``) on real
sockets; and the ``dask:`` errors quoting what the user wrote.

A Ctrl-C is SIGINT to the command's whole process group (a terminal's foreground job). Three
clusters: an outside scheduler and workers started as a user starts them, in other terminals
(their own sessions: the Ctrl-C never reaches them); a LocalCluster the command starts
(``dask:2``: its workers are in the command's group and get the Ctrl-C too); and an outside
scheduler and worker started in the command's own terminal job (they get the Ctrl-C too, and the
scheduler dies of it while the command is closing its client: its reconnect traceback was
printed). In each the command must print at most 3 lines after the signal, no traceback, exit
130, and no request may reach the instrument once it has exited (each worker's client watches
its link to the command and cancels its requests when it closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.config.taskrunner import CONNECT_TIMEOUT_S, DaskChoice, check_task_runner, validate
from tasks.engines.server import free_port
from tasks.scaleout import dask_wire
from tasks.scaleout.dask_wire import Link, _Wire

try:
    from tests.dask_cluster import outside_cluster
except ImportError:  # run from tests/
    from dask_cluster import outside_cluster

BIN = Path(sys.executable).parent / "infermeter"
ROOT = Path(__file__).resolve().parents[1]
#: Requests the instrument has read when the Ctrl-C comes (of 64 at 8/s, 2 s each: mid-level,
#: 4 in flight)
READ_AT_SIGNAL = 4
#: Lines the command may print after the Ctrl-C (the issue's target)
MAX_LINES = 3


def _read(instrument) -> int:
    """Requests the instrument has read so far (its ``gt_requests_total``)."""
    url = f"http://127.0.0.1:{instrument.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        int(float(line.split()[-1])) for line in text.splitlines() if line.startswith("gt_requests_total")
    )


@dataclass
class Interrupted:
    """One interrupted command: its exit code, the lines it printed after the signal (stdout
    and stderr), all it printed, and the instrument's request count at the signal, at its exit
    and 2 s after."""

    code: int
    lines: list[str]
    output: str
    at_signal: int
    at_exit: int
    after: int
    took_s: float
    left: list  # what on_signal returned that was still alive 10 s after the exit


def _stream(instrument, runner: str) -> list[str]:
    return [
        str(BIN), "stream", "--base-url", instrument.base_url, "--model", "ticks:20:100",
        "--max-concurrency", "8", "--request-rate", "8", "--burstiness", "100", "--num-requests", "64",
        "--warmup", "0", "--no-track", "--task-runner", runner,
    ]  # fmt: skip


def _interrupt(instrument, command: list[str], tmp_path: Path, on_signal=None) -> Interrupted:
    """Run ``command`` as a session of its own (its pid its process group's), SIGINT the group
    once the instrument has read :data:`READ_AT_SIGNAL` more requests; ``on_signal(pid)`` is
    called just before and returns processes (psutil) that must be gone within 10 s of the
    command's exit. The group is SIGKILLed after, if anything is left of it."""
    import psutil

    base = _read(instrument)
    said: list[tuple[float, str]] = []
    run = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "INFERMETER_WORK_DIR": str(tmp_path), "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def collect(pipe) -> None:
        for line in pipe:
            said.append((time.monotonic(), line.rstrip("\n")))

    readers = [
        threading.Thread(target=collect, args=(pipe,), daemon=True) for pipe in (run.stdout, run.stderr)
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 120
        while (
            _read(instrument) - base < READ_AT_SIGNAL and run.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        assert run.poll() is None, "\n".join(line for _, line in said)
        at_signal = _read(instrument) - base
        watched = on_signal(run.pid) if on_signal is not None else []
        sent = time.monotonic()
        os.killpg(run.pid, signal.SIGINT)
        code = run.wait(timeout=60)
        took_s = time.monotonic() - sent
        at_exit = _read(instrument) - base
        _, left = psutil.wait_procs(watched, timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    for reader in readers:
        reader.join(timeout=10)
    time.sleep(2.0)  # a worker still scheduling at 8/s would send 16 more meanwhile
    after = _read(instrument) - base
    lines = [line for at, line in said if at >= sent and line.strip()]
    output = "\n".join(line for _, line in said)
    return Interrupted(code, lines, output, at_signal, at_exit, after, took_s, left)


def _check(run: Interrupted) -> None:
    """The issue's targets: exit 130, at most 3 lines after the signal and no traceback (the
    one line names the records kept), no request read after the exit."""
    assert run.code == 130, run.output
    assert len(run.lines) <= MAX_LINES and not [line for line in run.lines if "Traceback" in line], run.lines
    assert "Traceback" not in run.output, run.output
    assert [line for line in run.lines if line.startswith("Interrupted: ")], run.lines
    assert run.at_exit >= run.at_signal >= READ_AT_SIGNAL
    assert run.after == run.at_exit, (run.at_signal, run.at_exit, run.after)


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A ``dask scheduler`` and 2 ``dask worker`` processes started as a user starts them."""
    with outside_cluster(2, tmp_path_factory.mktemp("outside")) as address:
        yield address


def test_a_ctrl_c_on_an_outside_schedulers_workers_prints_one_line_and_no_request_follows(
    outside, instrument, tmp_path
) -> None:
    from distributed import Client

    run = _interrupt(instrument, _stream(instrument, f"dask:{outside}"), tmp_path)
    _check(run)
    with Client(outside) as client:  # the workers are the user's: still there, and idle
        assert len(client.scheduler_info()["workers"]) == 2
        assert not any(client.processing().values()), client.processing()


def test_a_ctrl_c_on_a_local_cluster_prints_one_line_and_leaves_no_process(instrument, tmp_path) -> None:
    """``dask:2``: the LocalCluster's workers get the Ctrl-C too (the command's group); their
    output is the command's (a worker's heartbeat that met the closing scheduler once printed a
    traceback there, on a loaded machine)."""
    import psutil

    started: list[psutil.Process] = []

    def children(pid: int) -> list[psutil.Process]:
        started.extend(psutil.Process(pid).children(recursive=True))
        return started

    run = _interrupt(instrument, _stream(instrument, "dask:2"), tmp_path, on_signal=children)
    _check(run)
    assert len(started) >= 2 and not run.left, (started, run.left)  # its 2 workers (and helpers)


#: The terminal job of a user who started the scheduler and a worker from the same script as
#: the command: they share its process group (the Ctrl-C reaches them too) and die with it
#: (PR_SET_PDEATHSIG), then the script becomes the command (exec: the group's leader).
_ONE_JOB = """
import ctypes, os, signal, subprocess, sys
from distributed import Client
dask, port, log, *command = sys.argv[1:]
address = "tcp://127.0.0.1:" + port
libc = ctypes.CDLL(None, use_errno=True)
def with_parent():
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone when the command is
out = open(log, "ab")
for args in (["scheduler", "--host", "127.0.0.1", "--port", port, "--dashboard-address", "127.0.0.1:0"],
             ["worker", address, "--nthreads", "1", "--no-nanny", "--host", "127.0.0.1",
              "--dashboard-address", "127.0.0.1:0"]):
    subprocess.Popen([dask, *args], stdout=out, stderr=out, stdin=subprocess.DEVNULL, preexec_fn=with_parent)
with Client(address, timeout=60) as client:
    client.wait_for_workers(1, timeout=60)
os.execv(command[0], command)
"""


def test_a_ctrl_c_that_also_ends_the_scheduler_prints_no_traceback(instrument, tmp_path) -> None:
    """The scheduler dies of the same Ctrl-C while the command closes its client: the client's
    reconnect traceback (36 lines) was printed before the command's own line."""
    port = free_port()
    log = tmp_path / "dask.log"
    dask = str(Path(sys.executable).parent / "dask")
    command = [sys.executable, "-c", _ONE_JOB, dask, str(port), str(log)]
    command += _stream(instrument, f"dask:tcp://127.0.0.1:{port}")
    run = _interrupt(instrument, command, tmp_path)
    _check(run)


# The worker's side of the link ----------------------------------------------------------------


def _link_pair() -> tuple[Link, socket.socket]:
    """A worker's Link and the orchestrator's end of its connection (127.0.0.1), both kernel
    buffers small (16 KB asked: what fills them is a few tens of KB, not megabytes)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # the accepted one's
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        sock.connect(listener.getsockname())
        peer, _ = listener.accept()
    return Link(sock), peer


def test_records_leave_without_blocking_the_loop_and_all_arrive_before_the_end() -> None:
    """2,000 records of 1 KB go out while the orchestrator reads nothing (a slow link): each
    ``send`` returns at once (a blocking ``sendall`` would hold the loop until the orchestrator
    read), the loop goes on, and ``drain`` returns once every record has left, in order."""
    link, peer = _link_pair()
    reading = threading.Event()
    received: list[bytes] = []

    def orchestrator() -> None:
        time.sleep(0.5)  # slow: reads nothing for half a second
        reading.set()
        with peer.makefile("rb") as lines:
            received.extend(lines)  # to the end: the worker closes its side after drain

    reader = threading.Thread(target=orchestrator, daemon=True)
    reader.start()

    async def worker() -> tuple[bool, int, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with _Wire(link) as wire:
            for i in range(2000):
                wire.send({"kind": "record", "i": i, "pad": "x" * 1000})
            sent_before_reading = not reading.is_set()
            waiting = len(wire.pending)
            await asyncio.sleep(0.05)
            ticked = ticks
            await wire.drain()
        ticker.cancel()
        return sent_before_reading, waiting, ticked

    try:
        sent_before_reading, waiting, ticked = asyncio.run(worker())
        link.close()
        reader.join(timeout=10)
    finally:
        link.close()
        peer.close()
    assert sent_before_reading and waiting > 500_000, waiting  # most of 2 MB waited in the buffer
    assert ticked >= 5  # the loop ran meanwhile
    import json

    assert [json.loads(line)["i"] for line in received] == list(range(2000))


def test_a_link_closed_mid_level_cancels_the_loops_tasks_and_calls_the_hooks() -> None:
    """The orchestrator closes its end (it exited): the request in flight is cancelled at once,
    the hooks (a LocalCluster's worker mutes itself) are called, and nothing more is sent."""
    link, peer = _link_pair()
    called: list[str] = []

    def hook() -> None:
        called.append("orphaned")

    dask_wire.when_orphaned(hook)
    dask_wire.when_orphaned(hook)  # kept once

    async def worker() -> tuple[bool, float]:
        with _Wire(link) as wire:
            request = asyncio.create_task(asyncio.sleep(30))  # a request in flight
            asyncio.get_running_loop().call_later(0.1, peer.close)
            started = time.monotonic()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            wire.send({"kind": "record"})  # after the end: dropped
            return wire.closed, time.monotonic() - started

    try:
        closed, took_s = asyncio.run(worker())
    finally:
        dask_wire._ORPHANED.remove(hook)
        link.close()
    assert closed and took_s < 10 and called == ["orphaned"]


# What the user wrote, quoted -------------------------------------------------------------------


def test_a_dask_address_that_is_no_scheduler_is_named_with_what_the_user_wrote(instrument) -> None:
    """Each error quotes the value as written (``dask:abc`` was reported as ``tcp://abc``); an
    address where something else listens (the instrument: HTTP, silent until asked, as Dask's
    dashboard port is) is named within the check's bound (``distributed.Client`` waited for
    its handshake forever)."""
    fix = "start one (`dask scheduler`) or use dask for a local cluster"
    cases = {
        "dask:abc": "'dask:abc' is not a task runner (a scheduler needs a host and a port; did you mean "
        "dask:tcp://abc:8786?): give threads",
        f"dask:127.0.0.1:{free_port()}": "names no Dask scheduler: nothing answers at tcp://127.0.0.1:",
        "dask:nosuchhost.invalid:8786": "'dask:nosuchhost.invalid:8786' names no Dask scheduler: nothing "
        "answers at tcp://nosuchhost.invalid:8786 (nosuchhost.invalid does not resolve: ",
    }
    for text, needle in cases.items():
        with pytest.raises(ValueError) as caught:
            check_task_runner(text)
        assert needle in str(caught.value) and str(caught.value).startswith(repr(text)), str(caught.value)
    # blanks around the value or after the colon (YAML's "dask: 2" habit) are no host: it was
    # "did you mean dask:tcp:// 2:8786?"; "threads " was read as a Dask runner by the config
    assert check_task_runner("dask: 2") == DaskChoice(workers=2)
    assert check_task_runner(" dask:3 ") == DaskChoice(workers=3)
    assert check_task_runner("threads ") is None and validate(" threads ") == "threads"
    refused = f"dask:127.0.0.1:{free_port()}"
    with pytest.raises(
        ValueError, match=r"\(Connection refused\); " + fix.replace("(", r"\(").replace(")", r"\)")
    ):
        check_task_runner(refused)
    http = f"dask:127.0.0.1:{instrument.port}"
    started = time.monotonic()
    with pytest.raises(ValueError) as caught:
        check_task_runner(http)
    assert time.monotonic() - started < 3 * CONNECT_TIMEOUT_S + 1
    assert str(caught.value) == (
        f"{http!r} names no Dask scheduler: something accepts connections at tcp://127.0.0.1:"
        f"{instrument.port} but it is no Dask scheduler (it said nothing in {CONNECT_TIMEOUT_S:g} s; a "
        f"dashboard's port? a scheduler listens on 8786 unless told otherwise); {fix}"
    )
