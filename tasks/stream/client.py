"""One streamed chat request -> one :class:`RequestRecord`.

Definitions (DESIGN.md "Metric definitions"; vLLM ``benchmarks/backend_request_func.py`` and
SGLang ``bench_serving.py`` for TTFT / ITL / E2E, GenAI-Perf for the output-token count):

- The clock is ``time.perf_counter_ns()`` read just before the request is sent.
- ``ttft_ms``: to the first chunk whose delta carries text: ``content``, or a reasoning field
  (``reasoning_content`` / ``reasoning``, sent by vLLM, SGLang, llama.cpp, DeepSeek as extra
  fields, exposed by the openai client in ``delta.model_extra``). A role-only or empty chunk
  is not a token.
- ``itl_ms``: the gaps between successive text-carrying chunks (text chunks - 1 entries).
- ``e2e_ms``: to the last text-carrying chunk; ``stream_close_ms``: to the end of the stream
  (a late usage-only chunk and ``[DONE]`` stretch only this one).
- ``output_tokens``: the final ``usage.completion_tokens`` when the server sends it (asked for
  with ``stream_options={"include_usage": True}``), else ``count_tokens(output_text)`` (the
  caller's tokenizer, without special tokens). Never the chunk count, never ``max_tokens``.
- ``tpot_ms``: ``(e2e_ms - ttft_ms) / (output_tokens - 1)`` for at least 2 output tokens.

Inside the receive loop there is only a clock read, the text lookup and list appends: no
logging, no tokenizing, no string joins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import openai

from tasks.stream.errors import EMPTY_RESPONSE, SERVER, StreamError, classify
from tasks.stream.records import RequestRecord

#: Sampling keys sent as named arguments of ``chat.completions.create``.
_NAMED_SAMPLING = ("temperature", "top_p", "seed")

_NS_PER_MS = 1_000_000.0


def build_request(
    *,
    model: str,
    prompt: str,
    max_tokens: int,
    sampling: dict[str, Any] | None = None,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``client.chat.completions.create`` (streaming, usage asked).

    ``max_completion_tokens`` is the current OpenAI name; ``max_tokens`` goes too (through
    ``extra_body``) for servers that know only that one. ``temperature``, ``top_p`` and
    ``seed`` are named arguments; ``top_k`` and any other sampling key (not in the OpenAI
    API) go through ``extra_body``, as vLLM, SGLang and llama.cpp read them. None values are
    not sent.
    """
    body: dict[str, Any] = {"max_tokens": max_tokens}
    kwargs: dict[str, Any] = {}
    for key, value in (sampling or {}).items():
        if value is None:
            continue
        if key in _NAMED_SAMPLING:
            kwargs[key] = value
        else:
            body[key] = value
    body.update(extra_body or {})
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": max_tokens,
        "extra_body": body,
        **kwargs,
    }


def _in_stream_error(chunk: Any) -> StreamError:
    """The error of a chunk that is an error object without an ``error`` key (vLLM's older
    ``{"object": "error", "message": ...}``; ``{"error": {...}}`` is raised by the client)."""
    extra = chunk.model_extra or {}
    message = extra.get("message") or "the server sent an error object inside the stream"
    return StreamError(SERVER, f"the server sent an error inside the stream: {message}")


async def stream_chat(
    client: openai.AsyncOpenAI,
    *,
    model: str,
    prompt: str,
    max_tokens: int,
    count_tokens: Callable[[str], int] | None,
    sampling: dict[str, Any] | None = None,
    request_id: str,
    level: int = 0,
    max_concurrency: int = 1,
    warmup: bool = False,
    input_tokens: int | None = None,
    extra_body: dict[str, Any] | None = None,
    api_key_env: str | None = None,
) -> RequestRecord:
    """Send one streaming chat request and measure it (see the module docstring).

    Every exception of the request or the stream is caught and classified
    (``tasks.stream.errors.classify``); the record keeps what was measured before it. A
    stream that ends without a text chunk is an ``empty_response``. ``api_key_env`` (the
    NAME of the key's variable) is only used in the message of a 401/403.

    ``input_tokens``: the caller's count of the prompt; when None, the server's
    ``usage.prompt_tokens`` if it sends one.
    """
    kwargs = build_request(
        model=model, prompt=prompt, max_tokens=max_tokens, sampling=sampling, extra_body=extra_body
    )
    arrivals_ns: list[int] = []
    parts: list[str] = []
    usage = None
    chunks = 0
    finish_reason = None
    in_stream = False
    failure: BaseException | None = None
    perf = time.perf_counter_ns
    # Resolved before the clock starts: the first access imports the client's resource modules
    # (~0.1 s), which is not the endpoint's latency.
    create = client.chat.completions.create

    send_ns = perf()
    try:
        stream = await create(**kwargs)
        in_stream = True
        try:
            async for chunk in stream:
                now_ns = perf()
                chunks += 1
                choices = chunk.choices
                if choices:
                    choice = choices[0]
                    delta = choice.delta
                    text = delta.content if delta is not None else None
                    if not text and delta is not None:
                        extra = delta.model_extra
                        if extra:
                            text = extra.get("reasoning_content") or extra.get("reasoning")
                            if not isinstance(text, str):
                                text = None
                    if text:
                        arrivals_ns.append(now_ns)
                        parts.append(text)
                    if choice.finish_reason is not None:
                        finish_reason = choice.finish_reason
                elif getattr(chunk, "object", None) == "error":
                    raise _in_stream_error(chunk)
                if chunk.usage is not None:
                    usage = chunk.usage
        finally:
            await stream.close()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a classified record
        failure = exc
    end_ns = perf()

    record = RequestRecord(
        request_id=request_id,
        level=level,
        max_concurrency=max_concurrency,
        warmup=warmup,
        send_ns=send_ns,
        input_tokens=input_tokens,
        output_text="".join(parts),
    )
    if usage is not None and input_tokens is None:
        record.input_tokens = getattr(usage, "prompt_tokens", None)
    if in_stream:
        record.stream_close_ms = (end_ns - send_ns) / _NS_PER_MS
    if arrivals_ns:
        offsets = [(t - send_ns) / _NS_PER_MS for t in arrivals_ns]
        record.token_offsets_ms = offsets
        record.ttft_ms = offsets[0]
        record.e2e_ms = offsets[-1]
        record.itl_ms = [(b - a) / _NS_PER_MS for a, b in zip(arrivals_ns, arrivals_ns[1:])]

    completion_tokens = getattr(usage, "completion_tokens", None) if usage is not None else None
    if completion_tokens is not None:
        record.output_tokens = int(completion_tokens)
        record.output_tokens_source = "usage"
    elif parts and count_tokens is not None:
        record.output_tokens = int(count_tokens(record.output_text))
        record.output_tokens_source = "tokenizer"
    if (
        record.output_tokens is not None
        and record.output_tokens >= 2
        and record.ttft_ms is not None
        and record.e2e_ms is not None
    ):
        record.tpot_ms = (record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1)

    if failure is not None:
        record.error_class, record.error_message = classify(
            failure,
            api_key_env=api_key_env,
            model=model,
            in_stream=in_stream,
            secrets=(getattr(client, "api_key", None),),
        )
    elif not arrivals_ns:
        record.error_class = EMPTY_RESPONSE
        record.error_message = (
            f"HTTP 200 but the stream carried no text ({chunks} chunks, "
            f"finish_reason={finish_reason}, usage completion_tokens={completion_tokens})"
        )
    return record
