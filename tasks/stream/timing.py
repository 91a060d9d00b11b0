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
- ``tpot_ms``: ``(e2e_ms - ttft_ms) / (output_tokens - 1)`` (vLLM's TPOT), only with at least 2
  output tokens and at least 2 text chunks: when all the text came in one chunk the client
  cannot see the decode, so TPOT is None (not 0) and such a request is judged on its other SLOs.
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


def tpot_ms(
    ttft_ms: float | None, e2e_ms: float | None, output_tokens: int | None, text_chunks: int
) -> float | None:
    """Time per output token after the first, in ms: ``(e2e_ms - ttft_ms) / (output_tokens - 1)``.

    None when ``output_tokens`` is unknown or below 2, when fewer than 2 text chunks came (all
    the text in one chunk: the decode is invisible to the client), or when TTFT / E2E are
    missing.
    """
    if output_tokens is None or output_tokens < 2 or text_chunks < 2 or ttft_ms is None or e2e_ms is None:
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
    offsets = tuple((t - send_ns) / _NS_PER_MS for t in arrivals_ns)
    gaps = tuple((b - a) / _NS_PER_MS for a, b in zip(arrivals_ns, arrivals_ns[1:], strict=False))
    return ChunkTiming(
        token_offsets_ms=offsets,
        ttft_ms=offsets[0],
        itl_ms=gaps,
        e2e_ms=offsets[-1],
        tpot_ms=tpot_ms(offsets[0], offsets[-1], output_tokens, len(offsets)),
    )
