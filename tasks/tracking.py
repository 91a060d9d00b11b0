"""The only module that talks to MLflow.

Runs are created and written through ``MlflowClient`` with explicit run ids, never through
MLflow's thread-local active run, because Prefect runs tasks in other threads. Metrics, params
and tags go in batches (one ``log_metric`` call costs 6-15 ms on SQLite; ``log_batch`` of 1000
about 0.1 s). Params are written once, in one canonical string form, scalars only: MLflow params
are write-once and capped at 6000 characters, so lists longer than a line and the prompts live
in the ``config.yaml`` artifact instead.

Tracking URI: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<repo>/mlruns/mlflow.db`` with
artifacts under ``<repo>/mlruns/artifacts`` (this MLflow refuses the plain file store).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.models import REPO_ROOT

MAX_PARAM_CHARS = 6000
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
PARENT_TAG = "mlflow.parentRunId"
#: The experiment tag the MLflow 3 UI reads to choose its view (its ``ExperimentKind`` enum in
#: mlflow/server/js: ``genai_development`` opens Traces/Evaluations, ``custom_model_development``
#: the classic runs table and metric charts); untagged experiments are guessed, and were guessed
#: GenAI here. Set when this module creates an experiment, or finds one without it.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else the project's SQLite store under mlruns/."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    store = REPO_ROOT / "mlruns"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def _artifact_root_for(uri: str) -> str | None:
    """Local artifact root beside a SQLite store; None lets a tracking server decide."""
    if uri.startswith("sqlite:///"):
        db_path = Path(uri.removeprefix("sqlite:///"))
        return (db_path.parent / "artifacts").resolve().as_uri()
    return None


def canonical_param(value: Any) -> str:
    """One string form per value, so a resume never re-logs "7" as "7.0". Lists and dicts as
    one-line JSON with a space after each comma (``[1, 4]``: how a person writes it, and what
    the MLflow UI's params table shows without unfolding it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(", ", ": "))


def flatten_params(data: Mapping[str, Any], prefix: str = "", max_chars: int = 250) -> dict[str, str]:
    """Flatten a nested config dict to dotted keys with canonical string values.

    Lists and dicts that fit in ``max_chars`` become compact JSON; longer ones (prompt lists)
    are left to the config artifact.
    """
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value):
            nested = flatten_params(value, f"{name}.", max_chars)
            if nested:
                flat.update(nested)
                continue
        text = canonical_param(value)
        if len(text) <= min(max_chars, MAX_PARAM_CHARS):
            flat[name] = text
        elif isinstance(value, (list, tuple)):
            flat[f"{name}.count"] = str(len(value))
    return flat


