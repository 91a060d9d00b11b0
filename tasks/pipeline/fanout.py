"""Fan a stage's points out over a Dask cluster, through prefect-dask's ``DaskTaskRunner``.

``task_runner`` (config key ``sweep.task_runner`` / ``profile.task_runner``, CLI
``--task-runner``) is ``threads`` (this process: the default), ``dask`` (a new
``distributed.LocalCluster``, one single-threaded worker process per core), ``dask:N`` (a
LocalCluster of N workers) or ``dask:ADDRESS`` (the scheduler at ADDRESS, e.g.
``dask:tcp://10.0.0.5:8786``). Each point is one Prefect task run on a Dask worker; its result
comes back to the stage, which logs the point's MLflow child run exactly as in-process (one
writer: the stage). A point that needs the local model loads it once per worker process
(:func:`worker_model`), not once per point.

A worker that dies mid-point (killed, out of memory): Dask runs the point again on another
worker, once (``distributed.scheduler.allowed-failures`` = 1 on the LocalCluster we start; a
scheduler at an ADDRESS keeps its own setting); a second death, or an exception, is that
point's failure with its cause (:class:`PointFailure`); the other points finish.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tasks.config.taskrunner import QUIET_DASK_WORKER, DaskChoice, check_task_runner, parse_task_runner

__all__ = [
    "DaskChoice",
    "PointFailure",
    "check_task_runner",
    "dask_runner",
    "parse_task_runner",
    "run_points_on_dask",
    "worker_model",
]

#: Times a point is run again after the worker running it died (LocalCluster we start).
RETRIES_AFTER_WORKER_DEATH = 1


@dataclass(frozen=True)
class PointFailure:
    """A point whose Dask task did not come back: ``cause`` is ``"ExceptionClass: message"``
    (``KilledWorker: ...`` when its workers died twice)."""

    index: int
    cause: str

    @property
    def error_class(self) -> str:
        return self.cause.split(":", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "cause": self.cause}


@contextlib.contextmanager
def dask_runner(choice: DaskChoice) -> Iterator[Any]:
    """A started ``DaskTaskRunner`` on the chosen cluster; a LocalCluster it starts is closed
    when the block ends (also on failure). Its workers are processes with one thread each (a
    point never shares its process with another point)."""
    import dask
    from prefect_dask import DaskTaskRunner

    if choice.address:
        runner = DaskTaskRunner(address=choice.address)
    else:
        workers = choice.workers or os.cpu_count() or 1
        kwargs = {"n_workers": workers, "threads_per_worker": 1, "processes": True}
        runner = DaskTaskRunner(cluster_kwargs={**kwargs, "dashboard_address": ":0"})
    logging.getLogger("distributed").setLevel(logging.WARNING)  # a line per connection otherwise
    # read by the LocalCluster's scheduler and nannies when they are made (inside the block);
    # non-daemonic workers may spawn the profile's child processes (points that may not fit)
    settings = {
        **QUIET_DASK_WORKER,  # a point measures on the worker's task thread
        "distributed.scheduler.allowed-failures": RETRIES_AFTER_WORKER_DEATH,
        "distributed.worker.daemon": False,
    }
    with dask.config.set(settings):
        with runner:
            _ = runner.client  # start or connect now: a failure is the stage's, before any point
            yield runner


def run_points_on_dask(
    runner: Any,
    task: Any,
    parameters: Sequence[dict[str, Any]],
    on_done: Callable[[int, Any], None],
    on_failed: Callable[[PointFailure], None],
) -> None:
    """Submit ``task`` once per parameter set; as each finishes (in finishing order) call
    ``on_done(index, result)``, or ``on_failed(PointFailure)`` when its worker died twice or
    it raised. Returns when every point is accounted for."""
    from distributed import as_completed

    futures = [runner.submit(task, parameters=p) for p in parameters]
    index = {f.wrapped_future.key: i for i, f in enumerate(futures)}
    for done in as_completed([f.wrapped_future for f in futures], loop=runner.client.loop):
        i = index[done.key]
        try:
            state = done.result()
        except BaseException as exc:  # noqa: BLE001 - KilledWorker, a lost connection: recorded
            if not isinstance(exc, Exception):
                raise
            on_failed(PointFailure(i, f"{type(exc).__name__}: {exc}"))
            continue
        if state.is_completed():
            on_done(i, state.result())
        else:
            try:
                state.result()
            except Exception as exc:  # noqa: BLE001 - the task's own exception, as its cause
                on_failed(PointFailure(i, f"{type(exc).__name__}: {exc}"))
            else:
                on_failed(PointFailure(i, f"{state.type.value}: {state.message}"))


def worker_model(
    spec: str, dtype: str = "float32", device: str = "cpu", num_layers: int | None = None
) -> tuple[Any, Any]:
    """(model, tokenizer) as :func:`tasks.models.sources.load_model` gives them, loaded once per
    process: on a Dask worker every point (of every sweep or profile) that worker runs shares
    one load. :data:`MODEL_LOADS` counts the loads."""
    return _cached_model(spec, dtype, device, num_layers)  # one cache key however it is called


@lru_cache(maxsize=4)
def _cached_model(spec: str, dtype: str, device: str, num_layers: int | None) -> tuple[Any, Any]:
    from tasks.models.sources import load_model

    key = f"{spec}|{dtype}|{device}|{num_layers}"
    MODEL_LOADS[key] = MODEL_LOADS.get(key, 0) + 1
    return load_model(spec, dtype, device, num_layers=num_layers)


#: ``spec|dtype|device|num_layers`` -> times :func:`worker_model` loaded it in this process (a
#: test reads it from each worker: ``Client.run(model_loads)``).
MODEL_LOADS: dict[str, int] = {}


def model_loads() -> dict[str, int]:
    """A copy of :data:`MODEL_LOADS` (for ``Client.run`` on every worker)."""
    return dict(MODEL_LOADS)


def check_flow_task_runner(text: str | None, setting: str) -> None:
    """:func:`check_task_runner` for a flow run (a deployment, the Prefect UI: no CLI checked
    it): fails the flow run before its first MLflow run, one line naming ``setting``.

    Raises:
        tasks.endpoint.preflight.SettingsError: a bad spec, or no scheduler at the address."""
    from tasks.endpoint.preflight import SettingsError

    try:
        check_task_runner(text)
    except ValueError as exc:
        raise SettingsError(f"{setting}: {exc}") from None
