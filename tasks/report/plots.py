"""PNG plots of the stream stage (matplotlib, Agg backend: no display needed).

- :func:`level_histograms`: one level's TTFT histogram (one value per successful measured
  request) beside its ITL histogram (every gap between text-carrying chunks, pooled).
- :func:`load_curves`: p50 / p99 of TTFT, ITL, TPOT and E2E (ms) and output tokens/s against
  max_concurrency, one line per request rate (``inf`` for none).
- :func:`token_count_bars`: token count per prompt and tokenizer (the tokenize stage).
- :func:`sweep_vs_temperature`: distinct-1/2, identical fraction and TTFT / E2E means against
  temperature (the sampling sweep).

Both take the stage's JSON shapes (a level is ``{"max_concurrency", "request_rate",
"metrics", "requests"}``; a request is ``RequestRecord.to_json()``), write one PNG and return
its path. Imports only matplotlib and polars.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib import font_manager  # noqa: E402

# Chinese prompts label some charts. Where a CJK font is installed (Debian's fonts-wqy-zenhei,
# Noto CJK) it is added as a fallback after DejaVu Sans; where none is, missing glyphs are drawn
# as boxes instead of being warned about once per character. matplotlib's font cache predates a
# font installed after it was built, so Debian's WenQuanYi file is added by path when missing.
_CJK_NAMES = ("WenQuanYi Zen Hei", "Noto Sans CJK SC", "Noto Sans CJK JP", "Droid Sans Fallback")
_WQY_PATH = Path("/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc")
if not any(f.name in _CJK_NAMES for f in font_manager.fontManager.ttflist) and _WQY_PATH.exists():
    font_manager.fontManager.addfont(str(_WQY_PATH))
_CJK = [f.name for f in font_manager.fontManager.ttflist if f.name in _CJK_NAMES]
# Set where the text is drawn (rc_context), not once at import: another library resetting
# matplotlib's rcParams in the same process must not take the fallback away.
# Fallback works across the names in font.family, not across the font.sans-serif list. (The
# font manager logs a notice per draw that WenQuanYi has no "normal" weight, only "medium".)
logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
_FONTS = {"font.family": ["DejaVu Sans", *dict.fromkeys(_CJK)]}


def rate_label(request_rate: float | None) -> str:
    """``inf`` for None, else the rate without a trailing ``.0`` (``2``, ``0.5``)."""
    if request_rate is None:
        return "inf"
    return f"{request_rate:g}"


def level_histograms(level: dict[str, Any], path: str | Path, bins: int = 40) -> Path:
    """TTFT and ITL histograms (ms) of one level's successful, non-warm-up requests."""
    ok = [r for r in level["requests"] if not r.get("warmup") and r.get("error") is None]
    ttft = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
    itl = [gap for r in ok for gap in (r.get("itl_ms") or [])]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    title = f"max_concurrency={level['max_concurrency']} request_rate={rate_label(level['request_rate'])}"
    for ax, values, name in ((axes[0], ttft, "TTFT"), (axes[1], itl, "ITL (gap between text chunks)")):
        if values:
            ax.hist(values, bins=bins, color="#3a6ea5")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{name.split(' ')[0]} [ms]")
        ax.set_ylabel("count")
        ax.set_title(f"{name}, n={len(values)}")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def load_curves(levels: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """p50 / p99 latencies and output tokens/s against max_concurrency, a line per rate."""
    return _save(load_curves_figure(levels), path)


def _grid(panels: int) -> tuple[Any, list[Any]]:
    """A figure of ``panels`` charts, at most 3 a row, each about 4.6 x 3.4 inches (readable
    in MLflow's artifact viewer, which scales a PNG to its pane's width); unused cells hidden."""
    columns = min(3, panels)
    rows = -(-panels // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[panels:]:
        ax.set_visible(False)
    return fig, flat[:panels]


def _concurrency_axis(ax: Any, values: Sequence[int]) -> None:
    """A linear x axis ticked at the concurrency levels run, written as numbers (1, 4, 16)."""
    ticks = sorted(set(values))
    ax.set_xscale("linear")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("max_concurrency")


def load_curves_figure(levels: Sequence[dict[str, Any]]) -> Any:
    """The figure of :func:`load_curves`: a panel per latency (y from 0) and one for tokens/s,
    against max_concurrency on a linear axis ticked at the levels."""
    rows = [
        {
            "max_concurrency": lv["max_concurrency"],
            "rate": rate_label(lv["request_rate"]),
            **{k: lv["metrics"].get(k) for k in _CURVE_KEYS},
        }
        for lv in levels
    ]
    frame = pl.DataFrame(
        rows, schema={"max_concurrency": pl.Int64, "rate": pl.String, **{k: pl.Float64 for k in _CURVE_KEYS}}
    )
    frame = frame.sort("max_concurrency")
    panels = [
        ("ttft_ms", "TTFT [ms]"),
        ("itl_ms", "ITL [ms]"),
        ("tpot_ms", "TPOT [ms]"),
        ("e2e_ms", "E2E [ms]"),
    ]
    fig, axes = _grid(5)
    for k, ((rate,), group) in enumerate(frame.group_by(["rate"], maintain_order=True)):
        x, color = group["max_concurrency"].to_list(), f"C{k}"
        for ax, (name, label) in zip(axes, panels):
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
        axes[4].plot(x, group["output_tokens_per_s"].to_list(), marker="o", color=color, label=f"rate={rate}")
    axes[4].set_ylabel("output tokens/s")
    for ax in axes:
        _concurrency_axis(ax, frame["max_concurrency"].to_list())
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def token_count_bars(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Token count per prompt (x) and tokenizer (one bar each), from the tokenize stage's rows
    (``{"tokenizer", "text", "token_count", ...}``)."""
    names = list(dict.fromkeys(r["tokenizer"] for r in rows))
    texts = list(dict.fromkeys(r["text"] for r in rows))
    counts = {(r["tokenizer"], r["text"]): r["token_count"] for r in rows}
    width = 0.8 / max(len(names), 1)
    with plt.rc_context(_FONTS), warnings.catch_warnings():
        if not _CJK:  # missing glyphs are drawn as boxes, not warned about one by one
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


def sweep_vs_temperature(points: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Diversity (distinct-1, distinct-2, identical fraction) and latency (TTFT / E2E means, ms)
    against temperature, one line per combination of the other parameters. ``points`` are the
    sweep stage's point dicts (params and metrics side by side); points without figures (failed
    or skipped) are left out."""
    others = ("top_p", "top_k", "seed", "max_tokens")
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        if p.get("identical_fraction") is None:
            continue
        label = " ".join(f"{k}={p.get(k)}" for k in others if p.get(k) is not None)
        groups.setdefault(label, []).append(p)
    panels = [
        ("distinct_1", "distinct-1"),
        ("distinct_2", "distinct-2"),
        ("identical_fraction", "identical fraction"),
        ("ttft_ms_mean", "TTFT mean [ms]"),
        ("e2e_ms_mean", "E2E mean [ms]"),
    ]
    fig, axes = _grid(len(panels))
    for label, group in groups.items():
        group = sorted(group, key=lambda p: p["temperature"])
        for ax, (key, _) in zip(axes, panels):
            ax.plot(
                [p["temperature"] for p in group],
                [p.get(key) for p in group],
                marker="o",
                label=label or "all",
            )
    for ax, (_, name) in zip(axes, panels):
        ax.set_xlabel("temperature")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)  # fractions and times: read from 0
        if not groups:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    if groups:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)
