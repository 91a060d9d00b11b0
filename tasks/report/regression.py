"""Regression verdicts: is this run worse than its baseline, beyond threshold and noise?

Two rules. Where both sides kept their samples (``samples.parquet``, :mod:`tasks.stats.samples`)
the verdict is a test: per metric the change with its confidence interval and one of
``regressed`` / ``improved`` / ``unchanged`` / ``inconclusive``, Holm across the metrics
(:mod:`tasks.stats.verdict` has the rule and its sources). Where a side has none (a baseline
logged before samples were kept, an unreadable artifact), the rule below, the *legacy rule*,
and each row says so.

The legacy rule:

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
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

# Which metrics a threshold may name, and the defaults, live in the registry (re-exported).
from tasks.metrics import DEFAULT_THRESHOLDS_PCT, headline, is_known_metric
from tasks.stats import tails
from tasks.stats import verdict as test
from tasks.stats.samples import Samples

#: The per-request families whose tail is tested as a whole (a row ``<family>_tail``, judged when
#: the thresholds name the family's figure at the tail test's quantile, e.g. ``ttft_ms_p90``).
TAIL_FAMILIES = ("ttft_ms",)

__all__ = [
    "DEFAULT_THRESHOLDS_PCT",
    "MetricVerdict",
    "baseline_from_runs",
    "counts",
    "counts_text",
    "is_known_metric",
    "judge_metric",
    "overall",
    "verdict",
    "verdict_markdown",
]


@dataclass(frozen=True)
class MetricVerdict:
    """One metric's comparison. ``change_pct`` is (current - baseline) / baseline x 100;
    ``change_pct_ci_low`` / ``_high`` its confidence interval (None under the legacy rule);
    ``verdict`` one of ``regressed``, ``improved``, ``unchanged``, ``inconclusive``; ``rule``
    ``samples`` (the test) or ``legacy`` (median and spread, no interval)."""

    metric: str
    baseline: float | None
    current: float | None
    change_pct: float | None
    threshold_pct: float
    spread_min: float | None
    spread_max: float | None
    regressed: bool
    note: str
    change_pct_ci_low: float | None = None
    change_pct_ci_high: float | None = None
    verdict: str = "unchanged"
    p_value: float | None = None
    rule: str = "legacy"
    #: the run-to-run spread the test used (:meth:`tasks.stats.spread.RunSpread.to_dict`: its
    #: percent, degrees of freedom and their source: the prior, the history); None: none
    run_spread: dict | None = None

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
        return MetricVerdict(
            metric, baseline, current, None, threshold_pct, low, high, False, reason, verdict="inconclusive"
        )

    if current is None or baseline is None:
        return unjudged("missing in the current run" if current is None else "no baseline")
    if not (math.isfinite(current) and math.isfinite(baseline)):
        return unjudged("not a finite figure")
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
            verdict="inconclusive",
        )
    better = change_pct < -threshold_pct if threshold_pct >= 0 else change_pct > -threshold_pct
    kind = "regressed" if beyond else "improved" if better else "unchanged"
    note = "regression" if beyond else "ok"
    return MetricVerdict(
        metric, baseline, current, change_pct, threshold_pct, low, high, beyond, note, verdict=kind
    )


def verdict(
    current: Mapping[str, float],
    baseline_runs: Sequence[Mapping[str, float]],
    thresholds_pct: Mapping[str, float],
    current_samples: Samples | None = None,
    baseline_samples: Sequence[Samples | None] = (),
    confidence: float = 0.95,
    resamples: int = test.DEFAULT_RESAMPLES,
    spreads: Mapping[str, test.RunSpread] | None = None,
    client_bound: bool = False,
) -> list[MetricVerdict]:
    """Judge every thresholded metric against the baseline run(s).

    The test (:mod:`tasks.stats.verdict`) when ``current_samples`` and one ``baseline_samples``
    per baseline run are all given; else the legacy rule (one baseline run: its value, no
    spread; several: their median, with min..max as spread), its rows' notes saying so. Either
    way the baseline figure is the median of the runs' logged values. ``spreads``: per metric,
    how much whole runs differ as the audit history and its prior know it
    (:class:`tasks.stats.spread.RunSpread`, :meth:`tasks.report.history.History.run_spreads`).
    ``client_bound``: the current run's measured stream level was flagged client-bound
    (``tasks.stream.quality``): its stream figures that moved read inconclusive
    (:func:`client_limited`).

    Raises:
        ValueError: no baseline runs.
    """
    if not baseline_runs:
        raise ValueError("no baseline runs to compare with")
    medians = {metric: baseline_from_runs(baseline_runs, metric) for metric in thresholds_pct}
    samples_kept = (  # an empty samples file (a run without stream or profile) keeps nothing
        bool(current_samples) and len(baseline_samples) == len(baseline_runs) and all(baseline_samples)
    )
    if not samples_kept:
        rows = []
        for metric, threshold in thresholds_pct.items():
            median, low, high = medians[metric]
            spread = (low, high) if len(baseline_runs) > 1 else (None, None)
            row = judge_metric(metric, current.get(metric), median, threshold, spread)
            rows.append(replace(row, note=row.note + "; legacy rule (a side kept no samples)"))
        return client_limited(rows) if client_bound else rows
    pooled: Samples = {}
    for samples in baseline_samples:
        for group, units in (samples or {}).items():
            pooled.setdefault(group, []).extend(units)
    changes: dict[str, test.Change | str] = {}
    legacy: dict[str, MetricVerdict] = {}  # metrics no samples define: the legacy rule, said so
    for metric, threshold in thresholds_pct.items():
        value, base = current.get(metric), medians[metric][0]
        if test.estimator(metric) is None:
            median, low, high = medians[metric]
            spread = (low, high) if len(baseline_runs) > 1 else (None, None)
            row = judge_metric(metric, value, median, threshold, spread)
            legacy[metric] = replace(row, note=row.note + "; legacy rule (no samples define this metric)")
            continue
        if value is None or base is None or base == 0:
            changes[metric] = (
                "missing in the current run"
                if value is None
                else "no baseline value"
                if base is None
                else "baseline is 0"
            )
            continue
        est = test.estimator(metric)
        group = est.group if est else ""
        changes[metric] = test.change(
            metric,
            float(value),
            float(base),
            (current_samples or {}).get(group, []),
            pooled.get(group, []),
            confidence=confidence,
            resamples=resamples,
            # one seed per group: a group's metrics share their draws (the same requests and
            # whole-run draws: their joint distribution, tasks.stats.verdict.max_t_adjusted),
            # another group's are independent of them
            seed=zlib.crc32(group.encode()),
            spread=(spreads or {}).get(metric),
        )
    tail_thresholds: dict[str, float] = {}
    for family in TAIL_FAMILIES:  # a tail that moved only a minority of the requests
        figure = f"{family}_p{100 * tails.DEFAULT_QUANTILE:g}"
        threshold = thresholds_pct.get(figure)
        if threshold is None or not current_samples:
            continue
        shift = tails.tail_shift(
            (current_samples or {}).get("stream", []),
            pooled.get("stream", []),
            family,
            tails.DEFAULT_QUANTILE,
        )
        if isinstance(shift, tails.TailShift):
            changes[f"{family}_tail"], tail_thresholds[f"{family}_tail"] = shift, threshold
    rows = []
    every = {**thresholds_pct, **tail_thresholds}
    for judged in test.judge(changes, {m: every[m] for m in changes}, confidence):
        if judged.tail is not None:
            t = judged.tail
            rows.append(
                MetricVerdict(
                    judged.metric, t.baseline_value, t.current_value, t.change_pct, every[judged.metric],
                    None, None, judged.verdict == "regressed", judged.note, None, None, judged.verdict,
                    min(t.p_worse, t.p_better), "samples",
                )
            )  # fmt: skip
            continue
        c = judged.change
        median, low, high = medians[judged.metric]
        value = current.get(judged.metric)
        rows.append(
            MetricVerdict(
                judged.metric,
                median,
                None if value is None else float(value),
                None if c is None else c.change_pct,
                thresholds_pct[judged.metric],
                low if len(baseline_runs) > 1 else None,
                high if len(baseline_runs) > 1 else None,
                judged.verdict == "regressed",
                judged.note,
                None if c is None else c.ci_low,
                None if c is None else c.ci_high,
                judged.verdict,
                None if c is None else c.p_value,
                "samples",
                None if c is None or c.spread is None else c.spread.to_dict(),
            )
        )
    by_metric = {row.metric: row for row in rows} | legacy
    out = [by_metric[metric] for metric in [*thresholds_pct, *tail_thresholds]]
    return client_limited(out) if client_bound else out


#: Why a stream figure that moved is not judged when the current level was client-bound.
CLIENT_BOUND_NOTE = (
    "but the client was the bottleneck (the measured level is flagged client-bound): its stream "
    "figures describe the client as much as the server; measure again with more "
    "--client-processes or on a quieter machine"
)


def client_limited(rows: Sequence[MetricVerdict]) -> list[MetricVerdict]:
    """``rows`` with each stream figure (the stream stage's headline, and the tails) that read
    regressed or improved made inconclusive, its note saying what it read and why: a level the
    client could not keep up with (its chunks coalesced, or its event loop lagged) measured the
    client, so neither its slowdown nor its speed-up is the server's (vLLM #21104's lesson: a
    client that falls behind reports a slower server)."""
    out = []
    for row in rows:
        stream = row.metric in headline("stream") or row.metric.endswith("_tail")
        if stream and row.verdict in ("regressed", "improved"):
            row = replace(
                row,
                verdict="inconclusive",
                regressed=False,
                note=f"{row.verdict} by its figures, {CLIENT_BOUND_NOTE}; {row.note}",
            )
        out.append(row)
    return out


def overall(rows: Sequence[MetricVerdict]) -> str:
    """The audit's one word: ``regressed`` (any metric regressed), else ``improved`` (any
    improved), else ``unchanged`` (every judged metric unchanged; judged = a change could be
    computed: a p99 with too few requests for it is not judged), else ``inconclusive``. Never
    "ok" when nothing was settled."""
    kinds = [row.verdict for row in rows]
    if "regressed" in kinds:
        return "regressed"
    if "improved" in kinds:
        return "improved"
    judged = [row.verdict for row in rows if row.change_pct is not None]
    return "unchanged" if judged and all(k == "unchanged" for k in judged) else "inconclusive"


def counts(rows: Sequence[MetricVerdict]) -> dict[str, int]:
    """How many metrics got each verdict class, in :data:`tasks.stats.verdict.VERDICTS` order."""
    return {kind: sum(row.verdict == kind for row in rows) for kind in test.VERDICTS}


def counts_text(rows: Sequence[MetricVerdict]) -> str:
    """``2 regressed, 0 improved, 6 unchanged, 2 inconclusive``."""
    return ", ".join(f"{n} {kind}" for kind, n in counts(rows).items())


def verdict_markdown(rows: Sequence[MetricVerdict], baseline_label: str, confidence: float = 0.95) -> str:
    """The verdict as a markdown table (for MLflow and the Prefect artifact): the overall word
    with the counts per class, then every judged metric with baseline, current, change and its
    interval, threshold, and verdict class."""
    test_rows = [r for r in rows if r.rule == "samples"]
    rule = "a test on the samples: bootstrap intervals, Holm across metrics (docs/DESIGN.md)"
    if not test_rows:
        rule = "legacy rule: median and spread, no intervals"
    elif len(test_rows) < len(rows):
        rule += "; rows noted 'legacy rule' are judged by the median and spread"
    lines = [
        f"# Regression verdict: {overall(rows)} ({counts_text(rows)})",
        "",
        f"Baseline: {baseline_label}",
        "",
        f"Rule: {rule}",
        "",
        f"| metric | baseline | current | change | {100 * confidence:g} % interval | threshold | baseline spread "
        "| verdict | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def num(value):
        return "n/a" if value is None else f"{value:,.3f}"

    for row in rows:
        change = "n/a" if row.change_pct is None else f"{row.change_pct:+.1f} %"
        interval = (
            "n/a"
            if row.change_pct_ci_low is None
            else f"{row.change_pct_ci_low:+.1f} .. {row.change_pct_ci_high:+.1f} %"
        )
        spread = "n/a" if row.spread_min is None else f"{num(row.spread_min)} .. {num(row.spread_max)}"
        lines.append(
            f"| {row.metric} | {num(row.baseline)} | {num(row.current)} | {change} | {interval} | "
            f"{row.threshold_pct:+g} % | {spread} | {row.verdict} | {row.note} |"
        )
    return "\n".join(lines) + "\n"
