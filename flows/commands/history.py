"""`infermeter history`: an endpoint's audits, one headline metric at a time, with intervals,
verdicts and change points.

Not a flow: it only reads the tracking store. The endpoint is that of ``--run`` (an audit's run
id, in ``--experiment``: a run of another experiment, or none, exits 2 naming it), else of the
newest finished audit; its history is every finished audit of the same
endpoint and model (server kind, model, model file hash) with the same workload, oldest first
(:mod:`tasks.report.history`), the series the verdict's baseline comes from.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from flows.shared.common import JsonOption, fail_input, output_path, parse_list, preflight, write_json
from flows.tables.common import console, fmt_value, make_table, print_closed_runs


def command(
    run: Annotated[
        Optional[str],
        typer.Option(
            "--run", help="An audit's MLflow run id: its endpoint's history (default: the newest audit's)."
        ),
    ] = None,
    experiment: Annotated[str, typer.Option(help="MLflow experiment to read.")] = "infermeter",
    metric: Annotated[
        Optional[str],
        typer.Option(
            "--metric", help="Comma-separated headline metrics (default: every thresholded one logged)."
        ),
    ] = None,
    max_runs: Annotated[int, typer.Option(help="The newest N audits of the endpoint.")] = 50,
    plots: Annotated[
        Optional[Path],
        typer.Option(
            help="Write history_<metric>.png for each metric into this folder.", callback=output_path
        ),
    ] = None,
    json_path: JsonOption = None,
) -> None:
    """Show an endpoint's audit history, to see when a metric changed: per metric each audit's
    figure with its interval and verdict, the segments' means and the change points."""
    from tasks.metrics import DEFAULT_THRESHOLDS_PCT, is_registered
    from tasks.report import history as audit_history
    from tasks.report.baseline import IDENTITY_TAGS, find_audits, workload, workload_differences
    from tasks.tracking import Tracker

    chosen = parse_list("--metric", metric, str)
    unknown = [m for m in chosen or [] if not is_registered(m)]
    if unknown:
        fail_input(f"--metric: {', '.join(unknown)} not a known metric; e.g. ttft_ms_p50, tpot_ms_mean")
    if max_runs < 2:
        fail_input("--max-runs: must be >= 2 (a history needs two audits)")
    if max_runs > 50:  # tasks.report.baseline reads the newest 50 audits, as the verdict does
        fail_input("--max-runs: at most 50 (the verdict's search reads an endpoint's newest 50 audits)")
    preflight(track=True, prefect=False)
    tracker = Tracker(experiment)
    print_closed_runs(tracker.close_abandoned())  # ghosts of SIGKILLed commands: KILLED, not RUNNING
    try:
        if run:
            [anchor] = tracker.runs_by_id([run])
            held_by = tracker.experiment_of(run)
            if held_by != experiment:  # its history would be read in the wrong experiment: empty
                fail_input(
                    f"--run: run {run} is in experiment {held_by!r}, not {experiment!r}; pass "
                    f"--experiment {shlex.quote(held_by)}"
                )
        else:
            newest = tracker.find_runs(
                "tags.flow = 'audit' and attributes.status = 'FINISHED'", max_results=1, parents_only=True
            )
            if not newest:
                fail_input(f"no finished audits in experiment {experiment!r}: run `infermeter audit` first")
            anchor = newest[0]
    except LookupError as exc:
        fail_input(f"--run: {exc}")
    tags = anchor["tags"]
    if tags.get("flow") != "audit":
        fail_input(f"--run: run {anchor['run_id']} is a {tags.get('flow') or 'non-flow'} run, not an audit")
    found = find_audits(tracker, "", tags)
    mine = workload(anchor)
    alike = [r for r in found if not workload_differences(mine, workload(r), r["run_id"])][:max_runs]
    metrics = chosen or [m for m in DEFAULT_THRESHOLDS_PCT if any(m in r["metrics"] for r in alike)]
    if not metrics:
        fail_input("these audits logged none of the headline metrics; name one with --metric")
    # the spread is learned over every thresholded metric logged, as the verdict learns it,
    # whichever --metric shows
    pooled = list(
        dict.fromkeys(
            [*metrics, *(m for m in DEFAULT_THRESHOLDS_PCT if any(m in r["metrics"] for r in alike))]
        )
    )
    everything = audit_history.build(list(reversed(alike)), pooled)
    history = audit_history.History(everything.audits, {m: everything.metrics[m] for m in metrics})
    key = {k: tags.get(k) for k in IDENTITY_TAGS}
    console.print(
        f"Audit history of {key.get('endpoint_kind') or '?'} / {key.get('endpoint_model') or key.get('model')}: "
        f"{len(history)} audit{'' if len(history) == 1 else 's'} with the workload of run {anchor['run_id']}",
        highlight=False,
        markup=False,
    )
    prior = _prior(anchor)
    learned = everything.spread_learned(list(everything.metrics), prior)
    for series in history.metrics.values():
        console.print(_table(history, series, learned.get(series.metric, [])))
        console.print(_spread_line(history, series.metric, learned.get(series.metric, [])), highlight=False)
    if plots is not None:
        from tasks.report.history_plot import history_plots

        for path in history_plots(history, plots):
            console.print(f"Plot: {path}", highlight=False, markup=False)
    write_json(json_path, _json(history, key, anchor["run_id"], learned))


