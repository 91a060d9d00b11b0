"""The local profile stage as a Prefect task: orchestration and tracking around
:func:`tasks.profile.runner.run_sweep` (the measurement, the memory checks, the child processes,
the typed results, the journal and the plots are all in :mod:`tasks.profile`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prefect import task

from tasks import metrics
from tasks.config import ProfileConfig
from tasks.pipeline.common import STAGE, StageRun, _scalars
from tasks.pipeline.fanout import DaskChoice, dask_runner, parse_task_runner, run_points_on_dask, worker_model
from tasks.stats.interval import with_intervals
from tasks.tracking import TrackingTarget, flatten_params

if TYPE_CHECKING:  # torch and transformers load inside the task, not with this module
    from tasks.profile.result import ProfilePointResult
    from tasks.tracking import Tracker

PROFILE_HEADLINE = metrics.headline("profile")


class ProfileSweepFailed(RuntimeError):
    """Every point of a profile sweep failed; ``points`` keeps each point's recorded cause (the
    rows of :meth:`ProfilePointResult.to_dict`)."""

    def __init__(self, message: str, points: list[dict]):
        super().__init__(message)
        self.points = points


def _profile_progress(total: int):
    """A rich progress bar on stderr, redrawn only between points (no refresh thread runs
    beside the timed region)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("profile"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        auto_refresh=False,
    )
    return bar, bar.add_task("loading the model", total=total)


def _track_point(
    tracker: Tracker, stage_run_id: str | None, result: ProfilePointResult, label: str, folder: Path
) -> None:
    """One point's child run under the stage's: tags, the point's parameters, its scalar
    figures, the per-step decode times as a series, and under --breakdown the breakdown's and
    roofline's figures and artifacts; FAILED (with an ``error`` tag) or FINISHED."""
    from tasks.profile.breakdown_report import analysis_metrics, breakdown_rows, write_analysis

    row = result.to_dict()
    child = tracker.start_run(
        f"profile {label}",
        stage_run_id,
        {
            "stage": "profile_point",
            "random_weights": result.random_weights,
            "child_process": result.child_process,
            **({"error": result.error} if result.failed else {}),
        },
    )
    tracker.log_params(child, {k: str(v) for k, v in result.parameters().items()})
    tracker.log_metrics(child, {**_scalars(row), **analysis_metrics(row)})
    if result.measurement is not None:
        tracker.log_metric_series(child, "decode_step_ms", row["decode_ms"], durations=True)
    if result.analysis is not None:
        tracker.log_table(child, breakdown_rows(row), "breakdown/breakdown_table.json")
        for path in write_analysis(row, folder / label.replace(" ", "_")):
            tracker.log_artifact(child, path, "breakdown")
    tracker.end_run(child, "FAILED" if result.failed else "FINISHED")


