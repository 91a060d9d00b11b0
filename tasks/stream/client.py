"""One streamed chat request -> one :class:`RequestRecord`.

Timing (TTFT, ITL, E2E, TPOT) follows DESIGN.md "Metric definitions" and is computed in one
place, :func:`tasks.stream.timing.chunk_timing`, from the send time and the arrival times of the
text-carrying chunks this module collects:

- The clock is ``time.perf_counter_ns()`` read just before the request is sent.
- A text-carrying chunk is one whose delta carries ``content``, or a reasoning field
  (``reasoning_content`` / ``reasoning``, sent by vLLM, SGLang, llama.cpp, DeepSeek as extra
  fields, exposed by the openai client in ``delta.model_extra``), or ``refusal`` text (OpenAI's
  structured-output refusals, passed on by gateways: tensorzero PR #4961, nvcf PR #1826; the
  record's ``refusal`` says the answer was one). A role-only or empty chunk is not a token.
- ``stream_close_ms``: to the end of the stream (a late usage-only chunk and ``[DONE]``
  stretch only this one, never ``e2e_ms``).
- ``error_after_ms``: every failed record's send -> failure, the wait its user had.
- A text-carrying chunk is also one whose delta carries ``tool_calls`` fragments (a function
  name or arguments): generated tokens like content (AIPerf PR #804); the fragments are joined
  per ``tool_calls[].index`` into the record's ``tool_calls``.
- ``output_tokens``: the final usage's generated tokens when the server sends a count that can
  be trusted (asked for with ``stream_options={"include_usage": True}``; checked and read by
  :func:`tasks.wire.usage.read_usage`: reasoning conventions, 0 for a stream with text, values
  that are not counts), else ``count_tokens(generated text)`` (the caller's tokenizer, without
  special tokens; GenAI-Perf counts the same way) with ``usage_problem`` saying why. Never the
  chunk count, never ``max_tokens``.
- ``cached_tokens``: the usage's ``prompt_tokens_details.cached_tokens``, else llama.cpp's own
  server's ``timings.cache_n`` (its final chunk; ``level_result.fill_cached_tokens``).
- A stream that ends cleanly with text but without a ``finish_reason``, a usage or ``[DONE]``
  may have been cut anywhere (inference-perf #655): ``stream_broken``, not a success.
- ``api="responses"`` (OpenAI's Responses API): its events are read into the same state by
  :mod:`tasks.wire.responses` (text and reasoning deltas are the text chunks; the usage of
  ``response.completed`` in the chat names); a body that ends before ``response.completed`` or
  ``response.incomplete`` is ``stream_broken``.

Two transports give the same record: :class:`SSEClient` (our own HTTP/1.1 and SSE parser; the
default of ``tasks.stream.load.make_client``) and the openai client's ``AsyncOpenAI``. Their
receive loops (only a clock read, the text lookup and list appends inside; no logging, no
tokenizing, no string joins) and why there are two are in :mod:`tasks.wire.transports`; this
module sends the request, reads the clock around it and builds the record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import openai

from tasks.engines.death import server_gone
from tasks.stream.level_result import fill_cached_tokens, fill_output_tokens
from tasks.stream.records import RequestRecord
from tasks.stream.timing import chunk_timing
from tasks.wire import codings, rxclock
from tasks.wire.errors import (
    BAD_PAYLOAD,
    CONNECTION,
    EMPTY_RESPONSE,
    SERVER_DIED,
    STREAM_BROKEN,
    classify,
    server_died_message,
)
from tasks.wire.openai_reader import receive_openai
from tasks.wire.pool import Pool
from tasks.wire.responses import receive_openai_responses, receive_responses, warm_openai_events
from tasks.wire.transports import new_state, receive_sse
from tasks.wire.usage import read_usage

#: Sampling keys sent as named arguments of ``chat.completions.create``.
_NAMED_SAMPLING = ("temperature", "top_p", "seed")
#: Those the Responses API has (``responses.create``); the rest go through ``extra_body``.
_NAMED_RESPONSES = ("temperature", "top_p")

_NS_PER_MS = 1_000_000.0  # stream_close_ms only; the rest is tasks.stream.timing's


def build_request(
    *,
    model: str,
    prompt: str,
    max_tokens: int,
    sampling: dict[str, Any] | None = None,
    extra_body: dict[str, Any] | None = None,
    api: str = "chat",
    history: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``client.chat.completions.create`` (streaming, usage asked).

    ``history``: the conversation's earlier messages (``{"role", "content"}``, user and
    assistant in turn), sent before ``prompt`` as the new user message (chat only).

    ``api="completions"``: for ``client.completions.create`` (``/completions``): the prompt
    goes as ``prompt`` (no chat template) and the limit as ``max_tokens`` (the only name that
    endpoint knows); the rest is the same.

    ``api="responses"``: for ``client.responses.create`` (``/responses``, OpenAI's Responses
    API): ``input`` is the prompt text, or the messages when there is a ``history``; the limit
    is ``max_output_tokens``; ``store: false`` (nothing kept on the server); only
    ``temperature`` and ``top_p`` are named (the API has no ``seed``), the other sampling keys
    and ``extra_body`` go through ``extra_body`` (vLLM reads ``seed``, ``top_k``,
    ``ignore_eos`` there); no ``stream_options`` (the usage comes in ``response.completed``).

    ``max_completion_tokens`` is the current OpenAI name; ``max_tokens`` goes too (through
    ``extra_body``) for servers that know only that one. ``temperature``, ``top_p`` and
    ``seed`` are named arguments; ``top_k`` and any other sampling key (not in the OpenAI
    API) go through ``extra_body``, as vLLM, SGLang and llama.cpp read them. None values are
    not sent.
    """
    body: dict[str, Any] = {"max_tokens": max_tokens}
    kwargs: dict[str, Any] = {}
    named = _NAMED_RESPONSES if api == "responses" else _NAMED_SAMPLING
    for key, value in (sampling or {}).items():
        if value is None:
            continue
        if key in named:
            kwargs[key] = value
        else:
            body[key] = value
    body.update(extra_body or {})
    if api == "responses":
        del body["max_tokens"]
        text: dict[str, Any] = {
            "input": [*history, {"role": "user", "content": prompt}] if history else prompt
        }
        return {
            "model": model,
            **text,
            "stream": True,
            "store": False,
            "max_output_tokens": max_tokens,
            "extra_body": body,
            **kwargs,
        }
    if api == "completions":
        limit = {"max_tokens": body.pop("max_tokens")}
        text = {"prompt": prompt}
    else:
        limit, text = (
            {"max_completion_tokens": max_tokens},
            {"messages": [*(history or []), {"role": "user", "content": prompt}]},
        )
    return {
        "model": model,
        **text,
        "stream": True,
        "stream_options": {"include_usage": True},
        **limit,
        "extra_body": body,
        **kwargs,
    }


