"""What the single-stage flows (tokenize, sweep) share: the parent MLflow run of a flow run
(environment and Prefect tags, the config as params and as an artifact), ended FINISHED or
FAILED, and the Prefect markdown artifact linking to it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from flows.audit import _prefect_tags
from tasks.environment import environment_tags
from tasks.tracking import Tracker, TrackingTarget, flatten_params


def start_parent(
    target: TrackingTarget, name: str, flow_name: str, config: BaseModel, tags: Mapping[str, Any]
) -> tuple[Tracker, str | None]:
    """Open the tracker and start the flow run's parent run (None when tracking is off)."""
    tracker = target.open()
    parent = tracker.start_run(name, tags={**environment_tags(), **_prefect_tags(), "flow": flow_name, **tags})
    tracker.log_params(parent, flatten_params(config.model_dump(mode="json")))
    tracker.log_dict(parent, config.model_dump(mode="json"), "config.yaml")
    return tracker, parent


def finish_parent(
    tracker: Tracker, parent: str | None, metrics: Mapping[str, Any], error: str | None,
    summary: str,
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
        create_markdown_artifact(f"{summary}\n\nMLflow: {link}\n")
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning("could not create the Prefect artifact: %s", exc)
