"""Recorded traces replayed at their recorded times (Mooncake JSONL and plain timestamped JSONL).

Formats, one JSON object per line, in time order:

- ``mooncake:PATH`` (Mooncake's published traces, FAST'25): ``timestamp`` (ms since the trace's
  start), ``input_length`` and ``output_length`` (tokens), ``hash_ids``: one id per 512-token
  block of the prompt; requests that share a hash id share that block's tokens.
- ``trace:PATH``: ``timestamp``, ``input_length``, ``output_length`` (no sharing).

The prompts are built from token ids, never by joining strings (joining a shared prefix and a
suffix as text and tokenizing again moves the boundary and breaks sharing: inference-perf PR
#491): block ``h`` is :data:`BLOCK_TOKENS` random token ids drawn from ``random.Random`` seeded by
``(salt, h)`` from :func:`stable_vocab`, so every request naming ``h`` carries the same ids there
and a re-encode gives them back; the prompt is its blocks
in order, cut to ``input_length``, topped up with ids of its own where the blocks fall short, and
decoded once. ``salt`` (the run's seed) changes every block, so a second run with another salt
does not find the first's blocks in a server's prefix cache.

The schedule: request ``i`` is sent ``(timestamp_i - timestamp_0) / 1000 / time_scale`` seconds
after the first (``time_scale`` 2 = twice as fast), whatever the responses do (an open loop, as
AIPerf's fixed-schedule and vLLM's ``timed_trace`` replay).

Imports only the standard library; the tokenizer is passed in (``encode``, ``decode``, ``len()``,
``all_special_ids``).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.textfile import read_utf8

#: Tokens per Mooncake hash block.
BLOCK_TOKENS = 512
KINDS = ("mooncake", "trace")


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file, the row and the field."""


@dataclass(frozen=True)
class TraceRow:
    """One recorded request: its line number in the file (1-based), ``timestamp_ms``, its
    ``input_length`` and ``output_length`` in tokens, and its ``hash_ids`` (Mooncake)."""

    row: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TraceWorkload:
    """A trace ready to send.

    Attributes:
        prompts: one text per request, in send order.
        prompt_tokens: each prompt's token count under the tokenizer (re-encoded, no special
            tokens).
        output_lens: each request's ``output_length`` (sent as its ``max_tokens``, with
            ``ignore_eos``).
        arrival_offsets_s: each request's send time in seconds after the first (0 first).
        recorded_request_rate: requests / (last - first offset) in requests/s; None below 2.
        blocks: each prompt's blocks ``((key, tokens), ...)``: its hash blocks as cut to its
            length (``h<salt>:<id>``), then its own tokens (``r<salt>:<row>``), for the expected
            cache share (``tasks.cache.expected_cached_token_fraction``).
    """

    prompts: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    output_lens: tuple[int, ...]
    arrival_offsets_s: tuple[float, ...]
    recorded_request_rate: float | None
    blocks: tuple[tuple[tuple[str, int], ...], ...]


def _count(value: Any, *, positive: bool) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (value > 0 if positive else value >= 0)


def read_trace(kind: str, path: str | Path, *, max_context: int | None = None) -> list[TraceRow]:
    """The rows of a trace file, checked before any request is sent.

    Args:
        kind: ``mooncake`` or ``trace`` (module docstring).
        path: the JSONL file (UTF-8).
        max_context: the model's context length in tokens, when known: a row whose
            ``input_length + output_length`` exceeds it is refused.

    Raises:
        TraceError: missing file, bytes that are not UTF-8, no row, a line that is not a JSON
            object, a field missing or of the wrong type, timestamps that go backwards, a row
            longer than the context; the message names the file, the row and the field.
    """
    if kind not in KINDS:
        raise TraceError(f"--dataset: unknown trace kind {kind!r}; use one of {', '.join(KINDS)}")
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"--dataset {kind}:{path}: file not found")
    text = read_utf8(path, TraceError, "--dataset")
    rows: list[TraceRow] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            rows.append(_row(kind, path, number, line, rows[-1] if rows else None, max_context))
    if not rows:
        raise TraceError(f"--dataset {kind}:{path}: no row; write one JSON object per line")
    return rows


