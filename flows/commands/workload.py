"""Checks of the workload flags (``--dataset``) shared by `stream` and `capacity`, before any
request: a bad file exits 2 with one line naming the file and the first bad row."""

from __future__ import annotations

from typing import Any

from flows.commands.common import fail_input


def check_dataset(cfg: Any, other_source: Any = None) -> None:
    """Exit 2 when ``cfg.stream.dataset`` (a stream-shaped flow config's) is given with another
    prompt source (``other_source`` truthy: --prompt / --prompts / --input-len), or names a file
    of the wrong shape or without a usable row (``tasks.stream.datasets.read_rows``). A ShareGPT
    file also goes through vLLM's length filter here, under the tokenizer the run will count
    with (the endpoint's, as ``tasks.endpoint.open_endpoint`` picks it), so a file whose every
    row fails it exits 2 before the run, naming the first such row."""
    stream = cfg.stream
    if not stream.dataset:
        return
    if other_source:
        fail_input("--dataset: the dataset replaces --prompt/--prompts/--input-len; give one of them")
    from tasks.stream.datasets import DatasetError, build_workload, read_rows

    try:
        kind, _, _ = read_rows(stream.dataset)
        if kind == "sharegpt":
            from tasks.models import load_tokenizer

            default = "gguf:default" if cfg.endpoint.base_url else cfg.server.model
            build_workload(stream.dataset, load_tokenizer(cfg.endpoint.tokenizer or default), count=1)
    except DatasetError as exc:
        fail_input(str(exc))
