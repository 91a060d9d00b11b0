"""A real Dask ``LocalCluster`` for the tests, in a process of its own.

``python tests/dask_cluster.py SCHEDULER_PORT HTTP_PORT N_WORKERS`` starts a LocalCluster of
N single-threaded worker processes (with the settings ``tasks.pipeline.fanout`` gives the
clusters it starts: a point is retried once after its worker dies; workers may spawn) and waits
until SIGTERM. :func:`dask_cluster` runs it under :func:`tasks.engines.server.background_server`, so
the cluster and its workers stop when the block ends or when pytest dies in any way.

:func:`outside_cluster` starts what a user starts by hand in other terminals: Dask's own
``dask scheduler`` and ``dask worker`` commands (this environment's), each in a session of its
own, under the same guard.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def dask_cluster(workers: int, folder: Path) -> Iterator[str]:
    """Yield the scheduler address (``tcp://127.0.0.1:PORT``) of a fresh LocalCluster, once
    its ``workers`` workers have joined."""
    from tasks.engines.server import background_server, free_port

    scheduler, http = free_port(), free_port()
    command = [sys.executable, str(Path(__file__).resolve()), str(scheduler), str(http), str(workers)]
    with background_server(
        "dask LocalCluster",
        command,
        dict(os.environ),
        f"http://127.0.0.1:{http}/health",
        startup_timeout_s=120,
        log_path=folder / "dask-cluster.log",
    ):
        address = f"tcp://127.0.0.1:{scheduler}"
        from distributed import Client

        with Client(address) as client:  # the scheduler answers before its workers join
            client.wait_for_workers(workers, timeout=120)
        yield address


@contextlib.contextmanager
def outside_cluster(workers: int, folder: Path) -> Iterator[str]:
    """Yield the address (``tcp://127.0.0.1:PORT``) of a ``dask scheduler`` with ``workers``
    single-threaded ``dask worker`` processes (no nanny), each its own command in its own
    session (a terminal's Ctrl-C at another command never reaches them), on free ports; they
    are stopped when the block ends or pytest dies (their logs in ``folder``)."""
    from distributed import Client

    from tasks.engines.server import background_server, free_port

    dask = str(Path(sys.executable).parent / "dask")
    port, http = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        scheduler = [dask, "scheduler", "--host", "127.0.0.1", "--port", str(port)]
        scheduler += ["--dashboard-address", f"127.0.0.1:{http}"]
        stack.enter_context(
            background_server("dask scheduler", scheduler, env, f"http://127.0.0.1:{http}/health",
                              startup_timeout_s=60, log_path=folder / "scheduler.log")
        )  # fmt: skip
        for k in range(workers):
            worker_http = free_port()
            worker = [dask, "worker", address, "--nthreads", "1", "--no-nanny", "--host", "127.0.0.1"]
            worker += ["--dashboard-address", f"127.0.0.1:{worker_http}"]
            stack.enter_context(
                background_server(f"dask worker {k}", worker, env, f"http://127.0.0.1:{worker_http}/health",
                                  startup_timeout_s=60, log_path=folder / f"worker{k}.log")
            )  # fmt: skip
        with Client(address) as client:  # a worker answers before it has joined
            client.wait_for_workers(workers, timeout=60)
        yield address


def main(scheduler_port: int, http_port: int, workers: int) -> None:
    import dask
    from distributed import LocalCluster

    from tasks.pipeline.fanout import RETRIES_AFTER_WORKER_DEATH

    settings = {
        "distributed.scheduler.allowed-failures": RETRIES_AFTER_WORKER_DEATH,
        "distributed.worker.daemon": False,
    }
    with dask.config.set(settings):
        cluster = LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            scheduler_port=scheduler_port,
            dashboard_address=f"127.0.0.1:{http_port}",
        )
    print(f"scheduler at {cluster.scheduler_address}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (cluster.close(timeout=10), os._exit(0)))
    while True:
        signal.pause()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
