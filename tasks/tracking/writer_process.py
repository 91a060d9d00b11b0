"""The tracking writer process (``python -m tasks.tracking.writer_process FD_IN FD_OUT
[PRELOAD...]``, started by :func:`tasks.tracking.writer.start`, which says why it exists).

It imports MLflow at once (``tasks.tracking.preload``), then makes the command's calls in the
order they come, each on the real :class:`tasks.tracking.Tracker` it opened for the command's
tracker, with the stand-in run ids the command was given replaced by the runs' own; a job
(``tasks.tracking.writer.run_job``: a level's plots and timeline) runs here on that tracker.
While no call is waiting it imports the modules named on its command line (matplotlib, the
jobs' modules), so that the first job finds them loaded. A call that raises does not stop it:
the first error goes back with the next answer. It lowers its CPU priority by :data:`NICE`
once the command says it measures (the client processes, and a server on this machine, come
first); it ignores SIGINT, SIGTERM and SIGHUP, and ends when the command's end of the pipe
closes, after the calls it holds: a command killed by SIGKILL leaves its runs open, and the
writer then ends them KILLED at once (:meth:`_Writer.end_orphaned_runs`).

A plotter process beside it (the jobs drawn on the other core) was tried: on a quiet 2-core
machine it was no faster (7.8 s against 7.5 s, medians of 13 interleaved runs; the plotter's
imports slowed MLflow's, and the last level's plots are drawn after it either way) and on a
busy one slower (12.1 against 11.0 s), for twice the code.
"""

from __future__ import annotations

import importlib
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tasks import tracking
from tasks.phases import mark
from tasks.tracking import MAX_METRICS_PER_BATCH, Tracker
from tasks.tracking.run_owner import owner_gone
from tasks.tracking.values import chunks, default_tracking_uri, finite_metrics

#: How much lower the writer's priority goes once the command measures (``nice``).
NICE = 10
#: Seconds the writer waits, at the pipe's end, for a command that left runs open to be gone.
ORPHAN_WAIT_S = 5.0
#: This process's niceness at its start: the command's.
_START_NICE = os.getpriority(os.PRIO_PROCESS, 0)


def metric_entries(metrics: dict[str, Any], step: int = 0) -> list[list[Any]]:
    """What ``Tracker.log_metrics`` logs, stamped now: ``[key, value, timestamp_ms, step]``."""
    now_ms = int(time.time() * 1000)
    return [[k, v, now_ms, step] for k, v in finite_metrics(metrics).items()]


def log_metric_entries(tracker: Tracker, run_id: str, entries: list[list[Any]]) -> None:
    """``Tracker.log_metrics`` with the command's timestamps (:func:`metric_entries`): the same
    batches, through the tracker's journaled batch."""
    for batch in chunks(entries, MAX_METRICS_PER_BATCH):
        fields = {"run_id": run_id, "metrics": batch, "params": [], "tags": []}
        tracker._write("log_batch", fields, lambda batch=batch: tracker.send_batch(run_id, batch, [], []))