@task(name="profile", **STAGE)
def profile_stage(
    cfg: ProfileConfig,
    target: TrackingTarget,
    parent_run_id: str | None,
    workdir: str,
    show_progress: bool = False,
    breakdown_default: bool = False,
) -> dict:
    """Prefill and per-token decode over prompt length x batch size x dtype x prefill chunk size
    x max_new_tokens (points that may not fit run in a child process: :func:`run_sweep`).

    One child run per point (FAILED with an ``error`` tag for a point that failed), the points
    as ``profile_points.json`` and five PNG plots (one chart each) under ``plots/`` on the stage's run. Each
    finished point is also appended to ``profile_points.jsonl`` in ``workdir`` at once.
    Returns {"points" (the rows of :meth:`ProfilePointResult.to_dict`), "headline" (the first
    successful point's), "failed_points", "mlflow_run_id"}.

    ``cfg.breakdown`` (None: ``breakdown_default``, then only on the first point, as the audit
    does): each point also gets its profiled per-part breakdown and roofline (keys
    ``breakdown`` / ``roofline`` on its row; the table, the plots and the Chrome trace under
    ``breakdown/`` on the point's run), and the result gets ``decode_verdict``.

    Raises:
        ProfileSweepFailed: no point succeeded (its ``points`` say why each failed).
    """
    from tasks.models.sources import resolve
    from tasks.profile.breakdown_report import analysis_metrics, decode_verdict
    from tasks.profile.grid import chosen_dtypes, profile_points, steps_swept
    from tasks.profile.journal import append_point, write_points
    from tasks.profile.plots import write_profile_plots
    from tasks.profile.runner import run_sweep
    from tasks.profile.timing import resolve_device

    source = resolve(cfg.model)
    with StageRun(target, "profile", parent_run_id, {"random_weights": source.random_weights}) as run:
        run.keep(Path(workdir) / "profile_points.jsonl")
        device = resolve_device(cfg.device)
        dtypes = chosen_dtypes(cfg.model, cfg.dtypes)
        run.tracker.log_params(run.run_id, flatten_params(cfg.model_dump()))
        run.tracker.set_tags(run.run_id, {"device": device, "dtypes": ",".join(dtypes), "model": cfg.model})
        points = profile_points(
            cfg.prompt_lengths,
            cfg.batch_sizes,
            dtypes,
            cfg.prefill_chunk_sizes,
            cfg.max_new_tokens_values,
        )
        show_steps = steps_swept(points)
        breakdown = cfg.breakdown if cfg.breakdown is not None else breakdown_default
        traces = Path(workdir) / "breakdown"
        traces.mkdir(parents=True, exist_ok=True)
        bar, bar_task = _profile_progress(len(points)) if show_progress else (None, None)

        def on_point(index: int, total: int, result: ProfilePointResult) -> None:
            append_point(workdir, result)  # at once: a crash or Ctrl-C keeps it (also untracked)
            label = result.point.label(show_steps)
            _track_point(run.tracker, run.run_id, result, label, traces)
            if bar is not None:
                bar.update(bar_task, advance=1, description=label + (" FAILED" if result.failed else ""))
                bar.refresh()

        if bar is not None:
            bar.start()
            bar.refresh()
        dask = parse_task_runner(cfg.task_runner)
        try:
            if dask is not None:  # one Prefect task per point on the Dask workers
                results = _on_dask(dask, cfg, points, device, on_point, breakdown, traces)
            else:
                results = run_sweep(
                    cfg.model,
                    points,
                    repeats=cfg.repeats,
                    warmup=cfg.warmup,
                    device=device,
                    num_layers=cfg.num_layers,
                    on_point=on_point,
                    breakdown_steps=cfg.breakdown_steps if breakdown else 0,
                    trace_dir=str(traces) if breakdown else None,
                    breakdown_first=cfg.breakdown is None,
                )
        finally:
            if bar is not None:
                bar.stop()
        run.tracker.log_artifact(run.run_id, write_points(workdir, results))
        for png in write_profile_plots(results, Path(workdir) / "profile_plots"):
            run.tracker.log_artifact(run.run_id, png, "plots")
        rows = [r.to_dict() for r in results]
        ok = [r for r in results if not r.failed]
        failed = len(results) - len(ok)
        if ok:
            attn = ok[0].measurement.attn_implementation
            run.tracker.set_tags(run.run_id, {"attn_implementation": str(attn)})
        run.tracker.log_metrics(run.run_id, {"profile_points": len(rows), "profile_failed_points": failed})
        if not ok:
            raise ProfileSweepFailed(f"every profile point failed; first: {results[0].error}", rows)
        first = ok[0].to_dict()
        first.update(analysis_metrics(first))
        headline = with_intervals(PROFILE_HEADLINE, first)
        run.tracker.log_metrics(run.run_id, {k: v for k, v in headline.items() if v is not None})
        out = {"points": rows, "headline": headline, "failed_points": failed, "mlflow_run_id": run.run_id}
        if breakdown:
            out["decode_verdict"] = decode_verdict(rows)
        return out


@task(name="profile-point", **STAGE)
def profile_point(cfg: ProfileConfig, point, device: str, breakdown_steps: int, trace_dir: str | None):
    """One profile point where a Dask worker runs it: :func:`run_sweep` of that point on the
    worker's cached model (loaded once per worker process and dtype); the stage logs it."""
    from tasks.profile.runner import run_sweep

    return run_sweep(
        cfg.model,
        [point],
        repeats=cfg.repeats,
        warmup=cfg.warmup,
        device=device,
        num_layers=cfg.num_layers,
        breakdown_steps=breakdown_steps,
        trace_dir=trace_dir,
        load=worker_model,
    )[0]


def _on_dask(choice: DaskChoice, cfg: ProfileConfig, points, device, on_point, breakdown: bool, traces: Path):
    """The points as Dask tasks (:mod:`tasks.pipeline.fanout`), ``on_point`` as each comes back
    (finishing order); results in the order of ``points``. A point lost with its workers is
    failed with the cause (no measurement; ``memory_estimate_bytes`` 0: not estimated here)."""
    from tasks.models.sources import resolve
    from tasks.profile.result import ProfilePointResult

    first_only = cfg.breakdown is None  # as run_sweep's breakdown_first: the first point only
    steps = [
        cfg.breakdown_steps if breakdown and (not first_only or i == 0) else 0 for i in range(len(points))
    ]
    params = [
        {"cfg": cfg, "point": p, "device": str(device), "breakdown_steps": steps[i], "trace_dir": str(traces)}
        for i, p in enumerate(points)
    ]
    results: dict[int, ProfilePointResult] = {}

    def done(i: int, result: ProfilePointResult) -> None:
        results[i] = result
        on_point(len(results) - 1, len(points), result)

    def lost(failure) -> None:
        random = resolve(cfg.model).random_weights
        done(
            failure.index,
            ProfilePointResult(
                cfg.model, points[failure.index], str(device), random, failure.cause, 0, False
            ),
        )

    with dask_runner(choice) as runner:
        run_points_on_dask(runner, profile_point, params, done, lost)
    return [results[i] for i in range(len(points))]
