"""Send time and text-chunk arrival times -> TTFT / ITL / E2E / TPOT: the one place they are
computed (the stream client's records and the sampling sweep's local samples both use it).

Definitions (DESIGN.md "Metric definitions"; the TTFT / ITL / E2E conventions of vLLM
``benchmarks/backend_request_func.py`` and SGLang ``python/sglang/bench_serving.py``):

- Times are ``time.perf_counter_ns()`` values (monotonic, ns): ``send_ns`` read just before the
  request is sent, one arrival per chunk that carried generated text (a role-only or empty
  chunk, a usage-only chunk and ``[DONE]`` are not text chunks and are never passed here).
- ``ttft_ms``: send to the first text chunk.
- ``itl_ms``: every gap between successive text chunks, text chunks - 1 entries (vLLM / SGLang
  ITL). GenAI-Perf calls our TPOT "ITL"; ours is the chunk gap.
- ``e2e_ms``: send to the last text chunk (a later usage chunk or ``[DONE]`` does not stretch it).
- ``tpot_ms``: ``(e2e_ms - ttft_ms) / (output_tokens - 1)`` (vLLM's TPOT), only where the client
  can see the decode (:func:`decode_unobserved`): not for one output token, not when all the
  text came in one chunk, and not when all of it arrived at one instant (one read: a server or
  a buffering proxy wrote the whole answer at once, so its gaps of 0 say nothing of the
  decode). There TPOT is None (not 0) and the request neither passes nor fails a TPOT SLO: it is
  judged on its other SLOs (vLLM's ``benchmark_serving`` counts such requests as meeting it).
  A chunk may carry several tokens, so TPOT and the mean ITL differ; both are reported.

Pure arithmetic: no clock reads, no I/O; safe to call after the stream, never inside a receive
loop (which only appends arrival times).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_NS_PER_MS = 1_000_000.0


@dataclass(frozen=True)
class ChunkTiming:
    """One request's timing from its text-chunk arrivals (all in ms since send; None / empty
    when no text chunk came).

    Attributes:
        token_offsets_ms: arrival of every text chunk since send (one entry per chunk).
        ttft_ms: to the first text chunk; e2e_ms: to the last one.
        itl_ms: gaps between successive text chunks (text chunks - 1 entries).
        tpot_ms: see :func:`tpot_ms`; None without an output-token count.
    """

    token_offsets_ms: tuple[float, ...] = ()
    ttft_ms: float | None = None
    itl_ms: tuple[float, ...] = ()
    e2e_ms: float | None = None
    tpot_ms: float | None = None


#: Why the client cannot see a request's decode (:func:`decode_unobserved`).
ONE_TOKEN, ONE_CHUNK, ONE_READ = "one_token", "one_chunk", "one_read"


def decode_unobserved(output_tokens: int | None, token_offsets_ms: Sequence[float]) -> str | None:
    """Why the client cannot see this request's decode, or None when it can (or there is no
    text at all: such a request is not a success).

    ``token_offsets_ms``: the arrival of every text chunk (any unit; only equality matters).
    :data:`ONE_TOKEN` when the answer is one output token; :data:`ONE_CHUNK` when all the text
    came in one chunk; :data:`ONE_READ` when it came in several chunks that all arrived at one
    instant (one read of the socket: the answer was buffered and written at once). Chunks that
    arrive together while others come apart are a visible decode and keep their 0 gaps.
    """
    if not token_offsets_ms:
        return None
    if output_tokens is not None and output_tokens < 2:
        return ONE_TOKEN
    if len(token_offsets_ms) < 2:
        return ONE_CHUNK
    if min(token_offsets_ms) == max(token_offsets_ms):
        return ONE_READ
    return None


def tpot_ms(
    ttft_ms: float | None,
    e2e_ms: float | None,
    output_tokens: int | None,
    token_offsets_ms: Sequence[float],
) -> float | None:
    """Time per output token after the first, in ms: ``(e2e_ms - ttft_ms) / (output_tokens - 1)``.

    None when ``output_tokens`` is unknown, when the client cannot see the decode
    (:func:`decode_unobserved`: one token, one chunk, or every chunk in one instant), or when
    TTFT / E2E are missing.
    """
    if (
        output_tokens is None
        or ttft_ms is None
        or e2e_ms is None
        or decode_unobserved(output_tokens, token_offsets_ms) is not None
    ):
        return None
    return (e2e_ms - ttft_ms) / (output_tokens - 1)


def chunk_timing(send_ns: int, arrivals_ns: Sequence[int], output_tokens: int | None = None) -> ChunkTiming:
    """TTFT / ITL / E2E / TPOT of one request (module docstring) from ``send_ns`` and the
    ``perf_counter_ns`` arrival times of its text-carrying chunks, in arrival order.

    ITL gaps are taken between the integer ns stamps (not between rounded ms offsets).
    ``output_tokens``: the request's output-token count (server usage or tokenizer), for TPOT;
    None leaves TPOT None. No arrivals: every figure None / empty.
    """
    if not arrivals_ns:
        return ChunkTiming()
    # comprehensions, not generator expressions: this runs per chunk at each request's end
    offsets = tuple([(t - send_ns) / _NS_PER_MS for t in arrivals_ns])
    gaps = tuple([(b - a) / _NS_PER_MS for a, b in zip(arrivals_ns, arrivals_ns[1:], strict=False)])
    return ChunkTiming(
        token_offsets_ms=offsets,
        ttft_ms=offsets[0],
        itl_ms=gaps,
        e2e_ms=offsets[-1],
        tpot_ms=tpot_ms(offsets[0], offsets[-1], output_tokens, offsets),
    )
