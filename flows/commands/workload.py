"""Checks of the workload flags (``--dataset``) shared by `stream` and `capacity`, before any
request: a bad file exits 2 with one line naming the file and the first bad row."""

from __future__ import annotations

from typing import Any

from flows.commands.common import fail_input


def check_dataset(stream: Any, other_source: Any = None) -> None:
    """Exit 2 when ``stream.dataset`` (a ``StreamConfig``'s) is given with another prompt
    source (``other_source`` truthy: --prompt / --prompts / --input-len), or names a file of
    the wrong shape or without a usable row (``tasks.stream.datasets.read_rows``). The
    tokenizer-dependent ShareGPT length filter runs in the stage (a file whose every row fails
    it ends the run with the first such row named)."""
    if not stream.dataset:
        return
    if other_source:
        fail_input("--dataset: the dataset replaces --prompt/--prompts/--input-len; give one of them")
    from tasks.stream.datasets import DatasetError, read_rows

    try:
        read_rows(stream.dataset)
    except DatasetError as exc:
        fail_input(str(exc))
