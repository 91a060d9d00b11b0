"""The key paths of a JSON document, for comparing `--json` outputs key for key.

``stages.stream.levels[].metrics.ttft_ms_p50``: a dict key is a path segment; a list's elements
share the segment ``[]`` and their keys are merged. Values are not compared (timings differ run
to run); only which keys exist.
"""

from __future__ import annotations

from typing import Any


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path under ``value`` (a parsed JSON document); leaves are not listed."""
    paths: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            paths.add(path)
            paths |= key_paths(inner, path)
    elif isinstance(value, list):
        for inner in value:
            paths |= key_paths(inner, f"{prefix}[]")
    return paths
