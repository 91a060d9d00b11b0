"""The audit flow: tokenize -> local profile -> remote stream -> sampling sweep -> report.

One MLflow parent run per flow run, one child per stage (and per level / point under those).
The stages are independent measurements: a stage that fails (a stream whose every request
failed among them, or one whose error rate at a level is over ``regression.max_error_rate``) is
recorded as failed on its own child run and on the parent, the others still run and keep their
records, and the flow run ends Failed so Prefect's notifications fire (a FAILED audit is never
a later audit's baseline). The embedded server is stopped when the remote stages end, on failure too.
"""

from __future__ import annotations

import traceback

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed

from flows.events import emit_regressed
from flows.runs import model_label, parent_run, target_label
from tasks.config import AuditConfig
from tasks.endpoint.cache import first_level_figures
from tasks.endpoint.spec import open_endpoint
from tasks.engines.death import ServerDiedError, server_gone
from tasks.pipeline import profile_stage, stream_stage, sweep_stage, tokenize_stage
from tasks.report import summary as report
from tasks.report.baseline import SAMPLES_ARTIFACT, judge, log_history_plots
from tasks.report.samples_file import write_samples
from tasks.wire.errors import error_rate_exceeded, every_request_failed


def run_audit(config: AuditConfig, track: bool = True) -> dict:
    """The audit's body; returns the result dict (with ``errors`` per failed stage)."""
    from tasks.pipeline.fanout import check_flow_task_runner

    logger = get_run_logger()
    # a run from the Prefect UI or a deployment had no CLI to check these: a task runner that
    # cannot work (no scheduler at its address) fails the flow run here, before any MLflow run
    for name, stage in (("profile", config.profile), ("stream", config.stream), ("sweep", config.sweep)):
        if stage.enabled:
            check_flow_task_runner(stage.task_runner, f"{name}.task_runner")
    tags = {"model": config.profile.model, "endpoint": config.endpoint.base_url or "embedded"}
    with parent_run(
        "audit",
        config.name,
        config.model_dump(mode="json"),
        config.tracking,
        track,
        tags,
        artifact_key="audit-summary",
        what=_audit_what(config),
        torch_facts=config.profile.enabled,  # torch runs in this process tree only to profile
    ) as run:
        stages: dict[str, dict] = {}
        errors: dict[str, str] = {}

        def attempt(name: str, call) -> None:
            try:
                stages[name] = call()
            except Exception as exc:  # one failed stage must not lose the others' measurements
                errors[name] = f"{type(exc).__name__}: {exc}"
                logger.error("stage %s failed: %s", name, errors[name])

        common = run.stage_args()
        if config.tokenize.enabled:
            attempt("tokenize", lambda: tokenize_stage(config.tokenize, config.profile.model, **common))
        if config.profile.enabled:
            attempt("profile", lambda: profile_stage(config.profile, **common, breakdown_default=True))
        endpoint_kind = None
        if config.stream.enabled or config.sweep.enabled:
            try:
                with open_endpoint(config.endpoint, config.server) as endpoint:
                    endpoint_kind = endpoint.server_kind
                    run.set_tags(endpoint.identity())
                    if config.stream.enabled:
                        attempt("stream", lambda: stream_stage(config.stream, endpoint, **common))
                        levels = (stages.get("stream") or {}).get("levels") or []
                        # its records are kept; a stream that measured nothing, or whose error
                        # rate at a level is over regression.max_error_rate, failed (never a baseline)
                        failed = every_request_failed(levels) or error_rate_exceeded(
                            levels, config.regression.max_error_rate
                        )
                        if failed:
                            errors["stream"] = failed
                    if config.sweep.enabled and server_gone(endpoint.server_pid):
                        errors["sweep"] = "not run: the embedded server had died (see the stream stage)"
                    elif config.sweep.enabled:
                        attempt("sweep", lambda: sweep_stage(config.sweep, endpoint, **common))
            except ServerDiedError as exc:  # named once: by the stage it ended, else here
                if not any(error.startswith("ServerDiedError") for error in errors.values()):
                    errors["endpoint"] = f"ServerDiedError: {exc}"
                    logger.error("endpoint failed: %s", errors["endpoint"])
            except Exception as exc:
                errors["endpoint"] = f"{type(exc).__name__}: {exc}"
                logger.error("endpoint failed: %s", errors["endpoint"])
                run.tracker.log_text(run.run_id, traceback.format_exc(), "error.txt")

        headline = report.headline(stages)
        summary = report.summary_markdown(stages, errors, endpoint_kind)
        samples = report.samples(stages)  # kept, so that a later audit can be judged against them
        run.tracker.log_artifact(run.run_id, write_samples(samples, run.workdir / SAMPLES_ARTIFACT))
        verdict = None
        if run.run_id and config.regression.enabled and not errors:
            try:
                bound = report.client_bound(stages)
                verdict = judge(
                    run.tracker, run.run_id, headline, run.tags, config.regression, samples, bound
                )
            except LookupError as exc:  # a named baseline that does not exist
                errors["regression"] = str(exc)
        if verdict is not None and verdict.regressed:  # for a Prefect automation (never raises)
            emit_regressed(verdict, run.tags, run.run_id, run.tracker.run_url(run.run_id), run.runs_url)
        if verdict is not None:
            summary += "\n" + verdict.markdown()
            logger.info("regression verdict: %s", verdict.line())
            try:  # the history's plots: a failure to draw never loses the verdict
                log_history_plots(run.tracker, run.run_id, verdict, headline, run.workdir / "plots")
            except Exception as exc:
                logger.warning("history plots not drawn: %s: %s", type(exc).__name__, exc)
        cached = first_level_figures((stages.get("stream") or {}).get("levels") or [])  # for compare
        run.finish({**headline, **cached}, summary, "; ".join(f"{k}: {v}" for k, v in errors.items()) or None)
    return {
        "stages": stages,
        "headline": headline,
        "errors": errors,
        "regression": None if verdict is None else verdict.to_dict(),
        "mlflow_run_id": run.run_id,
        "tracking_uri": run.tracker.tracking_uri if run.run_id else None,
        "ui_command": run.ui_command,
        "runs_url": run.runs_url,
        "workdir": str(run.workdir),
    }


def _audit_what(config: AuditConfig) -> list[str]:
    """The run name's subject: the endpoint the remote stages use (engine and model), else the
    locally profiled model."""
    if config.stream.enabled or config.sweep.enabled:
        endpoint, server = config.endpoint, config.server
        return target_label(endpoint.base_url, endpoint.model, server.engine, server.model)
    return [model_label(config.profile.model)]


@flow(name="audit", log_prints=True)
def audit(config: AuditConfig = AuditConfig(), track: bool = True):
    """Audit a model and an endpoint: tokenize, profile, stream, sweep, then report."""
    result = run_audit(config, track)
    if result["errors"]:
        return Failed(message="failed stages: " + ", ".join(result["errors"]), data=result)
    if config.regression.fail_on_regression and (result["regression"] or {}).get("regressed"):
        return Failed(message="regression against " + result["regression"]["baseline"], data=result)
    return Completed(data=result)
