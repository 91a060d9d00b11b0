"""`--task-runner` and `--compare-workers` of `infermeter sweep` / `infermeter profile`: where
a stage's points run (tasks/pipeline/fanout.py), and the same sweep on 1 and on N Dask workers
side by side."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from flows.shared.common import fail_input
from flows.tables.common import console, fmt_value, make_table

TaskRunnerOption = Annotated[
    Optional[str],
    typer.Option(
        help="Where the points run: threads (default), dask (a Dask LocalCluster, one worker per "
        "core), dask:N (N workers) or dask:ADDRESS (e.g. dask:tcp://10.0.0.5:8786).",
    ),
]

#: the points' own figures the comparison shows, per worker count
_FIGURES = {"ttft_ms_mean": "TTFT ms", "e2e_ms_mean": "E2E ms", "output_tokens_mean": "tokens"}

NOT_COMPARABLE = (
    "Timings of points that ran at the same time on a shared CPU are not comparable: with N "
    "workers on this machine each point competes with N-1 others for the cores (and Dask "
    "workers run torch with 1 thread); wall time is the figure that fan-out changes."
)


def check_task_runner(value: str | None, flag: str = "--task-runner") -> None:
    """Exit 2 with one line when ``value`` is not a task runner, or names a Dask scheduler
    where nothing listens (a TCP connect, seconds), before anything is measured."""
    from tasks.pipeline.fanout import check_task_runner as check

    try:
        check(value)
    except ValueError as exc:
        fail_input(f"{flag}: {exc}")


def compare_workers(counts: list[int], run: Callable[[str], dict]) -> list[dict[str, Any]]:
    """Run the sweep once per worker count (``run("dask:N")`` returns the flow's result) and
    return ``[{"workers", "wall_s", "points", "error"}]``; wall time from before the cluster
    starts until the flow returns (seconds, ``perf_counter``)."""
    rows = []
    for n in counts:
        started = time.perf_counter()
        result = run(f"dask:{n}")
        rows.append(
            {
                "workers": n,
                "wall_s": round(time.perf_counter() - started, 2),
                "points": result["points"],
                "error": result["error"],
            }
        )
    return rows


def print_comparison(rows: list[dict[str, Any]]) -> None:
    """Wall time per worker count, then each point's figures under each count, then the note
    that concurrent timings on a shared CPU are not comparable."""
    walls = make_table(
        "sweep on Dask workers", [("workers", "right"), ("wall s", "right"), ("failed", "right")]
    )
    for row in rows:
        failed = sum(1 for p in row["points"] if p["status"] == "failed")
        walls.add_row(str(row["workers"]), f"{row['wall_s']:.1f}", str(failed))
    console.print(walls)
    columns = [("T", "right"), ("top_p", "right")]
    columns += [(f"{header} ({row['workers']}w)", "right") for header in _FIGURES.values() for row in rows]
    table = make_table("points' own figures, per worker count", columns)
    for i, point in enumerate(rows[0]["points"]):
        cells = [fmt_value(point.get("temperature"), ",.3g"), fmt_value(point.get("top_p"), ",.3g")]
        for key in _FIGURES:
            cells += [fmt_value(row["points"][i].get(key), ",.4g") for row in rows]
        table.add_row(*cells)
    console.print(table)
    console.print(NOT_COMPARABLE, highlight=False)
