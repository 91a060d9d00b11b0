"""The sweep against an OpenAI-compatible endpoint, through the stream client (its records,
its timing: ``tasks.stream.timing``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from tasks.stream.client import stream_chat
from tasks.stream.records import RequestRecord
from tasks.sweep.figures import PointResult, finish_point
from tasks.sweep.points import SweepPoint


async def run_points(
    client,
    points: Sequence[SweepPoint],
    *,
    model: str,
    prompt: str,
    samples: int,
    max_concurrency: int,
    count_tokens: Callable[[str], int],
    encode: Callable[[str], list[int]],
    api_key_env: str | None = None,
    on_point: Callable[[PointResult], Awaitable[None] | None] | None = None,
    key: Callable[[SweepPoint], str] = SweepPoint.key,
    warmup: int = 1,
    server_pid: int | None = None,
) -> list[PointResult]:
    """Run every point's samples concurrently, at most ``max_concurrency`` requests in flight
    across the whole sweep (sample i of a point with seed + i). ``on_point`` is called (and
    awaited, when it returns an awaitable) as each point finishes; results come back in the
    order of ``points``. A request that fails becomes a record with its error class.

    ``warmup`` (0 or 1): a point first sends one request with sample 0's parameters, waits for
    it, then sends its samples; that record is the result's ``warmup``, outside the figures (as
    the stream stage's warm-ups), and a deterministic point notes when its cold output differs
    from the warm samples (:func:`tasks.sweep.figures.determinism_note`).

    ``server_pid``: the embedded server, where it is the endpoint: a request refused or cut
    after its death is ``server_died`` (``tasks.stream.client.stream_chat``).
    """
    gate = asyncio.Semaphore(max_concurrency)

    async def one(point: SweepPoint, i: int, request_id: str | None = None) -> RequestRecord:
        async with gate:
            return await stream_chat(
                client,
                model=model,
                prompt=prompt,
                max_tokens=point.max_tokens,
                count_tokens=count_tokens,
                sampling=point.sampling(i),
                request_id=request_id or f"{key(point)}-{i}",
                max_concurrency=max_concurrency,
                api_key_env=api_key_env,
                server_pid=server_pid,
            )

    async def whole(point: SweepPoint) -> PointResult:
        cold = await one(point, 0, f"{key(point)}-warmup") if warmup else None
        records = list(await asyncio.gather(*(one(point, i) for i in range(samples))))
        result = finish_point(point, records, encode, cold)
        if on_point is not None:
            maybe = on_point(result)
            if asyncio.iscoroutine(maybe):
                await maybe
        return result

    return list(await asyncio.gather(*(whole(p) for p in points)))
