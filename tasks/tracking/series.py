"""Step series with timestamps of their own: one MLflow step per row, stamped with the row's
instant (a level's timeline windows, ``tasks.pipeline.timeline``).

:meth:`tasks.tracking.Tracker.log_metric_series` stamps steps now (or counts back over
durations); a timeline's steps each have a wall time of their own, so they are sent here as
plain ``[key, value, timestamp_ms, step]`` entries through the tracker's batch
(:meth:`~tasks.tracking.Tracker.send_batch`), journaled like its other writes when the tracking
server is gone (``infermeter sync`` sends them later). Apart from ``tasks.tracking`` (which is
at its size limit); it imports no mlflow itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tasks.tracking import MAX_METRICS_PER_BATCH, Tracker
from tasks.tracking.values import chunks


def step_entries(
    rows: Sequence[Mapping[str, Any]], stamps_ms: Sequence[float], prefix: str = ""
) -> list[list[Any]]:
    """``[prefix + key, value, timestamp_ms, step]`` for every finite number of every row (row i
    is step i, stamped ``stamps_ms[i]``); None, NaN, inf and text are left out (a gap in the
    series). Booleans are 0 / 1."""
    entries: list[list[Any]] = []
    for step, (row, stamp) in enumerate(zip(rows, stamps_ms, strict=True)):
        for key, value in row.items():
            if isinstance(value, bool):
                value = int(value)
            if isinstance(value, (int, float)) and math.isfinite(value):
                entries.append([f"{prefix}{key}", float(value), int(round(stamp)), step])
    return entries


def log_step_rows(
    tracker: Tracker,
    run_id: str | None,
    rows: Sequence[Mapping[str, Any]],
    stamps_ms: Sequence[float],
    prefix: str = "",
) -> int:
    """Log each row as one step of every key it holds (:func:`step_entries`) on ``run_id``;
    returns the number of entries sent (0 when tracking is off or there is no run)."""
    if not (tracker.enabled and run_id):
        return 0
    entries = step_entries(rows, stamps_ms, prefix)
    for batch in chunks(entries, MAX_METRICS_PER_BATCH):
        fields = {"run_id": run_id, "metrics": batch, "params": [], "tags": []}
        tracker._write("log_batch", fields, lambda batch=batch: tracker.send_batch(run_id, batch, [], []))
    return len(entries)
