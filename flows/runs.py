"""The parent MLflow run of a flow run: :func:`parent_run`, what every flow shares.

It opens the tracking target (closing KILLED the runs a command killed by SIGKILL left
RUNNING: ``Tracker.close_abandoned``), starts the parent run (environment and Prefect tags, the config
flattened as params and whole as ``config.yaml``), makes the folder for the run's records, and
on leaving the block logs the headline metrics and ``summary.md``, ends the run FINISHED or
FAILED (error tag), and links it from a Prefect markdown artifact. A flow body only measures
and says what to log with :meth:`ParentRun.finish`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from tasks.config import TrackingConfig
from tasks.environment import environment_tags
from tasks.models.sources import DEFAULT_MODEL_NAME, REPO_ROOT
from tasks.tracking import Tracker, TrackingTarget, flatten_params
from tasks.tracking.run_owner import start_runs_lifeline
from tasks.tracking.writer import STAND_IN, close_abandoned_later, flush, real_run_id

__all__ = ["ParentRun", "final_state", "latest_workdir", "new_workdir", "parent_run"]


def new_workdir(kind: str) -> Path:
    """A fresh folder for this run's records (crash-safe journals live here while running):
    under ``INFERMETER_WORK_DIR``, else ``.cache/infermeter/runs``; named
    ``<YYYYmmdd-HHMMSS>-<kind>-<random>``."""
    root = Path(os.environ.get("INFERMETER_WORK_DIR", REPO_ROOT / ".cache" / "infermeter" / "runs"))
    root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}-", dir=root))
    _WORKDIRS.append(workdir)
    return workdir


#: Every work folder this process made, oldest first: an interrupted command names its own.
_WORKDIRS: list[Path] = []


def latest_workdir() -> Path | None:
    """The work folder this process made last (None: none yet)."""
    return _WORKDIRS[-1] if _WORKDIRS else None


@dataclass
class ParentRun:
    """The open parent run as a flow body sees it. ``run_id`` is None under ``--no-track``
    (every tracker call is then a no-op); a tracking writer's stand-in (every call of this
    command takes it; ``tasks.tracking.writer.real_run_id`` gives MLflow's, as :meth:`links`
    does) until the block ends. The outcome set by :meth:`finish` is logged when the
    :func:`parent_run` block ends."""

    target: TrackingTarget
    tracker: Tracker
    run_id: str | None
    workdir: Path
    tags: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    summary: str = ""
    error: str | None = None

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Tags learnt during the run (the endpoint's identity): on the run and in ``tags``."""
        self.tags.update(tags)
        self.tracker.set_tags(self.run_id, tags)

    def finish(self, metrics: Mapping[str, Any], summary: str, error: str | None = None) -> None:
        """What the parent gets when the block ends: headline metrics, the summary.md text, and
        the error that failed the flow (None: FINISHED)."""
        self.metrics, self.summary, self.error = dict(metrics), summary, error

    def stage_args(self) -> dict[str, Any]:
        """The keyword arguments every stage task takes to log under this run."""
        return {"target": self.target, "parent_run_id": self.run_id, "workdir": str(self.workdir)}

    @property
    def ui_command(self) -> str | None:
        """The command that opens the MLflow UI on this run's store; None when not tracked."""
        return self.tracker.ui_command() if self.run_id else None

    @property
    def runs_url(self) -> str | None:
        """The experiment's runs table in the MLflow UI (classic view); None when not tracked."""
        return self.tracker.runs_url() if self.run_id else None

    def links(self) -> dict[str, Any]:
        """Where a flow's result says its records are: ``mlflow_run_id``, ``workdir``,
        ``ui_command``, ``runs_url``."""
        return {
            "mlflow_run_id": real_run_id(self.tracker, self.run_id),
            "workdir": str(self.workdir),
            "ui_command": self.ui_command,
            "runs_url": self.runs_url,
        }


