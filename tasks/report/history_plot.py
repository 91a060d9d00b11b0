"""The audit history's plots (``plots/history_<metric>.png`` on each audit's parent run): one
headline metric over an endpoint's audits, each audit a point with its interval, each segment's
mean a horizontal line, each change point a dashed vertical line, the audit being judged
highlighted (matplotlib, Agg; the backend is set by ``tasks.report.plots``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from tasks.metrics import is_registered, lookup
from tasks.report.history import History
from tasks.report.plots import _fonts, plt

#: Marker colour per audit verdict (an audit never judged: grey).
VERDICT_COLOURS = {"regressed": "C3", "improved": "C2", "unchanged": "C0", "inconclusive": "C1"}


def history_plot(history: History, metric: str, path: str | Path, highlight: int | None = None) -> Path:
    """One PNG of ``metric`` over ``history`` (oldest left); ``highlight``: the index of the
    audit to ring (the one being judged). Raises KeyError when the history lacks the metric."""
    series = history.metrics[metric]
    xs = list(range(len(history)))
    with plt.rc_context(_fonts()):
        fig, ax = plt.subplots(figsize=(8.0, 3.6))
        for i, audit in enumerate(history.audits):
            value = series.values[i]
            if not math.isfinite(value):
                continue
            low, high = series.lows[i], series.highs[i]
            yerr = None if low is None or high is None else [[max(value - low, 0)], [max(high - value, 0)]]
            ax.errorbar(
                [i],
                [value],
                yerr=yerr,
                fmt="o",
                color=VERDICT_COLOURS.get(audit.verdict or "", "0.5"),
                ecolor="0.6",
                capsize=3,
                zorder=3,
            )
        for k, segment in enumerate(series.segments):
            ax.hlines(
                segment.mean,
                segment.start - 0.4,
                segment.stop - 0.6,
                colors="0.25",
                linewidth=1.2,
                label="segment mean" if k == 0 else None,
                zorder=2,
            )
        for k, point in enumerate(series.change_points):
            ax.axvline(
                point - 0.5, color="C3", linestyle="--", linewidth=1, label="change point" if k == 0 else None
            )
        if highlight is not None and 0 <= highlight < len(xs) and math.isfinite(series.values[highlight]):
            ax.scatter(
                [highlight],
                [series.values[highlight]],
                s=260,
                facecolors="none",
                edgecolors="k",
                linewidths=1.5,
                label="this audit",
                zorder=4,
            )
        ax.set_xticks(xs, _tick_labels(history))
        ax.tick_params(axis="x", labelsize=7, rotation=45)
        unit = lookup(metric).unit if is_registered(metric) else ""
        ax.set_ylabel(f"{metric}" + (f" [{unit}]" if unit and unit not in metric else ""))
        ax.set_title(
            f"{metric} over the endpoint's audits (points: verdict colour; bars: intervals)", fontsize=9
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
        plt.close(fig)
    return out


def history_plots(history: History, folder: str | Path, highlight: int | None = None) -> list[Path]:
    """:func:`history_plot` for every metric with at least one value, as
    ``folder/history_<metric>.png``."""
    written: list[Path] = []
    for metric, series in history.metrics.items():
        if any(math.isfinite(v) for v in series.values):
            written.append(history_plot(history, metric, Path(folder) / f"history_{metric}.png", highlight))
    return written


def _tick_labels(history: History) -> Sequence[str]:
    return [f"{a.started[5:]}\n{a.run_id[:6]}" for a in history.audits]
