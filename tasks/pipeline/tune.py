"""One tune configuration's life, tracked: its MLflow child run, its server (started, measured,
stopped), its outcome kept for a resumed run.

MLflow: ``tune <i>: <label>`` under the tune run, the server parameters as params, tags
``stage = tune_configuration``, ``tune_key`` (``tasks.tune.grid.configuration_key``) and
``server_flags``; metric ``server_startup_s``; below it the stream stage and its levels (or the
capacity search's levels), exactly as ``infermeter stream`` / ``capacity`` log them; artifact
``tune_configuration.json`` (the outcome, read back by :func:`finished_outcome`). A server
that does not start: the run ends FAILED with ``error`` and ``server_log_tail.txt``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import TuneFlowConfig
from tasks.pipeline.capacity import capacity_stage
from tasks.pipeline.stream import stream_stage
from tasks.server import ServerStartError
from tasks.stream.errors import every_request_failed
from tasks.tracking import Tracker, TrackingTarget
from tasks.tune.front import TunePoint, point
from tasks.tune.grid import Configuration
from tasks.tune.serve import configuration_server

OUTCOME_ARTIFACT = "tune_configuration.json"
#: what a level keeps in the outcome (its records stay in the stage's Parquet)
LEVEL_KEYS = ("max_concurrency", "request_rate", "metrics")


@dataclass
class ConfigurationOutcome:
    """What one configuration gave.

    Attributes:
        index, label, server_params, server_flags: the configuration.
        status: ``FINISHED``, or ``FAILED`` (the server did not start, the stage failed, or
            every request failed: ``error`` says which).
        server_startup_s: launch to healthy (None when it never was).
        levels: the stream levels (``max_concurrency``, ``request_rate``, ``metrics``); with the
            capacity search, the levels it measured.
        capacity: the capacity search's ``CapacityResult.to_dict()`` (tune.capacity), else None.
        error: why it FAILED (a failed server's message ends with its log's last lines).
        mlflow_run_id: its child run.
        resumed: read back from an earlier run's child instead of measured now.
    """

    index: int
    label: str
    server_params: dict[str, Any]
    server_flags: list[str]
    status: str = "FAILED"
    server_startup_s: float | None = None
    levels: list[dict[str, Any]] = field(default_factory=list)
    capacity: dict[str, Any] | None = None
    error: str | None = None
    mlflow_run_id: str | None = None
    resumed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def points(self) -> list[TunePoint]:
        """Its levels as points of the front (none when it failed to start)."""
        return [point(self.index, self.label, i, level) for i, level in enumerate(self.levels)]


def _param_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)


def finished_outcome(tracker: Tracker, key: str, configuration: Configuration) -> ConfigurationOutcome | None:
    """The outcome of an earlier FINISHED child with this ``tune_key``, or None."""
    for found in tracker.find_runs(
        f"tags.tune_key = '{key}' and attributes.status = 'FINISHED'", max_results=1
    ):
        data = tracker.read_artifact(
            found["run_id"], OUTCOME_ARTIFACT, lambda p: json.loads(p.read_text(encoding="utf-8"))
        )
        if isinstance(data, dict) and data.get("status") == "FINISHED":
            data.update(index=configuration.index, label=configuration.label, resumed=True)
            data["mlflow_run_id"] = found["run_id"]
            known = ConfigurationOutcome.__dataclass_fields__
            return ConfigurationOutcome(**{k: v for k, v in data.items() if k in known})
    return None


def measure_configuration(
    cfg: TuneFlowConfig,
    configuration: Configuration,
    key: str,
    target: TrackingTarget,
    parent_run_id: str | None,
    workdir: Path,
) -> ConfigurationOutcome:
    """Start the server as ``configuration`` says, run the workload, stop it; never raises for a
    server that fails to start or a stage that fails (the outcome says so), so the sweep goes
    on. A Ctrl-C ends the child KILLED (the server is stopped either way) and goes on up."""
    tracker = target.open()
    outcome = ConfigurationOutcome(
        configuration.index, configuration.label, dict(configuration.params), list(configuration.flags)
    )
    child = tracker.start_run(
        f"tune {configuration.index}: {configuration.label}",
        parent_run_id,
        {"stage": "tune_configuration", "tune_key": key, "server_flags": " ".join(configuration.flags)[:480]},
    )
    outcome.mlflow_run_id = child
    tracker.log_params(
        child,
        {
            **{name: _param_text(value) for name, value in configuration.params.items()},
            "configuration_index": str(configuration.index),
        },
    )
    folder = workdir / f"configuration{configuration.index}"
    folder.mkdir(parents=True, exist_ok=True)
    stage_args = {"target": target, "parent_run_id": child, "workdir": str(folder)}
    try:
        with configuration_server(
            cfg.server, cfg.endpoint, configuration.flags, cfg.tune.serve_cmd, folder
        ) as started:
            outcome.server_startup_s = started.server_startup_s
            tracker.log_metrics(child, {"server_startup_s": started.server_startup_s})
            tracker.set_tags(child, started.endpoint.identity())
            if cfg.tune.capacity:
                stage = capacity_stage(cfg.stream, cfg.capacity, started.endpoint, **stage_args)
                outcome.capacity = stage["capacity"]
            else:
                stage = stream_stage(cfg.stream, started.endpoint, **stage_args)
        outcome.levels = [{k: level.get(k) for k in LEVEL_KEYS} for level in stage["levels"]]
        outcome.error = every_request_failed(stage["levels"])
    except ServerStartError as exc:
        outcome.error = f"server did not start: {exc}"
        tracker.log_text(child, str(exc), "server_log_tail.txt")
    except Exception as exc:  # one configuration's failure never loses the others
        outcome.error = f"{type(exc).__name__}: {exc}"
    except BaseException:  # Ctrl-C, SIGTERM: the server is already stopped by its block
        tracker.set_tags(child, {"error": "interrupted"})
        tracker.end_run(child, "KILLED")
        raise
    outcome.status = "FAILED" if outcome.error else "FINISHED"
    tracker.log_dict(child, outcome.to_dict(), OUTCOME_ARTIFACT)
    if outcome.error:
        tracker.set_tags(child, {"error": outcome.error[:480]})
    tracker.end_run(child, outcome.status)
    return outcome
