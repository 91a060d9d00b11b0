"""The receive loops of the two transports: one request's chunks -> the stream state.

:func:`receive_sse` (the stream client's own HTTP/1.1, :mod:`tasks.wire.h1`, and SSE parser,
behind :class:`tasks.stream.client.SSEClient`) and
:func:`tasks.wire.openai_reader.receive_openai` (the openai client's ``AsyncOpenAI``) fill the same state (:func:`new_state`): the arrival times
(``time.perf_counter_ns()``) and texts of the text-carrying chunks, the final usage, the chunk
count, the finish reason, and whether the stream was open. A text-carrying chunk is defined in
:mod:`tasks.stream.client`'s docstring (for ``/completions``: a choice whose ``text`` is not
empty); the record is built from the state there.

Separate from :mod:`tasks.stream.client` because this is the hot path and nothing else: inside
the receive loops there is only a clock read, the text lookup and list appends: no logging, no
tokenizing, no string joins. Transport failures are raised as the openai client would raise them
(``openai.APIStatusError``, ``APITimeoutError``, ``APIConnectionError``), and an in-stream error
object as a :class:`tasks.wire.errors.StreamError`, so one classifier
(``tasks.wire.errors.classify``) serves both.

Why two: the transports were chosen on numbers (``tests/benchmarks/stream_client.py``, README
"Stream"): at 64 and 256 concurrent streams the openai client's per-chunk parsing (a pydantic
model per chunk over httpx2) makes its own event loop the bottleneck and its measured ITL error
p99 grows to ~0.1 s / ~1 s, while a byte-level SSE parser (then over aiohttp, now over
:mod:`tasks.wire.h1`) stays within a few ms.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx2
import msgspec
import openai
import orjson

from tasks.wire import h1
from tasks.wire.errors import BAD_PAYLOAD, SERVER, StreamError
from tasks.wire.pool import Pool
from tasks.wire.sse import SSEFramer, loads

#: The longest an error response's body may go without new bytes before it is taken as it is:
#: a server or proxy that leaves it open (an answer's body: tasks.wire.h1.END_GRACE_S) must
#: not turn its status into a timeout after ``request_timeout_s``.
ERROR_BODY_WAIT_S = 0.5


def new_state() -> dict[str, Any]:
    """An empty stream state, filled by a receive loop.

    Keys: ``arrivals_ns`` (list of int, ``time.perf_counter_ns()`` per text-carrying chunk when
    the read that delivered it returned, or when the openai client yielded it: the user-space
    clock), ``rx_ns`` (the
    kernel CLOCK_REALTIME receive time of the read that completed each text-carrying chunk, 0
    where none; empty on a transport without stamps: :mod:`tasks.wire.rxclock`), ``parts``
    (list of str, their texts), ``usage`` (the last usage seen: a dict from SSE, the openai
    client's usage object, or None), ``chunks`` (int, every parsed chunk),
    ``finish_reason`` (str or None), ``refusal`` (the last refusal text chunk's, '' none: the
    answer was a refusal), ``in_stream`` (bool, True once a 200 response began),
    ``connect_ns`` ((start, end) ``perf_counter_ns`` of opening a new connection; None when a
    pooled one was reused) and ``sent_ns`` (``perf_counter_ns`` when the request's last byte was
    handed to the kernel; 0 unknown), ``done`` (bool, ``[DONE]`` came; the openai transport
    never sees it), ``tool_calls`` (``{index: [name, arguments]}``, the tool-call fragments
    joined per ``tool_calls[].index``: :func:`add_tool_calls`) and ``timings`` (llama.cpp's own
    server's ``timings`` object, e.g. ``cache_n`` prompt tokens taken from its cache, as sent on
    its final chunk, ``choices: []`` since llama.cpp #16048, or on the chunk with the
    ``finish_reason`` before; None: none sent). The final chunk's extras are read only on a
    chunk without choices or with a ``finish_reason``: never on every chunk. ``content_encoding``:
    the body's codings (``"gzip"``; None: as sent; :mod:`tasks.wire.codings`); ``answered``: what
    a reader calls at its answer's end (``[DONE]``, or a usage after the ``finish_reason``, on its
    chunk or a later one): :meth:`tasks.wire.h1.Response.answered`, ``grace.AnswerGrace``'s.
    """
    return {
        "arrivals_ns": [],
        "rx_ns": [],
        "parts": [],
        "usage": None,
        "chunks": 0,
        "finish_reason": None,
        "refusal": "",
        "in_stream": False,
        "connect_ns": None,
        "sent_ns": 0,
        "done": False,
        "tool_calls": {},
        "timings": None,
        "content_encoding": None,
        "answered": lambda: None,  # until read_sse has a response (never, on the openai transport)
    }


def arrived(state: dict[str, Any], read_ns: int, rx_ns: int | None, text: str) -> None:
    """Keep a text chunk in ``state``: its text, its read's ``perf_counter_ns`` and, from a
    stamped socket (``rx_ns`` not None), that read's kernel stamp (``tasks.wire.h1.Sink``)."""
    state["arrivals_ns"].append(read_ns)
    if rx_ns is not None:
        state["rx_ns"].append(rx_ns)
    state["parts"].append(text)


