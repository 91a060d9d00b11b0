"""A level's result as a client process returns it and as the command's process completes it,
without the transport (no openai or HTTP client imported): the command's process
imports this, the client processes ``tasks.stream.load`` (0.5 s of openai's import off the
command's path: tests/benchmarks/command_phases.py).

- :class:`LevelResult`: a level's records and client figures, before aggregation;
- :func:`fill_output_tokens`: the output's token count by the tokenizer where the server's
  usage gave none, then TPOT; :func:`fill_cached_tokens`: llama.cpp's ``timings`` cache counts;
- :class:`HistoryTokens`: a conversation turn's prompt tokens as the client counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tasks.stream.records import RequestRecord
from tasks.stream.settings import LevelSettings
from tasks.stream.timing import tpot_ms

__all__ = ["HistoryTokens", "LevelResult", "fill_cached_tokens", "fill_output_tokens"]


@dataclass
class LevelResult:
    """What running one level gave, before aggregation (``tasks.stream.level_figures.Level`` is the
    finished level): its records (warm-up included, flagged), wall time in seconds, and the
    client's figures (``tasks.stream.quality.client_figures``: ``arrival_clock``,
    ``client_bound``, ``coalesced_event_fraction``, ``client_loop_lag_ms_p99``, ...) with the raw
    parts they came from (``lag``, ``cpu_s``, ``offset_drift_ns``)."""

    level: int
    max_concurrency: int
    request_rate: float | None = None
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    client: dict[str, Any] = field(default_factory=dict)
    last_done_ns: int = 0  #: perf_counter_ns when the last measured request finished
    lag: dict[str, Any] = field(default_factory=dict)  #: the loop-lag probe's metrics
    cpu_s: float | None = None  #: the client's CPU seconds over the measured part
    offset_drift_ns: int | None = None  #: CLOCK_REALTIME - CLOCK_MONOTONIC, end minus start

    @property
    def measured(self) -> list[RequestRecord]:
        """The non-warm-up records."""
        return [r for r in self.records if not r.warmup]


def fill_output_tokens(record: RequestRecord, count_tokens: Callable[[str], int] | None) -> None:
    """Count the output by the tokenizer when the server's usage gave no trusted count, then
    set TPOT.

    ``output_tokens`` already set (from usage) is kept; otherwise, with generated text
    (``RequestRecord.generated_text``: tool calls included) and a tokenizer, its count with
    source ``tokenizer``. ``tpot_ms`` by :func:`tasks.stream.timing.tpot_ms`. Used after the
    stream (never inside the receive loop) and by the parent of client processes.
    """
    text = record.generated_text
    if record.output_tokens is None and text and count_tokens is not None:
        record.output_tokens = int(count_tokens(text))
        record.output_tokens_source = "tokenizer"
    record.tpot_ms = tpot_ms(record.ttft_ms, record.e2e_ms, record.output_tokens, record.token_offsets_ms)


def fill_cached_tokens(record: RequestRecord, timings: Any) -> None:
    """Where the usage gave none, ``cached_tokens`` from llama.cpp's ``timings.cache_n`` (prompt
    tokens taken from its cache) and ``usage_prompt_tokens`` from ``cache_n + prompt_n``
    (``prompt_n``: the prompt tokens it evaluated; llama.cpp ``tools/server``). Values that are
    not counts are ignored."""
    if not isinstance(timings, dict):
        return
    cached, evaluated = timings.get("cache_n"), timings.get("prompt_n")
    if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
        return
    if record.cached_tokens is None:
        record.cached_tokens = cached
    if record.usage_prompt_tokens is None and isinstance(evaluated, int) and evaluated >= 0:
        record.usage_prompt_tokens = cached + evaluated


class HistoryTokens:
    """The client's count of each conversation turn's prompt, set as the turn's ``input_tokens``
    where the tokenizer is (``tasks.scaleout.multiproc``'s parent, after
    :func:`fill_output_tokens`): every message's content it sent, without the
    chat template (as a single prompt's count): the session's earlier ``turn_tokens`` and the
    replies' ``output_tokens``, then its own. A turn where a part is not known keeps what the
    record has (the server's ``usage.prompt_tokens``, or None). Records of one session must
    come in turn order (they do: a turn is sent after the previous one's record)."""

    def __init__(self, settings: LevelSettings) -> None:
        self.settings = settings
        self.sent: dict[str, int | None] = {}  # session -> tokens of its messages so far

    def fill(self, record: RequestRecord) -> None:
        s = self.settings
        if record.turn is None or record.session_id is None or not s.sessions:
            return
        session = s.sessions[(s.prompt_index(record.request_id) - s.warmup) % len(s.sessions)]
        k, counts = record.turn - 1, session.turn_tokens or ()
        own = counts[k] if k < len(counts) else None
        before = 0 if k == 0 else self.sent.get(record.session_id)
        if own is None or before is None:
            self.sent[record.session_id] = None
            return
        record.input_tokens = before + own
        replied = record.output_tokens
        self.sent[record.session_id] = None if replied is None else before + own + replied
