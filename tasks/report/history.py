"""An endpoint's audit history: every audit's headline figures with their intervals, in order,
segmented at its change points; the baseline a verdict takes from it.

The history of an audit is the finished audits of the same endpoint and model (the identity
tags of :mod:`tasks.report.baseline`) with the same workload, oldest first. Per headline metric
it is a run-level series (each audit's logged figure and its ``_ci_low`` / ``_ci_high``), whose
change points (:mod:`tasks.stats.changepoint`) cut it into segments of one normal each. A
verdict's baseline is the stable stretch since the last confirmed change point
(:func:`tasks.stats.changepoint.choose_baseline`), not a rolling median: a regressed audit does
not join the normal until later audits confirm the shift.

Reads runs as :class:`tasks.tracking.Tracker` run dicts; plain functions otherwise (no MLflow
import here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tasks.stats.changepoint import Segment, change_points, segments
from tasks.stats.stretch import BaselineChoice, choose_baseline
from tasks.stats.verdict import RunSpread

#: The run tag that holds an audit's overall verdict (regressed / improved / unchanged /
#: inconclusive / incomparable); audits logged before it have only ``regression`` = true/false.
VERDICT_TAG = "verdict"
#: The verdicts that mark an audit as off its normal (left out of baselines until confirmed).
JUDGED_OFF = ("regressed", "improved")
#: z of a 95 % interval: a logged interval's half-width over this is the figure's standard error.
_Z95 = 1.959963984540054


def run_verdict(tags: Mapping[str, str]) -> str | None:
    """An audit's overall verdict from its tags; ``regression`` = true (before the ``verdict``
    tag) reads as regressed; None when it was never judged."""
    if tags.get(VERDICT_TAG):
        return tags[VERDICT_TAG]
    return "regressed" if tags.get("regression") == "true" else None


@dataclass(frozen=True)
class AuditPoint:
    """One audit in a history: its run, when it started (epoch ms), its overall verdict, and its
    logged metrics (headline figures and their ``_ci_low`` / ``_ci_high``)."""

    run_id: str
    name: str
    start_time_ms: int
    verdict: str | None
    metrics: Mapping[str, float]

    @classmethod
    def from_run(cls, run: Mapping[str, Any]) -> AuditPoint:
        """From a :class:`tasks.tracking.Tracker` run dict."""
        return cls(
            run["run_id"],
            run.get("name") or "",
            int(run.get("start_time_ms") or 0),
            run_verdict(run.get("tags") or {}),
            dict(run.get("metrics") or {}),
        )

    def figure(self, metric: str) -> tuple[float, float | None, float | None]:
        """(value, interval low, interval high) of ``metric``; NaN when the audit lacks it."""
        value = self.metrics.get(metric)
        low, high = self.metrics.get(f"{metric}_ci_low"), self.metrics.get(f"{metric}_ci_high")
        return (float("nan") if value is None else float(value)), low, high

    @property
    def started(self) -> str:
        """The start as ``YYYY-MM-DD HH:MM`` UTC."""
        return datetime.fromtimestamp(self.start_time_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M")


@dataclass(frozen=True)
class MetricHistory:
    """One metric's run-level series over a history: ``values`` (NaN where an audit lacks it),
    ``half_widths`` of their intervals (None where not logged), the ``change_points`` (indices
    where a segment starts) and the ``segments`` with their means."""

    metric: str
    values: tuple[float, ...]
    lows: tuple[float | None, ...]
    highs: tuple[float | None, ...]
    change_points: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def half_widths(self) -> tuple[float | None, ...]:
        return tuple(
            None if low is None or high is None else (high - low) / 2
            for low, high in zip(self.lows, self.highs)
        )


@dataclass(frozen=True)
class History:
    """An endpoint's audits, oldest first, with each requested metric's series."""

    audits: tuple[AuditPoint, ...]
    metrics: Mapping[str, MetricHistory]

    def __len__(self) -> int:
        return len(self.audits)

    def with_audit(self, audit: AuditPoint) -> History:
        """This history with ``audit`` appended (the audit being judged), its change points
        found again."""
        runs = [
            {
                "run_id": a.run_id,
                "name": a.name,
                "start_time_ms": a.start_time_ms,
                "tags": {VERDICT_TAG: a.verdict} if a.verdict else {},
                "metrics": a.metrics,
            }
            for a in (*self.audits, audit)
        ]
        return build(runs, list(self.metrics))

    def baseline(self, *, min_runs: int = 3, max_runs: int = 10) -> BaselineChoice:
        """The verdict's baseline over this history (:func:`tasks.stats.changepoint.choose_baseline`)."""
        return choose_baseline(
            {m: h.values for m, h in self.metrics.items()},
            {m: h.half_widths for m, h in self.metrics.items()},
            [a.verdict for a in self.audits],
            min_runs=min_runs,
            max_runs=max_runs,
        )

    def run_spread(self, metric: str, cuts: Sequence[int | None] = ()) -> RunSpread | None:
        """How much whole audits differ on ``metric``, net of their own sampling noise: the
        pooled standard deviation of ``log(figure / its segment's geometric mean)`` over the
        segments (audits judged regressed or improved left out), minus the mean squared standard
        error of the log figure (from each logged 95 % interval), on ``n - segments`` degrees of
        freedom (the one-way random-effects moment estimate: Searle, Casella & McCulloch,
        *Variance Components*, 1992, sec. 3.5). None with fewer than 2 degrees of freedom.

        ``cuts``: more segment starts than the metric's own change points: the baseline choice's
        confirmed change points (:meth:`baseline`, found on all metrics together; every one, not
        only the last: after a step up and back the raised stretch is otherwise pooled with the
        normal runs while this metric's own E-Divisive has not cut it yet). A step that
        this metric's own E-Divisive missed (10 audits, a x1.43 step: missed in 14 of 18 series of
        TTFT p50, ITL p90 and TPOT in 6 such histories at sigma 0.25, before the weak level of
        :mod:`tasks.stats.changepoint`) would otherwise count as run-to-run spread (18-26 % where
        the runs differ by 5 %)."""
        history = self.metrics.get(metric)
        if history is None:
            return None
        size = len(history.values)
        points = sorted({*history.change_points, *(int(c) for c in cuts if c is not None and 0 < c < size)})
        squares, n, groups, noise = 0.0, 0, 0, []
        for segment in segments(history.values, points) if points else history.segments:
            logs = []
            for i in range(segment.start, segment.stop):
                value, low, high = history.values[i], history.lows[i], history.highs[i]
                if not (math.isfinite(value) and value > 0) or self.audits[i].verdict in JUDGED_OFF:
                    continue
                logs.append(math.log(value))
                if low is not None and high is not None and low > 0 and high > 0:
                    noise.append(((math.log(high) - math.log(low)) / (2 * _Z95)) ** 2)
            if len(logs) >= 2:
                mean = sum(logs) / len(logs)
                squares += sum((x - mean) ** 2 for x in logs)
                n, groups = n + len(logs), groups + 1
        df = n - groups
        if df < 2:
            return None
        within = sum(noise) / len(noise) if noise else 0.0
        return RunSpread(math.sqrt(max(0.0, squares / df - within)), df, f"the audit history ({n} audits)")


def build(runs: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> History:
    """A :class:`History` of ``runs`` (Tracker run dicts, oldest first) for ``metrics``, with
    each metric's change points (interval widths taken into account)."""
    audits = tuple(AuditPoint.from_run(run) for run in runs)
    out: dict[str, MetricHistory] = {}
    for metric in metrics:
        figures = [a.figure(metric) for a in audits]
        values = tuple(f[0] for f in figures)
        lows, highs = tuple(f[1] for f in figures), tuple(f[2] for f in figures)
        halves = [None if lo is None or hi is None else (hi - lo) / 2 for _, lo, hi in figures]
        points = tuple(change_points(values, halves)) if len(values) >= 2 else ()
        out[metric] = MetricHistory(metric, values, lows, highs, points, tuple(segments(values, points)))
    return History(audits, out)
