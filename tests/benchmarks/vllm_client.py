"""vLLM's own benchmark client on the ground-truth instrument, for tests/benchmarks/stream_client.py.

Runs in vLLM's venv (``.venv-vllm``, ``make vllm``): ``async_request_openai_chat_completions``
from ``vllm.benchmarks.lib.endpoint_request_func`` (what ``vllm bench serve`` sends), N streams
at once, one request per prompt ``p0..p{N-1}``. Prints one JSON line: per prompt, vLLM's own
``ttft`` and ``itl`` (seconds) and its ``start_time`` (``time.perf_counter``, CLOCK_MONOTONIC).

    .venv-vllm/bin/python tests/benchmarks/vllm_client.py BASE_URL MODEL STREAMS MAX_TOKENS
"""

import asyncio
import json
import sys

import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_chat_completions


async def main(base_url: str, model: str, streams: int, max_tokens: int) -> None:
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    connector = aiohttp.TCPConnector(limit=streams + 8, limit_per_host=streams + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=True) as session:

        def one(prompt: str):
            request = RequestFuncInput(
                prompt=prompt,
                api_url=f"{base_url}/chat/completions",
                prompt_len=1,
                output_len=max_tokens,
                model=model,
                chat_messages=[{"role": "user", "content": prompt}],
            )
            return async_request_openai_chat_completions(request, session)

        await one("warm")  # the first connection and imports, as the other paths' warm-up
        outputs = await asyncio.gather(*(one(f"p{i}") for i in range(streams)))
    print(
        json.dumps(
            {
                f"p{i}": {
                    "ok": o.success,
                    "ttft": o.ttft,
                    "itl": o.itl,
                    "start_time": o.start_time,
                    "error": o.error,
                }
                for i, o in enumerate(outputs)
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
