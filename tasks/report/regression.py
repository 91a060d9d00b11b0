"""Regression verdicts: is this run worse than its baseline, beyond threshold and noise?

A threshold is a signed percentage that also says which way is worse:

- ``+15`` (latency, e.g. ``ttft_ms_p50``): worse when the current value is more than 15 % above
  the baseline;
- ``-10`` (throughput, e.g. ``decode_tokens_per_s``): worse when it is more than 10 % below.

The baseline is either one named run, or the median of the last N comparable runs. With N runs
the baseline also has a spread (their min..max): a current value inside that spread is noise,
never a regression, however far from the median it lies. (The same rule as "is the change
larger than run-to-run variation" in continuous-benchmarking tools such as asv and Bencher;
min..max is the conservative choice for the small N a nightly audit has.)

The metrics a threshold may name, their worse direction and the default thresholds are in
:mod:`tasks.metrics`. Plain functions; no MLflow, no Prefect.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

# Which metrics a threshold may name, and the defaults, live in the registry (re-exported).
from tasks.metrics import DEFAULT_THRESHOLDS_PCT, is_known_metric

__all__ = [
    "DEFAULT_THRESHOLDS_PCT",
    "MetricVerdict",
    "baseline_from_runs",
    "is_known_metric",
    "judge_metric",
    "verdict",
    "verdict_markdown",
]


@dataclass(frozen=True)
class MetricVerdict:
    """One metric's comparison. ``change_pct`` is (current - baseline) / baseline x 100."""

    metric: str
    baseline: float | None
    current: float | None
    change_pct: float | None
    threshold_pct: float
    spread_min: float | None
    spread_max: float | None
    regressed: bool
    note: str

    def to_row(self) -> dict:
        return asdict(self)


def baseline_from_runs(
    runs: Sequence[Mapping[str, float]], metric: str
) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of a metric over baseline runs that have it; Nones when none do."""
    values = [
        float(run[metric])
        for run in runs
        if metric in run and run[metric] is not None and math.isfinite(float(run[metric]))
    ]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def judge_metric(
    metric: str,
    current: float | None,
    baseline: float | None,
    threshold_pct: float,
    spread: tuple[float | None, float | None] = (None, None),
) -> MetricVerdict:
    """Compare one metric (see the module docstring for the rule)."""
    low, high = spread

    def unjudged(reason: str) -> MetricVerdict:  # no relative change can be computed
        return MetricVerdict(metric, baseline, current, None, threshold_pct, low, high, False, reason)

    if current is None or baseline is None:
        return unjudged("missing in the current run" if current is None else "no baseline")
    if baseline == 0:
        return unjudged("baseline is 0: no relative change")
    change_pct = (current - baseline) / abs(baseline) * 100.0
    beyond = change_pct > threshold_pct if threshold_pct >= 0 else change_pct < threshold_pct
    inside_spread = low is not None and high is not None and low <= current <= high
    if beyond and inside_spread:
        return MetricVerdict(
            metric,
            baseline,
            current,
            change_pct,
            threshold_pct,
            low,
            high,
            False,
            "beyond threshold but inside the baseline's spread (noise)",
        )
    note = "regression" if beyond else "ok"
    return MetricVerdict(metric, baseline, current, change_pct, threshold_pct, low, high, beyond, note)


def verdict(
    current: Mapping[str, float],
    baseline_runs: Sequence[Mapping[str, float]],
    thresholds_pct: Mapping[str, float],
) -> list[MetricVerdict]:
    """Judge every thresholded metric against the baseline run(s).

    One baseline run: its value, no spread. Several: their median, with min..max as spread.

    Raises:
        ValueError: no baseline runs.
    """
    if not baseline_runs:
        raise ValueError("no baseline runs to compare with")
    rows = []
    for metric, threshold in thresholds_pct.items():
        median, low, high = baseline_from_runs(baseline_runs, metric)
        spread = (low, high) if len(baseline_runs) > 1 else (None, None)
        rows.append(judge_metric(metric, current.get(metric), median, threshold, spread))
    return rows


def verdict_markdown(rows: Sequence[MetricVerdict], baseline_label: str) -> str:
    """The verdict as a markdown table (for MLflow and the Prefect artifact)."""
    regressed = any(row.regressed for row in rows)
    lines = [
        f"# Regression verdict: {'REGRESSION' if regressed else 'no regression'}",
        "",
        f"Baseline: {baseline_label}",
        "",
        "| metric | baseline | current | change | threshold | baseline spread | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def num(value):
        return "n/a" if value is None else f"{value:,.3f}"

    for row in rows:
        change = "n/a" if row.change_pct is None else f"{row.change_pct:+.1f} %"
        spread = "n/a" if row.spread_min is None else f"{num(row.spread_min)} .. {num(row.spread_max)}"
        lines.append(
            f"| {row.metric} | {num(row.baseline)} | {num(row.current)} | {change} | "
            f"{row.threshold_pct:+.0f} % | {spread} | {row.note} |"
        )
    return "\n".join(lines) + "\n"
