"""PNG plots of the local profile stage (matplotlib, Agg backend: no display needed).

:func:`write_profile_plots` takes the sweep's results (:func:`tasks.profile.runner.run_sweep`;
failed points are skipped) and writes five PNGs, one chart (one Axes) each:

- ``prefill_ms_vs_prompt_length.png``: prefill_ms (= local TTFT) against prompt length, a line
  per batch size x dtype (unchunked points);
- ``decode_ms_vs_context_position.png``: each decode step's time against the cache position it
  writes (prompt length + step index), a line per point (unchunked);
- ``memory_vs_sequence_length.png``: KV cache bytes measured after prefill (N positions) and
  after decode (N + T), the GQA-aware formula, and peak memory, against positions held;
- ``ttft_vs_prefill_chunk_size.png``: prefill_ms and peak memory against the prefill chunk size
  (the whole prompt for no chunking), a line per prompt length x batch x dtype.

When the sweep holds more than one max_new_tokens value, every grouping (and each decode line's
label) also splits by it (``T=``). The charts read the points' rows
(:meth:`~tasks.profile.result.ProfilePointResult.to_dict`): they are keyed by the metric names.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tasks.profile.grid import point_label, steps_swept  # noqa: E402
from tasks.profile.result import ProfilePointResult  # noqa: E402

MIB = 2**20
# One chart (one Axes) per PNG, 640 x 420 px at 100 dpi: shown unscaled in MLflow's viewer.
FIGSIZE_IN = (6.4, 4.2)


def _group(rows: Sequence[dict], keys: Sequence[str]) -> dict[str, list[dict]]:
    if steps_swept(rows):
        keys = (*keys, "max_new_tokens")
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[
            " ".join(f"{'T' if k == 'max_new_tokens' else k.split('_')[0]}={row[k]}" for k in keys)
        ].append(row)
    return groups


def _label_axes(ax, xlabel: str, ylabel: str, title: str | None = None, legend: str = "small") -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)  # times and bytes: a bar's height is read from 0, not from the minimum
    if title:
        ax.set_title(title)
    ax.legend(fontsize=legend)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _unchunked(rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if not r.get("prefill_chunk_size")]


def prefill_vs_prompt_length(rows: Sequence[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    for label, group in _group(_unchunked(rows), ("batch_size", "dtype")).items():
        group = sorted(group, key=lambda r: r["prompt_tokens"])
        ax.plot([r["prompt_tokens"] for r in group], [r["prefill_ms"] for r in group], "o-", label=label)
    _label_axes(
        ax, "prompt length [tokens]", "prefill_ms (local TTFT) [ms]", "Prefill time against prompt length"
    )
    return _save(fig, path)


def decode_vs_context_position(rows: Sequence[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    steps = steps_swept(rows)
    for row in _unchunked(rows):
        start = row["prompt_tokens"]
        positions = range(start, start + len(row["decode_ms"]))
        ax.plot(list(positions), row["decode_ms"], ".-", label=point_label(row, steps))
    _label_axes(
        ax,
        "context position written by the step [tokens]",
        "decode_ms per step [ms]",
        "Decode step time against context position (median repeat)",
    )
    return _save(fig, path)


def memory_vs_sequence_length(rows: Sequence[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    for label, group in _group(_unchunked(rows), ("batch_size", "dtype")).items():
        xs, measured, formula = [], [], []
        for r in sorted(group, key=lambda r: r["prompt_tokens"]):
            xs += [r["kv_cache_positions_after_prefill"], r["kv_cache_positions"]]
            measured += [r["kv_cache_bytes_after_prefill"] / MIB, r["kv_cache_bytes"] / MIB]
            formula += [r["kv_cache_bytes_formula_after_prefill"] / MIB, r["kv_cache_bytes_formula"] / MIB]
        line = ax.plot(xs, measured, "o", label=f"KV measured {label}")[0]
        ax.plot(xs, formula, "-", color=line.get_color(), alpha=0.6, label=f"KV formula {label}")
        peak = sorted(group, key=lambda r: r["kv_cache_positions"])
        ax.plot(
            [r["kv_cache_positions"] for r in peak],
            [r["peak_memory_bytes"] / MIB for r in peak],
            "s--",
            color=line.get_color(),
            label=f"peak memory {label}",
        )
    _label_axes(
        ax,
        "positions held in the KV cache [tokens]",
        "memory [MiB]",
        "KV cache and peak memory against sequence length",
        legend="x-small",
    )
    return _save(fig, path)


def _vs_chunk_size(rows: Sequence[dict], path: Path, key: str, scale: float, ylabel: str, title: str) -> Path:
    """``key`` (divided by ``scale``) against the prefill chunk size (the whole prompt for no
    chunking), a line per prompt length x batch x dtype."""
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    for label, group in _group(rows, ("prompt_tokens", "batch_size", "dtype")).items():
        group = sorted(group, key=lambda r: r.get("prefill_chunk_size") or r["prompt_tokens"])
        xs = [r.get("prefill_chunk_size") or r["prompt_tokens"] for r in group]
        ax.plot(xs, [r[key] / scale for r in group], "o-", label=label)
    _label_axes(ax, "prefill chunk size [tokens] (no chunking = prompt length)", ylabel, title)
    return _save(fig, path)


def ttft_vs_chunk_size(rows: Sequence[dict], path: Path) -> Path:
    return _vs_chunk_size(
        rows,
        path,
        "prefill_ms",
        1.0,
        "prefill_ms (local TTFT) [ms]",
        "Chunked prefill: TTFT against chunk size",
    )


def peak_memory_vs_chunk_size(rows: Sequence[dict], path: Path) -> Path:
    return _vs_chunk_size(
        rows,
        path,
        "peak_memory_bytes",
        MIB,
        "peak_memory_bytes [MiB]",
        "Chunked prefill: peak memory against chunk size",
    )


def write_profile_plots(results: Sequence[ProfilePointResult], folder: str | Path) -> list[Path]:
    """Write the five PNGs for the successful points into ``folder``; returns their paths
    (none when no point succeeded)."""
    ok: list[dict[str, Any]] = [r.to_dict() for r in results if not r.failed]
    if not ok:
        return []
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [
        prefill_vs_prompt_length(ok, folder / "prefill_ms_vs_prompt_length.png"),
        decode_vs_context_position(ok, folder / "decode_ms_vs_context_position.png"),
        memory_vs_sequence_length(ok, folder / "memory_vs_sequence_length.png"),
        ttft_vs_chunk_size(ok, folder / "ttft_vs_prefill_chunk_size.png"),
        peak_memory_vs_chunk_size(ok, folder / "peak_memory_vs_prefill_chunk_size.png"),
    ]
