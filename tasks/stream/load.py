"""Load levels: warm-up, then N measured requests with at most C in flight.

A level (vLLM ``benchmark_serving.py --max-concurrency``): warm-up requests go first, one at a
time, recorded with ``warmup=True`` and left out of the statistics; then ``num_requests``
measured requests are sent as fast as an ``asyncio.Semaphore(max_concurrency)`` lets them (a
closed loop: a new request starts when one in flight ends). Prompts are used round-robin.
``wall_s`` runs from the first measured send to the last measured completion; it is the
denominator of the level's throughput figures (``tasks.stats.aggregate_level``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

from tasks.stream.client import stream_chat
from tasks.stream.records import RequestRecord


@dataclass
class LevelResult:
    """The records of one level (warm-up included, flagged) and its wall time in seconds."""

    level: int
    max_concurrency: int
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def measured(self) -> list[RequestRecord]:
        """The non-warm-up records."""
        return [r for r in self.records if not r.warmup]


def _input_tokens(counts: Sequence[int | None] | None, index: int) -> int | None:
    return counts[index % len(counts)] if counts else None


async def run_level(
    client: openai.AsyncOpenAI,
    *,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    max_concurrency: int,
    num_requests: int,
    warmup: int,
    count_tokens: Callable[[str], int] | None,
    sampling: dict[str, Any] | None = None,
    level: int,
    on_record: Callable[[RequestRecord], None] | None = None,
    prompt_tokens: Sequence[int | None] | None = None,
    extra_body: dict[str, Any] | None = None,
    api_key_env: str | None = None,
) -> LevelResult:
    """Run one load level against ``client`` and return its records and wall time.

    Args:
        prompts: used round-robin (warm-up from the first prompt on, measured likewise).
        max_concurrency: most measured requests in flight at once (>= 1).
        num_requests: measured requests; warmup: sequential warm-up requests before them.
        count_tokens: the output-token fallback when the server sends no usage.
        on_record: called with every finished record (warm-up too), e.g. a ``RecordWriter``.
        prompt_tokens: optional token count of each prompt (parallel to ``prompts``), stored
            as ``input_tokens``.
        extra_body, api_key_env: passed to :func:`tasks.stream.client.stream_chat`.

    Request ids are ``l{level}-w{i}`` (warm-up) and ``l{level}-r{i}`` (measured).
    """
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    if not prompts:
        raise ValueError("prompts must not be empty")
    result = LevelResult(level=level, max_concurrency=max_concurrency)
    common = {
        "model": model,
        "max_tokens": max_tokens,
        "count_tokens": count_tokens,
        "sampling": sampling,
        "level": level,
        "max_concurrency": max_concurrency,
        "extra_body": extra_body,
        "api_key_env": api_key_env,
    }

    for i in range(warmup):
        record = await stream_chat(
            client,
            prompt=prompts[i % len(prompts)],
            request_id=f"l{level}-w{i}",
            warmup=True,
            input_tokens=_input_tokens(prompt_tokens, i),
            **common,
        )
        result.records.append(record)
        if on_record is not None:
            on_record(record)

    gate = asyncio.Semaphore(max_concurrency)
    done_ns: list[int] = []
    measured: list[RequestRecord] = []

    async def one(i: int) -> None:
        async with gate:
            record = await stream_chat(
                client,
                prompt=prompts[i % len(prompts)],
                request_id=f"l{level}-r{i}",
                input_tokens=_input_tokens(prompt_tokens, i),
                **common,
            )
            done_ns.append(time.perf_counter_ns())
        measured.append(record)
        if on_record is not None:
            on_record(record)

    await asyncio.gather(*(one(i) for i in range(num_requests)))
    result.records.extend(sorted(measured, key=lambda r: r.send_ns))
    if measured:
        first_send_ns = min(r.send_ns for r in measured)
        result.wall_s = (max(done_ns) - first_send_ns) / 1e9
    return result


def make_client(
    base_url: str, api_key: str | None, request_timeout_s: float, max_concurrency: int
) -> openai.AsyncOpenAI:
    """An AsyncOpenAI with no retries, the given timeout, and room for the concurrency.

    No retries: a retried request would hide an error and stretch its latency. The timeout
    applies to connecting and to each read (the wait for the next chunk). With no key a
    placeholder is sent (servers without auth ignore it).
    """
    room = max(max_concurrency, 1) + 8
    http_client = openai.DefaultAsyncHttpx2Client(
        timeout=httpx2.Timeout(request_timeout_s),
        limits=httpx2.Limits(max_connections=room, max_keepalive_connections=room),
    )
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key or "no-key",
        max_retries=0,
        timeout=request_timeout_s,
        http_client=http_client,
    )


def run_levels(
    base_url: str,
    api_key: str | None,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrencies: Sequence[int],
    num_requests: int,
    warmup: int,
    count_tokens: Callable[[str], int] | None,
    request_timeout_s: float,
    sampling: dict[str, Any] | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    *,
    prompt_tokens: Sequence[int | None] | None = None,
    extra_body: dict[str, Any] | None = None,
    api_key_env: str | None = None,
) -> list[LevelResult]:
    """Run one level per concurrency, in order, over one client (level i = concurrencies[i]).

    Synchronous: runs its own event loop (``asyncio.run``), so call it from a thread without a
    running loop. Each level sends its own warm-up requests.
    """

    async def main() -> list[LevelResult]:
        client = make_client(base_url, api_key, request_timeout_s, max(concurrencies, default=1))
        try:
            results = []
            for level, concurrency in enumerate(concurrencies):
                results.append(
                    await run_level(
                        client,
                        model=model,
                        prompts=prompts,
                        max_tokens=max_tokens,
                        max_concurrency=concurrency,
                        num_requests=num_requests,
                        warmup=warmup,
                        count_tokens=count_tokens,
                        sampling=sampling,
                        level=level,
                        on_record=on_record,
                        prompt_tokens=prompt_tokens,
                        extra_body=extra_body,
                        api_key_env=api_key_env,
                    )
                )
            return results
        finally:
            await client.close()

    return asyncio.run(main())
