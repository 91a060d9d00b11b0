"""One tune measurement's life, tracked: its MLflow child run, its server (started, measured,
stopped), its outcome kept for a resumed run; and a configuration's repeats as one.

MLflow: a child per measurement (a configuration in one repeat), ``tune <i>: <label>`` under the
tune run (with ``tune.repeats`` > 1: ``tune <i>: <label> (repeat <r>/<R>)``), the server
parameters as params, tags ``stage = tune_configuration``, ``tune_key``
(``tasks.tune.grid.configuration_key``), ``server_flags``, ``tune_repeat`` (0-based round) and
``tune_position`` (its place in the run's order); metric ``server_startup_s``; below it the
stream stage and its levels (or the capacity search's levels), exactly as ``infermeter
stream`` / ``capacity`` log them; artifact ``tune_configuration.json`` (the outcome, read back
by :func:`finished_outcome`). A server that does not start: the run ends FAILED with ``error``
and ``server_log_tail.txt``.

Resume is per measurement: a FINISHED child with the same ``tune_key`` and ``tune_repeat`` is
read back (a child from before repeats existed, without ``tune_repeat``, counts as repeat 0),
so raising ``--repeats`` measures only the repeats not yet done.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import TuneFlowConfig
from tasks.engines.server import ServerStartError
from tasks.pipeline.capacity import capacity_stage
from tasks.pipeline.stream import stream_stage
from tasks.tracking import Tracker, TrackingTarget
from tasks.tune.capacities import CapacityOverRepeats, over_repeats
from tasks.tune.front import INTERVAL_FIGURES, TunePoint, point
from tasks.tune.grid import Configuration
from tasks.tune.repeats import CombinedLevel, combine_levels
from tasks.tune.serve import configuration_server
from tasks.wire.errors import every_request_failed

OUTCOME_ARTIFACT = "tune_configuration.json"
#: what a level keeps in the outcome (its records stay in the stage's Parquet)
LEVEL_KEYS = ("max_concurrency", "request_rate", "metrics")
_INTERVAL_KEYS = tuple(f"{figure}_ci_{end}" for figure in INTERVAL_FIGURES for end in ("low", "high"))


@dataclass
class ConfigurationOutcome:
    """What one configuration gave in one repeat.

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
        repeat: its round (0-based; ``tune.repeats``).
        position: its place in this run's order (``tasks.tune.repeats.run_order``).
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
    repeat: int = 0
    position: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def points(self) -> list[TunePoint]:
        """Its levels as points of the front (none when it failed to start)."""
        return [point(self.index, self.label, i, level) for i, level in enumerate(self.levels)]


