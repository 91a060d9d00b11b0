"""The local profile stage as a Prefect task."""

from __future__ import annotations

import json
import os
from pathlib import Path

from prefect import task

from tasks.profile import measure as profile
from tasks.config import ProfileConfig
from tasks.tracking import TrackingTarget, flatten_params

from tasks.pipeline.common import STAGE, StageRun, _scalars

PROFILE_HEADLINE = (
    "prefill_ms", "prefill_tokens_per_s", "decode_ms_p50", "decode_tokens_per_s",
    "weights_bytes", "kv_cache_bytes", "kv_cache_bytes_formula", "peak_memory_bytes",
)


class ProfileSweepFailed(RuntimeError):
    """Every point of a profile sweep failed; ``points`` keeps each point's recorded cause."""

    def __init__(self, message: str, points: list[dict]):
        super().__init__(message)
        self.points = points


def _profile_progress(total: int):
    """A rich progress bar on stderr, redrawn only between points (no refresh thread runs
    beside the timed region)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("profile"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=Console(stderr=True), auto_refresh=False,
    )
    return bar, bar.add_task("loading the model", total=total)


@task(name="profile", **STAGE)
def profile_stage(
    cfg: ProfileConfig, target: TrackingTarget, parent_run_id: str | None, workdir: str,
    show_progress: bool = False,
) -> dict:
    """Prefill and per-token decode over prompt length x batch size x dtype x prefill chunk size
    x max_new_tokens (points that may not fit run in a child process: :func:`run_sweep`).

    One child run per point (FAILED with an ``error`` tag for a point that failed), the points
    as ``profile_points.json`` and four PNG plots under ``plots/`` on the stage's run. Each
    finished point is also appended to ``profile_points.jsonl`` in ``workdir`` at once.
    Returns {"points", "headline" (the first successful point's), "failed_points",
    "mlflow_run_id"}.

    Raises:
        ProfileSweepFailed: no point succeeded (its ``points`` say why each failed).
    """
    from tasks.profile.plots import write_profile_plots
    from tasks.profile.grid import point_label, profile_points, steps_swept
    from tasks.profile.runner import run_sweep
    from tasks.models import default_dtype, resolve

    source = resolve(cfg.model)
    with StageRun(target, "profile", parent_run_id, {"random_weights": source.random_weights}) as run:
        device = profile.resolve_device(cfg.device)
        dtypes = cfg.dtypes or [default_dtype(cfg.model)]
        run.tracker.log_params(run.run_id, flatten_params(cfg.model_dump()))
        run.tracker.set_tags(run.run_id, {"device": device, "dtypes": ",".join(dtypes), "model": cfg.model})
        points = profile_points(
            cfg.prompt_lengths, cfg.batch_sizes, dtypes, cfg.prefill_chunk_sizes,
            cfg.max_new_tokens_values,
        )
        show_steps = steps_swept(points)
        bar, bar_task = _profile_progress(len(points)) if show_progress else (None, None)

        journal = Path(workdir) / "profile_points.jsonl"

        def on_point(index: int, total: int, row: dict) -> None:
            # kept at once, so a crash or Ctrl-C keeps every finished point (also untracked)
            with open(journal, "a", encoding="utf-8") as out:
                out.write(json.dumps(row, default=str) + "\n")
                out.flush()
                os.fsync(out.fileno())
            label = point_label(row, show_steps)
            child = run.tracker.start_run(f"profile {label}", run.run_id, {
                "stage": "profile_point", "random_weights": row["random_weights"],
                "child_process": row["child_process"],
                **({"error": row["error"]} if row["failed"] else {}),
            })
            run.tracker.log_params(child, {k: str(row[k]) for k in (
                "model", "prompt_tokens", "batch_size", "dtype", "prefill_chunk_size",
                "max_new_tokens", "device", "random_weights",
            )})
            run.tracker.log_metrics(child, _scalars(row))
            if not row["failed"]:
                run.tracker.log_metric_series(child, "decode_step_ms", row["decode_ms"])
            run.tracker.end_run(child, "FAILED" if row["failed"] else "FINISHED")
            if bar is not None:
                bar.update(bar_task, advance=1, description=label + (" FAILED" if row["failed"] else ""))
                bar.refresh()

        if bar is not None:
            bar.start()
            bar.refresh()
        try:
            rows = run_sweep(
                cfg.model, points, repeats=cfg.repeats, warmup=cfg.warmup, device=device,
                num_layers=cfg.num_layers, on_point=on_point,
            )
        finally:
            if bar is not None:
                bar.stop()
        path = Path(workdir) / "profile_points.json"
        path.write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")
        run.tracker.log_artifact(run.run_id, path)
        for png in write_profile_plots(rows, Path(workdir) / "profile_plots"):
            run.tracker.log_artifact(run.run_id, png, "plots")
        ok = [r for r in rows if not r["failed"]]
        failed = len(rows) - len(ok)
        if ok:
            run.tracker.set_tags(run.run_id, {"attn_implementation": str(ok[0]["attn_implementation"])})
        run.tracker.log_metrics(run.run_id, {"profile_points": len(rows), "profile_failed_points": failed})
        if not ok:
            raise ProfileSweepFailed(f"every profile point failed; first: {rows[0]['error']}", rows)
        headline = {k: ok[0].get(k) for k in PROFILE_HEADLINE}
        run.tracker.log_metrics(run.run_id, headline)
        return {"points": rows, "headline": headline, "failed_points": failed, "mlflow_run_id": run.run_id}


