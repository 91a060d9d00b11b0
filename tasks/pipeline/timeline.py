"""A finished level's timeline on its MLflow run: the windows of ``tasks.stream.timeline`` as
step series (one step per window, stamped with the window's start in wall time), the windows
and the raw gauge samples as CSV, and the stacked plot (``tasks.report.timeline_plot``).

On the level's child run:

- metrics ``timeline_<figure>`` per step (``timeline_ttft_ms_p50``, ``timeline_itl_ms_mean``,
  ``timeline_output_tokens_per_s``, ``timeline_requests_in_flight``,
  ``timeline_server_vllm_num_requests_running`` ..., ``timeline_window_partial`` 0/1;
  ``tasks.metrics.timeline``), and the scalars ``timeline_windows``, ``timeline_slice_s``,
  ``timeline_gauge_samples``, ``timeline_gauge_interval_ms_p50``;
- artifacts ``timeline/level<N>_timeline.png``, ``timeline/level<N>_windows.csv`` (every
  window's row, ``window_start_ns`` on the client's monotonic clock and ``window_start_unix_ms``)
  and ``timeline/level<N>_gauges.csv`` (every sample, where the server has ``/metrics``).

Used by every command whose levels have child runs (``tasks.pipeline.stream``: stream and the
audit; ``tasks.pipeline.capacity``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from tasks.report.plots import level_rate_label
from tasks.report.timeline_plot import timeline_plot
from tasks.stats import percentile
from tasks.stream.timeline import level_timeline, sample_rows, wall_offset_ms
from tasks.tracking import Tracker
from tasks.tracking.series import log_step_rows

if TYPE_CHECKING:  # the level's module imports the client (openai), which the tracking
    # writer process that draws the timeline does not need
    from tasks.stream.level_figures import Level

#: The prefix of every timeline metric.
PREFIX = "timeline_"
#: Row keys kept out of the step series (the index is the step; ns are not a figure).
_NOT_LOGGED = ("window", "window_start_ns")


def log_timeline(
    tracker: Tracker, run_id: str | None, level: Level, slice_s: float, folder: Path
) -> list[Path]:
    """Log ``level``'s timeline of ``slice_s``-second windows on ``run_id`` (module docstring);
    the files go under ``folder`` first. Returns the files written (none when tracking is off
    or the level measured nothing)."""
    windows = level_timeline(level.records, level.gauges, slice_s)
    if not (tracker.enabled and run_id and windows):
        return []
    offset_ms = wall_offset_ms()
    rows = [w.to_row() for w in windows]
    stamps = [w.start_ns / 1e6 + offset_ms for w in windows]
    series = [{k: v for k, v in row.items() if k not in _NOT_LOGGED} for row in rows]
    log_step_rows(tracker, run_id, series, stamps, PREFIX)
    gaps = sorted((b.t_ns - a.t_ns) / 1e6 for a, b in zip(level.gauges, level.gauges[1:]))
    tracker.log_metrics(
        run_id,
        {
            "timeline_windows": len(windows),
            "timeline_slice_s": slice_s,
            "timeline_gauge_samples": len(level.gauges),
            "timeline_gauge_interval_ms_p50": percentile(gaps, 50),
        },
    )
    stem = f"level{level.level}"
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / f"{stem}_windows.csv"]
    table = [{**r, "window_start_unix_ms": stamp} for r, stamp in zip(rows, stamps)]
    pl.DataFrame(table, infer_schema_length=None).write_csv(written[-1])
    samples = sample_rows(level.gauges, windows[0].origin_ns)
    if samples:
        written.append(folder / f"{stem}_gauges.csv")
        pl.DataFrame(samples, infer_schema_length=None).write_csv(written[-1])
    rate = level_rate_label(level.request_rate, level.metrics)
    title = f"level {level.level}: concurrency {level.max_concurrency}, rate {rate}"
    written.append(timeline_plot(rows, samples, folder / f"{stem}_timeline.png", title))
    for path in written:
        tracker.log_artifact(run_id, path, "timeline")
    return written
