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

Plain functions; no MLflow, no Prefect.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

#: Defaults: latencies may not grow by more than 15 %, throughputs not drop by more than 10 %.
DEFAULT_THRESHOLDS_PCT: dict[str, float] = {
    "ttft_ms_p50": 15.0,
    "tpot_ms_mean": 15.0,
    "e2e_ms_p50": 15.0,
    "prefill_ms": 15.0,
    "decode_tokens_per_s": -10.0,
    "output_tokens_per_s": -10.0,
}


_STAT_METRICS = {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "decode_ms"}
_STATS = {"mean", "p50", "p90", "p95", "p99", "max"}
_SCALAR_METRICS = {
    "prefill_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "output_tokens_per_s",
    "requests_per_s", "goodput_requests_per_s", "error_rate", "weights_bytes",
    "kv_cache_bytes", "peak_memory_bytes", "token_count_model_total",
}


def is_known_metric(name: str) -> bool:
    """A headline metric a threshold may name: ``<latency>_<stat>`` or a known scalar."""
    base, _, stat = name.rpartition("_")
    return name in _SCALAR_METRICS or (base in _STAT_METRICS and stat in _STATS)


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


def baseline_from_runs(runs: Sequence[Mapping[str, float]], metric: str) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of a metric over baseline runs that have it; Nones when none do."""
    values = [
        float(run[metric]) for run in runs
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
    if current is None or baseline is None:
        return MetricVerdict(metric, baseline, current, None, threshold_pct, low, high, False,
                             "missing in the current run" if current is None else "no baseline")
    if baseline == 0:
        return MetricVerdict(metric, baseline, current, None, threshold_pct, low, high, False,
                             "baseline is 0: no relative change")
    change_pct = (current - baseline) / abs(baseline) * 100.0
    beyond = change_pct > threshold_pct if threshold_pct >= 0 else change_pct < threshold_pct
    inside_spread = low is not None and high is not None and low <= current <= high
    if beyond and inside_spread:
        return MetricVerdict(metric, baseline, current, change_pct, threshold_pct, low, high,
                             False, "beyond threshold but inside the baseline's spread (noise)")
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