def finite_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keep numeric, finite values (None, NaN and inf cannot be MLflow metrics)."""
    kept = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            kept[key] = float(value)
    return kept


def _run_dict(run) -> dict:
    return {
        "run_id": run.info.run_id,
        "name": run.info.run_name,
        "status": run.info.status,
        "start_time_ms": run.info.start_time,
        "metrics": dict(run.data.metrics),
        "params": dict(run.data.params),
        "tags": dict(run.data.tags),
    }


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass(frozen=True)
class TrackingTarget:
    """Where to track, as plain values: what flows hand to tasks (a live client is built inside
    the task, so Prefect never has to hash or pickle it)."""

    experiment: str
    tracking_uri: str | None
    enabled: bool = True

    def open(self) -> Tracker:
        return Tracker(self.experiment, self.tracking_uri, self.enabled)


class Tracker:
    """Explicit-run-id access to one MLflow experiment; a disabled tracker does nothing.

    Every method takes the run id; none reads MLflow's active run.
    """

    def __init__(self, experiment: str, tracking_uri: str | None = None, enabled: bool = True):
        self.enabled = enabled
        self.experiment = experiment
        self.tracking_uri = tracking_uri or (default_tracking_uri() if enabled else None)
        self._client = None
        self._experiment_id: str | None = None
        if enabled:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            found = self._client.get_experiment_by_name(experiment)
            if found is None:
                self._experiment_id = self._client.create_experiment(
                    experiment,
                    artifact_location=_artifact_root_for(self.tracking_uri),
                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
                )
            else:
                self._experiment_id = found.experiment_id
                if EXPERIMENT_KIND_TAG not in found.tags:  # made before; a user's choice stays
                    self._client.set_experiment_tag(self._experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)

    def start_run(
        self,
        name: str,
        parent_run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        start_time_ms: int | None = None,
    ) -> str | None:
        """Create a run (nested under ``parent_run_id`` when given) and return its id.
        ``start_time_ms`` (Unix ms): when what it records began, for a run logged afterwards
        (a load level); default now."""
        if not self.enabled:
            return None
        all_tags = {key: str(value) for key, value in (tags or {}).items()}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        run = self._client.create_run(
            self._experiment_id, start_time=start_time_ms, run_name=name, tags=all_tags
        )
        return run.info.run_id

    def end_run(self, run_id: str | None, status: str = "FINISHED", end_time_ms: int | None = None) -> None:
        """End the run; ``end_time_ms`` (Unix ms) when what it records ended earlier (default now):
        MLflow's Duration column is end - start."""
        if self.enabled and run_id:
            self._client.set_terminated(run_id, status=status, end_time=end_time_ms)

    def log_params(self, run_id: str | None, params: Mapping[str, str]) -> None:
        if not (self.enabled and run_id and params):
            return
        from mlflow.entities import Param

        entries = [Param(key, str(value)[:MAX_PARAM_CHARS]) for key, value in params.items()]
        for batch in _chunks(entries, MAX_PARAMS_PER_BATCH):
            self._client.log_batch(run_id, params=batch, synchronous=True)

    def log_metrics(self, run_id: str | None, metrics: Mapping[str, Any], step: int = 0) -> None:
        """Log finite numeric metrics in batches of 1000; other values are skipped."""
        if not (self.enabled and run_id):
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)  # MLflow's timestamp is wall-clock by definition
        entries = [Metric(k, v, now_ms, step) for k, v in finite_metrics(metrics).items()]
        for batch in _chunks(entries, MAX_METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=batch, synchronous=True)

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
        for batch in _chunks(entries, MAX_METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=batch, synchronous=True)

    def set_tags(self, run_id: str | None, tags: Mapping[str, Any]) -> None:
        if not (self.enabled and run_id and tags):
            return
        from mlflow.entities import RunTag

        entries = [RunTag(key, str(value)[:8000]) for key, value in tags.items()]
        for batch in _chunks(entries, MAX_PARAMS_PER_BATCH):
            self._client.log_batch(run_id, tags=batch, synchronous=True)

    def log_artifact(self, run_id: str | None, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled and run_id and Path(path).exists():
            self._client.log_artifact(run_id, str(path), artifact_path)

    def log_text(self, run_id: str | None, text: str, artifact_file: str) -> None:
        if self.enabled and run_id:
            self._client.log_text(run_id, text, artifact_file)

    def log_dict(self, run_id: str | None, data: dict, artifact_file: str) -> None:
        if self.enabled and run_id:
            self._client.log_dict(run_id, data, artifact_file)

    def log_table(self, run_id: str | None, rows: list[dict], artifact_file: str) -> None:
        """Rows (dicts with the same keys) as an MLflow table artifact (the UI's table view)."""
        if self.enabled and run_id and rows:
            columns = list(rows[0])
            self._client.log_table(run_id, {c: [row.get(c) for row in rows] for c in columns}, artifact_file)

    def load_table(self, run_id: str | None, artifact_file: str) -> list[dict]:
        """The rows of a table that :meth:`log_table` wrote ([] when tracking is off or the run
        has no such artifact)."""
        import tempfile

        from mlflow.exceptions import MlflowException

        if not (self.enabled and run_id):
            return []
        with tempfile.TemporaryDirectory() as folder:
            try:
                path = self._client.download_artifacts(run_id, artifact_file, folder)
                table = json.loads(Path(path).read_text(encoding="utf-8"))
            except (MlflowException, OSError, ValueError):
                return []
        return [dict(zip(table["columns"], row)) for row in table["data"]]

    def run_metrics(self, run_id: str) -> dict[str, float]:
        """The latest value of every metric of a run.

        Raises:
            LookupError: no such run in this store (the message names the id and the store).
        """
        from mlflow.exceptions import MlflowException

        try:
            return dict(self._client.get_run(run_id).data.metrics)
        except MlflowException:
            raise LookupError(f"MLflow run {run_id!r} not found in {self.tracking_uri}") from None

    def runs_by_id(self, run_ids: list[str]) -> list[dict]:
        """The named runs (any experiment of this store), in the order given, as plain dicts.

        Raises:
            LookupError: a run id that does not exist.
        """
        from mlflow.exceptions import MlflowException

        found = []
        for run_id in run_ids:
            try:
                found.append(_run_dict(self._client.get_run(run_id)))
            except MlflowException:
                raise LookupError(f"MLflow run {run_id!r} not found in {self.tracking_uri}") from None
        return found

    def find_runs(self, filter_string: str, max_results: int = 10, exclude: str | None = None) -> list[dict]:
        """Runs of this experiment matching an MLflow filter, newest first, as plain dicts
        (run_id, name, status, start_time_ms, metrics, params, tags)."""
        if not self.enabled:
            return []
        runs = self._client.search_runs(
            [self._experiment_id],
            filter_string=filter_string,
            max_results=max_results + (1 if exclude else 0),
            order_by=["attributes.start_time DESC"],
        )
        return [_run_dict(r) for r in runs if r.info.run_id != exclude][:max_results]

    def run_url(self, run_id: str | None) -> str | None:
        """The run's page when the tracking URI is a server; None for a local store."""
        if not (self.enabled and run_id and self.tracking_uri.startswith("http")):
            return None
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self._experiment_id}/runs/{run_id}"

    def ui_command(self) -> str:
        """The command that opens the MLflow UI on this store."""
        uri = self.tracking_uri or default_tracking_uri()
        if uri.startswith("http"):
            return f"open {uri}"
        return f".venv/bin/mlflow ui --backend-store-uri {uri} --port 5000"
