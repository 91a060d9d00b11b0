"""`infermeter audit`: the full audit (tokenize, local profile, remote stream, sampling sweep,
report) from a YAML config, with its headline table and regression verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.shared.common import (
    JsonOption,
    NoTrackOption,
    apply_overrides,
    check_embedded_engine,
    check_hf_model,
    check_remote_endpoint,
    check_tokenizer_sources,
    fail_input,
    load_or_fail,
    preflight,
    run_flow,
)
from flows.tables.common import console, err_console, print_headline, print_run_links
from tasks.config import AuditConfig


def command(
    config: Annotated[Optional[Path], typer.Option(help="YAML config (default: built-in defaults).")] = None,
    json_path: JsonOption = None,
    no_track: NoTrackOption = False,
    baseline: Annotated[
        Optional[str],
        typer.Option(
            help="MLflow run id(s) pinned as the baseline, comma-separated (default: the audit "
            "history's runs since its last change point)."
        ),
    ] = None,
    fail_on_regression: Annotated[
        Optional[bool],
        typer.Option("--fail-on-regression/--no-fail-on-regression", help="Exit 1 on a regression."),
    ] = None,
    force_baseline: Annotated[
        Optional[bool],
        typer.Option(
            "--force-baseline/--no-force-baseline",
            help="Judge even against a baseline whose workload differs (default: 'incomparable').",
        ),
    ] = None,
) -> None:
    """Audit an endpoint and its model end to end (tokenize, local profile, remote stream,
    sampling sweep, report) and flag regressions against the baseline."""
    cfg = load_or_fail(config, AuditConfig)
    if baseline is not None and not baseline.strip():  # blank in a config is unset; typed, a typo
        fail_input(f"--baseline: no run id in {baseline!r}; give one or more MLflow run ids, comma-separated")
    cfg = apply_overrides(
        cfg,
        "regression",
        {
            "baseline_run_id": baseline,
            "fail_on_regression": fail_on_regression,
            "force_baseline": force_baseline,
        },
        flags={"baseline_run_id": "--baseline"},
    )
    preflight(track=not no_track)
    if cfg.profile.enabled:
        check_hf_model(cfg.profile.model, "profile.model")
    if cfg.tokenize.enabled:  # before any stage: not after the hub's retries and the whole audit
        check_tokenizer_sources(
            cfg.tokenize.tokenizers, cfg.profile.model, "tokenize.tokenizers", "profile.model"
        )
    if cfg.stream.enabled or cfg.sweep.enabled:
        check_embedded_engine(cfg)
        check_remote_endpoint(cfg)
    if cfg.regression.baseline_run_id and not no_track:
        from tasks.report.baseline import pinned_ids
        from tasks.tracking import Tracker

        tracker = Tracker(cfg.tracking.experiment)
        for run_id in pinned_ids(cfg.regression):
            try:
                tracker.run_metrics(run_id)
            except LookupError as exc:
                fail_input(f"--baseline: {exc}")
    from flows.audit import audit as audit_flow

    state, result = run_flow(
        "audit",
        audit_flow,
        cfg,
        track=not no_track,
        json_path=json_path,
        json_keys=("stages", "headline", "errors", "regression"),
    )
    print_headline("infermeter audit: headline", result["headline"])
    decode = ((result.get("stages") or {}).get("profile") or {}).get("decode_verdict")
    if decode:  # the roofline's word on the first profile point (summary.md has the details)
        console.print(decode[:1].upper() + decode[1:], highlight=False)
    console.print(f"Records on disk: {result['workdir']}", highlight=False)
    print_run_links(result)
    verdict = result.get("regression")
    if not verdict and result["mlflow_run_id"] and not result["errors"] and cfg.regression.enabled:
        need = cfg.regression.min_baseline_audits
        console.print(
            f"Regression verdict: no baseline yet (the first audit of this endpoint, model and "
            f"workload: building a baseline, 0 of {need} audits; a verdict comes once {need} audits of it have run)",
            highlight=False,
        )
    if verdict:
        print_verdict(verdict)
    if result["errors"]:
        for stage, message in result["errors"].items():
            err_console.print(f"stage {stage} failed: {message}", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    if state.is_failed():  # fail_on_regression
        raise typer.Exit(1)


def print_verdict(verdict: dict) -> None:
    """The verdict's one line (the overall word with the counts per class), each judged metric,
    how the baseline was chosen and its runs; for an incomparable baseline the fields that
    differ."""
    ids = ", ".join(verdict.get("baseline_run_ids") or [])
    if verdict.get("building"):
        have, need = verdict["building"]["audits"], verdict["building"]["needed"]
        console.print(
            f"Regression verdict: building a baseline: {have} of {need} audits (no verdict until "
            f"{need} audits of this endpoint, model and workload; this one joins them)",
            highlight=False,
        )
        console.print(f"Audits so far: {ids}", highlight=False)
        return
    if verdict.get("status") == "incomparable":
        fields = "; ".join(
            f"{d['field']} {d['current']} vs {d['baseline']}" for d in verdict.get("incomparable", [])
        )
        console.print(
            f"Regression verdict: incomparable (no verdict; the baseline's workload differs: {fields}; "
            "--force-baseline judges anyway)",
            highlight=False,
        )
    else:
        counts = ", ".join(f"{n} {kind}" for kind, n in (verdict.get("counts") or {}).items())
        # the regressed metrics after "in", the improved ones apart: a headline that read
        # "REGRESSED in ..., ttft_ms_tail (-38.7 %)" listed an improvement as a regression
        moved = {
            kind: ", ".join(
                f"{row['metric']} ({row['change_pct']:+.1f} %)"
                for row in verdict["rows"]
                if row["verdict"] == kind
            )
            for kind in ("regressed", "improved")
        }
        console.print(
            f"Regression verdict: {verdict['status'].upper()} ({counts})"
            + (f" in {moved['regressed']}" if moved["regressed"] else "")
            + (f"; improved: {moved['improved']}" if moved["improved"] else "")
            + f"; baseline: {verdict['baseline']}",
            highlight=False,
            markup=False,
        )
        for row in verdict["rows"]:  # each judged metric: its change, interval and class
            console.print(f"  {verdict_line(row)}", highlight=False, markup=False)
        if verdict.get("thresholds_pct"):
            console.print(
                f"Thresholds: {thresholds_text(verdict['thresholds_pct'])}", highlight=False, markup=False
            )
        if verdict.get("baseline_note"):
            console.print(
                f"How the baseline was chosen: {verdict['baseline_note']}", highlight=False, markup=False
            )
    console.print(f"Baseline runs: {ids}", highlight=False)


def verdict_line(row: dict) -> str:
    """One judged metric: ``ttft_ms_p50  +3.1 % [-2.0 .. +8.4 %]  unchanged  (note)``."""
    change = "n/a" if row.get("change_pct") is None else f"{row['change_pct']:+.1f} %"
    if row.get("change_pct_ci_low") is not None:
        change += f" [{row['change_pct_ci_low']:+.1f} .. {row['change_pct_ci_high']:+.1f} %]"
    return f"{row['metric']:<22} {change:<28} {row['verdict']:<12} ({row['note']})"


def thresholds_text(thresholds: dict[str, float]) -> str:
    """``ttft_ms_p50 +15 %, decode_tokens_per_s -10 %``: the signed thresholds judged by."""
    return ", ".join(f"{metric} {value:+g} %" for metric, value in thresholds.items())
