"""The workload flags shared by `stream` and `capacity` (shared prefixes, conversations, the
prefix cache's isolation, repeated levels) and their checks before any request: a bad file exits 2 with one
line naming the file and the first bad row."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from flows.shared.common import fail_input

#: The chat template's tokens per turn (the role markers of a user and an assistant message)
#: and at its opening (a default system prompt), for the context check, with some room:
#: SmolLM2's template puts 30 tokens around a first turn and 11 more around each later one.
TEMPLATE_TOKENS_PER_TURN = 12
TEMPLATE_TOKENS_OPENING = 48

PrefixGroupsOption = Annotated[
    Optional[int],
    typer.Option(help="Shared-prefix workload: this many groups (with --prefix-len and --input-len)."),
]
PrefixLenOption = Annotated[
    Optional[int], typer.Option(help="Tokens of each group's shared prefix (then --input-len of its own).")
]
PrefixPopularityOption = Annotated[
    Optional[str], typer.Option(help="How requests pick a group: uniform (default) or zipf:S.")
]
TurnsOption = Annotated[
    Optional[int],
    typer.Option(
        help="Synthetic conversations of N turns of --input-len tokens each, the history live; "
        "--num-requests then counts conversations, --max-concurrency users."
    ),
]
ThinkTimeOption = Annotated[
    Optional[float], typer.Option(help="A conversation's pause after each reply, seconds (default 0).")
]
ThinkTimeDistOption = Annotated[
    Optional[str], typer.Option(help="Think times: fixed (default) or exponential (of that mean, seeded).")
]
KeepCacheOption = Annotated[
    bool, typer.Option("--keep-cache", help="Keep the server's prefix cache between levels (no reset).")
]
RepeatsOption = Annotated[
    Optional[int],
    typer.Option(
        help="Run each level N times in a row, each a fresh start (own warm-up, cache reset); "
        "figures pooled, the repeats' spread beside them."
    ),
]
SaltOption = Annotated[
    Optional[int], typer.Option(help="Salt of the random prompt tokens (default: drawn per run).")
]


def workload_overrides(
    *,
    prefix_groups: int | None,
    prefix_len: int | None,
    prefix_popularity: str | None,
    turns: int | None,
    think_time_s: float | None,
    think_time_dist: str | None,
    keep_cache: bool,
    salt: int | None,
) -> dict[str, Any]:
    """The stream config's fields the shared workload flags set (None: the config's own)."""
    return {
        "prefix_groups": prefix_groups,
        "prefix_len": prefix_len,
        "prefix_popularity": prefix_popularity,
        "turns": turns,
        "think_time_s": think_time_s,
        "think_time_dist": think_time_dist,
        "keep_cache": keep_cache or None,
        "salt": salt,
    }


def check_dataset(
    cfg: Any, other_source: Any = None, *, allow_trace: bool = True, num_requests_given: bool = True
) -> None:
    """Exit 2 when ``cfg.stream.dataset`` (a stream-shaped flow config's) is given with another
    prompt source (``other_source`` truthy: --prompt / --prompts / --input-len), or names a file
    of the wrong shape or without a usable row (``tasks.workload.datasets.read_rows``). A ShareGPT
    file also goes through vLLM's length filter here, under the tokenizer the run will count
    with (the endpoint's, as ``tasks.endpoint.spec.open_endpoint`` picks it), so a file whose every
    row fails it exits 2 before the run, naming the first such row. A trace (``mooncake:`` /
    ``trace:``) is read whole here, each row against the embedded server's context; where the
    command cannot replay one (``allow_trace`` False: capacity searches rates) it exits 2. A
    trace sends its first ``cfg.stream.num_requests`` rows: with ``num_requests_given`` False
    (neither --num-requests nor the config's file set it) it is set here to the row count, so
    every row is sent; a number above the row count exits 2."""
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
    if stream.turns and context is not None:
        # each turn's two messages carry the chat template's few tokens, and the template may
        # open with a system prompt: a margin, so that the last turn does not fail on the context
        turn = stream.input_len + (stream.output_len or stream.max_tokens)
        longest = stream.turns * (turn + TEMPLATE_TOKENS_PER_TURN) + TEMPLATE_TOKENS_OPENING
        if longest > context:
            fail_input(
                f"--turns: {stream.turns} turns of {stream.input_len} input + "
                f"{stream.output_len or stream.max_tokens} output tokens (and the chat template's "
                f"about {longest - stream.turns * turn}) = {longest} by the last turn, longer than "
                f"the embedded server's context ({context}); fewer or shorter turns"
            )
    if not stream.dataset:
        return
    if other_source:
        fail_input("--dataset: the dataset replaces --prompt/--prompts/--input-len; give one of them")
    from tasks.workload.datasets import DatasetError, build_workload, read_rows
    from tasks.workload.trace import KINDS, TraceError, read_trace

    kind, _, path = stream.dataset.partition(":")
    if kind == "sharegpt-multiturn":
        from tasks.models.sources import load_tokenizer
        from tasks.workload.conversation import read_sessions

        default = "gguf:default" if cfg.endpoint.base_url else cfg.server.model
        try:
            read_sessions(path, load_tokenizer(cfg.endpoint.tokenizer or default), count=1)
        except DatasetError as exc:
            fail_input(str(exc))
        return
    if kind in KINDS:  # a trace: every row checked, against the embedded server's context
        if not allow_trace:
            fail_input(
                f"--dataset {kind}: a trace sets its own send times; replay it with `infermeter stream`"
            )
        try:
            rows = read_trace(kind, path, max_context=context)
        except TraceError as exc:
            fail_input(str(exc))
        if not num_requests_given:
            stream.num_requests = len(rows)
        elif stream.num_requests > len(rows):
            from tasks.workload.stage import trace_too_short

            fail_input(trace_too_short(stream.dataset, len(rows), stream.num_requests))
        return
    try:
        kind, _, _ = read_rows(stream.dataset)
        if kind == "sharegpt":
            from tasks.models.sources import load_tokenizer

            default = "gguf:default" if cfg.endpoint.base_url else cfg.server.model
            build_workload(stream.dataset, load_tokenizer(cfg.endpoint.tokenizer or default), count=1)
    except DatasetError as exc:
        fail_input(str(exc))