def _function(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _lower_priority() -> None:
    """Take :data:`NICE` more than the command's, once."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < _START_NICE + NICE:
            os.nice(NICE)
    except OSError:
        pass


def _preload(spec: str, *args: Any) -> None:
    """Import ``module`` (and call ``module:function(*args)``); best effort: what the calls
    need they import anyway, and raise what fails."""
    import traceback

    try:
        module, _, call = spec.partition(":")
        loaded = importlib.import_module(module)
        if call:
            getattr(loaded, call)(*args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError with its type and message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


#: What the reader puts in the inbox when a call could not be read (:func:`_read`).
_UNREADABLE = ("unreadable",)


def _read(connection: Connection, inbox: queue.SimpleQueue) -> None:
    """Put every call of ``connection`` into ``inbox`` at once (the command never blocks on a
    full pipe), then None at its end; a pipe that ends without a call ends this process at
    once (the command exited before it tracked anything, a bad input: it must neither wait on
    MLflow's import nor keep the command's output open). A call that cannot be unpickled here
    (a class this process cannot import) puts :data:`_UNREADABLE`: the writer then ends with
    exit 1 and the command's next wait raises ``WriterGone``. Before, the reading thread died
    of it and both processes waited for ever, the writer outliving its killed command."""

    def read() -> None:
        received = False
        while True:
            try:
                inbox.put(connection.recv())
                received = True
            except (EOFError, OSError):
                if not received:
                    os._exit(0)
                inbox.put(None)
                return
            except Exception:  # noqa: BLE001  (printed; the writer ends on it)
                import traceback

                traceback.print_exc()
                inbox.put(_UNREADABLE)
                return

    threading.Thread(target=read, name="tracking-writer-read", daemon=True).start()


class _Writer:
    """The writer's state: the trackers it opened for the command's, the runs' real ids, the
    first error not reported yet."""

    def __init__(self, replies: Connection) -> None:
        self.replies = replies
        self.trackers: dict[int, Tracker] = {}
        self.ids: dict[str, str | None] = {}  # stand-in run id -> MLflow's
        self.error: BaseException | None = None
        self.open_runs: set[str | None] = set()  # created, not ended: what a SIGKILL leaves RUNNING

    def run(self, message: tuple) -> None:
        """Make one of the command's calls; answer it when the command waits for it."""
        kind, handle, name, args, kwargs, seq = message
        args = tuple(self.ids.get(a, a) if isinstance(a, str) else a for a in args)  # the stand-in ids
        kwargs = {k: self.ids.get(a, a) if isinstance(a, str) else a for k, a in kwargs.items()}
        value = None
        try:
            if kind == "open":
                target, owner = args
                tracker = Tracker(target.experiment, target.tracking_uri, target.enabled, target.journal)
                tracker.owner = owner  # the command's process owns the runs, not this one
                self.trackers[handle] = tracker
            elif kind == "create":  # name: the stand-in id the command uses for the run
                self.ids[name] = self.trackers[handle].start_run(*args)
                self.open_runs.add(self.ids[name])
            elif kind == "run_id":
                value = self.ids[name]
            elif kind == "call":
                value = getattr(self.trackers[handle], name)(*args, **kwargs)
                if name == "end_run":
                    self.open_runs.discard(args[0] if args else kwargs.get("run_id"))
            elif kind == "metrics":
                log_metric_entries(self.trackers[handle], *args)
            elif kind == "job":
                _function(name)(self.trackers[handle], *args, **kwargs)
            elif kind == "measuring":
                _lower_priority()
        except Exception as exc:  # noqa: BLE001  (the command raises it)
            self.error = self.error or _portable(exc)
        if seq:
            self.replies.send((seq, value, self.error))
            self.error = None

    def end_orphaned_runs(self) -> None:
        """At the pipe's end, the calls done: when runs the command created are still open and
        the command is gone (a SIGKILL: it could not end them), end them KILLED now, with an
        ``error`` tag naming the process and the records folder
        (``tasks.tracking.Tracker.close_abandoned``), rather than leave them RUNNING until the
        next command. A command that is still alive after :data:`ORPHAN_WAIT_S` ends its own."""
        trackers = [t for t in self.trackers.values() if t.enabled]
        if not (self.open_runs - {None}) or not trackers:
            return
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while not owner_gone(trackers[0].owner):  # the kernel closes its files before it is a zombie
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        for gone in trackers[0].close_abandoned():
            print(
                f"infermeter: MLflow run {gone['run_id']} ({gone['name']}) left RUNNING by a killed "
                f"command: marked KILLED; its records are in {gone['records_folder']}",
                file=sys.stderr,
            )


def _serve(requests: Connection, replies: Connection, preload: list[str]) -> None:
    """Make the command's calls in the order they come, importing ``preload`` while none is
    waiting; return at the end of the pipe, the calls all done."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    _read(requests, inbox)
    mark("writer_started")
    _preload(f"{tracking.__name__}:preload", default_tracking_uri())  # an error is the open's to raise
    mark("writer_mlflow_imported")
    writer = _Writer(replies)
    pending = list(preload)
    while True:
        try:  # the calls first
            message = inbox.get(block=not pending)
        except queue.Empty:
            _preload(pending.pop(0))
            if not pending:
                mark("writer_preloaded")
            continue
        if message is None:
            writer.end_orphaned_runs()
            return
        if message is _UNREADABLE:
            raise RuntimeError("a call from the command could not be read (the traceback above)")
        mark(f"call:{message[0]}:{message[2]}")
        writer.run(message)
        mark("call_done")
        if inbox.empty():
            mark("writer_idle")


def main(argv: list[str]) -> None:
    """``python -m tasks.tracking.writer_process FD_IN FD_OUT [PRELOAD...]`` (what
    ``tasks.tracking.writer.start`` runs): FD_IN the calls' pipe, FD_OUT the answers'."""
    import traceback

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    code = 0
    try:
        _serve(Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False), argv[2:])
    except BaseException:  # the command then reads WriterGone, with this exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the calls are done: skip the interpreter's teardown of MLflow's modules


if __name__ == "__main__":  # run as the imported module, so that jobs named by it find it
    from tasks.tracking.writer_process import main as module_main

    module_main(sys.argv[1:])
