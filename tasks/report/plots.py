"""PNG plots of the stream stage (matplotlib, Agg backend: no display needed).

- :func:`level_histograms`: one level's TTFT histogram (one value per successful measured
  request) and its ITL histogram (every gap between text-carrying chunks, pooled).
- :func:`load_curves`: p50 / p99 of TTFT, ITL, TPOT and E2E (ms) and output tokens/s against
  max_concurrency, one line per request rate (``inf`` for none), a PNG per metric.
- :func:`token_count_bars`: token count per prompt and tokenizer (the tokenize stage).
- :func:`sweep_vs_temperature`: distinct-1/2, identical fraction and TTFT / E2E means against
  temperature (the sampling sweep), a PNG per metric.

Every PNG holds one chart (one Axes) at :data:`FIGSIZE_IN`; the stream and sweep writers take
a folder and return the paths they wrote. They take the stage's JSON shapes (a level is
``{"max_concurrency", "request_rate", "metrics", "requests"}``; a request is
``RequestRecord.to_json()``). Imports only matplotlib and polars.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

# Chinese prompts label some charts. Where a CJK font is installed (Debian's fonts-wqy-zenhei,
# Noto CJK) it is added as a fallback after DejaVu Sans; where none is, missing glyphs are drawn
# as boxes instead of being warned about once per character. matplotlib's font cache predates a
# font installed after it was built, so Debian's WenQuanYi file is added by path when missing.
_CJK_NAMES = ("WenQuanYi Zen Hei", "Noto Sans CJK SC", "Noto Sans CJK JP", "Droid Sans Fallback")
_WQY_PATH = Path("/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc")


@functools.cache
def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, with the CJK fonts found: imported at the first
    plot, not with this module (0.7 s that a ``--no-track`` command, which draws nothing, does
    not pay)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    from matplotlib import font_manager

    if not any(f.name in _CJK_NAMES for f in font_manager.fontManager.ttflist) and _WQY_PATH.exists():
        font_manager.fontManager.addfont(str(_WQY_PATH))
    # (The font manager logs a notice per draw that WenQuanYi has no "normal" weight, only "medium".)
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    return pyplot


@functools.cache
def _cjk_fonts() -> tuple[str, ...]:
    from matplotlib import font_manager

    _pyplot()
    return tuple(dict.fromkeys(f.name for f in font_manager.fontManager.ttflist if f.name in _CJK_NAMES))


def _fonts() -> dict[str, list[str]]:
    """The font rc to draw text with. Set where the text is drawn (rc_context), not once at
    import: another library resetting matplotlib's rcParams in the same process must not take
    the fallback away. Fallback works across the names in font.family, not across the
    font.sans-serif list."""
    return {"font.family": ["DejaVu Sans", *_cjk_fonts()]}


class _LazyPyplot:
    """``plt`` for this package's plot modules: ``matplotlib.pyplot``, imported on first use."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_pyplot(), name)


plt: Any = _LazyPyplot()


def rate_label(request_rate: float | None) -> str:
    """``inf`` for None, else the rate without a trailing ``.0`` (``2``, ``0.5``)."""
    if request_rate is None:
        return "inf"
    return f"{request_rate:g}"


def level_rate_label(request_rate: float | None, metrics: dict[str, Any] | None = None) -> str:
    """A level's arrivals in words: ``trace`` for a replayed trace (its metrics carry
    ``schedule_faithful``: sent at recorded times, not all at once), else :func:`rate_label`
    (the ``request_rate`` param keeps ``inf``)."""
    if metrics is not None and "schedule_faithful" in metrics:
        return "trace"
    return rate_label(request_rate)


# One chart per PNG at one size: 6.4 x 4.2 inches at 100 dpi = 640 x 420 px, which MLflow's
# artifact viewer shows unscaled; a multi-panel grid was shrunk to its pane's width and its
# labels became unreadable (issue 14).
FIGSIZE_IN = (6.4, 4.2)
DPI = 100


def _figure() -> tuple[Any, Any]:
    """A new figure holding exactly one Axes, at :data:`FIGSIZE_IN`."""
    return plt.subplots(figsize=FIGSIZE_IN)