def _field(obj: Any, key: str) -> Any:
    """``obj[key]`` of a parsed dict, ``obj.key`` of an openai client model; None when absent."""
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def add_tool_calls(calls: Any, joined: dict[int, list[str]]) -> bool:
    """Join one delta's ``tool_calls`` fragments into ``joined`` (``index -> [name,
    arguments]``; dicts from the SSE parser or the openai client's models). Returns True when a
    fragment carried generated text (a function name or an arguments fragment): such a chunk is
    a text chunk for TTFT and ITL like content (AIPerf PR #804). Malformed fragments are skipped.
    """
    generated = False
    for call in calls if isinstance(calls, list) else ():
        function = _field(call, "function")
        if function is None:
            continue
        index = _field(call, "index")
        entry = joined.setdefault(index if isinstance(index, int) else 0, ["", ""])
        for slot, key in enumerate(("name", "arguments")):
            piece = _field(function, key)
            if isinstance(piece, str) and piece:
                entry[slot] += piece
                generated = True
    return generated


def _shape_error(what: str, payload: bytes) -> StreamError:
    """A data line that is JSON but not a chat-completions chunk."""
    return StreamError(BAD_PAYLOAD, f"the server sent a chunk of the wrong shape ({what}): {payload[:120]!r}")


def _request_body(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The JSON body the openai client would send for :func:`tasks.stream.client.build_request`'s
    kwargs."""
    body = {k: v for k, v in kwargs.items() if k != "extra_body"}
    body.update(kwargs.get("extra_body") or {})
    return body


def _dumps(body: dict[str, Any]) -> bytes:
    """The request's JSON (RFC 8259), compact and UTF-8 as the openai client's httpx writes it:
    orjson's (~1 us against ~8 for ``json.dumps``), ``json``'s for what orjson refuses (an
    integer beyond 64 bits, a key that is not a string: a user's ``extra_body``)."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _status_error(url: str, status: int, headers: Any, raw: bytes) -> openai.APIStatusError:
    """An HTTP error response as the openai client would raise it (same classification)."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode("utf-8", "replace")
    data = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    headers = {k: v for k, v in headers.items() if k != "content-encoding"}  # raw: decoded by h1
    response = httpx2.Response(status, headers=headers, content=raw, request=httpx2.Request("POST", url))
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


class _Delta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None  # structured-output refusals: text (tasks.stream.client's docstring)
    tool_calls: msgspec.Raw = None  # type: ignore[assignment]  # (Raw | None fails on any value)


class _Choice(msgspec.Struct, gc=False):
    delta: _Delta | None = None
    text: str | None = None  # /completions
    finish_reason: Any = None


class _Chunk(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    usage: msgspec.Raw = None  # type: ignore[assignment]
    timings: msgspec.Raw = None  # type: ignore[assignment]


#: The fields of a chat (or /completions) chunk that :func:`receive_sse` reads, decoded by
#: msgspec into these types and every other field skipped unread: ~0.5 us a chunk against ~1.0
#: for orjson's whole dict and its look-ups (README "Parsed to the fields it needs"). A chunk of
#: any other shape (no choices, an error object, a field of another type) fails the types and is
#: read by :func:`_read_event`, as every chunk was before.
_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _read_event(payload: bytes, state: dict[str, Any]) -> tuple[Any, bool, Any, Any, Any]:
    """A chunk that is not of the usual typed shape, read from its JSON value: ``(text, called,
    finish_reason, usage, timings)`` (:func:`receive_sse`'s on_event; ``called``: a tool-call
    fragment carried generated text), ``state["chunks"]`` counted and its tool-call fragments
    joined. Raises ``json``'s ``JSONDecodeError`` for a line that is not JSON, a
    :class:`StreamError` for an error object or a chunk of the wrong shape."""
    event = loads(payload)
    state["chunks"] += 1
    if not isinstance(event, dict):
        raise _shape_error("the data line is not a JSON object", payload)
    text = finish_reason = timings = None
    called = False
    choices = event.get("choices")
    if choices:
        choice = choices[0] if isinstance(choices, list) else None
        if not isinstance(choice, dict):
            raise _shape_error("choices[0] is not an object", payload)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
            if not text and isinstance(delta.get("refusal"), str):
                text = state["refusal"] = delta["refusal"]
            calls = delta.get("tool_calls")
            if calls:
                called = add_tool_calls(calls, state["tool_calls"])
        else:  # /completions: choices[].text
            text = choice.get("text")
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None:
            timings = event.get("timings")  # llama.cpp's, on its last choice chunk
    else:
        error = _event_error(event)
        if error is not None:
            raise error
        timings = event.get("timings")  # llama.cpp's final chunk, ``choices: []``
    return text, called, finish_reason, event.get("usage"), timings


async def read_sse(
    pool: Pool,
    url: str,
    headers: dict[str, str],
    kwargs: dict[str, Any],
    state: dict[str, Any],
    timeout_s: float,
    on_event: Callable[[bytes, int, int | None], None],
) -> None:
    """POST ``kwargs`` (:func:`tasks.stream.client.build_request`'s, as the openai client would
    send them) to ``url`` on ``pool`` and, once the status is 200, call ``on_event(payload,
    read_ns, rx_ns)`` for every SSE event of the body (:class:`SSEFramer`'s payloads) in the
    loop callback of the read that completed it, with that read's stamps
    (``tasks.wire.h1.Sink``); return when the body has ended. Sets ``state["in_stream"]``,
    ``state["sent_ns"]`` and, for a new connection, ``state["connect_ns"]``. ``timeout_s``
    bounds the wait for the response's head (connecting, sending, the server's first bytes)
    and each wait for the body's next bytes.

    Raises: what ``on_event`` raised; ``openai.APIStatusError`` for a status other than 200;
    ``openai.APITimeoutError`` / ``APIConnectionError`` for a transport failure, while posting
    or reading (as the openai client raises them).
    """
    framer = SSEFramer(on_event)
    response = None
    try:
        async with asyncio.timeout(timeout_s):
            response = await pool.post(url, headers, _dumps(_request_body(kwargs)), state)
        state["sent_ns"] = response.sent_ns  # an error's too: its record says when it was sent
        if response.status != 200:
            body = await response.read_all(min(timeout_s, ERROR_BODY_WAIT_S))
            raise _status_error(url, response.status, response.headers, body)
        state["in_stream"] = True
        state["content_encoding"], state["answered"] = response.content_encoding, response.answered
        await response.consume(framer.sink, timeout_s, (framer, on_event))
    except (h1.ProtocolError, OSError) as exc:
        request = httpx2.Request("POST", url)
        if isinstance(exc, TimeoutError):
            raise openai.APITimeoutError(request=request) from exc
        raise openai.APIConnectionError(message=str(exc), request=request) from exc
    finally:
        if response is not None:
            pool.release(response)


def chat_events(state: dict[str, Any]) -> Callable[[bytes, int, int | None], None]:
    """The reader of a chat (or /completions) stream's events into ``state`` (:func:`new_state`):
    ``on_event(payload, read_ns, rx_ns)`` for every SSE event's payload, with the stamps of the
    read that completed it (``tasks.wire.h1.Sink``). The usual chunk is read typed
    (:data:`_decode_chunk`), any other by :func:`_read_event`, to the same state.

    ``on_event`` raises what :func:`_read_event` raises."""
    tool_calls = state["tool_calls"]
    # :func:`arrived`'s lists, bound here: on_event runs once per chunk (README "Cheaper per chunk")
    arrivals_ns, stamps_ns, parts = state["arrivals_ns"], state["rx_ns"], state["parts"]

    def on_event(payload: bytes, read_ns: int, rx_ns: int | None) -> None:
        if payload == b"[DONE]":
            state["done"] = True
            state["answered"]()  # the request ends here, whatever the body does after (h1)
            return
        try:
            chunk = _decode_chunk(payload)
        except msgspec.MsgspecError:  # not JSON, or not the usual shape: the general reading
            chunk = None
        if chunk is not None and chunk.choices:  # the usual chunk, read typed
            state["chunks"] += 1
            choice = chunk.choices[0]
            delta = choice.delta
            called = False
            if delta is not None:
                text = delta.content or delta.reasoning_content or delta.reasoning
                if not text and delta.refusal:  # read only where the usual fields are empty
                    text = state["refusal"] = delta.refusal
                if delta.tool_calls is not None:
                    called = add_tool_calls(loads(bytes(delta.tool_calls)), tool_calls)
            else:  # /completions: choices[].text
                text = choice.text
            finish_reason, timings = choice.finish_reason, None
            if finish_reason is not None and chunk.timings is not None:
                timings = loads(bytes(chunk.timings))  # llama.cpp's, on its last choice chunk
            usage = None if chunk.usage is None else loads(bytes(chunk.usage))
        else:
            text, called, finish_reason, usage, timings = _read_event(payload, state)
        if not isinstance(text, str):
            text = ""
        if text or called:  # arrived(state, read_ns, rx_ns, text), without the call
            arrivals_ns.append(read_ns)
            if rx_ns is not None:
                stamps_ns.append(rx_ns)
            parts.append(text)
        if finish_reason is not None:
            state["finish_reason"] = finish_reason
        if timings is not None:
            state["timings"] = timings
        if usage:
            state["usage"] = usage
            if state["finish_reason"] is not None:  # the answer's close: finish, then its usage
                state["answered"]()  # (or both on one chunk): its end, as [DONE]'s (h1)

    return on_event


async def receive_sse(
    pool: Pool,
    url: str,
    headers: dict[str, str],
    kwargs: dict[str, Any],
    state: dict[str, Any],
    timeout_s: float,
) -> None:
    """POST the request to ``url`` and read its SSE body into ``state`` (:func:`new_state`).

    ``kwargs``: :func:`tasks.stream.client.build_request`'s, sent as the openai client would;
    ``timeout_s``: :func:`read_sse`'s. Every event gets the stamps of the read that completed
    it (:func:`chat_events`). Transport failures are raised as the openai client would raise them.
    """
    await read_sse(pool, url, headers, kwargs, state, timeout_s, chat_events(state))
