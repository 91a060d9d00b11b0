"""The profile's records in the run's work folder: each point appended to
``profile_points.jsonl`` the moment it finishes (a crash or Ctrl-C keeps every finished point,
tracked or not), and all points as ``profile_points.json`` at the end. Both hold the rows of
:meth:`~tasks.profile.result.ProfilePointResult.to_dict`. Standard library only."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from tasks.profile.result import ProfilePointResult

__all__ = ["JOURNAL_NAME", "POINTS_NAME", "append_point", "write_points"]

JOURNAL_NAME = "profile_points.jsonl"
POINTS_NAME = "profile_points.json"


def append_point(folder: str | os.PathLike[str], result: ProfilePointResult) -> Path:
    """Append one point's row as a JSON line to ``folder/profile_points.jsonl``, flushed and
    fsynced before returning (values JSON cannot hold are written as ``str``); returns the
    file's path."""
    path = Path(folder) / JOURNAL_NAME
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(result.to_dict(), default=str) + "\n")
        out.flush()
        os.fsync(out.fileno())
    return path


def write_points(folder: str | os.PathLike[str], results: Sequence[ProfilePointResult]) -> Path:
    """Write every point's row to ``folder/profile_points.json`` (a JSON list, indent 1);
    returns the file's path."""
    path = Path(folder) / POINTS_NAME
    rows = [r.to_dict() for r in results]
    path.write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")
    return path
