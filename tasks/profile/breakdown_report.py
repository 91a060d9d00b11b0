"""The breakdown and roofline of profile points as figures, table rows, plots and a verdict:
plain functions over the rows of :meth:`~tasks.profile.result.ProfilePointResult.to_dict`
(keys ``breakdown`` and ``roofline``, present under ``--breakdown``). matplotlib (Agg) only.

- :func:`analysis_metrics`: the flat metrics (names in ``tasks/metrics/registry.py``);
- :func:`breakdown_rows`: one row per phase x part (ms, share);
- :func:`write_analysis`: ``breakdown_shares.png`` (stacked bars: prefill vs mean decode step,
  share per part), ``roofline.png`` (both phases on this device's measured roofline) and the
  Chrome trace as ``trace.json`` (open it in https://ui.perfetto.dev);
- :func:`decode_verdict`: "decode: memory-bound, X GB/s = Y % of measured copy bandwidth".
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["analysis_metrics", "breakdown_rows", "decode_verdict", "write_analysis"]

_PHASE_FIGURES = (
    "flops",
    "bytes",
    "arithmetic_intensity_flop_per_byte",
    "achieved_flop_per_s",
    "achieved_bandwidth_gb_per_s",
    "bandwidth_fraction",
    "compute_fraction",
)


def _ok(row: dict, key: str) -> dict | None:
    part = row.get(key)
    return part if isinstance(part, dict) and not part.get("failed") else None


def analysis_metrics(row: dict[str, Any]) -> dict[str, float]:
    """Flat metrics of a point's breakdown and roofline ({} when it has neither or they
    failed): ``breakdown_<phase>_<part>_ms``, ``breakdown_<phase>_step_ms``, the ceilings, and
    per phase ``<phase>_<figure>`` plus ``<phase>_memory_bound`` (1 / 0)."""
    out: dict[str, float] = {}
    breakdown = _ok(row, "breakdown")
    if breakdown:
        for phase in ("prefill", "decode"):
            table = breakdown[phase]
            out[f"breakdown_{phase}_step_ms"] = table["step_ms"]
            out.update({f"breakdown_{phase}_{p['part']}_ms": p["ms"] for p in table["parts"]})
    roof = _ok(row, "roofline")
    if roof:
        for key in ("copy_bandwidth_gb_per_s", "matmul_flop_per_s", "ridge_flop_per_byte"):
            out[key] = roof[key]
        for phase in ("prefill", "decode"):
            out.update({f"{phase}_{k}": roof[phase][k] for k in _PHASE_FIGURES})
            out[f"{phase}_memory_bound"] = int(roof[phase]["bound"] == "memory-bound")
    return out


def breakdown_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per phase x part: {"phase", "part", "ms", "share", "step_ms", "label"}."""
    breakdown = _ok(row, "breakdown")
    if not breakdown:
        return []
    return [
        {"phase": phase, **part, "step_ms": breakdown[phase]["step_ms"], "label": breakdown["label"]}
        for phase in ("prefill", "decode")
        for part in breakdown[phase]["parts"]
    ]


def decode_verdict(rows: Sequence[dict[str, Any]]) -> str | None:
    """The first point's decode verdict with its numbers, or None (no roofline)."""
    for row in rows:
        roof = _ok(row, "roofline")
        if roof:
            d = roof["decode"]
            return (
                f"decode: {d['bound']}, {d['achieved_bandwidth_gb_per_s']:,.2f} GB/s = "
                f"{100 * d['bandwidth_fraction']:.1f} % of measured copy bandwidth "
                f"({roof['copy_bandwidth_gb_per_s']:,.1f} GB/s); intensity "
                f"{d['arithmetic_intensity_flop_per_byte']:.2f} FLOP/B vs ridge {roof['ridge_flop_per_byte']:.2f}"
            )
    return None


def _shares_plot(breakdown: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    phases = ("prefill", "decode")
    parts = [p["part"] for p in breakdown["prefill"]["parts"]]
    parts += [p["part"] for p in breakdown["decode"]["parts"] if p["part"] not in parts]
    colors = plt.get_cmap("tab20")
    bottoms = [0.0, 0.0]
    for i, name in enumerate(parts):
        shares = [
            next((p["share"] or 0.0 for p in breakdown[ph]["parts"] if p["part"] == name), 0.0)
            for ph in phases
        ]
        ax.bar(phases, shares, bottom=bottoms, label=name, color=colors(i % 20))
        bottoms = [b + s for b, s in zip(bottoms, shares, strict=True)]
    ax.set_ylabel("share of the profiled step")
    ax.set_title(
        f"per-part time ({breakdown['clock']}): prefill {breakdown['prefill']['step_ms']:.2f} ms, "
        f"decode step {breakdown['decode']['step_ms']:.2f} ms",
        fontsize="small",
    )
    ax.legend(fontsize="x-small", bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _roofline_plot(roof: dict, path: Path) -> Path:
    bandwidth = roof["copy_bandwidth_gb_per_s"] * 1e9
    peak = roof["matmul_flop_per_s"]
    phases = [roof["prefill"], roof["decode"]]
    low = min(0.1, *(p["arithmetic_intensity_flop_per_byte"] / 4 for p in phases))
    high = max(
        roof["ridge_flop_per_byte"] * 8, *(p["arithmetic_intensity_flop_per_byte"] * 4 for p in phases)
    )
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [min(peak, x * bandwidth) for x in xs], color="black", label="measured roofline")
    for p, marker in zip(phases, ("o", "s"), strict=True):
        ax.scatter(
            [p["arithmetic_intensity_flop_per_byte"]],
            [p["achieved_flop_per_s"]],
            marker=marker,
            s=60,
            label=f"{p['phase']}: {p['bound']}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(
        f"{roof['device']} {roof['dtype']}: copy {roof['copy_bandwidth_gb_per_s']:,.1f} GB/s, "
        f"matmul {peak / 1e9:,.1f} GFLOP/s",
        fontsize="small",
    )
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_analysis(row: dict[str, Any], folder: Path) -> list[Path]:
    """The point's plots and its trace (copied as ``trace.json``) under ``folder``; returns the
    paths written (none for what is missing or failed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    breakdown = _ok(row, "breakdown")
    if breakdown:
        out.append(_shares_plot(breakdown, folder / "breakdown_shares.png"))
        trace = breakdown.get("trace_path")
        if trace and Path(trace).is_file():
            out.append(Path(shutil.copyfile(trace, folder / "trace.json")))
    roof = _ok(row, "roofline")
    if roof:
        out.append(_roofline_plot(roof, folder / "roofline.png"))
    return out
