"""The Prefect events infermeter emits, so that a user can attach a Prefect automation (mail,
Slack, a webhook) to them from the Prefect UI or by API.

One event today: ``infermeter.audit.regressed`` (:data:`AUDIT_REGRESSED`), emitted by an audit
whose verdict says some metric regressed. Its parts, in Prefect's event schema
(https://docs.prefect.io/v3/concepts/events):

- resource: the endpoint, ``infermeter.endpoint.<kind>.<model>`` (the like-for-like key the
  verdict uses: server kind and model name), with the labels ``infermeter.endpoint.kind``,
  ``.model``, ``.model_sha256``, ``.url`` (the base URL without credentials or query, or
  ``embedded``) and ``prefect.resource.name``;
- related: the audit's MLflow run (role ``mlflow-run``) and its baseline runs (role
  ``baseline``); Prefect adds the flow run, flow, deployment and tags of the run it is emitted
  in;
- payload (:class:`RegressedEvent`): ``metrics`` (one entry per regressed metric: its
  ``change_pct`` with interval, threshold, baseline and current figures, the rule and note),
  ``regressed_metrics`` (names), ``status``, ``counts`` (metrics per verdict class, when the
  verdict gives them), ``baseline``, ``baseline_run_ids``,
  ``mlflow_run_id``, ``mlflow_run_url``, ``runs_url``, ``flow_run_id``.

Only the fields named above leave the process: never the config, an environment variable, or a
URL's user, password or query (where an API key could sit). An event that cannot be sent never
fails the audit: :func:`emit_regressed` logs a warning and returns None.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

__all__ = ["AUDIT_REGRESSED", "RegressedEvent", "emit_regressed", "endpoint_resource", "regressed_event"]

#: The event a regressed audit emits (an automation's trigger expects this name).
AUDIT_REGRESSED = "infermeter.audit.regressed"

#: The fields of a verdict row (``regression.rows[]`` of the audit's JSON) the event carries.
_ROW_FIELDS = (
    "metric",
    "change_pct",
    "change_pct_ci_low",
    "change_pct_ci_high",
    "threshold_pct",
    "baseline",
    "current",
    "verdict",
    "p_value",
    "rule",
    "note",
)
#: Baseline runs named as related resources (all of them are in the payload); Prefect caps an
#: event's related resources (``PREFECT_SERVER_EVENTS_MAXIMUM_RELATED_RESOURCES``) and adds the
#: run context's own.
_MAX_RELATED_BASELINES = 10

_log = logging.getLogger(__name__)


class Verdict(Protocol):
    """What the event reads from an audit's verdict (``tasks.report.baseline.RegressionResult``):
    whether it regressed, and its ``--json`` form (``regressed_metrics``, ``rows``,
    ``baseline``, ``baseline_run_ids``, ``status``)."""

    @property
    def regressed(self) -> bool: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RegressedEvent:
    """The parts of one ``infermeter.audit.regressed`` event, as ``prefect.events.emit_event``
    takes them: ``resource`` (labels: str -> str), ``related`` (resources with a
    ``prefect.resource.role``), ``payload`` (JSON-shaped; see the module docstring)."""

    resource: dict[str, str]
    related: list[dict[str, str]]
    payload: dict[str, Any]


def _public_url(url: str) -> str:
    """``url`` without user, password, query or fragment (a key may sit in any of them)."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.hostname:
        return url if url == "embedded" else ""
    host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def endpoint_resource(tags: Mapping[str, Any]) -> dict[str, str]:
    """The endpoint as a Prefect resource, from an audit parent run's tags (``endpoint_kind``,
    ``endpoint_model``, ``endpoint_model_sha256``, ``endpoint`` = base URL or ``embedded``,
    ``model`` = the profiled model: the fallback when no endpoint was opened)."""
    kind = str(tags.get("endpoint_kind") or "unknown")
    model = str(tags.get("endpoint_model") or tags.get("model") or "unknown")
    return {
        "prefect.resource.id": f"infermeter.endpoint.{kind}.{model}",
        "prefect.resource.name": f"{kind} {model}",
        "infermeter.endpoint.kind": kind,
        "infermeter.endpoint.model": model,
        "infermeter.endpoint.model_sha256": str(tags.get("endpoint_model_sha256") or ""),
        "infermeter.endpoint.url": _public_url(str(tags.get("endpoint") or "")),
    }


def regressed_event(
    verdict: Verdict,
    tags: Mapping[str, Any],
    mlflow_run_id: str | None,
    mlflow_run_url: str | None = None,
    runs_url: str | None = None,
) -> RegressedEvent:
    """The event for a regressed ``verdict`` of the audit whose parent run has ``tags`` (see
    :func:`endpoint_resource`; ``prefect_flow_run_id`` names the flow run). ``mlflow_run_url``:
    the run's page (None on a local store); ``runs_url``: the experiment's runs table."""
    judged = verdict.to_dict()
    names = list(judged.get("regressed_metrics") or [])
    rows = [row for row in judged.get("rows") or [] if row.get("metric") in names]
    baseline_ids = [str(run_id) for run_id in judged.get("baseline_run_ids") or []]
    related = []
    if mlflow_run_id:
        related.append(
            {
                "prefect.resource.id": f"infermeter.mlflow-run.{mlflow_run_id}",
                "prefect.resource.role": "mlflow-run",
                "infermeter.mlflow.url": mlflow_run_url or runs_url or "",
            }
        )
    related += [
        {"prefect.resource.id": f"infermeter.mlflow-run.{run_id}", "prefect.resource.role": "baseline"}
        for run_id in baseline_ids[:_MAX_RELATED_BASELINES]
    ]
    payload = {
        "status": judged.get("status"),
        "counts": judged.get("counts"),
        "regressed_metrics": names,
        "metrics": [{key: row.get(key) for key in _ROW_FIELDS} for row in rows],
        "baseline": judged.get("baseline"),
        "baseline_run_ids": baseline_ids,
        "mlflow_run_id": mlflow_run_id,
        "mlflow_run_url": mlflow_run_url,
        "runs_url": runs_url,
        "flow_run_id": str(tags.get("prefect_flow_run_id") or "") or None,
    }
    return RegressedEvent(endpoint_resource(tags), related, payload)


def emit_regressed(
    verdict: Verdict,
    tags: Mapping[str, Any],
    mlflow_run_id: str | None,
    mlflow_run_url: str | None = None,
    runs_url: str | None = None,
) -> Any | None:
    """Emit ``infermeter.audit.regressed`` (:func:`regressed_event`) to the Prefect API of the
    current settings; returns the ``prefect.events.Event`` sent, or None when none was (no
    API, or a failure: logged as a warning, never raised, so that the audit's verdict stands
    whatever happens to its notification). Prefect's events worker sends it in the background
    and attaches the current flow run's related resources."""
    try:
        from prefect.events import emit_event

        event = regressed_event(verdict, tags, mlflow_run_id, mlflow_run_url, runs_url)
        return emit_event(AUDIT_REGRESSED, event.resource, related=event.related, payload=event.payload)
    except Exception as exc:  # noqa: BLE001  (a notification must not fail the audit)
        _warn(f"could not emit the Prefect event {AUDIT_REGRESSED}: {type(exc).__name__}: {exc}")
        return None


def _warn(message: str) -> None:
    """A warning in the flow run's log when there is one, else in this module's."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().warning(message)
    except MissingContextError:
        _log.warning(message)
