"""The tracking writer: a process of its own that makes a tracked command's MLflow calls and
draws its plots, off the command's timed path (issue 29).

Why: a tracked ``infermeter stream`` of 4 short requests spent about 4.5 s of CPU in tracking,
in the command's own process, on a 2-core machine (tests/benchmarks/command_phases.py): MLflow's
import (1.5-2.5 s, pandas and its GenAI modules included), opening the SQLite store (0.8-1.4 s:
SQLAlchemy's models, alembic's schema check), matplotlib (0.6 s), 11 PNG plots (about 0.1 s
each) between the levels. A thread does not take that off the command: an import holds the GIL,
so a thread gains only where the command waits (measured on a busy machine: 10.0 -> 8.9 s).

How: the command starts the writer (:func:`start`) as soon as it knows it will track, before
its pre-flight and Prefect's start; it imports MLflow, then matplotlib, on the other core while
the command does its own work (``tasks.tracking.writer_process`` is its code).
From then on every enabled ``TrackingTarget.open()`` of the command returns a
:class:`RemoteTracker`: its calls go down a pipe, in the order they are made, to a real
``Tracker`` in the writer, which makes the same MLflow calls with the same values as the command
would have (the timestamps the command would have stamped are the command's; the runs' owner
is the command's process: ``tasks.tracking.run_owner``). Nothing waits but what returns a value (the
runs a SIGKILLed command left RUNNING, a run's real id: :func:`real_run_id`, links): a run's
id is a stand-in until then. :func:`run_job` sends a job that draws and logs (a level's plots
and timeline) as one call. :func:`measuring` lowers its CPU priority while the command
measures.

Nothing is lost: a call that fails in the writer raises in the command at its next waiting call
or at :func:`flush` (``flows.runs.parent_run`` flushes before its run ends, so a failed write
fails the run, as it did); the command's exit waits until every call it made is done
(:func:`close`, at exit). A signal never cuts a call in half (:class:`_Writer`). The writer
ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C reaches the whole process group; the
command then sends the KILLED ends, which must land) and ends when the command's end of the
pipe closes, after the calls it holds: on a clean exit, a signal, or SIGKILL (the kernel closes
a dead process's files; the runs it left open the writer then ends KILLED at once:
``tasks.tracking.writer_process``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tasks import tracking
from tasks.tracking import Tracker, TrackingTarget
from tasks.tracking.values import default_tracking_uri, ui_command
from tasks.tracking.writer_process import NICE, metric_entries

__all__ = [
    "RemoteTracker",
    "close",
    "close_abandoned_later",
    "flush",
    "measuring",
    "real_run_id",
    "run_job",
    "start",
]

#: The module the writer process runs (``python -m``).
PROCESS = "tasks.tracking.writer_process"
#: How the run ids :meth:`RemoteTracker.start_run` hands out begin (``stand-in-<32 hex>``).
STAND_IN = "stand-in-"


class WriterGone(RuntimeError):
    """The tracking writer process ended before the command did (its exit code in the message)."""


class _Writer:
    """The command's side of the pipes to the writer process (thread-safe: Prefect runs tasks
    in threads of their own).

    A signal must not cut a call in half (the writer would then read garbage, and the KILLED
    ends the interrupted command sends next would be lost): each call goes down the pipe in
    one ``write`` with SIGINT and SIGTERM held off, and the answers are read by a thread of
    their own (Python raises KeyboardInterrupt only in the main thread), numbered, so that a
    wait a signal interrupted leaves nothing for the next one to misread."""

    def __init__(self, preload: Iterable[str]) -> None:
        to_writer, self._fd = os.pipe()
        to_command, from_writer = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", PROCESS, str(to_writer), str(from_writer), *preload],
            pass_fds=(to_writer, from_writer),
            stdin=subprocess.DEVNULL,
        )
        os.close(to_writer)
        os.close(from_writer)
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        answers = Connection(to_command, writable=False)
        threading.Thread(
            target=self._read, args=(answers,), name="tracking-writer-answers", daemon=True
        ).start()
        self._lock = threading.Lock()  # one call down the pipe at a time
        self._waiting = threading.Lock()  # one thread reading the answers at a time
        self._seq = 0
        self._later: set[int] = set()  # numbered calls whose answers are read later (result)
        self._kept: dict[int, Any] = {}  # their answers, read meanwhile
        self._handles = 0
        self._error: BaseException | None = None  # carried by an answer nobody waited for
        self.used = False  # whether a call was sent: an exit with none waits for nothing

    def _read(self, answers: Connection) -> None:
        while True:
            try:
                self._answers.put(answers.recv())
            except (EOFError, OSError):
                self._answers.put(None)
                return

    def new_handle(self) -> int:
        with self._lock:
            self._handles += 1
            return self._handles

    def send(self, kind: str, handle: int, name: str, args: tuple, kwargs: dict, wait: bool) -> Any:
        """Send one call; with ``wait``, return its value once every call before it is done.

        Raises:
            the first exception a call raised in the writer since the last waiting call.
            WriterGone: the writer process is gone.
        """
        seq = self._post((kind, handle, name, args, kwargs), answered=wait, later=False)
        return self.result(seq) if wait else None

    def send_later(self, kind: str, handle: int, name: str, args: tuple, kwargs: dict) -> int:
        """Send one call whose value :meth:`result` reads later, by the number this returns:
        the command goes on meanwhile.

        Raises:
            WriterGone: the writer process is gone."""
        return self._post((kind, handle, name, args, kwargs), answered=True, later=True)

    def _post(self, call: tuple, answered: bool, later: bool) -> int:
        """Write ``call`` down the pipe; its number (0: the writer sends no answer)."""
        with self._lock:
            self.used = True
            self._seq += 1
            seq = self._seq if answered else 0
            if later:  # before it is sent: a wait that reads its answer first must keep it
                self._later.add(seq)
            data = pickle.dumps((*call, seq), pickle.HIGHEST_PROTOCOL)
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:  # header and body in one write: Connection.recv's framing ("!i" length)
                frame = memoryview(struct.pack("!i", len(data)) + data)
                while frame:
                    frame = frame[os.write(self._fd, frame) :]
            except OSError:
                self._gone()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return seq

    def result(self, seq: int) -> Any:
        """The value of call number ``seq``, once every call before it is done.

        Raises:
            the first exception a call raised in the writer since the last waiting call.
            WriterGone: the writer process is gone.
        """
        with self._waiting:
            while seq not in self._kept:
                answer = self._answers.get()
                if answer is None:
                    self._answers.put(None)
                    self._gone()
                number, value, error = answer
                self._error = self._error or error
                if number == seq or number in self._later:
                    self._kept[number] = value
            value = self._kept.pop(seq)
            self._later.discard(seq)
        error, self._error = self._error, None
        if error is not None:
            raise error
        return value

    def _gone(self) -> None:
        raise WriterGone(
            f"the tracking writer process exited (code {self.process.wait()}) before the command "
            "did; the run's records are in its folder"
        )

    def close(self) -> None:
        """Wait until every call sent is done (when any was), then close the pipe: the
        writer exits."""
        try:
            if self.used:
                self.send("sync", 0, "", (), {}, wait=True)
        finally:
            os.close(self._fd)


_WRITER: _Writer | None = None


def start(preload: Iterable[str] = ()) -> None:
    """Start the writer process, and open this process's enabled trackers in it from now on
    (``tasks.tracking.OPENER``). ``preload``: what it imports for the jobs to come once MLflow
    is imported and while no call waits, ``module`` or ``module:function`` (called without
    arguments). A second call does nothing."""
    global _WRITER
    if _WRITER is not None:
        return
    _WRITER = _Writer(preload)
    tracking.OPENER = _open
    atexit.register(close)


def close() -> None:
    """Wait for the writer to finish every call this process made, then let it exit; no
    tracker opens in it after this. A no-op without a writer."""
    global _WRITER
    writer, _WRITER = _WRITER, None
    if writer is not None:
        tracking.OPENER = None
        writer.close()


def flush(tracker: Any) -> None:
    """Wait until every call made through ``tracker`` (and any other) is done, when it is a
    :class:`RemoteTracker`.

    Raises:
        the first exception a call raised in the writer and no waiting call reported yet."""
    if isinstance(tracker, RemoteTracker):
        tracker._call("sync", "", (), {}, wait=True)


def measuring(tracker: Any) -> None:
    """Say that the command starts measuring: the writer, when ``tracker`` is a
    :class:`RemoteTracker`, does what it has left at a lower CPU priority from then on (its
    imports, the store's opening and the first runs went at the command's). Lowered from here
    at once (an import in flight reads no call), and by the writer itself when it reads the
    call (where this process may not)."""
    if isinstance(tracker, RemoteTracker):
        with contextlib.suppress(OSError):
            pid, lowered = tracker._writer.process.pid, os.getpriority(os.PRIO_PROCESS, 0) + NICE
            if os.getpriority(os.PRIO_PROCESS, pid) < lowered:
                os.setpriority(os.PRIO_PROCESS, pid, lowered)
        tracker._call("measuring", "", (), {}, wait=False)


def close_abandoned_later(tracker: Any) -> Callable[[], list[dict]]:
    """``tracker.close_abandoned()`` (the runs a SIGKILLed command left RUNNING, now ended
    KILLED): done now, or, when ``tracker`` is a :class:`RemoteTracker`, sent to the writer
    without waiting (its MLflow import may still run); the function returned gives the runs
    (it waits for the writer's answer).

    Raises:
        (the function) what ``close_abandoned`` raised, or an earlier call in the writer."""
    if isinstance(tracker, RemoteTracker):
        writer = tracker._writer
        seq = writer.send_later("call", tracker._handle, "close_abandoned", (), {})
        return lambda: writer.result(seq)
    runs = tracker.close_abandoned()
    return lambda: runs


def real_run_id(tracker: Any, run: str | None) -> str | None:
    """The MLflow id of ``run`` (what ``tracker.start_run`` returned): waits for the writer to
    have created it when ``tracker`` is a :class:`RemoteTracker`; else ``run`` itself."""
    if isinstance(tracker, RemoteTracker) and run and run.startswith(STAND_IN):
        return tracker._call("run_id", run, (), {}, wait=True)
    return run


def run_job(tracker: Any, func: Callable[..., Any], *args: Any) -> None:
    """``func(tracker, *args)``: in the writer, on its real tracker, after the calls made before
    it and without waiting for it, when ``tracker`` is a :class:`RemoteTracker` (``func`` and
    ``args`` must pickle: a module-level function, plain values); else here and now."""
    if isinstance(tracker, RemoteTracker):
        tracker._call("job", f"{func.__module__}:{func.__qualname__}", args, {}, wait=False)
    else:
        func(tracker, *args)


def _open(target: TrackingTarget) -> RemoteTracker:
    return RemoteTracker(target)


def _now_ms() -> int:
    return int(time.time() * 1000)


class RemoteTracker:
    """A :class:`tasks.tracking.Tracker` whose calls run in the writer process (module
    docstring): the same methods, the same arguments; :meth:`start_run` returns a stand-in id.
    ``client`` and ``_write`` (an MLflow client, a callable) cannot cross the pipe: code that
    needs them runs through :func:`run_job`."""

    def __init__(self, target: TrackingTarget) -> None:
        from tasks.tracking.run_owner import process_identity

        assert _WRITER is not None
        self._writer = _WRITER
        self._handle = self._writer.new_handle()
        self.enabled = target.enabled
        self.experiment = target.experiment
        self.tracking_uri = target.tracking_uri or default_tracking_uri()
        self.workdir = target.journal
        self._call("open", "", (target, process_identity()), {}, wait=False)

    def _call(self, kind: str, name: str, args: tuple, kwargs: dict, wait: bool) -> Any:
        return self._writer.send(kind, self._handle, name, args, kwargs, wait)

    def _forward(self, name: str, *args: Any, wait: bool = False, **kwargs: Any) -> Any:
        return self._call("call", name, args, kwargs, wait)

    def start_run(
        self,
        name: str,
        parent_run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        start_time_ms: int | None = None,
    ) -> str | None:
        """Create the run in the writer, without waiting: the id returned stands for the run's
        in every later call of this command (the writer puts the real one in); :func:`real_run_id`
        gives the real one."""
        stand_in = f"{STAND_IN}{uuid.uuid4().hex}"
        start = start_time_ms or _now_ms()
        self._call("create", stand_in, (name, parent_run_id, tags, start), {}, wait=False)
        return stand_in

    # what returns a value waits for it (and for every call before it)
    def close_abandoned(self) -> list[dict]:
        return self._forward("close_abandoned", wait=True)

    @property
    def offline(self) -> bool:
        return self._forward("__getattribute__", "offline", wait=True)  # the real tracker's property

    def ui_command(self) -> str:
        return ui_command(self.tracking_uri)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """Every other public method of ``Tracker`` (the reads, ``run_url``, ``runs_url``):
        forwarded, and waited for."""
        if name.startswith("_") or name == "client" or not callable(getattr(Tracker, name, None)):
            raise AttributeError(f"{type(self).__name__} has no {name!r} (it runs in the tracking writer)")
        return lambda *args, **kwargs: self._forward(name, *args, wait=True, **kwargs)

    # writes do not wait; their timestamps are taken here, when the command makes them
    def end_run(self, run_id: str | None, status: str = "FINISHED", end_time_ms: int | None = None) -> None:
        if self.enabled and run_id:
            self._forward("end_run", run_id, status, end_time_ms or _now_ms())

    def log_metrics(self, run_id: str | None, metrics: Mapping[str, Any], step: int = 0) -> None:
        if self.enabled and run_id:
            self._call("metrics", "", (run_id, metric_entries(metrics, step)), {}, wait=False)

    def log_params(self, run_id: str | None, params: Mapping[str, str]) -> None:
        self._forward("log_params", run_id, dict(params))

    def set_tags(self, run_id: str | None, tags: Mapping[str, Any]) -> None:
        self._forward("set_tags", run_id, dict(tags))

    def log_artifact(self, run_id: str | None, path: str | Path, artifact_path: str | None = None) -> None:
        self._forward("log_artifact", run_id, path, artifact_path)

    def log_text(self, run_id: str | None, text: str, artifact_file: str) -> None:
        self._forward("log_text", run_id, text, artifact_file)

    def log_dict(self, run_id: str | None, data: dict, artifact_file: str) -> None:
        self._forward("log_dict", run_id, data, artifact_file)

    def log_table(self, run_id: str | None, rows: list[dict], artifact_file: str) -> None:
        self._forward("log_table", run_id, rows, artifact_file)

    def log_metric_series(
        self, run_id: str | None, key: str, values: Iterable[float], durations: bool = False
    ) -> None:
        self._forward("log_metric_series", run_id, key, list(values), durations)
