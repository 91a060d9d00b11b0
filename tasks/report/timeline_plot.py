"""A level's timeline as one stacked plot (matplotlib, Agg; the backend is set by
``tasks.report.plots``): the client's figures per window above the server's gauges as sampled,
every panel on one time axis (seconds since the level's first measured send, the clock of
``tasks.stream.timeline``), the partial first and last windows of each measured part shaded.

Panels, top to bottom: requests in flight (window mean, and the window's max dotted); TTFT p50
(ms, by the first chunk's arrival); ITL mean and p50 (ms, by the gap's end); output tokens/s;
the server's request gauges (running, waiting ..., each 250 ms sample held until the next); and, where the server
has them, its cache-usage gauges (fraction) with each counter's increase since the level's first
sample (preemptions) on a second axis. Client figures are drawn at each window's midpoint (a gap
where the window had none to measure, and between repeats).

Takes the plain rows of ``Window.to_row()`` and ``tasks.stream.timeline.sample_rows``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tasks.report.plots import DPI, plt

#: The width of every stream PNG (6.4 in at 100 dpi: MLflow's viewer shows it unscaled); each
#: panel gets this height.
WIDTH_IN, PANEL_IN = 6.4, 1.75
_USAGE = ("usage", "perc", "ratio")  # gauge names that are fractions, not request counts
_SAMPLE_KEYS = {"t_s", "t_ns", "fetch_ms"}
_STEPS = {"drawstyle": "steps-post"}  # a sample holds until the next one


def _from_zero(ax: Any) -> None:
    """y from 0 to a little above the largest value drawn (a constant series stays visible)."""
    values = [float(y) for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y)]
    top = max(values, default=0.0)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(window midpoints, values) with NaN for a missing value and between repeats."""
    xs: list[float] = []
    ys: list[float] = []
    for i, row in enumerate(rows):
        if i and row.get("repeat_index") != rows[i - 1].get("repeat_index"):
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append((row["window_start_s"] + row["window_end_s"]) / 2)
        value = row.get(key)
        ys.append(math.nan if value is None else float(value))
    return xs, ys


def timeline_plot(
    rows: Sequence[Mapping[str, Any]],
    samples: Sequence[Mapping[str, Any]],
    path: str | Path,
    title: str,
) -> Path:
    """Draw the stacked timeline of one level (module docstring) to ``path`` (PNG) and return it.

    Args:
        rows: the level's windows (``Window.to_row()``), in order.
        samples: the server's gauge samples (``sample_rows``); empty: the server panel says so.
        title: the figure's title (the level: concurrency and rate).
    """
    names = [k for k in dict.fromkeys(k for s in samples for k in s) if k not in _SAMPLE_KEYS]
    usage = [n for n in names if any(word in n for word in _USAGE)]
    counters = [n for n in names if n.endswith("_total")]
    requests = [n for n in names if n not in usage and n not in counters]
    client = [
        ("requests in flight", [("requests_in_flight", "mean", "-"), ("requests_in_flight_max", "max", ":")]),
        ("TTFT p50 [ms]", [("ttft_ms_p50", "p50", "-")]),
        ("ITL [ms]", [("itl_ms_mean", "mean", "-"), ("itl_ms_p50", "p50", "--")]),
        ("output tokens/s", [("output_tokens_per_s", "tokens/s", "-")]),
    ]
    panels = len(client) + 1 + bool(usage or counters)
    fig, axes = plt.subplots(panels, 1, sharex=True, figsize=(WIDTH_IN, PANEL_IN * panels))
    for ax, (label, lines) in zip(axes, client):
        for key, name, style in lines:
            ax.plot(*_series(rows, key), style, marker="o", markersize=2.5, label=name)
        ax.set_ylabel(label, fontsize=8)
        if len(lines) > 1:
            ax.legend(fontsize=7, loc="upper right")
    ax = axes[len(client)]
    twins: list[Any] = []
    t = [s["t_s"] for s in samples]
    for name in requests:
        ax.plot(t, [math.nan if s.get(name) is None else s[name] for s in samples], label=name, **_STEPS)
    if requests:
        ax.legend(fontsize=6, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no server gauges (no /metrics)", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("server requests", fontsize=8)
    if usage or counters:
        ax = axes[-1]
        for name in usage:
            ax.plot(t, [math.nan if s.get(name) is None else s[name] for s in samples], label=name, **_STEPS)
        ax.set_ylabel("server cache use" if usage else "server counters", fontsize=8)
        if usage:
            ax.legend(fontsize=6, loc="upper left")
        if counters:
            twin = ax.twinx()
            twins.append(twin)
            for name in counters:
                first = next((s[name] for s in samples if s.get(name) is not None), 0.0)
                values = [math.nan if s.get(name) is None else s[name] - first for s in samples]
                twin.plot(t, values, "--", color="C3", label=f"{name} increase", **_STEPS)
            twin.set_ylabel("count", fontsize=8)
            twin.legend(fontsize=6, loc="upper right")
    for ax in (*axes, *twins):
        _from_zero(ax)
    for ax in axes:
        ax.tick_params(labelsize=7)
        for row in rows:
            if row.get("window_partial"):
                ax.axvspan(row["window_start_s"], row["window_end_s"], color="0.85", zorder=0)
    axes[-1].set_xlabel("time since the level's first measured send [s] (grey: partial windows)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
