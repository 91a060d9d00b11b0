"""The only module that talks to MLflow.

Runs are created and written through ``MlflowClient`` with explicit run ids, never through
MLflow's thread-local active run, because Prefect runs tasks in other threads. Metrics, params
and tags go in batches (one ``log_metric`` call costs 6-15 ms on SQLite; ``log_batch`` of 1000
about 0.1 s). Params are written once, in one canonical string form, scalars only: MLflow params
are write-once and capped at 6000 characters, so lists longer than a line and the prompts live
in the ``config.yaml`` artifact instead.

Tracking URI: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<repo>/mlruns/mlflow.db`` with
artifacts under ``<repo>/mlruns/artifacts`` (this MLflow refuses the plain file store).

A tracker given a ``journal`` folder (a flow run's work folder) survives a tracking server that
goes away: the first call that finds it gone (after :data:`HTTP_RETRIES` retries, not MLflow's
default 7 over ~4 minutes) and every write after it go to the journal
(:mod:`tasks.tracking.journal`); ``infermeter sync`` sends them once the server is back.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.tracking.gone import server_gone
from tasks.tracking.journal import OFFLINE_PREFIX, RUN_KEY_TAG, Journal
from tasks.tracking.run_owner import (  # noqa: F401  (the tags: imported from here too)
    OWNER_HOST_TAG,
    OWNER_TAG,
    RECORDS_TAG,
    close_abandoned_runs,
    process_identity,
)
from tasks.tracking.values import (  # noqa: F401  (canonical_param, flatten_params: imported from here)
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    MAX_PARAM_CHARS,
    artifact_root_for,
    canonical_param,
    chunks,
    default_tracking_uri,
    finite_metrics,
    flatten_params,
    open_experiment,
    run_dict,
    run_page_url,
    runs_table_url,
    shown_uri,
    ui_command,
)

MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
PARENT_TAG = "mlflow.parentRunId"
#: MLflow HTTP retries (backoff 1, 2, 4 s) before a journaled tracker gives the server up
#: (``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` overrides it).
HTTP_RETRIES = 3
OPENER: Callable[[TrackingTarget], Any] | None = None  # opens them in tasks.tracking.writer's process


def preload(tracking_uri: str) -> None:
    """Import what a tracker of ``tracking_uri`` will (MLflow's client, its store), creating nothing."""
    import mlflow.tracking  # noqa: F401

    if not tracking_uri.startswith(("http:", "https:", "databricks")):
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401


@dataclass(frozen=True)
class TrackingTarget:
    """Where to track, as plain values: what flows hand to tasks (a live client is built inside
    the task, so Prefect never has to hash or pickle it)."""

    experiment: str
    tracking_uri: str | None
    enabled: bool = True
    journal: str | None = None  # the run's work folder: writes the server missed go there

    def open(self) -> Tracker:
        if self.enabled and OPENER is not None:
            return OPENER(self)
        return Tracker(self.experiment, self.tracking_uri, self.enabled, self.journal)


class Tracker:
    """Explicit-run-id access to one MLflow experiment; a disabled tracker does nothing.

    Every method takes the run id; none reads MLflow's active run. With ``journal`` (a folder)
    writes that find the server gone are journaled there instead of raising (module docstring).
    """

    def __init__(
        self,
        experiment: str,
        tracking_uri: str | None = None,
        enabled: bool = True,
        journal: str | None = None,
    ):
        self.enabled = enabled
        self.experiment = experiment
        self.tracking_uri = tracking_uri or (default_tracking_uri() if enabled else None)
        self._client = None
        self._experiment_id: str | None = None
        self.workdir = journal
        self.journal = Journal(journal) if journal and enabled else None
        self.owner = process_identity()  # its runs' owner (a tracking writer's: the command)
        if enabled:
            from mlflow.tracking import MlflowClient

            if self.journal and self.tracking_uri.startswith("http"):
                os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(HTTP_RETRIES))
                os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            if not (self.journal and self.journal.offline):
                self._write("experiment", {}, self._open_experiment)

    def _open_experiment(self) -> None:
        """Find or create the experiment (``tasks.tracking.values.open_experiment``)."""
        self._experiment_id = open_experiment(
            self._client, self.experiment, artifact_root_for(self.tracking_uri)
        )

    @property
    def offline(self) -> bool:
        """Whether this run's writes go to its journal (the server was found gone)."""
        return bool(self.journal and self.journal.offline)

    def _write(self, op: str, fields: dict, call) -> Any:
        """``call()``; with a journal, a server found gone (now or by another tracker of the
        run) journals ``op`` with ``fields`` instead and returns None."""
        if self.journal is None:
            return call()
        if not self.journal.offline:
            try:
                return call()
            except Exception as exc:
                if not server_gone(exc):
                    raise
                self.journal.go_offline(self.tracking_uri, f"{type(exc).__name__}: {exc}")
        if op != "experiment":
            self.journal.append(op, self.experiment, fields)
        return None

    def start_run(
        self,
        name: str,
        parent_run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        start_time_ms: int | None = None,
    ) -> str | None:
        """Create a run (nested under ``parent_run_id`` when given) and return its id. ``start_time_ms``
        (Unix ms): when what it records began, for a run logged afterwards (a level); default now."""
        if not self.enabled:
            return None
        all_tags = {OWNER_HOST_TAG: socket.gethostname(), OWNER_TAG: self.owner}
        if self.workdir:
            all_tags[RECORDS_TAG] = str(self.workdir)
        all_tags.update({key: str(value) for key, value in (tags or {}).items()})
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        if self.journal is None:
            return self.create_run(name, all_tags, start_time_ms)
        key = uuid.uuid4().hex
        all_tags[RUN_KEY_TAG] = key  # finds the run again should its create be journaled
        start = start_time_ms or int(time.time() * 1000)
        fields = {"key": key, "name": name, "tags": all_tags, "start_time_ms": start}
        return self._write("create_run", fields, lambda: self.create_run(name, all_tags, start)) or (
            OFFLINE_PREFIX + key
        )

    def create_run(self, name: str, tags: dict[str, str], start_time_ms: int | None) -> str:
        """A new run with exactly these tags (start_run's, or a journaled one sent again)."""
        run = self._client.create_run(self._experiment_id, start_time=start_time_ms, run_name=name, tags=tags)
        return run.info.run_id

    def close_abandoned(self) -> list[dict]:
        """End KILLED the RUNNING runs of this store whose owner on this host is certainly gone
        (``tasks.tracking.run_owner.close_abandoned_runs``: a command killed by SIGKILL could not end
        them); nothing when tracking is off, offline, or the server does not answer."""
        if not self.enabled or self.offline:
            return []
        try:
            return close_abandoned_runs(self._client, socket.gethostname())
        except Exception as exc:
            if server_gone(exc):
                return []
            raise

    def end_run(self, run_id: str | None, status: str = "FINISHED", end_time_ms: int | None = None) -> None:
        """End the run; ``end_time_ms`` (Unix ms) when what it records ended earlier (default now):
        MLflow's Duration column is end - start."""
        if self.enabled and run_id:
            end = end_time_ms or int(time.time() * 1000)
            fields = {"run_id": run_id, "status": status, "end_time_ms": end}
            self._write(
                "end", fields, lambda: self._client.set_terminated(run_id, status=status, end_time=end)
            )

    def log_params(self, run_id: str | None, params: Mapping[str, str]) -> None:
        if not (self.enabled and run_id and params):
            return
        from mlflow.entities import Param

        entries = [Param(key, str(value)[:MAX_PARAM_CHARS]) for key, value in params.items()]
        for batch in chunks(entries, MAX_PARAMS_PER_BATCH):
            self._batch(run_id, params=batch)

    def log_metrics(self, run_id: str | None, metrics: Mapping[str, Any], step: int = 0) -> None:
        """Log finite numeric metrics in batches of 1000; other values are skipped."""
        if not (self.enabled and run_id):
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)  # MLflow's timestamp is wall-clock by definition
        entries = [Metric(k, v, now_ms, step) for k, v in finite_metrics(metrics).items()]
        for batch in chunks(entries, MAX_METRICS_PER_BATCH):
            self._batch(run_id, metrics=batch)

    def log_metric_series(
        self, run_id: str | None, key: str, values: Iterable[float], durations: bool = False
    ) -> None:
        """One metric with a step per value (e.g. decode_ms per decode step).

        ``durations``: the values are consecutive durations in ms (decode steps): step i is
        stamped with the wall time it ended, counting back from now by the durations after it,
        so MLflow's relative/wall-time axis spaces the steps as they ran instead of stacking
        them on one instant (mlflow#8182). Otherwise every step is stamped now."""
        if not (self.enabled and run_id):
            return
        from mlflow.entities import Metric

        now_ms = time.time() * 1000
        kept = [(step, float(v)) for step, v in enumerate(values) if v is not None and math.isfinite(v)]
        stamps = [now_ms] * len(kept)
        if durations:
            remaining = sum(v for _, v in kept)
            for i, (_, v) in enumerate(kept):
                remaining -= v
                stamps[i] = now_ms - remaining
        entries = [Metric(key, v, int(round(stamp)), step) for (step, v), stamp in zip(kept, stamps)]
        for batch in chunks(entries, MAX_METRICS_PER_BATCH):
            self._batch(run_id, metrics=batch)

    def set_tags(self, run_id: str | None, tags: Mapping[str, Any]) -> None:
        if not (self.enabled and run_id and tags):
            return
        from mlflow.entities import RunTag

        entries = [RunTag(key, str(value)[:8000]) for key, value in tags.items()]
        for batch in chunks(entries, MAX_PARAMS_PER_BATCH):
            self._batch(run_id, tags=batch)

    def _batch(self, run_id: str, metrics=(), params=(), tags=()) -> None:
        """One ``log_batch`` call (journaled as plain lists when the server is gone)."""
        fields = {
            "run_id": run_id,
            "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics],
            "params": [[p.key, p.value] for p in params],
            "tags": [[t.key, t.value] for t in tags],
        }
        call = lambda: self._client.log_batch(  # noqa: E731
            run_id, metrics=list(metrics), params=list(params), tags=list(tags), synchronous=True
        )
        self._write("log_batch", fields, call)

    def log_artifact(self, run_id: str | None, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled and run_id and Path(path).exists():
            fields = {"run_id": run_id, "path": str(path), "artifact_path": artifact_path}
            self._write(
                "artifact", fields, lambda: self._client.log_artifact(run_id, str(path), artifact_path)
            )

    def log_text(self, run_id: str | None, text: str, artifact_file: str) -> None:
        if self.enabled and run_id:
            fields = {"run_id": run_id, "data": text, "file": artifact_file}
            self._write("text", fields, lambda: self._client.log_text(run_id, text, artifact_file))

    def log_dict(self, run_id: str | None, data: dict, artifact_file: str) -> None:
        if self.enabled and run_id:
            fields = {"run_id": run_id, "data": data, "file": artifact_file}
            self._write("dict", fields, lambda: self._client.log_dict(run_id, data, artifact_file))

    def log_table(self, run_id: str | None, rows: list[dict], artifact_file: str) -> None:
        """Rows (dicts with the same keys) as an MLflow table artifact (the UI's table view)."""
        if self.enabled and run_id and rows:
            data = {c: [row.get(c) for row in rows] for c in rows[0]}
            fields = {"run_id": run_id, "data": data, "file": artifact_file}
            self._write("table", fields, lambda: self._client.log_table(run_id, data, artifact_file))

    def load_table(self, run_id: str | None, artifact_file: str) -> list[dict]:
        """The rows of a table that :meth:`log_table` wrote ([] when tracking is off or the run
        has no such artifact)."""
        table = self.read_artifact(run_id, artifact_file, lambda p: json.loads(p.read_text(encoding="utf-8")))
        return [] if table is None else [dict(zip(table["columns"], row)) for row in table["data"]]

    def read_artifact(self, run_id: str | None, artifact_file: str, read: Callable[[Path], Any]) -> Any:
        """``read(local copy of the artifact)``; None when tracking is off, the run has no such
        artifact, or ``read`` raises OSError / ValueError (an unreadable file)."""
        import tempfile

        from mlflow.exceptions import MlflowException

        if not (self.enabled and run_id) or self.offline:
            return None
        with tempfile.TemporaryDirectory() as folder:
            try:
                return read(Path(self._client.download_artifacts(run_id, artifact_file, folder)))
            except (MlflowException, OSError, ValueError):
                return None

    def _get_run(self, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id)
        except MlflowException:
            raise LookupError(f"MLflow run {run_id!r} not found in {shown_uri(self.tracking_uri)}") from None

    def run_metrics(self, run_id: str) -> dict[str, float]:
        """The latest value of every metric of a run.

        Raises:
            LookupError: no such run in this store (the message names the id and the store).
        """
        return dict(self._get_run(run_id).data.metrics)

    def experiment_of(self, run_id: str) -> str:
        """The name of the experiment that holds run ``run_id`` (any experiment of this store).

        Raises:
            LookupError: no such run in this store (the message names the id and the store).
        """
        return self._client.get_experiment(self._get_run(run_id).info.experiment_id).name

    def runs_by_id(self, run_ids: list[str]) -> list[dict]:
        """The named runs (any experiment of this store), in the order given, as plain dicts.

        Raises:
            LookupError: a run id that does not exist (the message names the id and the store).
        """
        return [run_dict(self._get_run(run_id)) for run_id in run_ids]

    def find_runs(
        self,
        filter_string: str,
        max_results: int = 10,
        exclude: str | None = None,
        parents_only: bool = False,
    ) -> list[dict]:
        """Runs of this experiment matching an MLflow filter, newest first, as plain dicts
        (run_id, name, status, start_time_ms, metrics, params, tags). ``parents_only``: runs
        without a parent (a flow's own run, not its stages, levels or points)."""
        if not self.enabled or self.offline:
            return []
        if parents_only:
            top = f"tags.`{PARENT_TAG}` IS NULL"
            filter_string = f"{filter_string} and {top}" if filter_string.strip() else top
        runs = self._client.search_runs(
            [self._experiment_id],
            filter_string=filter_string,
            max_results=max_results + (1 if exclude else 0),
            order_by=["attributes.start_time DESC"],
        )
        return [run_dict(r) for r in runs if r.info.run_id != exclude][:max_results]

    def run_url(self, run_id: str | None) -> str | None:
        """The run's page in the UI's classic view on a server (``values.run_page_url``); None
        for a local store, tracking off, or a run not known to the server yet (offline)."""
        return run_page_url(self.tracking_uri, self._experiment_id, run_id) if self.enabled else None

    def ui_command(self) -> str:
        """The command that opens the MLflow UI on this store (``tasks.tracking.values.ui_command``)."""
        return ui_command(self.tracking_uri or default_tracking_uri())

    def runs_url(self) -> str | None:
        """The experiment's runs table in the MLflow UI's classic view
        (``tasks.tracking.values.runs_table_url``); None when tracking is off or the experiment is not
        known (offline)."""
        if not (self.enabled and self._experiment_id):
            return None
        return runs_table_url(self.tracking_uri or default_tracking_uri(), self._experiment_id)

    def find_run_by_key(self, key: str) -> str | None:
        """The id of this experiment's run tagged ``infermeter_run_key = key``, or None."""
        found = self._client.search_runs(
            [self._experiment_id], f"tags.{RUN_KEY_TAG} = '{key}'", max_results=1
        )
        return found[0].info.run_id if found else None

    def send_batch(self, run_id: str, metrics: list, params: list, tags: list) -> None:
        """One ``log_batch`` from plain lists (``[key, value, timestamp, step]``, ``[key,
        value]``, ``[key, value]``: a journal's), synchronously; failures raise."""
        from mlflow.entities import Metric, Param, RunTag

        self._client.log_batch(
            run_id,
            metrics=[Metric(*m) for m in metrics],
            params=[Param(*p) for p in params],
            tags=[RunTag(*t) for t in tags],
            synchronous=True,
        )

    @property
    def client(self) -> Any:
        """The MLflow client (artifacts, tables, ends replayed by ``tasks.tracking.sync``)."""
        return self._client
