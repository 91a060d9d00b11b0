"""The sampling sweep alone: the `sweep` flow.

One MLflow parent run per flow run, the sweep stage's child run under it, and one child per
point under that (params = the point, samples as a table). Against the embedded llama.cpp
server by default (started for the flow, stopped when it ends), a remote endpoint
(``endpoint.base_url``), or the local model (``sweep.target: local``). A rerun of the same
config skips the points already FINISHED (matched by point_key: the point, prompt, samples and
the target's identity, never its URL or port). The command is ``flows.commands.sweep``.
"""

from __future__ import annotations

from prefect import flow

from flows.runs import final_state, model_label, parent_run, target_label
from tasks.config import SweepFlowConfig
from tasks.endpoint.preflight import check_flow_settings


def run_sweep(config: SweepFlowConfig, track: bool = True) -> dict:
    """The flow's body: ``{"points", "headline", "distribution", "error", "mlflow_run_id",
    "workdir", "ui_command", "runs_url"}`` (``error`` None, or why the stage failed; ``distribution`` the
    sampler's view rows of a local sweep, else None).

    Raises:
        tasks.endpoint.preflight.SettingsError: a setting the pre-flight finds cannot work (one line)."""
    # imported here, not at the top: they pull in torch and transformers, which
    # `infermeter --help` does not need
    from tasks.endpoint.spec import open_endpoint
    from tasks.pipeline import sweep_stage
    from tasks.pipeline.fanout import check_flow_task_runner
    from tasks.report import summary as report

    local = config.sweep.target == "local"
    # the CLI checked these already; a run from the Prefect UI or a deployment had no CLI:
    # a setting that cannot work fails the flow run here, in seconds, before any MLflow run
    if local:
        check_flow_settings(None, config.sweep.local_model)
    else:
        check_flow_settings(config.endpoint)
    check_flow_task_runner(config.sweep.task_runner, "sweep.task_runner")
    tags = {
        "model": config.sweep.local_model if local else config.server.model,
        "endpoint": "local" if local else (config.endpoint.base_url or "embedded"),
    }
    endpoint, server = config.endpoint, config.server
    what = (
        ["local", model_label(config.sweep.local_model)]
        if local
        else target_label(endpoint.base_url, endpoint.model, server.engine, server.model)
    )
    with parent_run(
        "sweep", config.name, config.model_dump(mode="json"), config.tracking, track, tags, what=what
    ) as run:
        common = {**run.stage_args(), "resume": config.resume}
        result, error, kind = None, None, None
        try:
            if local:
                result = sweep_stage(config.sweep, None, **common)
            else:
                with open_endpoint(config.endpoint, config.server) as endpoint:
                    kind = endpoint.server_kind
                    run.set_tags(endpoint.identity())
                    result = sweep_stage(config.sweep, endpoint, **common)
        except Exception as exc:  # the stage run records the traceback; the parent the cause
            error = f"{type(exc).__name__}: {exc}"
        stages = {"sweep": result} if result else {}
        summary = report.summary_markdown(
            stages, {"sweep": error} if error else {}, kind, title="infermeter sweep"
        )
        run.finish((result or {}).get("headline", {}), summary, error)
    return {
        "points": (result or {}).get("points", []),
        "headline": (result or {}).get("headline", {}),
        "distribution": (result or {}).get("distribution"),  # the sampler's view; None when off
        "error": error,
        **run.links(),
    }


@flow(name="sweep", log_prints=True)
def sweep(config: SweepFlowConfig = SweepFlowConfig(), track: bool = True):
    """N samples per sampling point (temperature / top_p / top_k / seed / max_tokens)."""
    return final_state(run_sweep(config, track))
