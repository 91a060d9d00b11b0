"""The `tune` flow: one server configuration after another, measured the same way, and the
answer (the Pareto front, the best configuration under the SLOs).

The DAG: plan (the grid expanded and checked by the engine's own parser, before any server
starts) -> ``tune.repeats`` rounds, each measuring every configuration once in an order
shuffled from the seed (``tasks.tune.repeats.run_order``): start its server, wait healthy, run
the stream levels (or the capacity search), stop it and every child it made -> the answer, by
the rule of ``tasks.tune.rule`` (the best named only where its repeats separate it from the
rest; else "tied within noise"). A configuration whose server does not start is recorded
FAILED, not started again in later rounds, and the sweep goes on; with ``tune.resume``
(default) a measurement (configuration and repeat) already FINISHED with the same settings is
read back from MLflow, not measured. MLflow: the tune parent (tag ``tune_best_rule``: the
rule's outcome); a child per measurement (``tasks.pipeline.tune``) with its stream stage and
levels below it; on the parent ``tune.csv`` (every level a row: the means over the repeats and
their intervals), ``tune.json`` (with ``order`` and ``repeats``), the plot and the summary.
With ``tune.capacity`` the best is decided on each configuration's capacity in each repeat
(``tasks.tune.capacities``: a search's levels are at rates of its own repeat, no sample over
repeats): ``tune.csv`` adds a row per configuration, ``level`` -1, with its mean capacity and
interval (``capacity_requests_per_s``, ``_ci_low``, ``_ci_high``), ``tune.json``'s
configurations their ``capacity_over_repeats``, the summary a capacity line per configuration,
the parent metric ``tune_best_capacity_requests_per_s``. The command is
``flows.commands.tune``; ``infermeter serve`` / ``deploy`` deploy it.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runs import final_state, parent_run, target_label
from tasks.config import TuneFlowConfig


def answer(summaries: list, config: TuneFlowConfig) -> dict:
    """``{"points", "pareto": {"per_user_tokens_per_s": [...], "ttft_ms_p99": [...]}, "best"}``
    of the configurations (``ConfigurationSummary``: their repeats combined; ``tasks.tune.front``);
    ``best`` adds the winning configuration's ``server_params`` when one is named (the rule:
    ``tasks.tune.rule``), and ``best_obj`` is the ``Best`` itself. With ``tune.capacity`` the
    candidates are the configurations' capacities over their repeats (``capacities``: their
    points, ``tasks.tune.capacities``), else each configuration's levels."""
    from tasks.tune.front import CAPACITY, CAPACITY_LEVEL, best, pareto

    slos = config.stream.goodput
    points = [p for summary in summaries for p in summary.points()]
    capacities = []
    if config.tune.capacity:
        over = [c for c in (s.capacity_over_repeats() for s in summaries) if c is not None]
        capacities = [p for p in (c.point() for c in over) if p is not None]
        samples = {(c.configuration, CAPACITY_LEVEL): c.per_repeat for c in over}
        chosen = best(capacities, slos, config.capacity.target, samples, objective=CAPACITY)
    else:
        objective = "goodput_requests_per_s" if slos else "output_tokens_per_s"
        samples = {k: v for summary in summaries for k, v in summary.samples(objective).items()}
        chosen = best(points, slos, config.capacity.target, samples)
    best_dict = chosen.to_dict()
    if chosen.point is not None:
        best_dict["server_params"] = summaries[
            [o.index for o in summaries].index(chosen.point.configuration)
        ].server_params
    return {
        "points": points,
        "pareto": {axis: pareto(points, axis) for axis in ("per_user_tokens_per_s", "ttft_ms_p99")},
        "best": best_dict,
        "best_obj": chosen,
        "capacities": capacities,
    }


