"""Runs side by side: a polars table of chosen runs' params and headline metrics, with each
metric's change against the first run, and a PNG of one metric across runs.

Plain functions over run dicts (as :meth:`tasks.tracking.Tracker.find_runs` returns them).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import polars as pl

from tasks.metrics import COMPARE_DEFAULT_METRICS

#: The metrics shown when none are asked for: the audit's headline, where present (the list
#: lives in the metric registry).
DEFAULT_METRICS = COMPARE_DEFAULT_METRICS
#: Tags shown beside the metrics: what makes two runs different.
CONTEXT_TAGS = ("model", "endpoint_kind", "endpoint_model", "git_commit", "host")
#: A metric's interval ends, logged beside it (``tasks.stats.interval``).
_ENDS = ("ci_low", "ci_high")
#: The columns that go with a metric (dropped when no run has them).
EXTRA_COLUMNS = ("_ci_low", "_ci_high", "_verdict")


def comparison_frame(runs: Sequence[dict], metrics: Sequence[str] | None = None) -> pl.DataFrame:
    """One row per run: run_id, name, start (UTC), context tags, metrics, and for each metric
    ``<metric>_change_pct`` = (value - first run's value) / first run's value x 100; where a run
    logged them, its interval ``<metric>_ci_low`` / ``_ci_high`` and the class its audit's
    verdict gave the metric, ``<metric>_verdict`` (tag ``verdict.<metric>``).

    ``metrics`` None: the default headline metrics that at least one run has.

    Raises:
        ValueError: no runs.
    """
    if not runs:
        raise ValueError("no runs to compare")
    if metrics is None:
        metrics = [m for m in DEFAULT_METRICS if any(m in r["metrics"] for r in runs)]
    rows = []
    for run in runs:
        row = {
            "run_id": run["run_id"],
            "name": run.get("name"),
            "start_utc": datetime.fromtimestamp(run["start_time_ms"] / 1000, UTC).strftime(
                "%Y-%m-%d %H:%M:%S"
            )
            if run.get("start_time_ms")
            else None,
        }
        row.update({tag: run["tags"].get(tag) for tag in CONTEXT_TAGS})
        row.update({m: run["metrics"].get(m) for m in metrics})
        row.update({f"{m}_{end}": run["metrics"].get(f"{m}_{end}") for m in metrics for end in _ENDS})
        row.update({f"{m}_verdict": run["tags"].get(f"verdict.{m}") for m in metrics})
        rows.append(row)
    schema = {"run_id": pl.String, "name": pl.String, "start_utc": pl.String}
    schema.update({tag: pl.String for tag in CONTEXT_TAGS})
    schema.update({m: pl.Float64 for m in metrics})
    schema.update({f"{m}_{end}": pl.Float64 for m in metrics for end in _ENDS})
    schema.update({f"{m}_verdict": pl.String for m in metrics})
    frame = pl.DataFrame(rows, schema=schema)
    frame = frame.drop(
        [c for c in frame.columns if c.endswith(EXTRA_COLUMNS) and frame[c].null_count() == len(frame)]
    )
    changes = []
    for m in metrics:
        first = frame[m][0]
        if first is None or first == 0:
            changes.append(pl.lit(None, dtype=pl.Float64).alias(f"{m}_change_pct"))
        else:
            changes.append(((pl.col(m) - first) / abs(first) * 100).alias(f"{m}_change_pct"))
    return frame.with_columns(changes)


#: What two runs must share for a change between them to compare like with like: the tag, and
#: how the note names it.
LIKE_TAGS = {"flow": "flow", "endpoint_kind": "engine", "endpoint_model": "model", "model": "model"}


def unlike_runs(runs: Sequence[dict]) -> dict[str, list[str]]:
    """What differs between ``runs`` that makes their changes compare unlike measurements: for
    each of :data:`LIKE_TAGS`' names (``flow``, ``engine``, ``model``) whose tag holds more
    than one value among the runs that carry it, those values in the runs' order, each once
    (``{"flow": ["audit", "stream"], "engine": ["llama.cpp", "vllm"]}``); {} when they are
    alike. A run without the tag (a child run, a run from before it) is not judged on it."""
    found: dict[str, list[str]] = {}
    for tag, label in LIKE_TAGS.items():
        values = list(dict.fromkeys(str(r["tags"][tag]) for r in runs if r["tags"].get(tag)))
        if len(values) > 1:
            found.setdefault(label, [])
            found[label] += [v for v in values if v not in found[label]]
    return found


def markdown_table(frame: pl.DataFrame) -> str:
    """The frame as a GitHub markdown table: numbers to 3 decimals, but a column whose every
    value is whole (bytes, counts) as integers."""
    header = "| " + " | ".join(frame.columns) + " |"
    lines = [header, "|" + " --- |" * len(frame.columns)]
    whole = {
        name: all(float(v).is_integer() for v in frame[name] if isinstance(v, float))
        for name in frame.columns
    }
    for row in frame.iter_rows(named=True):
        cells = [
            ""
            if v is None
            else (f"{v:,.0f}" if whole[k] else f"{v:,.3f}")
            if isinstance(v, float)
            else str(v)
            for k, v in row.items()
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_metric(frame: pl.DataFrame, metric: str, path: Path) -> Path:
    """A bar chart of one metric across the runs (in table order), written as PNG.

    Raises:
        KeyError: the metric is not a column of the frame.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if metric not in frame.columns:
        raise KeyError(metric)
    labels = [f"{(n or '')[:18]}\n{r[:8]}" for n, r in zip(frame["name"], frame["run_id"])]
    values = [v if v is not None else 0.0 for v in frame[metric]]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(labels)), 4))
    ax.bar(range(len(values)), values, color="#4C72B0")
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} across runs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
