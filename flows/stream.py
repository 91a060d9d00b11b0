"""The single-stage `stream` flow.

Open the endpoint (the configured base_url, or the embedded llama.cpp server started for the
run and stopped after it), run the stream stage (``tasks.pipeline.stream_stage``, the same task
the audit's remote stage runs) under one MLflow parent run (``flows.runs.parent_run``), log its
headline and summary.md on the parent. MLflow: parent run -> ``stream`` child -> one child per
load level. The command is ``flows.commands.stream``.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runs import final_state, parent_run, target_label
from tasks.config import StreamFlowConfig
from tasks.endpoint.preflight import check_flow_settings

# tasks.pipeline (torch, openai, matplotlib) is imported inside the body, so that loading this
# module (deployments, the CLI) stays fast.


def run_stream(config: StreamFlowConfig, track: bool = True) -> dict:
    """The flow's body: returns ``{"levels", "headline", "error", "mlflow_run_id", "workdir",
    "ui_command", "runs_url"}`` (``error`` is None, or the message of the failure that ended the run early,
    or ``every request failed; ...`` when no measured request succeeded: the run ends FAILED).

    Raises:
        tasks.endpoint.preflight.SettingsError: a setting the pre-flight finds cannot work (one line)."""
    from tasks.phases import mark

    mark("flow_body")
    from tasks.scaleout.multiproc import start_fork_server

    if config.stream.task_runner == "threads":  # Dask workers run their own clients
        start_fork_server()  # the client processes' imports run beside the MLflow and endpoint set-up
    from tasks.endpoint.cache import first_level_figures
    from tasks.endpoint.spec import open_endpoint
    from tasks.pipeline import stream_stage
    from tasks.pipeline.fanout import check_flow_task_runner
    from tasks.report import summary as report
    from tasks.wire.errors import every_request_failed

    logger = get_run_logger()
    # the CLI checked these already; a run from the Prefect UI or a deployment had no CLI:
    # a setting that cannot work fails the flow run here, in seconds, before any MLflow run
    check_flow_settings(config.endpoint, api=config.stream.api)
    check_flow_task_runner(config.stream.task_runner, "stream.task_runner")
    tags = {
        "model": config.server.model if not config.endpoint.base_url else config.endpoint.model,
        "endpoint": config.endpoint.base_url or "embedded",
    }
    endpoint, server = config.endpoint, config.server
    what = target_label(endpoint.base_url, endpoint.model, server.engine, server.model)
    with parent_run(
        "stream", config.name, config.model_dump(mode="json"), config.tracking, track, tags, what=what
    ) as run:
        result: dict = {"levels": [], "headline": {}, "error": None}
        kind = None
        try:
            with open_endpoint(config.endpoint, config.server) as endpoint:
                kind = endpoint.server_kind
                run.set_tags(endpoint.identity())
                stage = stream_stage(config.stream, endpoint, **run.stage_args())
            result.update(levels=stage["levels"], headline=stage["headline"])
            result["error"] = every_request_failed(stage["levels"])  # measured nothing: FAILED
        except Exception as exc:  # the records written so far stay in workdir and MLflow
            result["error"] = f"{type(exc).__name__}: {exc}"
            logger.error("stream failed: %s", result["error"])
        stages = {"stream": {"levels": result["levels"], "headline": result["headline"]}}
        summary = report.summary_markdown(
            stages if result["levels"] else {},
            {"stream": result["error"]} if result["error"] else {},
            kind,
            title="infermeter stream",
        )
        mark("flow_finish")
        # the first level's prefix-cache figures beside the headline: what compare reads
        run.finish({**result["headline"], **first_level_figures(result["levels"])}, summary, result["error"])
    mark("flow_body_end")
    return {**result, **run.links()}


@flow(name="stream", log_prints=True)
def stream(config: StreamFlowConfig = StreamFlowConfig(), track: bool = True):
    """Stream from an endpoint under a concurrency x request-rate sweep (TTFT, ITL, TPOT, E2E)."""
    return final_state(run_stream(config, track))