def summary_text(summaries: list, result: dict, error: str | None) -> str:
    """summary.md: one line per configuration (with its capacity over the repeats under
    ``tune.capacity``), then the best (the rule's outcome) and the front."""
    from tasks.tune.capacities import capacity_text
    from tasks.tune.front import CAPACITY_LEVEL

    lines = ["# infermeter tune", ""]
    if error:
        lines += [f"failed: {error}", ""]
    for o in summaries:
        d = o.to_dict()
        startup = f"{d['server_startup_s']:.1f} s" if d["server_startup_s"] is not None else "-"
        note = " (resumed)" if d["resumed"] else ""
        repeats = f", {len(o.finished)} of {len(o.measurements) + len(o.skipped)} repeats finished"
        if d["capacity_over_repeats"]:
            repeats += f", {capacity_text(d['capacity_over_repeats'])}"
        lines.append(
            f"- {o.index}: `{o.label}` {d['status']}{note}{repeats}, startup {startup}"
            + (f": {d['error'][:200]}" if d["error"] else "")
        )
    best = result.get("best") or {}
    if best.get("point"):
        p = best["point"]
        where = "" if p["level"] == CAPACITY_LEVEL else f" at concurrency {p['max_concurrency']}"
        lines += ["", f"best: `{p['label']}`{where}: {best['reason']}"]
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
    """The flow's body: returns ``{"configurations": [ConfigurationSummary.to_dict()], "best",
    "pareto", "order", "repeats", "error", "mlflow_run_id", "workdir", "ui_command",
    "runs_url"}``; ``order``: each measurement's ``position``, ``repeat``, ``configuration`` and
    what became of it (``measured``, ``resumed``, ``skipped``); ``error`` when the plan was
    refused or every configuration FAILED (the run ends FAILED)."""
    from tasks.pipeline.tune import ConfigurationSummary, finished_outcome, measure_configuration
    from tasks.tune.plan import plan
    from tasks.tune.repeats import run_order

    logger = get_run_logger()
    engine = "serve_cmd" if config.tune.serve_cmd else config.server.engine
    tags = {
        "model": config.endpoint.model if config.tune.serve_cmd else config.server.model,
        "engine": engine,
    }
    repeats = config.tune.repeats
    # the run's name: `tune 12-02 10:06:42 llama.cpp SmolLM2-135M-Instruct`, as the other flows'
    what = (
        ["serve_cmd", config.endpoint.model or "?"]
        if config.tune.serve_cmd
        else target_label(None, None, config.server.engine, config.server.model)
    )
    params = config.model_dump(mode="json")
    with parent_run("tune", config.name, params, config.tracking, track, tags, what=what) as run:
        summaries: list[ConfigurationSummary] = []
        order: list[dict] = []
        error = None
        try:
            planned = plan(config)
            summaries = [
                ConfigurationSummary(
                    item.configuration.index,
                    item.configuration.label,
                    dict(item.configuration.params),
                    list(item.configuration.flags),
                )
                for item in planned
            ]
            slots = run_order(len(planned), repeats, config.stream.seed)
            for slot in slots:
                item, summary = planned[slot.configuration], summaries[slot.configuration]
                conf = item.configuration
                where = (
                    f"measurement {slot.position + 1}/{len(slots)}: configuration {conf.index} "
                    f"({conf.label}), repeat {slot.repeat + 1}/{repeats}"
                )
                if any(m.server_startup_s is None and m.status == "FAILED" for m in summary.measurements):
                    logger.info("%s: skipped (its server did not start in an earlier repeat)", where)
                    summary.skipped.append(slot.repeat)
                    order.append({**slot.to_dict(), "label": conf.label, "done": "skipped"})
                    continue
                found = (
                    finished_outcome(run.tracker, item.key, conf, slot.repeat) if config.tune.resume else None
                )
                if found is not None:
                    logger.info("%s: FINISHED in run %s; skipped (resume)", where, found.mlflow_run_id)
                    found.position = slot.position
                    summary.measurements.append(found)
                    order.append({**slot.to_dict(), "label": conf.label, "done": "resumed"})
                    continue
                logger.info("%s: starting the server", where)
                outcome = measure_configuration(
                    config,
                    conf,
                    item.key,
                    run.target,
                    run.run_id,
                    run.workdir,
                    slot.repeat,
                    repeats,
                    slot.position,
                )
                logger.info(
                    "%s: %s%s", where, outcome.status, f": {outcome.error[:300]}" if outcome.error else ""
                )
                summary.measurements.append(outcome)
                order.append({**slot.to_dict(), "label": conf.label, "done": "measured"})
            for summary in summaries:
                summary.measurements.sort(key=lambda m: m.repeat)
            if summaries and all(s.status == "FAILED" for s in summaries):
                error = f"every configuration FAILED; the first: {summaries[0].error()}"
        except Exception as exc:  # the plan refused, or tracking broke: what was measured stays
            error = f"{type(exc).__name__}: {exc}"
            logger.error("tune failed: %s", error)
        measured = [s for s in summaries if s.measurements]
        result = _publish(run, measured, config, order)
        run.finish(result.pop("metrics"), summary_text(measured, result, error), error)
    return {
        "configurations": [s.to_dict() for s in measured],
        **result,
        "error": error,
        **run.links(),
    }


def _publish(run, summaries: list, config: TuneFlowConfig, order: list[dict]) -> dict:
    """The answer on the parent run: tune.csv, tune.json, the plot, the rule's outcome as tag
    ``tune_best_rule``; its metrics returned under ``metrics`` for the run's end."""
    import polars as pl

    from tasks.report.tune_plot import tune_plot

    found = answer(summaries, config)
    points = found.pop("points")
    chosen = found.pop("best_obj")
    capacities = found.pop("capacities")
    result = {
        "best": found["best"],
        "pareto": {axis: [p.to_dict() for p in front] for axis, front in found["pareto"].items()},
        "order": order,
        "repeats": config.tune.repeats,
    }
    if points:
        csv = run.workdir / "tune.csv"
        pl.DataFrame([p.to_dict() for p in points + capacities]).write_csv(csv)
        run.tracker.log_artifact(run.run_id, csv)
    run.tracker.log_dict(
        run.run_id, {"configurations": [o.to_dict() for o in summaries], **result}, "tune.json"
    )
    run.set_tags({"tune_best_rule": chosen.rule})
    if run.tracker.enabled and points:
        run.tracker.log_artifact(
            run.run_id,
            tune_plot(points, chosen.point, run.workdir / "plots/tune_pareto.png", chosen.tied),
            "plots",
        )
    best = found["best"]["point"] or {}
    metrics = {
        "tune_configurations": len(summaries),
        "tune_configurations_failed": sum(o.status == "FAILED" for o in summaries),
        "tune_configurations_resumed": sum(o.resumed for o in summaries),
        "tune_pareto_points": len(result["pareto"]["per_user_tokens_per_s"]),
        "tune_best_output_tokens_per_s": best.get("output_tokens_per_s"),
        "tune_best_goodput_requests_per_s": best.get("goodput_requests_per_s"),
        "tune_best_capacity_requests_per_s": best.get("capacity_requests_per_s"),
    }
    return {**result, "metrics": {k: v for k, v in metrics.items() if v is not None}}


@flow(name="tune", log_prints=True)
def tune(config: TuneFlowConfig = TuneFlowConfig(), track: bool = True):
    """Measure the server under each configuration of a grid; the Pareto front and the best."""
    return final_state(run_tune(config, track))
