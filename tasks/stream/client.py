"""One streamed chat request -> one :class:`RequestRecord`.

Timing (TTFT, ITL, E2E, TPOT) follows DESIGN.md "Metric definitions" and is computed in one
place, :func:`tasks.stream.timing.chunk_timing`, from the send time and the arrival times of the
text-carrying chunks this module collects:

- The clock is ``time.perf_counter_ns()`` read just before the request is sent.
- A text-carrying chunk is one whose delta carries ``content``, or a reasoning field
  (``reasoning_content`` / ``reasoning``, sent by vLLM, SGLang, llama.cpp, DeepSeek as extra
  fields, exposed by the openai client in ``delta.model_extra``). A role-only or empty chunk
  is not a token.
- ``stream_close_ms``: to the end of the stream (a late usage-only chunk and ``[DONE]``
  stretch only this one, never ``e2e_ms``).
- ``output_tokens``: the final ``usage.completion_tokens`` when the server sends it (asked for
  with ``stream_options={"include_usage": True}``), else ``count_tokens(output_text)`` (the
  caller's tokenizer, without special tokens; GenAI-Perf counts the same way). Never the chunk
  count, never ``max_tokens``.

Inside the receive loop there is only a clock read, the text lookup and list appends: no
logging, no tokenizing, no string joins.

Two transports give the same record: :class:`SSEClient` (aiohttp with this module's own SSE
parser; the default of ``tasks.stream.load.make_client``) and the openai client's
``AsyncOpenAI``. They were chosen on numbers (``tests/benchmarks/stream_client.py``, README
"Stream"): at 64 and 256 concurrent streams the openai client's per-chunk parsing (a pydantic
model per chunk over httpx2) makes its own event loop the bottleneck and its measured ITL error
p99 grows to ~0.1 s / ~1 s, while aiohttp with a byte-level SSE parser stays within a few ms.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import httpx2
import openai

from tasks.stream.errors import EMPTY_RESPONSE, SERVER, StreamError, classify
from tasks.stream.records import RequestRecord
from tasks.stream.timing import chunk_timing, tpot_ms

#: Sampling keys sent as named arguments of ``chat.completions.create``.
_NAMED_SAMPLING = ("temperature", "top_p", "seed")

_NS_PER_MS = 1_000_000.0  # stream_close_ms only; the rest is tasks.stream.timing's


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


class SSEClient:
    """An OpenAI-compatible chat-completions client over aiohttp, with its own SSE parser.

    The same interface as the parts of ``AsyncOpenAI`` the stream client uses: ``api_key``,
    ``base_url`` and ``await close()``. ``request_timeout_s`` bounds connecting and each read
    (the wait for the next bytes), as the openai client's timeout does; there are no retries.
    The aiohttp session is made on first use, inside the running event loop.
    """

    def __init__(
        self, base_url: str, api_key: str | None, request_timeout_s: float, max_connections: int
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or "no-key"
        self.url = f"{self.base_url}/chat/completions"
        self.headers = {
            "Authorization": f"Bearer {self.api_key}",
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",
        }
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=request_timeout_s,
            sock_connect=request_timeout_s,
            sock_read=request_timeout_s,
        )
        self._limit = max(1, max_connections)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, limit_per_host=self._limit),
                timeout=self._timeout,
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _request_body(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The JSON body the openai client would send for :func:`build_request`'s kwargs."""
    body = {k: v for k, v in kwargs.items() if k != "extra_body"}
    body.update(kwargs.get("extra_body") or {})
    return body