def _row(
    kind: str, path: Path, number: int, line: str, previous: TraceRow | None, max_context: int | None
) -> TraceRow:
    where = f"--dataset {kind}:{path}: row {number}"
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: not a JSON object")
    stamp = data.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp) or stamp < 0:
        raise TraceError(f"{where}: field 'timestamp' must be a number of ms >= 0, got {stamp!r}")
    if previous is not None and stamp < previous.timestamp_ms:
        raise TraceError(
            f"{where}: field 'timestamp' goes backwards ({stamp} after {previous.timestamp_ms} at row "
            f"{previous.row}); sort the trace by timestamp"
        )
    for key in ("input_length", "output_length"):
        if not _count(data.get(key), positive=True):
            raise TraceError(f"{where}: field {key!r} must be an integer >= 1, got {data.get(key)!r}")
    hash_ids: tuple[int, ...] = ()
    if kind == "mooncake":
        ids = data.get("hash_ids")
        if not isinstance(ids, list) or not ids or not all(_count(h, positive=False) for h in ids):
            raise TraceError(
                f"{where}: field 'hash_ids' must be a non-empty list of integers >= 0, got {ids!r}"
            )
        hash_ids = tuple(ids)
    total = data["input_length"] + data["output_length"]
    if max_context is not None and total > max_context:
        raise TraceError(
            f"{where}: field 'input_length' + 'output_length' = {total} tokens is longer than the "
            f"model's context ({max_context}); drop or shorten the row"
        )
    return TraceRow(number, float(stamp), data["input_length"], data["output_length"], hash_ids)


def stable_vocab(tokenizer: Any) -> list[int]:
    """Token ids that survive a decode and a re-encode next to each other: each decodes to a
    space and lowercase letters (a pre-tokenizer splits there, so a sequence of them re-encodes
    to the same ids) and encodes back to itself. Prompts drawn from them have exactly the length
    asked and share exactly the blocks they name; random ids from the whole vocabulary re-encode
    a few percent longer and can merge across a block's edge.

    Raises:
        ValueError: the tokenizer has fewer than 100 such tokens (not a word-piece vocabulary).
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = []
    for i in range(len(tokenizer)):
        if i in special:
            continue
        text = tokenizer.decode([i])
        if (
            len(text) > 1
            and text[0] == " "
            and text[1:].isascii()
            and text[1:].isalpha()
            and text[1:].islower()
        ):
            if tokenizer.encode(text, add_special_tokens=False) == [i]:
                out.append(i)
    if len(out) < 100:
        raise ValueError(f"the tokenizer has {len(out)} re-encodable word tokens; need 100 to build a trace")
    return out


def build_trace(
    rows: list[TraceRow], tokenizer: Any, *, time_scale: float = 1.0, salt: int = 0
) -> TraceWorkload:
    """The prompts and schedule of a trace (module docstring).

    Args:
        rows: :func:`read_trace`'s.
        tokenizer: a transformers tokenizer.
        time_scale: > 0; 2 replays twice as fast.
        salt: seeds every block's tokens (the run's seed).

    Raises:
        ValueError: ``time_scale`` not > 0.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    vocab = stable_vocab(tokenizer)
    drawn: dict[int, list[int]] = {}
    prompts, counts, keys = [], [], []
    for r in rows:
        ids: list[int] = []
        mine: list[tuple[str, int]] = []
        for h in r.hash_ids:
            if len(ids) >= r.input_length:
                break
            block = drawn.get(h)
            if block is None:
                block = drawn[h] = random.Random(f"{salt}:block:{h}").choices(vocab, k=BLOCK_TOKENS)
            take = block[: r.input_length - len(ids)]
            mine.append((f"h{salt}:{h}", len(take)))
            ids += take
        if len(ids) < r.input_length:
            mine.append((f"r{salt}:{r.row}", r.input_length - len(ids)))
            ids += random.Random(f"{salt}:row:{r.row}").choices(vocab, k=r.input_length - len(ids))
        text = tokenizer.decode(ids, skip_special_tokens=True)
        prompts.append(text)
        counts.append(len(tokenizer.encode(text, add_special_tokens=False)))
        keys.append(tuple(mine))
    start = rows[0].timestamp_ms
    offsets = tuple((r.timestamp_ms - start) / 1000.0 / time_scale for r in rows)
    span = offsets[-1] - offsets[0]
    return TraceWorkload(
        prompts=tuple(prompts),
        prompt_tokens=tuple(counts),
        output_lens=tuple(r.output_length for r in rows),
        arrival_offsets_s=offsets,
        recorded_request_rate=(len(rows) - 1) / span if span > 0 else None,
        blocks=tuple(keys),
    )
