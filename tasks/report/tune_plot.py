"""The tune run's plot: every measured level a point (the mean over its repeats, its output
tokens/s interval as a horizontal bar), the Pareto fronts drawn, the best marked, or the points
tied within noise ringed when the rule names none (matplotlib, Agg; the backend is set by
``tasks.report.plots``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tasks.report.plots import plt
from tasks.tune.front import TunePoint, pareto

#: (point attribute, axis label) of the two panels' y axes; x is output tokens/s per instance
PANELS = (
    ("per_user_tokens_per_s", "per-user tokens/s (1000 / TPOT p50)"),
    ("ttft_ms_p99", "TTFT p99 [ms]"),
)


def tune_plot(
    points: Sequence[TunePoint], best: TunePoint | None, path: str | Path, tied: Sequence[TunePoint] = ()
) -> Path:
    """One PNG, two panels sharing the throughput axis: per-user tokens/s and TTFT p99 against
    output tokens/s, a colour per configuration (legend: its parameters), each point labelled by
    its concurrency with its output tokens/s interval over the repeats as an error bar, the
    front as a dashed line through its points, the best as a star, or the ``tied`` points (tied
    within noise: no best named) ringed."""
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.4))
    labels = {p.configuration: p.label for p in points}
    for ax, (attr, ylabel) in zip(axes, PANELS):
        for index, label in labels.items():
            mine = [p for p in points if p.configuration == index and p.output_tokens_per_s is not None]
            mine = [p for p in mine if getattr(p, attr) is not None]
            ax.scatter(
                [p.output_tokens_per_s for p in mine],
                [getattr(p, attr) for p in mine],
                color=f"C{index % 10}",
                label=label[:48],
                zorder=3,
            )
            bars = [p for p in mine if p.output_tokens_per_s_ci_low is not None]
            if bars:  # the interval over the repeats (tasks.tune.rule): how far apart is apart
                ax.errorbar(
                    [p.output_tokens_per_s for p in bars],
                    [getattr(p, attr) for p in bars],
                    xerr=[
                        [p.output_tokens_per_s - p.output_tokens_per_s_ci_low for p in bars],
                        [p.output_tokens_per_s_ci_high - p.output_tokens_per_s for p in bars],
                    ],
                    fmt="none",
                    ecolor=f"C{index % 10}",
                    elinewidth=1,
                    capsize=3,
                    zorder=3,
                )
            for p in mine:
                ax.annotate(
                    f"c={p.max_concurrency}",
                    (p.output_tokens_per_s, getattr(p, attr)),
                    fontsize=7,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        front = pareto(points, attr)
        if front:
            ax.plot(
                [p.output_tokens_per_s for p in front],
                [getattr(p, attr) for p in front],
                linestyle="--",
                color="0.4",
                linewidth=1,
                label="Pareto front",
                zorder=2,
            )
        if best is not None and best.output_tokens_per_s is not None and getattr(best, attr) is not None:
            ax.scatter(
                [best.output_tokens_per_s],
                [getattr(best, attr)],
                marker="*",
                s=220,
                facecolors="none",
                edgecolors="C3",
                linewidths=1.5,
                label="best under SLOs",
                zorder=4,
            )
        ringed = [p for p in tied if p.output_tokens_per_s is not None and getattr(p, attr) is not None]
        if ringed:
            ax.scatter(
                [p.output_tokens_per_s for p in ringed],
                [getattr(p, attr) for p in ringed],
                marker="o",
                s=220,
                facecolors="none",
                edgecolors="C3",
                linewidths=1.5,
                label="tied within noise (no best)",
                zorder=4,
            )
        ax.set_xlabel("output tokens/s per instance")
        ax.set_ylabel(ylabel)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("infermeter tune: each point a level of one server configuration", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
