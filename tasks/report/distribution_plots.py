"""The sampler's view as a PNG (matplotlib, Agg backend): one bar chart per decode step (rows)
and temperature (columns) of the top next tokens' probabilities, the tokens the tightest top_p
nucleus keeps in a darker colour. Takes the rows of
:meth:`tasks.sweep.distribution.StepDistribution.to_dict`. Imports only matplotlib (through :mod:`tasks.report.plots`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.report.plots import plt  # matplotlib.pyplot (Agg), imported at the first plot

__all__ = ["sampler_view"]


def _piece(text: str) -> str:
    """A token piece readable as a tick label: escapes shown (``\\n``), leading space as ``␣``."""
    shown = repr(text)[1:-1].replace(" ", "␣")
    return shown if len(shown) <= 12 else shown[:11] + "…"


def sampler_view(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write the grid (steps x temperatures) to ``path`` and return it.

    Raises:
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("sampler_view needs at least one step distribution")
    steps = sorted({r["step"] for r in rows})
    temps = sorted({r["temperature"] for r in rows})
    cell = {(r["step"], r["temperature"]): r for r in rows}
    fig, axes = plt.subplots(
        len(steps), len(temps), figsize=(4.2 * len(temps), 2.9 * len(steps)), squeeze=False
    )
    for i, step in enumerate(steps):
        for j, t in enumerate(temps):
            ax, row = axes[i][j], cell.get((step, t))
            if row is None:
                ax.set_axis_off()
                continue
            # the tightest nucleus (smallest top_p) is the one worth seeing; top_p 1 keeps all
            tight = min(row["nucleus"], key=lambda n: n["top_p"], default=None)
            kept = tight["tokens"] if tight else len(row["top"])
            probs = [top["probability"] for top in row["top"]]
            colours = ["tab:blue" if k < kept else "lightsteelblue" for k in range(len(probs))]
            ax.bar(range(len(probs)), probs, color=colours)
            ax.set_xticks(
                range(len(probs)), [_piece(top["piece"]) for top in row["top"]], rotation=90, fontsize=6
            )
            ax.set_ylim(0, 1)
            nucleus = f", top_p {tight['top_p']:g} keeps {tight['tokens']}" if tight else ""
            ax.set_title(f"step {step}, T={t:g}: H={row['entropy_bits']:.2f} bits{nucleus}", fontsize=8)
            if j == 0:
                ax.set_ylabel("probability")
    fig.suptitle("next-token distribution (greedy path; dark = in the nucleus)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
