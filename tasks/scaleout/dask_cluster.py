"""The Dask cluster a stream's levels run on (``--task-runner`` of ``infermeter stream``;
``tasks.scaleout.dask_load``): a scheduler's workers, or a LocalCluster this process starts and
closes, and how an interrupt ends the latter.

A Ctrl-C goes to the terminal's whole process group: the LocalCluster's worker processes too.
Each would die on its own (its traceback printed, its level's requests going on until its
nanny kills it 4 s later). So they never take SIGINT: it is blocked in the thread that starts
the cluster while it does (the cluster's threads, and the processes they spawn, inherit the
mask) and each worker leaves it blocked, taken by a thread of its own that mutes the worker
(:func:`dask_setup`, Dask's preload hook). This process takes it: the level's links close,
each worker's client cancels its requests at once (``tasks.scaleout.dask_wire``), and the
cluster closes. What Dask says meanwhile is no error of the run's, and is silenced the instant
the signal arrives (the log lines a closing cluster writes; the client's reconnect traceback
when a scheduler died of the same Ctrl-C): in this process Dask's loggers, by a handler run
before the command's own (:func:`_silenced_on_signal`); in a LocalCluster's worker its whole
output (its stdout and stderr are the command's: a heartbeat that met the closing scheduler
printed a traceback there), when SIGINT reaches it or its level's link closes mid-level
(:func:`mute_worker`), whichever comes first.

The LocalCluster's workers run with :data:`QUIET_WORKER_CONFIG`: a worker's own event loop
otherwise wakes 300-700 times a second (its 20 ms tick, its 10 ms profiler, its memory and
system monitors) and takes the GIL from the client measuring on its task thread each time.
A scheduler's workers (``--task-runner dask:tcp://...``) keep the config they were started with:
README "Load from several hosts" gives the same settings as environment variables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from tasks.config.taskrunner import QUIET_DASK_WORKER
from tasks.scaleout.multiproc import START_TIMEOUT_S

__all__ = ["QUIET_WORKER_CONFIG", "dask_client", "dask_setup", "mute_worker", "silence_dask_logs"]

#: Dask settings for the LocalCluster's workers (module docstring). Measured through
#: `infermeter stream --task-runner dask:2` at 512 streams (tests/benchmarks/stream_client.py,
#: 2026-12-04): each worker's loop thread went from 300-700 wakes a second to about 6, the
#: level's CPU per chunk from 24-28 us to 21-23 (2 client processes: 21-23).
QUIET_WORKER_CONFIG = {
    **QUIET_DASK_WORKER,  # its tick, system monitor and profiler
    # 100 ms: spill / pause / terminate; a worker here holds only a client's records
    "distributed.worker.memory.monitor-interval": "1s",
}


#: The loggers that speak for Dask in a process (distributed's own; tornado's and asyncio's
#: carry what its closing connections raise).
_DASK_LOGGERS = ("distributed", "tornado", "asyncio")


def silence_dask_logs() -> None:
    """Dask's loggers in this process say nothing more (an interrupted command's: what its
    cluster and client say while closing is no error of the run's): each of them and those
    under them that exist, since Dask's logging config gives some their own level
    (``distributed.client``: warning, ``tornado.application``: error)."""
    names = [
        name
        for name in list(logging.root.manager.loggerDict)
        if any(name.startswith(f"{prefix}.") for prefix in _DASK_LOGGERS)
    ]
    for name in (*_DASK_LOGGERS, *names):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def mute_worker() -> None:
    """A LocalCluster worker's whole output from now on to /dev/null, its Dask loggers
    silenced: its stdout and stderr are the interrupted command's (the module docstring).
    Called when SIGINT reaches the worker (:func:`dask_setup`) and when its level's link
    closes mid-level (``tasks.scaleout.dask_wire.when_orphaned``)."""
    silence_dask_logs()
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)


def dask_setup(worker: Any) -> None:
    """Dask's preload hook (``preload=["tasks.scaleout.dask_cluster"]``, the LocalCluster's
    workers only): SIGINT mutes the worker and does nothing else (the command ends the level
    and the cluster); so does its level's link closing mid-level (the module docstring).

    SIGINT was blocked when the worker was spawned (:func:`_sigint_blocked`) and stays blocked
    in each of its threads: a thread of its own takes it with ``sigwait``, at once, whatever
    the other threads do (a Python handler would run only when the main thread next runs
    Python code: its loop may sleep a second, the heartbeat's traceback is written meanwhile).
    Its disposition is set to ignored too, should a thread ever unblock it (Linux queues a
    blocked signal even so, for ``sigwait``)."""
    from tasks.scaleout import dask_wire

    dask_wire.when_orphaned(mute_worker)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the waiter below inherits it

    def take_sigint() -> None:
        signal.sigwait({signal.SIGINT})
        mute_worker()

    threading.Thread(target=take_sigint, daemon=True, name="infermeter-sigint").start()


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block (threads started meanwhile inherit it; a
    Ctrl-C then is taken by another thread of this process, or here once the block ends).
    multiprocessing's resource tracker is started first: starting it later, in the cluster's
    loop thread, would unblock SIGINT there (``resource_tracker.ensure_running`` blocks it
    around its spawn, then unblocks it whatever the mask was before)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def dask_client(choice: Any) -> Iterator[Any]:
    """A ``distributed.Client`` on the chosen cluster (a ``tasks.config.taskrunner.DaskChoice``): the
    scheduler at ``choice.address``, else a LocalCluster of ``choice.workers`` single-threaded
    worker processes (None: one per core) on 127.0.0.1, closed when the block ends (its worker
    processes exit when this process does, however it ends: Dask's parent-alive pipe). An
    interrupt (a signal, or an exception not an ``Exception``) silences Dask's logging in this
    process from then on: what the closing cluster says then is no error of the run's.

    Raises:
        RuntimeError: the scheduler at ``choice.address`` cannot be reached (quoting
            ``choice.text``)."""
    import dask
    from distributed import Client, LocalCluster

    logging.getLogger("distributed").setLevel(logging.WARNING)  # a line per connection otherwise
    with _silenced_on_signal(), _quiet_if_interrupted():
        if choice.address:
            with _scheduler_client(choice) as client:
                yield client
            return
        workers = choice.workers or os.cpu_count() or 1
        # the config is set while the nannies are made: each hands its worker the config of then
        with _sigint_blocked(), dask.config.set(QUIET_WORKER_CONFIG):
            cluster = LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=":0",
                preload=["tasks.scaleout.dask_cluster"],  # dask_setup: SIGINT is ours
            )
        with cluster, Client(cluster) as client:
            client.wait_for_workers(workers, timeout=START_TIMEOUT_S)
            yield client


@contextlib.contextmanager
def _scheduler_client(choice: Any) -> Iterator[Any]:
    """A ``distributed.Client`` on the scheduler at ``choice.address``.

    Raises:
        RuntimeError: it cannot be reached (the message quotes what the user wrote,
            ``choice.text``, and the address it was read as)."""
    from distributed import Client

    try:
        client = Client(choice.address)
    except (OSError, TimeoutError) as exc:
        raise RuntimeError(
            f"task_runner {choice.text or choice.address!r}: no Dask scheduler could be reached at "
            f"{choice.address} ({exc}); start one (`dask scheduler`) or use dask for a local cluster"
        ) from None
    with client:
        yield client


@contextlib.contextmanager
def _silenced_on_signal() -> Iterator[None]:
    """Dask's loggers silenced the instant SIGINT or SIGTERM arrives, before the handler that
    was there runs (the command's: it raises KeyboardInterrupt, which unwinds the level): the
    lines Dask writes while that unwinds are then never written (the module docstring). Only in
    the main thread (where handlers are set); elsewhere the block runs unchanged. The handlers
    are put back when the block ends, unless another was put in meanwhile."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours: dict[int, tuple[Any, Any]] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)
        if not callable(previous):  # ignored, or the default (no Python code runs then)
            continue

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            silence_dask_logs()
            previous(signum, frame)

        signal.signal(signum, handler)
        ours[signum] = (handler, previous)
    try:
        yield
    finally:
        for signum, (handler, previous) in ours.items():
            if signal.getsignal(signum) is handler:
                signal.signal(signum, previous)


@contextlib.contextmanager
def _quiet_if_interrupted() -> Iterator[None]:
    """Dask's loggers silenced when the block ends by an interrupt (not an ``Exception``) that
    no signal handler of ours saw (a KeyboardInterrupt raised by other code): the closing
    cluster's lines that follow are no error of the run's."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception):
            silence_dask_logs()
        raise