def save_figures(figures: dict[str, Any], folder: str | Path) -> list[Path]:
    """Write each ``{file name: figure}`` as ``folder/name`` (PNG, :data:`DPI`), close it, and
    return the paths in the dict's order."""
    return [_save(fig, Path(folder) / name) for name, fig in figures.items()]


#: The level histograms, in the order drawn: ``{stem}_<name>_hist.png`` each.
LEVEL_HISTOGRAMS = ("ttft", "itl")


def level_histogram_paths(folder: str | Path, stem: str) -> list[Path]:
    """The PNGs :func:`level_histograms` writes into ``folder`` for ``stem``, in its order."""
    return [Path(folder) / f"{stem}_{name}_hist.png" for name in LEVEL_HISTOGRAMS]


def level_histogram_figures(level: dict[str, Any], stem: str, bins: int = 40) -> dict[str, Any]:
    """``{stem}_ttft_hist.png`` (one TTFT per successful measured request) and
    ``{stem}_itl_hist.png`` (every gap between text-carrying chunks, pooled), in ms
    (:data:`LEVEL_HISTOGRAMS`)."""
    ok = [r for r in level["requests"] if not r.get("warmup") and r.get("error") is None]
    series = {
        "ttft": ([r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None], "TTFT"),
        "itl": ([gap for r in ok for gap in (r.get("itl_ms") or [])], "ITL (gap between text chunks)"),
    }
    rate = level_rate_label(level["request_rate"], level.get("metrics"))
    where = f"max_concurrency={level['max_concurrency']} request_rate={rate}"
    figures = {}
    for key, (values, name) in series.items():
        fig, ax = _figure()
        if values:
            ax.hist(values, bins=bins, color="#3a6ea5")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{name.split(' ')[0]} [ms]")
        ax.set_ylabel("count")
        ax.set_title(f"{name}, n={len(values)}\n{where}", fontsize=10)
        fig.tight_layout()
        figures[f"{stem}_{key}_hist.png"] = fig
    return figures


def level_histograms(level: dict[str, Any], folder: str | Path, stem: str, bins: int = 40) -> list[Path]:
    """Write :func:`level_histogram_figures` into ``folder``; returns the two PNG paths."""
    return save_figures(level_histogram_figures(level, stem, bins), folder)


def _concurrency_axis(ax: Any, values: Sequence[int]) -> None:
    """A linear x axis ticked at the concurrency levels run, written as numbers (1, 4, 16)."""
    ticks = sorted(set(values))
    ax.set_xscale("linear")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("max_concurrency")


# (metric stem in the level's metrics, y label): one load_<stem>.png each; latencies have a
# p50 and a p99 line per request rate, throughput one line per rate.
LOAD_CHARTS = (
    ("ttft_ms", "TTFT [ms]"),
    ("itl_ms", "ITL [ms]"),
    ("tpot_ms", "TPOT [ms]"),
    ("e2e_ms", "E2E [ms]"),
    ("output_tokens_per_s", "output tokens/s"),
)


