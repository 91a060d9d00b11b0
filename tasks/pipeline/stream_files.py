"""What the stream stage draws and logs once a level, or the stage, is measured: the level's
histograms and timeline on its child run, then its end; the load curves and every level's
histograms on the stage's run.

Each function takes the tracker first and plain values after, so that
``tasks.tracking.writer.run_job`` can run it in the tracking writer process, off the command's
timed path, or here and now when there is none. Imports neither prefect nor the stream client
(the writer imports this module while the command starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.pipeline.timeline import log_timeline
from tasks.report import plots as plots_module
from tasks.stream.level_figures import Level
from tasks.tracking import Tracker

__all__ = ["level_files", "stage_plots"]


def level_files(
    tracker: Tracker, run_id: str | None, level: Level, slice_s: float, workdir: str, end_time_ms: int | None
) -> None:
    """On the level's child run ``run_id``: ``plots/level<N>_ttft_hist.png`` and
    ``_itl_hist.png`` (``tasks.report.plots.level_histograms``), the timeline
    (``tasks.pipeline.timeline.log_timeline``: step series, CSV, plot), then the run's end at
    ``end_time_ms`` (Unix ms; the level's last measured completion). The files go under
    ``workdir``'s ``plots/`` and ``timeline/``."""
    folder = Path(workdir)
    if tracker.enabled:
        for hist in plots_module.level_histograms(level.to_dict(), folder / "plots", f"level{level.level}"):
            tracker.log_artifact(run_id, hist, "plots")
    log_timeline(tracker, run_id, level, slice_s, folder / "timeline")
    tracker.end_run(run_id, end_time_ms=end_time_ms)


def stage_plots(
    tracker: Tracker,
    run_id: str | None,
    levels: Sequence[dict[str, Any]],
    folder: str,
    level_plots: Sequence[str],
) -> None:
    """On the stage's run ``run_id``, under ``plots/``: the load curves of ``levels``
    (``{"max_concurrency", "request_rate", "metrics"}`` each; ``tasks.report.plots.load_curves``,
    written into ``folder``), then ``level_plots`` (the levels' histograms, already written)."""
    if tracker.enabled:
        for path in (*plots_module.load_curves(levels, folder), *map(Path, level_plots)):
            tracker.log_artifact(run_id, path, "plots")
