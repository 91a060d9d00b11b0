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
from tasks.stats.spread import Deviations, RunSpread, SpreadPrior, shared
from tasks.stats.stretch import BaselineChoice, choose_baseline

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

    def head(self, count: int) -> History:
        """The first ``count`` audits, with the change points found on the whole history (no
        new search: the segmentation known now)."""
        out = {}
        for name, h in self.metrics.items():
            points = tuple(p for p in h.change_points if p < count)
            values = h.values[:count]
            out[name] = MetricHistory(
                name, values, h.lows[:count], h.highs[:count], points, tuple(segments(values, list(points)))
            )
        return History(self.audits[:count], out)

    def spread_learned(self, metrics: Sequence[str], prior: SpreadPrior) -> dict[str, list[RunSpread]]:
        """Per metric, the run-to-run spread known after each audit (:meth:`run_spreads` of the
        first 1, 2, ... audits, cut where that history's baseline choice is: the spread the next
        audit is judged with, given the same ``metrics``): how the estimate moved from the prior to the history's own,
        and from which audit on it is trustworthy (:attr:`tasks.stats.spread.RunSpread.trusted`)."""
        out: dict[str, list[RunSpread]] = {m: [] for m in metrics if m in self.metrics}
        for count in range(1, len(self.audits) + 1):
            head = self.head(count)
            choice = head.baseline()  # the next audit's baseline: its confirmed points cut too
            cuts = choice.change_points or (choice.change_point,)
            known = head.run_spreads(list(out), cuts, prior)
            for metric in out:
                out[metric].append(known[metric])
        return out

    def baseline(self, *, min_runs: int = 3, max_runs: int = 10) -> BaselineChoice:
        """The verdict's baseline over this history (:func:`tasks.stats.changepoint.choose_baseline`)."""
        return choose_baseline(
            {m: h.values for m, h in self.metrics.items()},
            {m: h.half_widths for m, h in self.metrics.items()},
            [a.verdict for a in self.audits],
            min_runs=min_runs,
            max_runs=max_runs,
        )

    def run_spreads(
        self, metrics: Sequence[str], cuts: Sequence[int | None] = (), prior: SpreadPrior = SpreadPrior()
    ) -> dict[str, RunSpread]:
        """How much whole audits differ on each of ``metrics``, net of their own sampling noise,
        learned from the whole history and ``prior`` (:mod:`tasks.stats.spread`): per stage,
        the metrics' log deviations from their segments' means (audits judged regressed or
        improved left out; each audit's noise from its logged 95 % interval) pooled into the
        spread they share.

        The segments: every metric's own change points and ``cuts`` (the baseline choice's
        confirmed change points, :meth:`baseline`), one segmentation for all: a step any metric
        shows, or the choice confirmed, is a segment's end for every metric, so a step is never
        counted as spread (a x1.43 step that one metric's E-Divisive missed had read as 18-26 %
        of spread where runs differ by 5 %)."""
        from tasks.metrics import lookup

        out: dict[str, RunSpread] = {}
        by_stage: dict[str, list[str]] = {}
        for metric in metrics:
            if metric in self.metrics:
                by_stage.setdefault(lookup(metric).stage, []).append(metric)
        size = len(self.audits)
        for names in by_stage.values():
            points = {int(c) for c in cuts if c is not None and 0 < c < size}
            for name in names:
                points.update(self.metrics[name].change_points)
            evidence = [self._deviations(name, sorted(points)) for name in names]
            signs = {name: (1.0 if lookup(name).worse == "higher" else -1.0) for name in names}
            out.update(shared(evidence, prior, signs))
        return out

    def _deviations(self, metric: str, points: Sequence[int]) -> Deviations:
        """``metric``'s log deviations from its segments' means (:class:`tasks.stats.spread.Deviations`)."""
        history = self.metrics[metric]
        size = len(history.values)
        deviations, noise = [math.nan] * size, [math.nan] * size
        df = 0
        for segment in segments(history.values, list(points)) if points else [Segment(0, size, 0.0)]:
            kept = []
            for i in range(segment.start, segment.stop):
                value, low, high = history.values[i], history.lows[i], history.highs[i]
                if not (math.isfinite(value) and value > 0) or self.audits[i].verdict in JUDGED_OFF:
                    continue
                kept.append(i)
                if low is not None and high is not None and low > 0 and high > 0:
                    noise[i] = ((math.log(high) - math.log(low)) / (2 * _Z95)) ** 2
            newest = 0
            if len(kept) >= 2:
                mean = sum(math.log(history.values[i]) for i in kept) / len(kept)
                for i in kept:
                    deviations[i] = math.log(history.values[i]) - mean
                df += len(kept) - 1
                newest = len(kept) - 1
        return Deviations(metric, tuple(deviations), tuple(noise), df, newest)


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
