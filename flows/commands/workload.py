"""Checks of the workload flags (``--dataset``) shared by `stream` and `capacity`, before any
request: a bad file exits 2 with one line naming the file and the first bad row."""

from __future__ import annotations

from typing import Any

from flows.commands.common import fail_input


def check_dataset(cfg: Any, other_source: Any = None, *, allow_trace: bool = True) -> None:
    """Exit 2 when ``cfg.stream.dataset`` (a stream-shaped flow config's) is given with another
    prompt source (``other_source`` truthy: --prompt / --prompts / --input-len), or names a file
    of the wrong shape or without a usable row (``tasks.stream.datasets.read_rows``). A ShareGPT
    file also goes through vLLM's length filter here, under the tokenizer the run will count
    with (the endpoint's, as ``tasks.endpoint.open_endpoint`` picks it), so a file whose every
    row fails it exits 2 before the run, naming the first such row. A trace (``mooncake:`` /
    ``trace:``) is read whole here, each row against the embedded server's context; where the
    command cannot replay one (``allow_trace`` False: capacity searches rates) it exits 2."""
    stream = cfg.stream
    context = None if cfg.endpoint.base_url else cfg.server.n_ctx
    if stream.prefix_groups and context is not None:
        longest = stream.prefix_len + stream.input_len + (stream.output_len or stream.max_tokens)
        if longest > context:
            fail_input(
                f"--prefix-len: {stream.prefix_len} prefix + {stream.input_len} own + "
                f"{stream.output_len or stream.max_tokens} output tokens = {longest} is longer than the "
                f"embedded server's context ({context}); shorten them"
            )
    if not stream.dataset:
        return
    if other_source:
        fail_input("--dataset: the dataset replaces --prompt/--prompts/--input-len; give one of them")
    from tasks.stream.datasets import DatasetError, build_workload, read_rows
    from tasks.workload.trace import KINDS, TraceError, read_trace

    kind, _, path = stream.dataset.partition(":")
    if kind in KINDS:  # a trace: every row checked, against the embedded server's context
        if not allow_trace:
            fail_input(
                f"--dataset {kind}: a trace sets its own send times; replay it with `infermeter stream`"
            )
        try:
            read_trace(kind, path, max_context=context)
        except TraceError as exc:
            fail_input(str(exc))
        return
    try:
        kind, _, _ = read_rows(stream.dataset)
        if kind == "sharegpt":
            from tasks.models import load_tokenizer

            default = "gguf:default" if cfg.endpoint.base_url else cfg.server.model
            build_workload(stream.dataset, load_tokenizer(cfg.endpoint.tokenizer or default), count=1)
    except DatasetError as exc:
        fail_input(str(exc))
