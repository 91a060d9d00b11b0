"""What every flow shares: a folder for its records, and the parent MLflow run of a flow run
(environment and Prefect tags, the config as params and as an artifact), ended FINISHED or
FAILED, with the Prefect markdown artifact linking to it."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from tasks.environment import environment_tags
from tasks.models import REPO_ROOT
from tasks.tracking import Tracker, TrackingTarget, flatten_params


def new_workdir(kind: str) -> Path:
    """A fresh folder for this run's records (crash-safe journals live here while running):
    under ``INFERMETER_WORK_DIR``, else ``.cache/infermeter/runs``."""
    root = Path(os.environ.get("INFERMETER_WORK_DIR", REPO_ROOT / ".cache" / "infermeter" / "runs"))
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}-", dir=root))


def run_tags(flow_name: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The parent run's tags: the environment, the Prefect flow run, ``flow`` and ``extra``."""
    return {
        **environment_tags(),
        "prefect_flow_run_id": str(flow_run.get_id() or ""),
        "prefect_flow_run_name": str(flow_run.get_name() or ""),
        "flow": flow_name, **extra,
    }


def start_parent(
    target: TrackingTarget, name: str, config: Mapping[str, Any], tags: Mapping[str, Any]
) -> tuple[Tracker, str | None]:
    """Open the tracker and start the flow run's parent run (None when tracking is off), with
    ``tags`` (see :func:`run_tags`) and ``config`` (JSON-shaped) as params and config.yaml."""
    tracker = target.open()
    parent = tracker.start_run(name, tags=dict(tags))
    tracker.log_params(parent, flatten_params(dict(config)))
    tracker.log_dict(parent, dict(config), "config.yaml")
    return tracker, parent


def finish_parent(
    tracker: Tracker, parent: str | None, metrics: Mapping[str, Any], error: str | None,
    summary: str, artifact_key: str | None = None,
) -> None:
    """Headline metrics and summary.md on the parent, error tag when failed, end it, and link
    it from a Prefect markdown artifact (a convenience: its failure is only logged)."""
    tracker.log_metrics(parent, metrics)
    tracker.log_text(parent, summary, "summary.md")
    if error:
        tracker.set_tags(parent, {"error": error[:500]})
    tracker.end_run(parent, "FAILED" if error else "FINISHED")
    link = tracker.run_url(parent) or f"MLflow run id `{parent}` in {tracker.tracking_uri}"
    try:
        create_markdown_artifact(f"{summary}\n\nMLflow: {link}\n", key=artifact_key)
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning("could not create the Prefect artifact: %s", exc)