def _prior(anchor: dict) -> Any:
    """The spread's prior the anchor audit was judged with (its logged config), else the
    default (``regression.run_spread_prior_pct`` / ``_runs``)."""
    from tasks.config import RegressionConfig
    from tasks.stats.spread import SpreadPrior

    params, default = anchor.get("params") or {}, RegressionConfig()
    try:
        pct = float(params.get("regression.run_spread_prior_pct", default.run_spread_prior_pct))
        runs = float(params.get("regression.run_spread_prior_runs", default.run_spread_prior_runs))
    except ValueError:
        pct, runs = default.run_spread_prior_pct, default.run_spread_prior_runs
    return SpreadPrior(pct / 100, runs)


def _trusted_since(spreads: list) -> int | None:
    """The index of the audit from which on the spread stayed trustworthy, None: not yet."""
    since = None
    for i, spread in enumerate(spreads):
        since = (i if since is None else since) if spread.trusted else None
    return since


def _spread_line(history: Any, metric: str, spreads: list) -> str:
    """``run-to-run spread of ttft_ms_p50: 4.2 % on 14.0 df (prior 3, history 11.0); trustworthy since
    audit 5 (run 1a2b3c4d)``."""
    if not spreads:
        return ""
    now, since = spreads[-1], _trusted_since(spreads)
    when = (
        f"trustworthy since audit {since + 1} (run {history.audits[since].run_id[:8]})"
        if since is not None
        else (
            f"not yet trustworthy: the history's {now.history_df:.1f} df are fewer than "
            f"{max(now.prior_df, 2):g} (the prior's weight, at least 2); more audits will settle it"
        )
    )
    return (
        f"run-to-run spread of {metric}: {100 * now.sd_log:.1f} % on {now.df:.1f} df (prior "
        f"{now.prior_df:g}, history {now.history_df:.1f}); {when}"
    )


def _table(history: Any, series: Any, spreads: list) -> Any:
    table = make_table(
        f"{series.metric}: {len(series.change_points)} change point(s)",
        [
            ("#", "right"),
            ("UTC", "left"),
            ("run", "left"),
            (series.metric, "right"),
            ("interval", "right"),
            ("segment", "right"),
            ("verdict", "left"),
            ("spread", "right"),
            ("", "left"),
        ],
        compact=True,
        no_wrap=True,
    )
    starts = {segment.start: segment for segment in series.segments}
    segment = None
    for i, audit in enumerate(history.audits):
        segment = starts.get(i, segment)
        value, low, high = series.values[i], series.lows[i], series.highs[i]
        interval = "" if low is None or high is None else f"{fmt_value(low)}..{fmt_value(high)}"
        mark = "<- change point" if i in series.change_points else ""
        table.add_row(
            str(i + 1),
            audit.started[5:],  # MM-DD HH:MM: the year is in --json
            audit.run_id[:8],
            fmt_value(value) if math.isfinite(value) else "n/a",
            interval,
            fmt_value(segment.mean) if segment is not None else "",
            audit.verdict or "",
            _spread_cell(spreads[i]) if i < len(spreads) else "",
            mark,
        )
    return table


def _spread_cell(spread: Any) -> str:
    """``4.2 % /14`` (the spread known after this audit, its df); a ``*`` where trustworthy."""
    return f"{100 * spread.sd_log:.1f} % /{spread.df:.0f}" + ("*" if spread.trusted else "")


def _json(history: Any, key: dict, anchor: str, learned: dict) -> dict:
    """The ``--json`` shape: the endpoint key, the audits (oldest first), per metric the points
    (each with the run-to-run spread known after it: ``spread``), the change points (run ids
    where a segment starts), the segments, and ``spread_trusted_since`` (a run id, or null)."""
    ids = [a.run_id for a in history.audits]
    return {
        "endpoint": key,
        "anchor_run_id": anchor,
        "audits": [
            {"run_id": a.run_id, "name": a.name, "start_time_ms": a.start_time_ms, "verdict": a.verdict}
            for a in history.audits
        ],
        "metrics": {
            name: {
                "points": [
                    {
                        "run_id": ids[i],
                        "value": None if not math.isfinite(series.values[i]) else series.values[i],
                        "ci_low": series.lows[i],
                        "ci_high": series.highs[i],
                        "spread": learned[name][i].to_dict() if name in learned else None,
                    }
                    for i in range(len(ids))
                ],
                "spread_trusted_since": None
                if name not in learned or (since := _trusted_since(learned[name])) is None
                else ids[since],
                "change_points": [ids[i] for i in series.change_points],
                "segments": [
                    {
                        "first_run_id": ids[s.start],
                        "last_run_id": ids[s.stop - 1],
                        "audits": s.stop - s.start,
                        "mean": s.mean,
                    }
                    for s in series.segments
                ],
            }
            for name, series in history.metrics.items()
        },
    }
