"""Choosing an audit's baseline and recording the verdict on its run.

The baseline is a named run, or the last N finished audits of the same endpoint and model
(identified by server kind + model + model file hash, never by URL or port). Talks to MLflow only
through a :class:`tasks.tracking.Tracker`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tasks.config import RegressionConfig
from tasks.report.regression import MetricVerdict, verdict, verdict_markdown
from tasks.tracking import Tracker

#: Tags that make two audits comparable.
IDENTITY_TAGS = ("endpoint_kind", "endpoint_model", "endpoint_model_sha256", "model")


@dataclass
class RegressionResult:
    rows: list[MetricVerdict]
    baseline_label: str
    baseline_run_ids: list[str]

    @property
    def regressed(self) -> bool:
        return any(row.regressed for row in self.rows)

    def markdown(self) -> str:
        return verdict_markdown(self.rows, self.baseline_label)


def _quote(value: str) -> str:
    return value.replace("'", "\\'")


def find_baseline(
    tracker: Tracker, run_id: str, tags: Mapping[str, str], cfg: RegressionConfig
) -> tuple[list[dict[str, float]], list[str], str]:
    """(metrics of each baseline run, their ids, a label). Empty when no baseline exists yet.

    Raises:
        LookupError: ``baseline_run_id`` names a run that does not exist.
    """
    if cfg.baseline_run_id:
        metrics = tracker.run_metrics(cfg.baseline_run_id)
        return [metrics], [cfg.baseline_run_id], f"run {cfg.baseline_run_id}"
    clauses = ["tags.flow = 'audit'", "attributes.status = 'FINISHED'"]
    clauses += [f"tags.{key} = '{_quote(tags[key])}'" for key in IDENTITY_TAGS if tags.get(key)]
    runs = tracker.find_runs(" and ".join(clauses), max_results=cfg.baseline_last_n, exclude=run_id)
    label = f"median of the last {len(runs)} audits of the same endpoint and model"
    return [r["metrics"] for r in runs], [r["run_id"] for r in runs], label


def judge(
    tracker: Tracker,
    run_id: str,
    current: Mapping[str, float],
    tags: Mapping[str, str],
    cfg: RegressionConfig,
) -> RegressionResult | None:
    """Compare ``current`` with the baseline and record the verdict on ``run_id``: tag
    ``regression`` = true/false, ``regression.md`` and ``regression.json``. None when there is
    no baseline yet (the first audit of an endpoint and model)."""
    baseline_runs, ids, label = find_baseline(tracker, run_id, tags, cfg)
    if not baseline_runs:
        tracker.set_tags(run_id, {"regression": "no_baseline"})
        return None
    result = RegressionResult(verdict(current, baseline_runs, cfg.thresholds_pct), label, ids)
    tracker.set_tags(
        run_id,
        {
            "regression": str(result.regressed).lower(),
            "baseline_run_ids": ",".join(ids)[:5000],
        },
    )
    tracker.log_text(run_id, result.markdown(), "regression.md")
    tracker.log_dict(
        run_id,
        {"baseline": label, "baseline_run_ids": ids, "rows": [row.to_row() for row in result.rows]},
        "regression.json",
    )
    return result