def load_curves_figures(levels: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``{"load_<metric>.png": figure}`` for each of :data:`LOAD_CHARTS`: the metric against
    max_concurrency on a linear axis ticked at the levels run, y from 0, a line per request
    rate (``inf`` for none); latencies plot p50 (solid) and p99 (dashed)."""
    rows = [
        {
            "max_concurrency": lv["max_concurrency"],
            "rate": level_rate_label(lv["request_rate"], lv["metrics"]),
            **{k: lv["metrics"].get(k) for k in _CURVE_KEYS},
        }
        for lv in levels
    ]
    frame = pl.DataFrame(
        rows, schema={"max_concurrency": pl.Int64, "rate": pl.String, **{k: pl.Float64 for k in _CURVE_KEYS}}
    )
    frame = frame.sort("max_concurrency")
    groups = list(frame.group_by(["rate"], maintain_order=True))
    figures = {}
    for name, label in LOAD_CHARTS:
        fig, ax = _figure()
        for k, ((rate,), group) in enumerate(groups):
            x, color = group["max_concurrency"].to_list(), f"C{k}"
            if name == "output_tokens_per_s":
                ax.plot(x, group[name].to_list(), marker="o", color=color, label=f"rate={rate}")
                continue
            ax.plot(x, group[f"{name}_p50"].to_list(), marker="o", color=color, label=f"p50 rate={rate}")
            ax.plot(
                x,
                group[f"{name}_p99"].to_list(),
                marker="x",
                linestyle="--",
                color=color,
                label=f"p99 rate={rate}",
            )
        ax.set_ylabel(label)
        ax.set_title(f"{label.split(' [')[0]} against max_concurrency")
        _concurrency_axis(ax, frame["max_concurrency"].to_list())
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        fig.tight_layout()
        figures[f"load_{name}.png"] = fig
    return figures


def load_curves(levels: Sequence[dict[str, Any]], folder: str | Path) -> list[Path]:
    """Write :func:`load_curves_figures` into ``folder``; returns the five PNG paths."""
    return save_figures(load_curves_figures(levels), folder)


_CURVE_KEYS = (
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "e2e_ms_p50",
    "e2e_ms_p99",
    "output_tokens_per_s",
)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def token_count_bars(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Token count per prompt (x) and tokenizer (one bar each), from the tokenize stage's rows
    (``{"tokenizer", "text", "token_count", ...}``)."""
    names = list(dict.fromkeys(r["tokenizer"] for r in rows))
    texts = list(dict.fromkeys(r["text"] for r in rows))
    counts = {(r["tokenizer"], r["text"]): r["token_count"] for r in rows}
    width = 0.8 / max(len(names), 1)
    with plt.rc_context(_fonts()), warnings.catch_warnings():
        if not _cjk_fonts():  # missing glyphs are drawn as boxes, not warned about one by one
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font", category=UserWarning)
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(texts) * max(1, len(names) / 2)), 4.2))
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(texts))]
            ax.bar(xs, [counts.get((name, t), 0) for t in texts], width, label=name)
        labels = [t.replace("\n", "⏎") if len(t) <= 18 else t.replace("\n", "⏎")[:16] + "…" for t in texts]
        ax.set_xticks(range(len(texts)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tokens")
        ax.set_title("token count per prompt and tokenizer (no special tokens)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        return _save(fig, path)


# (point key, y label): one sweep_<key>_vs_temperature.png each.
SWEEP_CHARTS = (
    ("distinct_1", "distinct-1"),
    ("distinct_2", "distinct-2"),
    ("identical_fraction", "identical fraction"),
    ("ttft_ms_mean", "TTFT mean [ms]"),
    ("e2e_ms_mean", "E2E mean [ms]"),
)


def sweep_figures(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``{"sweep_<key>_vs_temperature.png": figure}`` for each of :data:`SWEEP_CHARTS`:
    diversity (distinct-1, distinct-2, identical fraction) and latency (TTFT / E2E means, ms)
    against temperature, y from 0, one line per combination of the other parameters.
    ``points`` are the sweep stage's point dicts (params and metrics side by side); points
    without figures (failed or skipped) are left out."""
    others = ("top_p", "top_k", "seed", "max_tokens")
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        if p.get("identical_fraction") is None:
            continue
        label = " ".join(f"{k}={p.get(k)}" for k in others if p.get(k) is not None)
        groups.setdefault(label, []).append(p)
    figures = {}
    for key, name in SWEEP_CHARTS:
        fig, ax = _figure()
        for label, group in groups.items():
            group = sorted(group, key=lambda p: p["temperature"])
            ax.plot(
                [p["temperature"] for p in group],
                [p.get(key) for p in group],
                marker="o",
                label=label or "all",
            )
        ax.set_xlabel("temperature")
        ax.set_ylabel(name)
        ax.set_title(f"{name.split(' [')[0]} against temperature")
        ax.set_ylim(bottom=0)  # fractions and times: read from 0
        if groups:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        figures[f"sweep_{key}_vs_temperature.png"] = fig
    return figures


def sweep_vs_temperature(points: Sequence[dict[str, Any]], folder: str | Path) -> list[Path]:
    """Write :func:`sweep_figures` into ``folder``; returns the five PNG paths."""
    return save_figures(sweep_figures(points), folder)
