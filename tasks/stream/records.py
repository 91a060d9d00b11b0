"""The request record, its crash-safe JSONL writer, and its Parquet tables.

One :class:`RequestRecord` per streamed request (DESIGN.md, "Metric definitions"): times in
milliseconds since the client's ``time.perf_counter_ns()`` just before the request was sent.

- ``RecordWriter`` appends one JSON line per finished record and flushes it to the OS at once,
  so a crash of the process keeps every record finished before it; an ``fsync`` per record
  (done by a helper thread, so the event loop that times other streams is not blocked on the
  disk) makes it survive an OS crash too. ``read_jsonl`` reads such a file back, skipping a
  final line cut by the crash.
- ``write_parquet`` writes ``requests.parquet`` (one row per request, ``itl_ms`` as a list
  column) and ``tokens.parquet`` (one row per text-carrying chunk: ``request_id``, ``index``,
  ``offset_ms`` since send, ``gap_ms`` since the previous chunk, null for the first). A chunk
  may carry several tokens; the rows are chunk events, as the ITL definition counts them.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import polars as pl

from tasks.stream.timing import decode_unobserved


@dataclass
class RequestRecord:
    """One streamed request and what was measured of it (times in ms since send).

    Attributes:
        request_id: unique within the run.
        level: index of the load level; max_concurrency: that level's concurrency;
            request_rate: that level's request rate in requests/s (None = inf, all at once).
        warmup: a warm-up request (recorded, left out of the statistics).
        repeat: which run of its level it belongs to (0-based; ``StreamConfig.repeats``).
        send_ns: ``time.perf_counter_ns()`` just before the request was sent (monotonic, ns).
        input_tokens: prompt tokens (the caller's count, else the server's ``usage``).
        ttft_ms: to the first chunk carrying text (content or reasoning); None if none came.
        itl_ms: gaps between successive text-carrying chunks (text chunks - 1 entries).
        tpot_ms: ``(e2e_ms - ttft_ms) / (output_tokens - 1)``; None below 2 output tokens or
            2 text chunks (``tasks.stream.timing.tpot_ms``).
        e2e_ms: to the last text-carrying chunk.
        stream_close_ms: to the end of the stream (after a late usage chunk / ``[DONE]``), or
            to the failure for a failed request.
        output_tokens: from the server's usage (source ``usage``: ``completion_tokens``, plus
            ``reasoning_tokens`` where the usage reports them apart; ``tasks.wire.usage``) or
            the configured tokenizer on the generated text without special tokens (source
            ``tokenizer``); never from a usage count that is not trusted.
        usage_problem: why the server's usage count was not used (0 for a stream with text, not
            a non-negative integer, totals that fit neither reasoning convention); None when it
            was used or none came.
        reasoning_tokens: ``usage.completion_tokens_details.reasoning_tokens`` when sent.
        usage_convention: for a usage with reasoning tokens, whether ``completion_tokens``
            includes them (``included``: OpenAI, vLLM), reports them apart (``separate``),
            ``unverified`` (no totals to decide by) or ``neither`` (flagged, not trusted).
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` when sent, else llama.cpp's
            ``timings.cache_n`` (prompt tokens the server's prefix cache supplied);
            usage_prompt_tokens: ``usage.prompt_tokens`` (else llama.cpp's ``cache_n +
            prompt_n``: the server's count, chat template included), beside the caller's
            ``input_tokens`` (a conversation turn's: the client's count of every message sent).
        output_text: all generated text, reasoning deltas included, in arrival order.
        tool_calls: the tool calls generated, ``{"index", "name", "arguments"}`` each, their
            fragments joined per ``tool_calls[].index`` (their chunks are text chunks).
        refusal: the answer was a refusal (``delta.refusal`` text, the Responses API's
            ``response.refusal.*``): its text is the output and timed as content is.
        decode_unobserved: why the client could not see the decode, so TPOT is None and the
            request neither passes nor fails a TPOT SLO: ``one_token``, ``one_chunk`` or
            ``one_read`` (every chunk arrived at one instant); None when it could
            (``tasks.stream.timing.decode_unobserved``).
        error_class / error_message: None for a success (see ``tasks.wire.errors``).
        error_after_ms: send to the failure (the user's wait for it, e.g. a gateway's 524 after
            1.5 s), for every failed request on either transport; None for a success.
        token_offsets_ms: arrival time of every text-carrying chunk since send, on the clock
            ``arrival_clock`` names.
        arrival_clock: ``kernel`` (each chunk's time is the kernel's receive stamp of the read
            that completed it, ``tasks.wire.rxclock``) or ``user`` (when the event loop read it).
        user_token_offsets_ms: the user-space arrivals beside kernel ones (empty for ``user``).
        clock_fallback: why the arrivals are on the user clock although the kernel's was asked
            for (``tasks.wire.rxclock.kernel_arrivals``' reasons); None otherwise.
        coalesced_events: text chunks that came in the same read as the one before (kernel
            clock only; they share one stamp).
        connect_ms: send to the new connection being open (TCP, and TLS when https); None when a
            pooled connection was reused or the transport does not say.
        request_sent_ms: send to the request's last byte handed to the kernel; None unknown.
        content_encoding: the codings the body came in (``gzip``, ``deflate``, ``br``; decoded,
            ``tasks.wire.codings``), None as sent: a compressing proxy that buffers its output
            (gzip without a flush per event) makes the arrival times its own, not the server's.
        send_lateness_ms: the request's bytes handed to the kernel (``send_ns`` +
            ``request_sent_ms``; the send call where that is unknown) minus the arrival the
            schedule drew for it (a finite request rate or a trace's recorded time; the wait for
            a concurrency slot included); None otherwise.
        prefix_group: the shared-prefix group of the request's prompt
            (``tasks.workload.prefix``); None for other workloads and warm-ups.
        session_id: the conversation a turn belongs to (``l{level}-s{i}``; request ids
            ``l{level}-r{i}.{turn}``); None for a single request.
        turn: the turn's place in its conversation (1 = the first); None for a single request.
    """

    request_id: str
    level: int = 0
    max_concurrency: int = 1
    request_rate: float | None = None
    warmup: bool = False
    repeat: int = 0
    send_ns: int = 0
    input_tokens: int | None = None
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    stream_close_ms: float | None = None
    output_tokens: int | None = None
    output_tokens_source: str | None = None
    usage_problem: str | None = None
    reasoning_tokens: int | None = None
    usage_convention: str | None = None
    cached_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    output_text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    refusal: bool = False
    error_class: str | None = None
    error_message: str | None = None
    error_after_ms: float | None = None
    token_offsets_ms: list[float] = field(default_factory=list)
    arrival_clock: str = "user"
    user_token_offsets_ms: list[float] = field(default_factory=list)
    clock_fallback: str | None = None
    coalesced_events: int = 0
    connect_ms: float | None = None
    request_sent_ms: float | None = None
    content_encoding: str | None = None
    send_lateness_ms: float | None = None
    prefix_group: int | None = None
    session_id: str | None = None
    turn: int | None = None

    @property
    def decode_unobserved(self) -> str | None:
        """Why the client could not see the decode (``one_token``, ``one_chunk``, ``one_read``),
        or None: derived from the count and the arrivals by
        :func:`tasks.stream.timing.decode_unobserved`, never stored."""
        return decode_unobserved(self.output_tokens, self.token_offsets_ms)

    @property
    def generated_text(self) -> str:
        """Every generated text the tokenizer counts when the usage cannot: ``output_text``,
        then each tool call's name and arguments."""
        calls = "".join(f"{c.get('name') or ''}{c.get('arguments') or ''}" for c in self.tool_calls)
        return self.output_text + calls

    @property
    def succeeded(self) -> bool:
        """At least one token and no error (DESIGN.md)."""
        return self.error_class is None and self.ttft_ms is not None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict; ``error`` is null or ``{"class", "message"}``."""
        error = (
            None if self.error_class is None else {"class": self.error_class, "message": self.error_message}
        )
        return {
            "request_id": self.request_id,
            "level": self.level,
            "max_concurrency": self.max_concurrency,
            "request_rate": self.request_rate,
            "warmup": self.warmup,
            "repeat": self.repeat,
            "send_ns": self.send_ns,
            "input_tokens": self.input_tokens,
            "ttft_ms": self.ttft_ms,
            "itl_ms": list(self.itl_ms),
            "tpot_ms": self.tpot_ms,
            "e2e_ms": self.e2e_ms,
            "stream_close_ms": self.stream_close_ms,
            "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source,
            "usage_problem": self.usage_problem,
            "reasoning_tokens": self.reasoning_tokens,
            "usage_convention": self.usage_convention,
            "cached_tokens": self.cached_tokens,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "output_text": self.output_text,
            "tool_calls": [dict(call) for call in self.tool_calls],
            "refusal": self.refusal,
            "decode_unobserved": self.decode_unobserved,
            "error": error,
            "error_after_ms": self.error_after_ms,
            "token_offsets_ms": list(self.token_offsets_ms),
            "arrival_clock": self.arrival_clock,
            "user_token_offsets_ms": list(self.user_token_offsets_ms),
            "clock_fallback": self.clock_fallback,
            "coalesced_events": self.coalesced_events,
            "connect_ms": self.connect_ms,
            "request_sent_ms": self.request_sent_ms,
            "content_encoding": self.content_encoding,
            "send_lateness_ms": self.send_lateness_ms,
            "prefix_group": self.prefix_group,
            "session_id": self.session_id,
            "turn": self.turn,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        """Inverse of :meth:`to_json` (unknown keys are ignored)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        error = data.get("error")
        if isinstance(error, dict):
            kwargs["error_class"] = error.get("class")
            kwargs["error_message"] = error.get("message")
        return cls(**kwargs)


class RecordWriter:
    """Append records to a JSONL file, one line each, flushed as soon as it is written.

    Use as a context manager or call :meth:`close`. ``write`` is meant to be the load
    generator's ``on_record`` callback; it must be called from one thread.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._fsync = fsync
        self._dirty = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        if fsync:
            self._thread = threading.Thread(target=self._sync_loop, name="record-fsync", daemon=True)
            self._thread.start()

    def _sync_loop(self) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            if self._stop:
                return
            try:
                os.fsync(self._file.fileno())
            except (OSError, ValueError):
                return

    def write(self, record: RequestRecord) -> None:
        """Append one record as a JSON line and hand it to the OS (flush) before returning."""
        self._file.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
        self._file.flush()
        if self._fsync:
            self._dirty.set()

    __call__ = write

    def close(self) -> None:
        """Flush, fsync and close the file (idempotent)."""
        if self._file.closed:
            return
        if self._thread is not None:
            self._stop = True
            self._dirty.set()
            self._thread.join()
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[RequestRecord]:
    """The records of a JSONL file written by :class:`RecordWriter`.

    A last line cut off by a crash is skipped; a bad line elsewhere raises ``ValueError``
    naming the line.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    records: list[RequestRecord] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(RequestRecord.from_json(json.loads(line)))
        except (json.JSONDecodeError, TypeError) as exc:
            is_last = all(not rest.strip() for rest in lines[number:])
            if is_last:
                break
            raise ValueError(f"{path}:{number}: not a request record: {exc}") from None
    return records


_REQUEST_SCHEMA: dict[str, pl.DataType] = {
    "request_id": pl.String(),
    "level": pl.Int64(),
    "max_concurrency": pl.Int64(),
    "request_rate": pl.Float64(),
    "warmup": pl.Boolean(),
    "repeat": pl.Int64(),
    "send_ns": pl.Int64(),
    "input_tokens": pl.Int64(),
    "ttft_ms": pl.Float64(),
    "itl_ms": pl.List(pl.Float64()),
    "tpot_ms": pl.Float64(),
    "e2e_ms": pl.Float64(),
    "stream_close_ms": pl.Float64(),
    "output_tokens": pl.Int64(),
    "output_tokens_source": pl.String(),
    "usage_problem": pl.String(),
    "reasoning_tokens": pl.Int64(),
    "usage_convention": pl.String(),
    "cached_tokens": pl.Int64(),
    "usage_prompt_tokens": pl.Int64(),
    "output_text": pl.String(),
    "tool_calls": pl.List(pl.Struct({"index": pl.Int64(), "name": pl.String(), "arguments": pl.String()})),
    "refusal": pl.Boolean(),
    "decode_unobserved": pl.String(),
    "error_class": pl.String(),
    "error_message": pl.String(),
    "error_after_ms": pl.Float64(),
    "arrival_clock": pl.String(),
    "clock_fallback": pl.String(),
    "coalesced_events": pl.Int64(),
    "connect_ms": pl.Float64(),
    "request_sent_ms": pl.Float64(),
    "content_encoding": pl.String(),
    "send_lateness_ms": pl.Float64(),
    "prefix_group": pl.Int64(),
    "session_id": pl.String(),
    "turn": pl.Int64(),
    "succeeded": pl.Boolean(),
}

_TOKEN_SCHEMA: dict[str, pl.DataType] = {
    "request_id": pl.String(),
    "index": pl.Int64(),
    "offset_ms": pl.Float64(),
    "gap_ms": pl.Float64(),
    "user_offset_ms": pl.Float64(),
}


def requests_frame(records: Iterable[RequestRecord]) -> pl.DataFrame:
    """One row per request (columns of :data:`_REQUEST_SCHEMA`)."""
    rows = []
    for r in records:
        row = asdict(r)
        row.pop("token_offsets_ms")
        row.pop("user_token_offsets_ms")
        row["itl_ms"] = [float(x) for x in r.itl_ms]
        row["succeeded"] = r.succeeded
        row["decode_unobserved"] = r.decode_unobserved
        rows.append(row)
    return pl.DataFrame(rows, schema=_REQUEST_SCHEMA)


def tokens_frame(records: Iterable[RequestRecord]) -> pl.DataFrame:
    """One row per text-carrying chunk: request_id, index, offset_ms, gap_ms (null first),
    user_offset_ms (the user-space arrival beside a kernel one; null on the user clock)."""
    columns: dict[str, list[Any]] = {name: [] for name in _TOKEN_SCHEMA}
    for r in records:
        previous: float | None = None
        users = r.user_token_offsets_ms
        for index, offset in enumerate(r.token_offsets_ms):
            columns["user_offset_ms"].append(float(users[index]) if index < len(users) else None)
            columns["request_id"].append(r.request_id)
            columns["index"].append(index)
            columns["offset_ms"].append(float(offset))
            columns["gap_ms"].append(None if previous is None else float(offset) - previous)
            previous = float(offset)
    return pl.DataFrame(columns, schema=_TOKEN_SCHEMA)


def write_parquet(
    records: Iterable[RequestRecord],
    requests_path: str | os.PathLike[str],
    tokens_path: str | os.PathLike[str],
) -> None:
    """Write ``requests.parquet`` and ``tokens.parquet`` (see the module docstring)."""
    records = list(records)
    for path in (requests_path, tokens_path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    requests_frame(records).write_parquet(requests_path)
    tokens_frame(records).write_parquet(tokens_path)
