"""Recorded traces replayed at their recorded times (Mooncake JSONL, plain timestamped JSONL,
Azure's LLM inference CSV).

Formats, in time order:

- ``mooncake:PATH`` (Mooncake's published traces, FAST'25), one JSON object per line:
  ``timestamp`` (ms since the trace's start), ``input_length`` and ``output_length`` (tokens),
  ``hash_ids``: one id per 512-token block of the prompt, ``ceil(input_length / 512)`` of them
  (fewer cannot cover the prompt, more name blocks it does not have: both refused); requests
  that share a hash id share that block's tokens. Ids are Python integers of any size (an id
  above 2**32 is its own block: dynamo PR #12046 merged prompts by a u32 cast).
- ``trace:PATH``: ``timestamp``, ``input_length``, ``output_length`` per line (no sharing).
- ``azure:PATH`` (Azure's public LLM inference traces, 2023/2024): CSV with the header
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` a date and time such as
  ``2023-11-16 18:15:46.6805900`` (up to 9 fractional digits, kept exactly as integer
  nanoseconds: inference-perf PR #782 fixed timestamps cut to two digits, which turned 1-11 ms
  gaps into a burst), offsets taken from the first row; ``ContextTokens`` is the input length,
  ``GeneratedTokens`` the output length (no sharing).

The unit: a JSONL ``timestamp`` is in milliseconds. A trace whose timestamps have fractions and
whose mean gap is under 1 ms (more than 1,000 requests/s as milliseconds: the look of one
written in seconds, ``0, 0.5, 1.0``) is refused, naming the field and the fix (multiply by
1000), rather than replayed 1000 times too fast.

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

import calendar
import csv
import io
import json
import math
import random
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tasks.textfile import read_utf8

#: Tokens per Mooncake hash block.
BLOCK_TOKENS = 512
KINDS = ("mooncake", "trace", "azure")
#: Azure's CSV header (``azure:PATH``).
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?")


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file, the row and the field."""


@dataclass(frozen=True)
class TraceRow:
    """One recorded request: its line number in the file (1-based), ``timestamp_ms`` (an Azure
    row's: ms after the first row, from integer nanoseconds), its ``input_length`` and
    ``output_length`` in tokens, and its ``hash_ids`` (Mooncake)."""

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
            cache share (``tasks.endpoint.cache.expected_cached_token_fraction``).
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
        kind: ``mooncake``, ``trace`` or ``azure`` (module docstring).
        path: the JSONL file, or the CSV file for ``azure`` (UTF-8).
        max_context: the model's context length in tokens, when known: a row whose
            ``input_length + output_length`` exceeds it is refused.

    Raises:
        TraceError: missing file, bytes that are not UTF-8, no row, a line that is not a JSON
            object (a CSV row without Azure's three fields), a field missing or of the wrong
            type, timestamps that go backwards, a row longer than the context, Mooncake
            ``hash_ids`` that do not match ``input_length``'s 512-token blocks, timestamps that
            look like seconds (module docstring); the message names the file, the row (but for
            the unit, a property of the whole trace) and the field.
    """
    if kind not in KINDS:
        raise TraceError(f"--dataset: unknown trace kind {kind!r}; use one of {', '.join(KINDS)}")
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"--dataset {kind}:{path}: file not found")
    text = read_utf8(path, TraceError, "--dataset")
    if kind == "azure":
        return _azure_rows(path, text, max_context)
    rows: list[TraceRow] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            rows.append(_row(kind, path, number, line, rows[-1] if rows else None, max_context))
    if not rows:
        raise TraceError(f"--dataset {kind}:{path}: no row; write one JSON object per line")
    _check_unit(kind, path, rows)
    return rows


def _check_unit(kind: str, path: Path, rows: list[TraceRow]) -> None:
    """Refuse timestamps that look like seconds: fractions, and a mean gap under 1 ms."""
    if len(rows) < 2 or all(float(r.timestamp_ms).is_integer() for r in rows):
        return
    span_ms = rows[-1].timestamp_ms - rows[0].timestamp_ms
    if span_ms < len(rows) - 1:
        raise TraceError(
            f"--dataset {kind}:{path}: field 'timestamp' is in milliseconds, but these look like "
            f"seconds ({len(rows)} rows over {span_ms:g} ms with fractions: more than 1,000 "
            f"requests/s); multiply every timestamp by 1000 (e.g. 0.5 s -> 500)"
        )


def _azure_rows(path: Path, text: str, max_context: int | None) -> list[TraceRow]:
    """Azure's CSV (module docstring): offsets from the first row, in integer nanoseconds."""
    where = f"--dataset azure:{path}"
    reader = csv.reader(io.StringIO(text.removeprefix("\ufeff")))
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != AZURE_HEADER:
        raise TraceError(
            f"{where}: row 1: the header is {header!r}; write {','.join(AZURE_HEADER)} "
            "(Azure's LLM inference trace)"
        )
    rows: list[TraceRow] = []
    first_ns = previous_ns = None
    for values in reader:
        number = reader.line_num
        if not values or not "".join(values).strip():
            continue
        at = f"{where}: row {number}"
        if len(values) != 3:
            raise TraceError(f"{at}: {len(values)} fields; write TIMESTAMP,ContextTokens,GeneratedTokens")
        stamp_ns = _azure_ns(values[0].strip())
        if stamp_ns is None:
            raise TraceError(
                f"{at}: field 'TIMESTAMP' {values[0]!r} is not a date and time; write it like "
                "2023-11-16 18:15:46.6805900"
            )
        if previous_ns is not None and stamp_ns < previous_ns:
            raise TraceError(f"{at}: field 'TIMESTAMP' goes backwards; sort the trace by TIMESTAMP")
        lengths = []
        for name, value in zip(AZURE_HEADER[1:], values[1:], strict=True):
            try:
                count = int(value.strip())
            except ValueError:
                count = 0
            if count < 1:
                raise TraceError(f"{at}: field {name!r} must be an integer >= 1, got {value!r}")
            lengths.append(count)
        if max_context is not None and sum(lengths) > max_context:
            raise TraceError(
                f"{at}: field 'ContextTokens' + 'GeneratedTokens' = {sum(lengths)} tokens is longer "
                f"than the model's context ({max_context}); drop or shorten the row"
            )
        first_ns = stamp_ns if first_ns is None else first_ns
        previous_ns = stamp_ns
        rows.append(TraceRow(number, (stamp_ns - first_ns) / 1e6, lengths[0], lengths[1]))
    if not rows:
        raise TraceError(f"{where}: no row; write one request per line after the header")
    return rows


def _azure_ns(text: str) -> int | None:
    """``2023-11-16 18:15:46.6805900`` -> nanoseconds since the epoch (UTC), exactly (the
    fraction's digits read as an integer, never through a float)."""
    match = _AZURE_TIME.fullmatch(text)
    if match is None:
        return None
    try:
        moment = datetime.strptime(match.group(1).replace("T", " "), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    seconds = calendar.timegm(moment.timetuple())  # read as UTC: only the differences count
    return seconds * 1_000_000_000 + int((match.group(2) or "").ljust(9, "0"))


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
        blocks = -(-data["input_length"] // BLOCK_TOKENS)
        if len(ids) != blocks:
            fix = (
                "cannot cover it: give one id per block"
                if len(ids) < blocks
                else "names blocks the prompt does not have: drop the extra ids"
            )
            raise TraceError(
                f"{where}: field 'hash_ids' has {len(ids)} ids for 'input_length' "
                f"{data['input_length']} ({blocks} blocks of {BLOCK_TOKENS} tokens); it {fix}, or "
                "correct 'input_length'"
            )
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
