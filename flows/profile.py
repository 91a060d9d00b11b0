"""The single-stage `profile` flow.

Run the profile stage (``tasks.pipeline.profile_stage``, the same task the audit's local stage
runs) under one MLflow parent run: parent -> ``profile`` child -> one child per sweep point
(prompt length x batch size x dtype x prefill chunk size x max_new_tokens), with the points as
``profile_points.json`` and four PNG plots under ``plots/`` on the ``profile`` run. The parent's
params are the ``profile.*`` and ``tracking.*`` sections. The command is
``flows.commands.profile``.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runs import final_state, model_label, parent_run
from tasks.config import ProfileFlowConfig

# torch, transformers and tasks.pipeline are imported inside the body, so that loading this
# module (deployments, the CLI) stays fast.


def run_profile(config: ProfileFlowConfig, track: bool = True, show_progress: bool = False) -> dict:
    """The flow's body: ``{"points", "headline", "error", "mlflow_run_id", "workdir",
    "ui_command", "runs_url"}`` (``error`` None, or why the stage failed)."""
    from tasks.models.sources import resolve
    from tasks.pipeline import ProfileSweepFailed, profile_stage
    from tasks.pipeline.fanout import check_flow_task_runner

    check_flow_task_runner(config.profile.task_runner, "profile.task_runner")  # before any run
    logger = get_run_logger()
    tags = {"model": config.profile.model, "random_weights": resolve(config.profile.model).random_weights}
    # the params are the sections only (not the run name): the names the profile runs have
    params = config.model_dump(mode="json", include={"profile", "tracking"})
    what = [model_label(config.profile.model)]
    with parent_run(
        "profile", config.name, params, config.tracking, track, tags, what=what, torch_facts=True
    ) as run:
        result: dict = {"points": [], "headline": {}, "error": None}
        try:
            stage = profile_stage(config.profile, **run.stage_args(), show_progress=show_progress)
            result.update(points=stage["points"], headline=stage["headline"])
        except ProfileSweepFailed as exc:
            result.update(points=exc.points, error=str(exc))
        except Exception as exc:  # recorded on the parent; the command exits 1
            result["error"] = f"{type(exc).__name__}: {exc}"
        if result["error"]:
            logger.error("profile failed: %s", result["error"])
        failed = sum(1 for point in result["points"] if point["failed"])
        summary = (
            f"# infermeter profile\n\n{config.profile.model}: {len(result['points'])} points, "
            f"{failed} failed\n" + (f"\nfailed: {result['error']}\n" if result["error"] else "")
        )
        run.finish(result["headline"], summary, result["error"])
    return {**result, **run.links()}


@flow(name="profile", log_prints=True)
def profile(config: ProfileFlowConfig = ProfileFlowConfig(), track: bool = True, show_progress: bool = False):
    """Profile prefill and decode inside a model over prompt length x batch x dtype x chunk."""
    return final_state(run_profile(config, track, show_progress))
