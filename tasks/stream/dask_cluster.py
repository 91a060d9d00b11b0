"""The Dask cluster a stream's levels run on (``--task-runner`` of ``infermeter stream``;
``tasks.stream.dask_load``): a scheduler's workers, or a LocalCluster this process starts and
closes, and how an interrupt ends the latter.

A Ctrl-C goes to the terminal's whole process group: the LocalCluster's worker processes too.
Each would die on its own (its traceback printed, its level's requests going on until its
nanny kills it 4 s later). So they never take SIGINT: it is blocked in the thread that starts
the cluster while it does (the cluster's threads, and the processes they spawn, inherit the
mask) and ignored by each worker (:func:`dask_setup`, Dask's preload hook). This process takes
it: the level's links close, each worker's client cancels its requests at once
(``tasks.stream.dask_wire``), and the cluster closes, its shutdown's log lines silenced.

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

from tasks.stream.multiproc import START_TIMEOUT_S
from tasks.taskrunner import QUIET_DASK_WORKER

__all__ = ["QUIET_WORKER_CONFIG", "dask_client", "dask_setup"]

#: Dask settings for the LocalCluster's workers (module docstring). Measured through
#: `infermeter stream --task-runner dask:2` at 512 streams (tests/benchmarks/stream_client.py,
#: 2026-12-04): each worker's loop thread went from 300-700 wakes a second to about 6, the
#: level's CPU per chunk from 24-28 us to 21-23 (2 client processes: 21-23).
QUIET_WORKER_CONFIG = {
    **QUIET_DASK_WORKER,  # its tick, system monitor and profiler
    # 100 ms: spill / pause / terminate; a worker here holds only a client's records
    "distributed.worker.memory.monitor-interval": "1s",
}


def dask_setup(worker: Any) -> None:
    """Dask's preload hook (``preload=["tasks.stream.dask_cluster"]``): the worker ignores
    SIGINT (the module docstring)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


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
    """A ``distributed.Client`` on the chosen cluster (a ``tasks.taskrunner.DaskChoice``): the
    scheduler at ``choice.address``, else a LocalCluster of ``choice.workers`` single-threaded
    worker processes (None: one per core) on 127.0.0.1, closed when the block ends (its worker
    processes exit when this process does, however it ends: Dask's parent-alive pipe). An
    interrupt (an exception not an ``Exception``) ends the block with Dask's logging silenced:
    what the closing cluster says then is no error of the run's."""
    import dask
    from distributed import Client, LocalCluster

    log = logging.getLogger("distributed")
    log.setLevel(logging.WARNING)  # a line per connection otherwise
    try:
        if choice.address:
            with Client(choice.address) as client, _quiet_if_interrupted(log):
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
                preload=["tasks.stream.dask_cluster"],  # dask_setup: SIGINT is ours
            )
        with cluster, Client(cluster) as client:
            client.wait_for_workers(workers, timeout=START_TIMEOUT_S)
            with _quiet_if_interrupted(log):
                yield client
    finally:
        log.setLevel(logging.WARNING)


@contextlib.contextmanager
def _quiet_if_interrupted(log: logging.Logger) -> Iterator[None]:
    """``log`` silenced when the block ends by an interrupt (not an ``Exception``): the
    closing cluster's lines that follow are no error of the run's."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception):
            log.setLevel(logging.CRITICAL + 1)
        raise