def _status_error(url: str, status: int, headers: Any, raw: bytes) -> openai.APIStatusError:
    """An HTTP error response as the openai client would raise it (same classification)."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode("utf-8", "replace")
    data = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    response = httpx2.Response(
        status, headers=dict(headers), content=raw, request=httpx2.Request("POST", url)
    )
    return openai.APIStatusError(f"Error code: {status}", response=response, body=data)


def _event_error(event: dict[str, Any]) -> StreamError | None:
    """The error of an in-stream error object (``{"error": {...}}`` or vLLM's
    ``{"object": "error", "message": ...}``), else None."""
    error = event.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else error
    elif event.get("object") == "error":
        message = event.get("message")
    else:
        return None
    message = message or "the server sent an error object inside the stream"
    return StreamError(SERVER, f"the server sent an error inside the stream: {message}")


async def _stream_sse(client: SSEClient, kwargs: dict[str, Any], state: dict[str, Any]) -> None:
    """Send the request and read its SSE body into ``state`` (arrivals, parts, usage, ...).

    SSE (WHATWG HTML, "Server-sent events"): events end with a blank line; ``data:`` lines (one
    optional space after the colon) carry the payload; lines starting with ``:`` are comments;
    ``\r\n`` line ends are accepted. Every event read from one network read gets that read's
    arrival time. Transport failures are raised as the openai client would raise them.
    """
    url = client.url
    perf = time.perf_counter_ns
    arrivals, parts = state["arrivals_ns"], state["parts"]
    loads = json.loads
    try:
        async with client.session().post(
            url, data=json.dumps(_request_body(kwargs)), headers=client.headers
        ) as response:
            if response.status != 200:
                raise _status_error(url, response.status, response.headers, await response.read())
            state["in_stream"] = True
            pending = b""
            data_lines: list[bytes] = []
            async for block in response.content.iter_any():
                now_ns = perf()
                lines = (pending + block).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line.endswith(b"\r"):
                        line = line[:-1]
                    if line:
                        if line.startswith(b"data:"):
                            data_lines.append(line[6:] if line[5:6] == b" " else line[5:])
                        continue
                    if not data_lines:
                        continue
                    payload = data_lines[0] if len(data_lines) == 1 else b"\n".join(data_lines)
                    data_lines = []
                    if payload == b"[DONE]":
                        continue
                    event = loads(payload)
                    state["chunks"] += 1
                    choices = event.get("choices") if isinstance(event, dict) else None
                    if choices:
                        choice = choices[0]
                        delta = choice.get("delta") or {}
                        text = (
                            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                        )
                        if text and isinstance(text, str):
                            arrivals.append(now_ns)
                            parts.append(text)
                        if choice.get("finish_reason") is not None:
                            state["finish_reason"] = choice["finish_reason"]
                    elif isinstance(event, dict):
                        error = _event_error(event)
                        if error is not None:
                            raise error
                    usage = event.get("usage") if isinstance(event, dict) else None
                    if usage:
                        state["usage"] = usage
    except (aiohttp.ClientError, OSError) as exc:
        request = httpx2.Request("POST", url)
        if isinstance(exc, TimeoutError):
            raise openai.APITimeoutError(request=request) from exc
        raise openai.APIConnectionError(message=str(exc), request=request) from exc


async def stream_chat(
    client: openai.AsyncOpenAI | SSEClient,
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

    ``client``: an :class:`SSEClient` or an ``openai.AsyncOpenAI``; both give the same record.
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
    state: dict[str, Any] = {
        "arrivals_ns": [],
        "parts": [],
        "usage": None,
        "chunks": 0,
        "finish_reason": None,
        "in_stream": False,
    }
    failure: BaseException | None = None
    perf = time.perf_counter_ns
    if isinstance(client, SSEClient):
        client.session()  # made before the clock starts
        send_ns = perf()
        try:
            await _stream_sse(client, kwargs, state)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a classified record
            failure = exc
    else:
        # Resolved before the clock starts: the first access imports the client's resource
        # modules (~0.1 s), which is not the endpoint's latency.
        create = client.chat.completions.create
        send_ns = perf()
        try:
            await _stream_openai(create, kwargs, state)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a classified record
            failure = exc
    end_ns = perf()
    usage = state["usage"]
    if usage is not None and not isinstance(usage, dict):
        usage = {
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
        }
    return _record(
        state,
        usage,
        send_ns,
        end_ns,
        failure,
        request_id=request_id,
        level=level,
        max_concurrency=max_concurrency,
        warmup=warmup,
        input_tokens=input_tokens,
        count_tokens=count_tokens,
        api_key_env=api_key_env,
        model=model,
        secret=getattr(client, "api_key", None),
    )


async def _stream_openai(create: Any, kwargs: dict[str, Any], state: dict[str, Any]) -> None:
    """Send the request with the openai client and read its chunks into ``state``."""
    arrivals_ns, parts = state["arrivals_ns"], state["parts"]
    perf = time.perf_counter_ns
    stream = await create(**kwargs)
    state["in_stream"] = True
    try:
        async for chunk in stream:
            now_ns = perf()
            state["chunks"] += 1
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
                    state["finish_reason"] = choice.finish_reason
            elif getattr(chunk, "object", None) == "error":
                raise _in_stream_error(chunk)
            if chunk.usage is not None:
                state["usage"] = chunk.usage
    finally:
        await stream.close()


def fill_output_tokens(record: RequestRecord, count_tokens: Callable[[str], int] | None) -> None:
    """Count the output by the tokenizer when the server sent no usage, then set TPOT.

    ``output_tokens`` already set (from usage) is kept; otherwise, with text and a tokenizer,
    ``count_tokens(output_text)`` with source ``tokenizer``. ``tpot_ms`` by
    :func:`tasks.stream.timing.tpot_ms` (at least 2 tokens and 2 text chunks). Used after the
    stream (never inside the receive loop) and by the parent of client processes.
    """
    if record.output_tokens is None and record.output_text and count_tokens is not None:
        record.output_tokens = int(count_tokens(record.output_text))
        record.output_tokens_source = "tokenizer"
    record.tpot_ms = tpot_ms(
        record.ttft_ms, record.e2e_ms, record.output_tokens, len(record.token_offsets_ms)
    )


def _record(
    state: dict[str, Any],
    usage: dict[str, Any] | None,
    send_ns: int,
    end_ns: int,
    failure: BaseException | None,
    *,
    request_id: str,
    level: int,
    max_concurrency: int,
    warmup: bool,
    input_tokens: int | None,
    count_tokens: Callable[[str], int] | None,
    api_key_env: str | None,
    model: str,
    secret: str | None,
) -> RequestRecord:
    """The record of one request from what its stream gave (DESIGN.md's definitions)."""
    arrivals_ns, parts = state["arrivals_ns"], state["parts"]
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
        record.input_tokens = usage.get("prompt_tokens")
    if state["in_stream"]:
        record.stream_close_ms = (end_ns - send_ns) / _NS_PER_MS
    timing = chunk_timing(send_ns, arrivals_ns)  # TPOT once the output count is known
    record.token_offsets_ms, record.itl_ms = list(timing.token_offsets_ms), list(timing.itl_ms)
    record.ttft_ms, record.e2e_ms = timing.ttft_ms, timing.e2e_ms

    completion_tokens = usage.get("completion_tokens") if usage is not None else None
    if completion_tokens is not None:
        record.output_tokens = int(completion_tokens)
        record.output_tokens_source = "usage"
    fill_output_tokens(record, count_tokens)

    if failure is not None:
        record.error_class, record.error_message = classify(
            failure,
            api_key_env=api_key_env,
            model=model,
            in_stream=state["in_stream"],
            secrets=(secret,),
        )
    elif not arrivals_ns:
        record.error_class = EMPTY_RESPONSE
        record.error_message = (
            f"HTTP 200 but the stream carried no text ({state['chunks']} chunks, "
            f"finish_reason={state['finish_reason']}, usage completion_tokens={completion_tokens})"
        )
    return record