def _tags(flow_name: str, extra: Mapping[str, Any], torch_facts: bool) -> dict[str, Any]:
    """The parent run's tags: the environment, the Prefect flow run, ``flow`` and ``extra``."""
    return {
        **environment_tags(torch_facts=torch_facts),
        "prefect_flow_run_id": str(flow_run.get_id() or ""),
        "prefect_flow_run_name": str(flow_run.get_name() or ""),
        "flow": flow_name,
        **extra,
    }


@contextlib.contextmanager
def parent_run(
    flow_name: str,
    run_name: str,
    params: Mapping[str, Any],
    tracking: TrackingConfig,
    track: bool = True,
    tags: Mapping[str, Any] | None = None,
    artifact_key: str | None = None,
    what: Sequence[str] = (),
    torch_facts: bool = False,
) -> Iterator[ParentRun]:
    """Start the parent run of a flow run; finish it when the block ends.

    Args:
        flow_name: the ``flow`` tag and the work folder's kind (``audit``, ``stream``, ...).
        run_name: the config's name: the tag ``config_name``, and the MLflow run name when
            ``what`` is empty.
        what: what the run measures (engine, model): the MLflow run name is then
            :func:`run_title` (``audit 11-30 10:06:42 llama.cpp SmolLM2-135M-Instruct``).
        params: the config as JSON-shaped data: flattened as params (``stream.max_concurrency``
            = ``[1, 2]``), and whole as the ``config.yaml`` artifact.
        tracking: experiment and on/off; ``track=False`` (``--no-track``) turns it off too.
        tags: tags beside the environment's and Prefect's (model, endpoint).
        artifact_key: key of the Prefect markdown artifact (None: unkeyed).
        torch_facts: whether the environment tags come from torch
            (:func:`tasks.environment.environment_tags`): True for a flow whose stages run torch
            in this process tree (the profile; an audit with its profile stage on). Else the
            versions come from package metadata: importing torch for the tags took 1.2 s of a
            stream-only audit's 23.9 s wall (the nightly guide's; 3.8 s of 29 s under py-spy).

    On an exception escaping the block the run ends FAILED with the exception as its error
    (KILLED on a KeyboardInterrupt, without the Prefect artifact: Prefect is reporting the
    interrupted flow run), and the exception goes on.
    """
    logger = get_run_logger()
    workdir = new_workdir(flow_name)  # first: it holds the tracking journal should the server go
    target = TrackingTarget(tracking.experiment, None, tracking.enabled and track, journal=str(workdir))
    tracker = target.open()
    # the tags (git, package versions, NVML: 0.3 s here) while a tracking writer still imports MLflow
    all_tags = _tags(flow_name, tags or {}, torch_facts)
    all_tags["config_name"] = run_name
    abandoned = close_abandoned_later(tracker)  # runs a SIGKILLed command could not end
    run_id = tracker.start_run(run_title(flow_name, what) if what else run_name, tags=all_tags)
    tracker.log_params(run_id, flatten_params(dict(params)))
    tracker.log_dict(run_id, dict(params), "config.yaml")
    # a tracking writer's run id is a stand-in until the writer has created the run, and its
    # MLflow import may still run: the command goes on (0.5-1 s) and names the run at its end
    pending = bool(run_id) and run_id.startswith(STAND_IN)
    if pending:
        logger.info("Records in %s; the MLflow run is named when it ends", workdir)
    else:
        _warn_abandoned(abandoned())
        logger.info("MLflow run %s; records in %s", run_id or "(not tracked)", workdir)
    run = ParentRun(target, tracker, run_id, workdir, all_tags)
    # killed outright (SIGKILL), this process cannot end its runs: a watcher does, at once (a
    # tracking writer's process does it for its command: tasks.tracking.writer_process)
    owned = isinstance(tracker, Tracker) and tracker.enabled and run_id and not tracker.offline
    release = start_runs_lifeline(tracker.owner, tracker.tracking_uri, tracker.experiment) if owned else None
    try:
        yield run
        flush(tracker)  # a tracking writer's (tasks.tracking.writer): a write that failed fails the run
        if pending:
            _warn_abandoned(abandoned())
    except BaseException as exc:
        error = run.error or (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if isinstance(exc, Exception):
            _close(run, run.summary or f"# infermeter {flow_name}\n\nfailed: {error}\n", error, artifact_key)
        else:  # Ctrl-C: mark it and get out; the records written so far stay in workdir
            tracker.set_tags(run_id, {"error": error[:500]})
            tracker.end_run(run_id, "KILLED")
        if release:
            release()  # ended: the watcher goes without a word
        raise
    _close(run, run.summary, run.error, artifact_key)
    if release:
        release()


def _warn_abandoned(runs: list[dict]) -> None:
    """Log the runs :meth:`tasks.tracking.Tracker.close_abandoned` ended."""
    for gone in runs:
        get_run_logger().warning(
            "MLflow run %s (%s) was left RUNNING by a process that is gone: marked KILLED; its "
            "records are in %s",
            gone["run_id"],
            gone["name"],
            gone["records_folder"] or "(no records folder)",
        )


def _close(run: ParentRun, summary: str, error: str | None, artifact_key: str | None) -> None:
    """Headline metrics and summary.md on the parent, error tag when failed, end it, and link
    it from a Prefect markdown artifact (a convenience: its failure is only logged)."""
    tracker, run_id = run.tracker, run.run_id
    tracker.log_metrics(run_id, run.metrics)
    tracker.log_text(run_id, summary, "summary.md")
    if error:
        tracker.set_tags(run_id, {"error": error[:500]})
    tracker.end_run(run_id, "FAILED" if error else "FINISHED")
    flush(tracker)  # the run is ended in MLflow before the flow says so
    run_id = real_run_id(tracker, run_id)
    if run_id:  # the Prefect run log names the MLflow run it wrote
        get_run_logger().info("MLflow run %s ended %s", run_id, "FAILED" if error else "FINISHED")
    link = tracker.run_url(run_id) or f"MLflow run id `{run_id}` in {tracker.tracking_uri}"
    try:
        create_markdown_artifact(f"{summary}\n\nMLflow: {link}\n", key=artifact_key)
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning("could not create the Prefect artifact: %s", exc)


def final_state(result: dict[str, Any]) -> State:
    """A single-stage flow's end: Failed with its ``error`` as the message, else Completed; the
    result dict is the state's data either way (the command reads it)."""
    if result["error"]:
        return Failed(message=result["error"], data=result)
    return Completed(data=result)


#: How the engines read in run names.
_ENGINE_LABELS = {"llamacpp": "llama.cpp", "vllm": "vLLM"}


def model_label(spec: str) -> str:
    """A model spec as a person names it: ``gguf:default`` -> ``SmolLM2-135M-Instruct``,
    ``gguf:/m/x.gguf`` -> ``x``, ``hf:org/name`` -> ``name``, ``arch:llama-2-7b`` ->
    ``llama-2-7b (random)``; anything else as given."""
    kind, _, rest = spec.partition(":")
    if spec == "gguf:default":
        return DEFAULT_MODEL_NAME
    if kind == "gguf" and rest:
        return Path(rest).stem
    if kind == "hf" and rest:
        return rest.rstrip("/").rsplit("/", 1)[-1]
    if kind == "arch" and rest:
        return f"{Path(rest).stem if rest.endswith('.json') else rest} (random)"
    return spec


def target_label(
    base_url: str | None, endpoint_model: str | None, engine: str, server_model: str
) -> list[str]:
    """What a remote stage talks to, for a run name: the embedded engine and its model, or the
    remote endpoint's host and model name."""
    if base_url:
        from urllib.parse import urlparse

        return [urlparse(base_url).netloc or base_url, endpoint_model or "?"]
    return [_ENGINE_LABELS.get(engine, engine), model_label(server_model)]


def run_title(flow_name: str, what: Sequence[str]) -> str:
    """A parent run's MLflow name: the flow, when it started (local time, month-day and
    seconds), then what it measured: ``audit 11-30 10:06:42 llama.cpp SmolLM2-135M-Instruct``.
    What differs between runs comes first: the UI's runs table shows a name's first 20-30
    characters, and runs of one engine and model differ only in their start."""
    return " ".join([flow_name, time.strftime("%m-%d %H:%M:%S"), *what])
