"""The `capacity` flow: the highest request rate an endpoint serves within its SLOs.

Open the endpoint (the configured base_url, or the embedded server started for the run and
stopped after it) and run the capacity search (``tasks.pipeline.capacity_stage`` over
``tasks.stream.capacity``) under one MLflow parent run: a child run per level, and on the
parent the capacity, its bracket, ``capacity.json`` and the plot. The command is
``flows.commands.capacity``; ``infermeter serve`` deploys it.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runs import final_state, parent_run, target_label
from tasks.config import CapacityFlowConfig


def summary_text(capacity: dict | None, error: str | None) -> str:
    """summary.md of a capacity run: the answer, why the search stopped, the last failure."""
    lines = ["# infermeter capacity", ""]
    if error:
        lines += [f"failed: {error}", ""]
    if capacity:
        rate, tokens = capacity["capacity_requests_per_s"], capacity["capacity_output_tokens_per_s"]
        bracket = capacity["bracket_requests_per_s"]
        lines += [
            f"- capacity: {rate if rate is None else f'{rate:.3f}'} req/s, "
            f"{tokens if tokens is None else f'{tokens:.1f}'} output tokens/s "
            f"(SLOs {capacity['slos']}, goodput target {capacity['target']})",
            f"- bracket: {bracket} req/s",
            f"- stopped: {capacity['stop_reason']}",
            f"- last failing level: {capacity['last_failure']}",
        ]
    return "\n".join(lines) + "\n"


def run_capacity(config: CapacityFlowConfig, track: bool = True) -> dict:
    """The flow's body: returns ``{"capacity", "levels", "error", "mlflow_run_id", "workdir",
    "ui_command", "runs_url"}`` (``capacity`` is ``CapacityResult.to_dict()``, None when it failed;
    ``error`` also says ``every request failed; ...`` when no measured request succeeded, and
    the run ends FAILED)."""
    from tasks.endpoint.spec import open_endpoint
    from tasks.pipeline.capacity import capacity_stage
    from tasks.wire.errors import every_request_failed

    logger = get_run_logger()
    tags = {
        "model": config.server.model if not config.endpoint.base_url else config.endpoint.model,
        "endpoint": config.endpoint.base_url or "embedded",
    }
    remote, server = config.endpoint, config.server  # the run's name says what it measured
    what = target_label(remote.base_url, remote.model, server.engine, server.model)
    with parent_run(
        "capacity", config.name, config.model_dump(mode="json"), config.tracking, track, tags, what=what
    ) as run:
        result: dict = {"capacity": None, "levels": [], "error": None}
        try:
            with open_endpoint(config.endpoint, config.server) as endpoint:
                run.set_tags(endpoint.identity())
                stage = capacity_stage(config.stream, config.capacity, endpoint, **run.stage_args())
            result.update(stage)
            result["error"] = every_request_failed(stage["levels"])  # no capacity to speak of
        except Exception as exc:  # the records written so far stay in workdir
            result["error"] = f"{type(exc).__name__}: {exc}"
            logger.error("capacity failed: %s", result["error"])
        run.finish({}, summary_text(result["capacity"], result["error"]), result["error"])
    return {**result, **run.links()}


@flow(name="capacity", log_prints=True)
def capacity(config: CapacityFlowConfig = CapacityFlowConfig(), track: bool = True):
    """The highest request rate whose goodput fraction meets the target (bisection between the
    synchronous rate and the saturation throughput)."""
    return final_state(run_capacity(config, track))
