"""One streamed request against the ground-truth instrument, as the API tests make it
(tests/test_completions.py, tests/test_responses.py): a fresh client, a warm-up request on the
same connection, then the measured one."""

from __future__ import annotations

import asyncio

from tasks.stream.client import stream_chat
from tasks.stream.load import make_client
from tasks.stream.records import RequestRecord

#: How far past the instrument's schedule a timed figure may land on a shared 2-core machine (ms).
TOL_MS = 60.0


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


def measure(base_url: str, model: str, *, api: str, transport: str = "sse", **kwargs) -> RequestRecord:
    """One ``api`` request to the instrument's ``model`` (a scenario) with a fresh client of
    ``transport``, after a warm-up on the same connection; ``kwargs`` go to ``stream_chat``."""

    async def main() -> RequestRecord:
        client = make_client(base_url, "sk-x", 10.0, 1, transport)
        try:
            await stream_chat(
                client, model="single", prompt="w", max_tokens=4, count_tokens=words, request_id="w", api=api
            )
            options = {"prompt": "hi", "max_tokens": 16, "count_tokens": words, "request_id": model, **kwargs}
            return await stream_chat(client, model=model, api=api, **options)
        finally:
            await client.close()

    return asyncio.run(main())
