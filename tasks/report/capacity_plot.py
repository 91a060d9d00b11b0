"""The capacity search's plot: goodput fraction and p99 TTFT / TPOT against the request rate,
the target and the capacity marked (matplotlib, Agg; the backend is set by
``tasks.report.plots``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.report.plots import plt


def capacity_plot(result: dict[str, Any], path: str | Path) -> Path:
    """One PNG of ``CapacityResult.to_dict()``: three panels sharing the rate axis (req/s; a
    level run all at once sits at its measured requests/s), each level a point labelled by kind,
    the SLO limits and the goodput target as dashed lines, the capacity as a vertical line."""
    levels = sorted((lv for lv in result["levels"] if _rate(lv) is not None), key=lambda lv: _rate(lv) or 0.0)
    x = [_rate(lv) for lv in levels]
    panels = [
        ("goodput_fraction", "goodput fraction", result.get("target")),
        ("ttft_ms_p99", "TTFT p99 [ms]", result["slos"].get("ttft_ms")),
        ("tpot_ms_p99", "TPOT p99 [ms]", result["slos"].get("tpot_ms")),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13.8, 3.6))
    capacity = result.get("capacity_requests_per_s")
    for ax, (key, label, limit) in zip(axes, panels):
        y = [lv["metrics"].get(key) for lv in levels]
        ax.plot(x, [v if v is not None else float("nan") for v in y], marker="o", color="C0")
        for xi, yi, lv in zip(x, y, levels):
            if yi is not None:
                ax.annotate(lv["kind"][:4], (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if limit is not None:
            ax.axhline(limit, color="C3", linestyle="--", linewidth=1, label=f"limit {limit:g}")
        if capacity is not None:
            ax.axvline(capacity, color="C2", linewidth=1.5, label=f"capacity {capacity:.3g} req/s")
        ax.set_xlabel("request rate [req/s]")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(f"capacity search: {result['stop_reason'][:110]}", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rate(level: dict[str, Any]) -> float | None:
    rate = level.get("request_rate")
    return rate if rate is not None else level["metrics"].get("requests_per_s")
