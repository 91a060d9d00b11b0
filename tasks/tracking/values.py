"""How values become MLflow params and metrics: one canonical string per param value, flat
dotted keys, finite floats only. Also the default tracking URI and plain forms of runs. Standard library only; re-exported
by :mod:`tasks.tracking`, which is where callers import them from."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tasks.models.sources import REPO_ROOT

__all__ = [
    "MAX_PARAM_CHARS",
    "canonical_param",
    "default_tracking_uri",
    "finite_metrics",
    "flatten_params",
]

MAX_PARAM_CHARS = 6000


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


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else the project's SQLite store under mlruns/."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    store = REPO_ROOT / "mlruns"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def shown_uri(uri: str) -> str:
    """A tracking URI as a message may show it: a password in it (``postgresql://u:pw@host/db``)
    replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        url = urlsplit(uri)
        if url.password is None:
            return uri
    except ValueError:  # a port that is not a number: nothing to hide that urlsplit could find
        return uri
    host = url.netloc.rpartition("@")[2]
    return urlunsplit(url._replace(netloc=f"{url.username or ''}:***@{host}"))


def artifact_root_for(uri: str) -> str | None:
    """Local artifact root beside a SQLite store; None lets a tracking server decide."""
    if uri.startswith("sqlite:///"):
        db_path = Path(uri.removeprefix("sqlite:///"))
        return (db_path.parent / "artifacts").resolve().as_uri()
    return None


def run_dict(run) -> dict:
    return {
        "run_id": run.info.run_id,
        "name": run.info.run_name,
        "status": run.info.status,
        "start_time_ms": run.info.start_time,
        "metrics": dict(run.data.metrics),
        "params": dict(run.data.params),
        "tags": dict(run.data.tags),
    }


def chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


#: The experiment tag the MLflow 3 UI reads to choose its view (its ``ExperimentKind`` enum in
#: mlflow/server/js: ``genai_development`` opens Traces/Evaluations, ``custom_model_development``
#: the classic runs table and metric charts); untagged experiments are guessed, and were guessed
#: GenAI here. Set when ``tasks.tracking`` creates an experiment, or finds one without it. MLflow
#: 3.17's UI no longer reads it while its sidebar's GenAI / Model training switch is on (it
#: is, in the bundled JS): the switch decides, from the URL's ``workflowType`` (default: the
#: browser's last choice, GenAI at first), so :func:`runs_table_url` names the view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
#: The MLflow UI's classic view (``?workflowType=machine_learning``: "Model training").
UI_WORKFLOW = "machine_learning"
#: The port :func:`ui_command` starts ``mlflow ui`` on.
UI_PORT = 5000


def ui_command(uri: str) -> str:
    """The command that opens the MLflow UI on the store at ``uri``."""
    if uri.startswith("http"):
        return f"open {uri}"
    return f".venv/bin/mlflow ui --backend-store-uri {uri} --port {UI_PORT}"


def runs_table_url(uri: str, experiment_id: str | None) -> str | None:
    """The experiment's runs table in the MLflow UI's classic (Model training) view: on the
    tracking server at ``uri``, or on the ``mlflow ui`` of :func:`ui_command` for a local store;
    None without an experiment id (tracking off, or the experiment not known: offline)."""
    if not experiment_id:
        return None
    base = uri.rstrip("/") if uri.startswith("http") else f"http://127.0.0.1:{UI_PORT}"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType={UI_WORKFLOW}"


def run_page_url(uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """A run's own page in the MLflow UI's classic (Model training) view on the tracking server
    at ``uri`` (``http://host:5000/#/experiments/<id>/runs/<run id>?workflowType=machine_learning``;
    without ``workflowType`` MLflow 3's UI opens it in its GenAI view); None for a local store
    (no server to link to) or without an experiment or run id."""
    if not (experiment_id and run_id and uri.startswith("http")):
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType={UI_WORKFLOW}"


def open_experiment(client: Any, name: str, artifact_location: str | None) -> str:
    """The id of experiment ``name`` of ``client``'s store (an ``MlflowClient``), created
    (tagged with :data:`EXPERIMENT_KIND`) when missing, tagged when made before without it.
    Two commands started together (two audits on a new store) race to create it: the loser's
    create fails (RESOURCE_ALREADY_EXISTS) and it takes the winner's.

    Raises:
        MlflowException: the create failed and the experiment is still not there.
    """
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(
                name, artifact_location=artifact_location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
            )
        except Exception:  # noqa: BLE001 - MlflowException, but this module does not import mlflow
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if EXPERIMENT_KIND_TAG not in found.tags:  # made before; a user's choice stays
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return found.experiment_id