@dataclass
class ConfigurationSummary:
    """A configuration over its repeats: what ``--json``'s ``configurations`` lists.

    Attributes:
        index, label, server_params, server_flags: the configuration.
        measurements: its repeats' outcomes, in repeat order (FAILED ones included).
        skipped: repeats not measured because its server had failed to start in an earlier one
            (a server that cannot start is not started again, ``server.startup_timeout_s`` each).
    """

    index: int
    label: str
    server_params: dict[str, Any]
    server_flags: list[str]
    measurements: list[ConfigurationOutcome] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    @property
    def finished(self) -> list[ConfigurationOutcome]:
        return [m for m in self.measurements if m.status == "FINISHED"]

    @property
    def status(self) -> str:
        """FINISHED when at least one repeat finished (its figures rest on those), else FAILED."""
        return "FINISHED" if self.finished else "FAILED"

    @property
    def resumed(self) -> bool:
        """Every repeat was read back from earlier runs."""
        return bool(self.measurements) and all(m.resumed for m in self.measurements)

    def levels(self) -> list[CombinedLevel]:
        """The levels over the finished repeats (:func:`tasks.tune.repeats.combine_levels`)."""
        return combine_levels([m.levels for m in self.finished])

    def capacity_over_repeats(self) -> CapacityOverRepeats | None:
        """Its capacity over the finished repeats, each repeat's search one value
        (:mod:`tasks.tune.capacities`); None when no repeat ran a capacity search."""
        if all(m.capacity is None for m in self.measurements):
            return None
        return over_repeats(self.index, self.label, [m.capacity for m in self.finished])

    def error(self) -> str | None:
        """The first FAILED repeat's error (with several repeats: ``repeat r of R FAILED: ...``)."""
        failed = [m for m in self.measurements if m.status == "FAILED"]
        if not failed:
            return None
        if len(self.measurements) + len(self.skipped) == 1:
            return failed[0].error
        count = len(self.measurements) + len(self.skipped)
        return f"repeat {failed[0].repeat + 1} of {count} FAILED: {failed[0].error}"

    def to_dict(self) -> dict[str, Any]:
        """``ConfigurationOutcome.to_dict()``'s keys over the repeats (``levels``: the combined
        levels, each with its objectives' intervals over the repeats, ``<figure>_ci_low`` /
        ``_ci_high`` of :data:`tasks.tune.front.INTERVAL_FIGURES`; ``server_startup_s``: the
        mean; ``capacity``, ``mlflow_run_id``: the first finished repeat's), plus ``repeats``
        (each repeat's outcome), ``repeats_skipped`` and ``capacity_over_repeats`` (the
        capacity's mean, interval and value in each repeat: ``CapacityOverRepeats.to_dict()``;
        None without ``tune.capacity``)."""
        startups = [m.server_startup_s for m in self.measurements if m.server_startup_s is not None]
        first = (self.finished or self.measurements or [None])[0]
        capacity = self.capacity_over_repeats()
        return {
            "index": self.index,
            "label": self.label,
            "server_params": self.server_params,
            "server_flags": self.server_flags,
            "status": self.status,
            "server_startup_s": sum(startups) / len(startups) if startups else None,
            "levels": [
                {**level.to_dict(), **{k: getattr(p, k) for k in _INTERVAL_KEYS}}
                for level, p in zip(self.levels(), self.points())
            ],
            "capacity": first.capacity if first else None,
            "error": self.error(),
            "mlflow_run_id": first.mlflow_run_id if first else None,
            "resumed": self.resumed,
            "repeats": [m.to_dict() for m in self.measurements],
            "repeats_skipped": list(self.skipped),
            "capacity_over_repeats": capacity.to_dict() if capacity else None,
        }

    def points(self) -> list[TunePoint]:
        """Its combined levels as points (means, with intervals over the repeats)."""
        return [
            point(self.index, self.label, i, level.to_dict(), level.values)
            for i, level in enumerate(self.levels())
        ]

    def samples(self, figure: str) -> dict[tuple[int, int], tuple[float | None, ...]]:
        """``(index, level) -> figure's value in each repeat`` (for :func:`tasks.tune.front.best`)."""
        return {(self.index, i): level.values.get(figure, ()) for i, level in enumerate(self.levels())}


def _param_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)


def finished_outcome(
    tracker: Tracker, key: str, configuration: Configuration, repeat: int = 0
) -> ConfigurationOutcome | None:
    """The outcome of an earlier FINISHED child with this ``tune_key`` and ``tune_repeat``, or
    None; for repeat 0 also a child that predates repeats (no ``tune_repeat`` tag)."""
    finished = f"tags.tune_key = '{key}' and attributes.status = 'FINISHED'"
    searches = [f"{finished} and tags.tune_repeat = '{repeat}'"]
    if repeat == 0:
        searches.append(f"{finished} and tags.tune_repeat IS NULL")
    for search in searches:
        for found in tracker.find_runs(search, max_results=1):
            data = tracker.read_artifact(
                found["run_id"], OUTCOME_ARTIFACT, lambda p: json.loads(p.read_text(encoding="utf-8"))
            )
            if isinstance(data, dict) and data.get("status") == "FINISHED":
                data.update(index=configuration.index, label=configuration.label, resumed=True, repeat=repeat)
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
    repeat: int = 0,
    repeats: int = 1,
    position: int | None = None,
) -> ConfigurationOutcome:
    """Start the server as ``configuration`` says, run the workload, stop it: repeat ``repeat``
    (0-based) of ``repeats``, ``position`` in the run's order. Never raises for a server that
    fails to start or a stage that fails (the outcome says so), so the sweep goes on. A Ctrl-C
    ends the child KILLED (the server is stopped either way) and goes on up."""
    tracker = target.open()
    outcome = ConfigurationOutcome(
        configuration.index,
        configuration.label,
        dict(configuration.params),
        list(configuration.flags),
        repeat=repeat,
        position=position,
    )
    name = f"tune {configuration.index}: {configuration.label}"
    tags: dict[str, Any] = {
        "stage": "tune_configuration",
        "tune_key": key,
        "server_flags": " ".join(configuration.flags)[:480],
        "tune_repeat": repeat,
    }
    if position is not None:
        tags["tune_position"] = position
    child = tracker.start_run(
        name if repeats == 1 else f"{name} (repeat {repeat + 1}/{repeats})", parent_run_id, tags
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
    if repeats > 1:
        folder = folder / f"repeat{repeat}"
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
