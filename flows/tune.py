"""The `tune` flow: one server configuration after another, measured the same way, and the
answer (the Pareto front, the best configuration under the SLOs).

The DAG: plan (the grid expanded and checked by the engine's own parser, before any server
starts) -> per configuration, in order: start its server, wait healthy, run the stream levels
(or the capacity search), stop it and every child it made -> the answer. A configuration whose
server does not start is recorded FAILED and the sweep goes on; with ``tune.resume`` (default)
a configuration already FINISHED with the same settings is read back from MLflow, not measured.
MLflow: the tune parent; a child per configuration (``tasks.pipeline.tune``) with its stream
stage and levels below it; on the parent ``tune.csv`` (every level a row), ``tune.json``, the
plot and the summary. The command is ``flows.commands.tune``; ``infermeter serve`` / ``deploy``
deploy it.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runs import final_state, parent_run
from tasks.config import TuneFlowConfig


def answer(outcomes: list, config: TuneFlowConfig) -> dict:
    """``{"points", "pareto": {"per_user_tokens_per_s": [...], "ttft_ms_p99": [...]}, "best"}``
    of the outcomes (``tasks.tune.front``); ``best`` adds the winning configuration's
    ``server_params``."""
    from tasks.tune.front import best, pareto

    points = [p for outcome in outcomes for p in outcome.points()]
    chosen = best(points, config.stream.goodput, config.capacity.target)
    best_dict = chosen.to_dict()
    if chosen.point is not None:
        best_dict["server_params"] = outcomes[
            [o.index for o in outcomes].index(chosen.point.configuration)
        ].server_params
    return {
        "points": points,
        "pareto": {axis: pareto(points, axis) for axis in ("per_user_tokens_per_s", "ttft_ms_p99")},
        "best": best_dict,
    }


def summary_text(outcomes: list, result: dict, error: str | None) -> str:
    """summary.md: one line per configuration, then the best and the front."""
    lines = ["# infermeter tune", ""]
    if error:
        lines += [f"failed: {error}", ""]
    for o in outcomes:
        startup = f"{o.server_startup_s:.1f} s" if o.server_startup_s is not None else "-"
        note = " (resumed)" if o.resumed else ""
        lines.append(
            f"- {o.index}: `{o.label}` {o.status}{note}, startup {startup}"
            + (f": {o.error[:200]}" if o.error else "")
        )
    best = result.get("best") or {}
    if best.get("point"):
        p = best["point"]
        lines += ["", f"best: `{p['label']}` at concurrency {p['max_concurrency']}: {best['reason']}"]
    elif best:
        lines += ["", f"best: none ({best['reason']})"]
    front = result.get("pareto", {}).get("per_user_tokens_per_s", [])
    if front:
        lines += ["", "Pareto front (output tokens/s vs per-user tokens/s):"]
        lines += [
            f"- `{p['label']}` c={p['max_concurrency']}: {p['output_tokens_per_s']:.1f} tok/s, "
            f"{p['per_user_tokens_per_s']:.1f} tok/s per user"
            for p in front
        ]
    return "\n".join(lines) + "\n"


def run_tune(config: TuneFlowConfig, track: bool = True) -> dict:
    """The flow's body: returns ``{"configurations": [ConfigurationOutcome.to_dict()], "best",
    "pareto", "error", "mlflow_run_id", "workdir", "ui_command", "runs_url"}``; ``error`` when
    the plan was refused or every configuration FAILED (the run ends FAILED)."""
    from tasks.pipeline.tune import finished_outcome, measure_configuration
    from tasks.tune.plan import plan

    logger = get_run_logger()
    engine = "serve_cmd" if config.tune.serve_cmd else config.server.engine
    tags = {
        "model": config.endpoint.model if config.tune.serve_cmd else config.server.model,
        "engine": engine,
    }
    with parent_run("tune", config.name, config.model_dump(mode="json"), config.tracking, track, tags) as run:
        outcomes, error = [], None
        try:
            planned = plan(config)
            for number, item in enumerate(planned, 1):
                conf = item.configuration
                found = finished_outcome(run.tracker, item.key, conf) if config.tune.resume else None
                if found is not None:
                    logger.info(
                        "configuration %d/%d (%s): FINISHED in run %s; skipped (resume)",
                        number,
                        len(planned),
                        conf.label,
                        found.mlflow_run_id,
                    )
                    outcomes.append(found)
                    continue
                logger.info("configuration %d/%d (%s): starting the server", number, len(planned), conf.label)
                outcome = measure_configuration(config, conf, item.key, run.target, run.run_id, run.workdir)
                logger.info(
                    "configuration %d/%d (%s): %s%s",
                    number,
                    len(planned),
                    conf.label,
                    outcome.status,
                    f": {outcome.error[:300]}" if outcome.error else "",
                )
                outcomes.append(outcome)
            if outcomes and all(o.status == "FAILED" for o in outcomes):
                error = f"every configuration FAILED; the first: {outcomes[0].error}"
        except Exception as exc:  # the plan refused, or tracking broke: what was measured stays
            error = f"{type(exc).__name__}: {exc}"
            logger.error("tune failed: %s", error)
        result = _publish(run, outcomes, config)
        run.finish(result.pop("metrics"), summary_text(outcomes, result, error), error)
    return {"configurations": [o.to_dict() for o in outcomes], **result, "error": error, **run.links()}


def _publish(run, outcomes: list, config: TuneFlowConfig) -> dict:
    """The answer on the parent run: tune.csv, tune.json, the plot; its metrics returned under
    ``metrics`` for the run's end."""
    import polars as pl

    from tasks.report.tune_plot import tune_plot

    found = answer(outcomes, config)
    points = found.pop("points")
    result = {
        "best": found["best"],
        "pareto": {axis: [p.to_dict() for p in front] for axis, front in found["pareto"].items()},
    }
    if points:
        csv = run.workdir / "tune.csv"
        pl.DataFrame([p.to_dict() for p in points]).write_csv(csv)
        run.tracker.log_artifact(run.run_id, csv)
    run.tracker.log_dict(
        run.run_id, {"configurations": [o.to_dict() for o in outcomes], **result}, "tune.json"
    )
    if run.tracker.enabled and points:
        best_point = next(
            (p for p in points if found["best"]["point"] and p.to_dict() == found["best"]["point"]), None
        )
        run.tracker.log_artifact(
            run.run_id, tune_plot(points, best_point, run.workdir / "plots/tune_pareto.png"), "plots"
        )
    best = found["best"]["point"] or {}
    metrics = {
        "tune_configurations": len(outcomes),
        "tune_configurations_failed": sum(o.status == "FAILED" for o in outcomes),
        "tune_configurations_resumed": sum(o.resumed for o in outcomes),
        "tune_pareto_points": len(result["pareto"]["per_user_tokens_per_s"]),
        "tune_best_output_tokens_per_s": best.get("output_tokens_per_s"),
        "tune_best_goodput_requests_per_s": best.get("goodput_requests_per_s"),
    }
    return {**result, "metrics": {k: v for k, v in metrics.items() if v is not None}}


@flow(name="tune", log_prints=True)
def tune(config: TuneFlowConfig = TuneFlowConfig(), track: bool = True):
    """Measure the server under each configuration of a grid; the Pareto front and the best."""
    return final_state(run_tune(config, track))