class SSEClient:
    """An OpenAI-compatible chat-completions client over the stream client's own HTTP/1.1
    (:mod:`tasks.wire.h1`); :func:`stream_chat` reads its streams with the SSE parser of
    :func:`tasks.wire.transports.receive_sse`.

    The same interface as the parts of ``AsyncOpenAI`` the stream client uses: ``api_key``,
    ``base_url`` and ``await close()``. ``request_timeout_s`` bounds connecting and each read
    (the wait for the next bytes), as the openai client's timeout does; there are no retries.
    ``kernel_clock``: its sockets stamp receives in the kernel (:mod:`tasks.wire.rxclock`;
    Linux only, else the user-space clock). ``ca_bundle``: a PEM file of the CAs that sign the
    endpoint's certificate (else the system store or ``SSL_CERT_FILE``); a proxy the
    environment names is used as :mod:`tasks.wire.proxy` says (:class:`tasks.wire.pool.Pool`).

    Raises:
        ValueError: ``base_url`` is not an http(s) URL.
        tasks.wire.proxy.ProxyError: a proxy variable names a proxy it cannot use.
        OSError: ``ca_bundle`` cannot be read.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        request_timeout_s: float,
        kernel_clock: bool = True,
        ca_bundle: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or "no-key"
        self.url = f"{self.base_url}/chat/completions"
        self.completions_url = f"{self.base_url}/completions"
        self.responses_url = f"{self.base_url}/responses"
        self.headers = {
            "Authorization": f"Bearer {self.api_key}",
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Accept-Encoding": codings.ACCEPT_ENCODING,  # a compressed body is decoded (h1)
        }
        self.request_timeout_s = request_timeout_s
        self.kernel_clock = kernel_clock and rxclock.SUPPORTED
        self.pool = Pool(self.base_url, self.kernel_clock, ca_bundle=ca_bundle)

    async def close(self) -> None:
        """Close the kept connections."""
        await self.pool.close()


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
    api: str = "chat",
    history: list[dict[str, str]] | None = None,
    server_pid: int | None = None,
) -> RequestRecord:
    """Send one streaming chat request and measure it (see the module docstring).

    ``client``: an :class:`SSEClient` or an ``openai.AsyncOpenAI``; both give the same record.
    Every exception of the request or the stream is caught and classified
    (``tasks.wire.errors.classify``); the record keeps what was measured before it. A
    stream that ends without a text chunk is an ``empty_response``. ``api_key_env`` (the
    NAME of the key's variable) is only used in the message of a 401/403.

    ``input_tokens``: the caller's count of the prompt; when None, the server's
    ``usage.prompt_tokens`` if it sends one.

    ``api``: ``"chat"`` (``/chat/completions``), ``"completions"`` (``/completions``, text
    from ``choices[].text``) or ``"responses"`` (``/responses``, the Responses API's events:
    :mod:`tasks.wire.responses`); the same definitions and error classes. ``history``: a
    conversation's earlier messages (:func:`build_request`).

    ``server_pid``: the embedded server this command started, where it is the endpoint. A
    request refused or cut (``connection``, ``stream_broken``) while that process is gone is of
    the class ``server_died``: the server's death, not the endpoint's address
    (:mod:`tasks.engines.death`).
    """
    kwargs = build_request(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        extra_body=extra_body,
        api=api,
        history=history,
    )
    state = new_state()
    failure: BaseException | None = None
    perf = time.perf_counter_ns
    if isinstance(client, SSEClient):
        url = client.completions_url if api == "completions" else client.url
        receive = receive_sse
        if api == "responses":
            url, receive = client.responses_url, receive_responses
        send_ns = perf()
        try:
            await receive(client.pool, url, client.headers, kwargs, state, client.request_timeout_s)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a classified record
            failure = exc
    else:
        # Resolved before the clock starts: the first access imports the client's resource
        # modules (~0.1 s), which is not the endpoint's latency.
        create = client.completions.create if api == "completions" else client.chat.completions.create
        receive_events = receive_openai
        if api == "responses":
            create, receive_events = client.responses.create, receive_openai_responses
            warm_openai_events()  # its event models, built once (~0.6 s), not on the clock
        send_ns = perf()
        try:
            await receive_events(create, kwargs, state)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a classified record
            failure = exc
    end_ns = perf()
    # after the stream, never inside it: CLOCK_REALTIME - CLOCK_MONOTONIC for the kernel stamps
    offset_ns = rxclock.realtime_offset_ns() if state["rx_ns"] else 0
    identity = {
        "request_id": request_id,
        "level": level,
        "max_concurrency": max_concurrency,
        "warmup": warmup,
        "send_ns": send_ns,
        "input_tokens": input_tokens,
    }
    try:
        record = _build_record(
            state,
            identity,
            end_ns,
            failure,
            offset_ns=offset_ns,
            count_tokens=count_tokens,
            api_key_env=api_key_env,
            model=model,
            secret=getattr(client, "api_key", None),
            kernel_clock=isinstance(client, SSEClient) and client.kernel_clock,
        )
    except Exception as exc:  # noqa: BLE001 - whatever a server sent, the level keeps a record
        return RequestRecord(
            **identity,
            error_class=BAD_PAYLOAD,
            error_message=f"the stream could not be read into a record: {type(exc).__name__}: {exc}",
            error_after_ms=(end_ns - send_ns) / _NS_PER_MS,
        )
    if server_pid and record.error_class in (CONNECTION, STREAM_BROKEN) and await _gone_soon(server_pid):
        record.error_class = SERVER_DIED
        record.error_message = server_died_message(server_pid, record.error_message)
    return record


#: How long a failed request waits for the embedded server's process to be gone: a dying
#: process's sockets close before it is a zombie (and a SIGSEGV's core dump comes first), so the
#: client can see the cut a moment before the pid shows the death. Only failed requests wait,
#: after their times were taken, without blocking the loop.
DEATH_GRACE_S = 1.0


async def _gone_soon(server_pid: int) -> bool:
    """Whether the server ``server_pid`` is gone, or goes within :data:`DEATH_GRACE_S`."""
    deadline = time.monotonic() + DEATH_GRACE_S
    while not server_gone(server_pid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _build_record(
    state: dict[str, Any],
    identity: dict[str, Any],
    end_ns: int,
    failure: BaseException | None,
    *,
    offset_ns: int,
    count_tokens: Callable[[str], int] | None,
    api_key_env: str | None,
    model: str,
    secret: str | None,
    kernel_clock: bool,
) -> RequestRecord:
    """The record of one request from what its stream gave (DESIGN.md's definitions).

    The text chunks' times are their kernel receive stamps when every one has a usable stamp
    (``tasks.wire.rxclock.kernel_arrivals``; the user-space ones are kept beside them), else
    the user-space ones (``arrival_clock``), and where the kernel's were asked for
    (``kernel_clock``) ``clock_fallback`` says why they could not be used. ``identity``: the
    record's ``request_id``, ``level``, ``max_concurrency``, ``warmup``, ``send_ns`` and
    ``input_tokens``."""
    send_ns, input_tokens = identity["send_ns"], identity["input_tokens"]
    user_ns, parts = state["arrivals_ns"], state["parts"]
    kernel_ns, fallback = rxclock.kernel_arrivals(send_ns, user_ns, state["rx_ns"], offset_ns)
    arrivals_ns = kernel_ns if kernel_ns is not None else user_ns
    record = RequestRecord(
        **identity,
        clock_fallback=fallback if kernel_clock else None,
        output_text="".join(parts),
        refusal=bool(state["refusal"]),
        tool_calls=[
            {"index": index, "name": name, "arguments": arguments}
            for index, (name, arguments) in sorted(state["tool_calls"].items())
        ],
    )
    usage = read_usage(state["usage"], carried_text=bool(arrivals_ns))
    if input_tokens is None:
        record.input_tokens = usage.prompt_tokens
    if state["in_stream"]:
        record.stream_close_ms = (end_ns - send_ns) / _NS_PER_MS
        record.content_encoding = state["content_encoding"]
    timing = chunk_timing(send_ns, arrivals_ns)  # TPOT once the output count is known
    record.token_offsets_ms, record.itl_ms = list(timing.token_offsets_ms), list(timing.itl_ms)
    record.ttft_ms, record.e2e_ms = timing.ttft_ms, timing.e2e_ms
    if kernel_ns is not None:
        record.arrival_clock = "kernel"
        record.user_token_offsets_ms = [(t - send_ns) / _NS_PER_MS for t in user_ns]
        record.coalesced_events = rxclock.coalesced_events(state["rx_ns"], kernel_ns, user_ns)
    if state["connect_ns"] and state["connect_ns"][1]:
        record.connect_ms = (state["connect_ns"][1] - send_ns) / _NS_PER_MS
    if state["sent_ns"] >= send_ns:
        record.request_sent_ms = (state["sent_ns"] - send_ns) / _NS_PER_MS

    record.reasoning_tokens, record.usage_convention = usage.reasoning_tokens, usage.convention
    record.cached_tokens, record.usage_prompt_tokens = usage.cached_tokens, usage.prompt_tokens
    if state["timings"] is not None:  # llama.cpp's own server: its cache in timings
        fill_cached_tokens(record, state["timings"])
    record.usage_problem = usage.problem
    if usage.output_tokens is not None:
        record.output_tokens = usage.output_tokens
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
            f"finish_reason={state['finish_reason']}, usage output tokens={usage.output_tokens})"
        )
    elif state["finish_reason"] is None and state["usage"] is None and not state["done"]:
        record.error_class = STREAM_BROKEN
        record.error_message = (
            f"the stream ended after {len(arrivals_ns)} text chunks with no finish_reason, no usage "
            "and no [DONE]: the answer may have been cut anywhere (a proxy or the server closed it)"
        )
    if record.error_class is not None:  # whatever failed, how long its user waited for it
        record.error_after_ms = (end_ns - send_ns) / _NS_PER_MS
    return record
