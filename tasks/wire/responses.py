"""The Responses API transport (``POST {base_url}/responses``, ``--api responses``): one
request's events -> the stream state of :func:`tasks.wire.transports.new_state`.

OpenAI's Responses API ("Streaming events" in its API reference; vLLM serves it, and its
``bench serve`` has a Responses backend, vLLM PR #54628) streams SSE events with an ``event:
<type>`` line and a JSON ``data:`` line carrying the same ``type``:

- Text: ``response.output_text.delta`` (``delta``: a string). Reasoning:
  ``response.reasoning_text.delta`` and ``response.reasoning_summary_text.delta``, counted as
  token-carrying as the chat transport counts ``reasoning_content``. A function call's
  ``response.function_call_arguments.delta`` (and its name, in ``response.output_item.added``)
  is joined per ``output_index`` into the state's ``tool_calls``, a text chunk as chat's
  ``tool_calls`` fragments are. An empty delta is not a token.
- A refusal (``response.refusal.delta``; ``response.refusal.done``'s whole ``refusal`` where no
  delta came before it) is the answer's text too, and the state's ``refusal`` says so, as
  chat's ``delta.refusal`` (:func:`tasks.wire.transports.chat_events`).
- ``response.completed``: the end; ``response.usage`` (``input_tokens``, ``output_tokens``,
  ``input_tokens_details.cached_tokens``, ``output_tokens_details.reasoning_tokens``,
  ``total_tokens``) is kept in the chat names (:func:`chat_usage`), so the record is built by
  :mod:`tasks.stream.client` unchanged. ``response.incomplete`` also ends it, its finish reason
  from ``response.incomplete_details.reason`` (``max_output_tokens`` -> ``length``).
- ``response.failed`` or an ``error`` event: a server error (``StreamError``, class
  ``server``), as an error object inside a chat stream.
- The request ends at ``response.completed`` / ``response.incomplete`` (or the error of
  ``response.failed``), even where the body is never terminated after it
  (:meth:`tasks.wire.h1.Response.answered`; the openai client's: :mod:`tasks.wire.grace`).
- A body that ends before ``response.completed`` or ``response.incomplete`` was cut, whatever
  it carried: ``stream_broken``, never a success (the class the chat transport gives a stream
  that ends without ``finish_reason``, usage or ``[DONE]``; vLLM PR #54628's review found a
  benchmark counting such streams as successes).

Timing is the SSE transport's (:func:`tasks.wire.transports.read_sse`): every event gets the
``time.perf_counter_ns()`` and the kernel's receive stamp of the read that completed it
(:mod:`tasks.wire.rxclock`). The readers are the hot path: the type lookup and list appends.
"""

from __future__ import annotations

import time
from typing import Any

from tasks.wire.errors import SERVER, STREAM_BROKEN, StreamError
from tasks.wire.grace import AnswerGrace
from tasks.wire.pool import Pool
from tasks.wire.sse import loads
from tasks.wire.transports import _event_error, _shape_error, arrived, read_sse
from tasks.wire.usage import as_mapping

#: Event types whose ``delta`` is generated text (a token-carrying chunk when not empty).
TEXT_EVENTS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
    }
)
_ARGS_DELTA = "response.function_call_arguments.delta"
_REFUSAL, _REFUSAL_DONE = "response.refusal.delta", "response.refusal.done"
_ITEM_ADDED = "response.output_item.added"
_COMPLETED, _INCOMPLETE, _FAILED = "response.completed", "response.incomplete", "response.failed"

#: ``incomplete_details.reason`` -> the chat API's ``finish_reason``.
_FINISH = {"max_output_tokens": "length", "content_filter": "content_filter"}


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses ``usage`` (a dict, or the openai client's ``ResponseUsage``) in the chat
    API's names: ``input_tokens`` -> ``prompt_tokens``, ``output_tokens`` ->
    ``completion_tokens``, ``total_tokens``, ``input_tokens_details.cached_tokens`` ->
    ``prompt_tokens_details.cached_tokens``, ``output_tokens_details.reasoning_tokens`` ->
    ``completion_tokens_details.reasoning_tokens`` (OpenAI counts them inside
    ``output_tokens``, as inside ``completion_tokens``). Values are passed as sent, to be
    checked by :func:`tasks.wire.usage.read_usage`. None: no usage."""
    usage = as_mapping(usage)
    if not usage:
        return None
    out: dict[str, Any] = {}
    for source, target in (
        ("input_tokens", "prompt_tokens"),
        ("output_tokens", "completion_tokens"),
        ("total_tokens", "total_tokens"),
    ):
        if source in usage:
            out[target] = usage[source]
    for source, key, target in (
        ("input_tokens_details", "cached_tokens", "prompt_tokens_details"),
        ("output_tokens_details", "reasoning_tokens", "completion_tokens_details"),
    ):
        details = usage.get(source)
        if isinstance(details, dict) and details.get(key) is not None:
            out[target] = {key: details[key]}
    return out


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _finish(kind: str, event: Any, state: dict[str, Any]) -> None:
    """``response.completed`` / ``response.incomplete`` into ``state``: usage (chat names),
    finish reason, and ``done`` (the stream ended as a stream ends)."""
    response = _field(event, "response")
    state["usage"] = chat_usage(_field(response, "usage")) if response is not None else None
    if kind == _COMPLETED:
        state["finish_reason"] = "tool_calls" if state["tool_calls"] and not state["parts"] else "stop"
    else:
        reason = _field(_field(response, "incomplete_details"), "reason") if response is not None else None
        state["finish_reason"] = _FINISH.get(reason, reason) if isinstance(reason, str) else "incomplete"
    state["done"] = True


def _failure(kind: str, event: Any) -> StreamError:
    """The ``server`` error of a ``response.failed`` or ``error`` event."""
    source = _field(event, "response") if kind == _FAILED else event
    error = _field(source, "error") if kind == _FAILED else event
    message = _field(error, "message") if error is not None else None
    if not message and isinstance(source, dict):
        found = _event_error(source)
        message = found.message if found is not None else None
    what = "response.failed" if kind == _FAILED else "an error event"
    return StreamError(SERVER, f"the server sent {what} inside the stream: {message or 'no message'}")


def _call_piece(kind: str, event: Any, calls: dict[int, list[str]]) -> bool:
    """A function call's name (``response.output_item.added`` of a ``function_call`` item) or
    arguments fragment, joined per ``output_index`` into ``calls`` (the state's
    ``tool_calls``). True when it carried generated text."""
    index = _field(event, "output_index")
    index = index if isinstance(index, int) else 0
    if kind == _ARGS_DELTA:
        piece, slot = _field(event, "delta"), 1
    else:
        item = _field(event, "item")
        if _field(item, "type") != "function_call":
            return False
        piece, slot = _field(item, "name"), 0
    if not isinstance(piece, str) or not piece:
        return False
    calls.setdefault(index, ["", ""])[slot] += piece
    return True


def _refused(kind: str, event: Any, state: dict[str, Any]) -> str:
    """The refusal text a refusal event adds (module docstring), '' none; kept as the state's
    ``refusal``."""
    text = _field(event, "delta" if kind == _REFUSAL else "refusal")
    if not isinstance(text, str) or (kind == _REFUSAL_DONE and state["refusal"]):
        return ""  # a done event after deltas repeats them
    if text:
        state["refusal"] = text
    return text


def _cut(state: dict[str, Any]) -> StreamError:
    return StreamError(
        STREAM_BROKEN,
        f"the stream ended after {len(state['arrivals_ns'])} text chunks ({state['chunks']} events) "
        "before response.completed or response.incomplete: the answer may have been cut anywhere "
        "(a proxy or the server closed it)",
    )


async def receive_responses(
    pool: Pool,
    url: str,
    headers: dict[str, str],
    kwargs: dict[str, Any],
    state: dict[str, Any],
    timeout_s: float,
) -> None:
    """POST ``kwargs`` (:func:`tasks.stream.client.build_request` with ``api="responses"``) to
    ``url`` (``{base_url}/responses``) and read its SSE events into ``state``
    (:func:`tasks.wire.transports.new_state`; module docstring for what each event does;
    ``timeout_s``: :func:`tasks.wire.transports.read_sse`'s).

    SSE as :func:`tasks.wire.transports.receive_sse` reads it (``data:`` lines, blank line
    ends an event, ``\\r\\n`` accepted; ``event:`` lines are skipped: the data's ``type`` says
    the same). Raises: the openai client's exceptions for HTTP and transport failures,
    :class:`StreamError` for ``response.failed`` / ``error`` (``server``), a data line that is
    not an object (``bad_payload``) and a body that ends before the response did
    (``stream_broken``).
    """
    calls, text_events = state["tool_calls"], TEXT_EVENTS

    def on_event(payload: bytes, read_ns: int, rx_ns: int | None) -> None:
        if payload == b"[DONE]":  # not the Responses API's; harmless
            return
        event = loads(payload)
        state["chunks"] += 1
        if not isinstance(event, dict):
            raise _shape_error("the data line is not a JSON object", payload)
        kind = event.get("type")
        if kind in text_events:
            text = event.get("delta")
            if isinstance(text, str) and text:
                arrived(state, read_ns, rx_ns, text)
        elif kind == _ARGS_DELTA or kind == _ITEM_ADDED:
            if _call_piece(kind, event, calls):
                arrived(state, read_ns, rx_ns, "")
        elif kind == _REFUSAL or kind == _REFUSAL_DONE:
            text = _refused(kind, event, state)
            if text:
                arrived(state, read_ns, rx_ns, text)
        elif kind == _COMPLETED or kind == _INCOMPLETE:
            _finish(kind, event, state)
            state["answered"]()  # the request ends here, whatever the body does after (h1)
        elif kind == _FAILED or kind == "error":
            raise _failure(kind, event)
        elif kind is None:
            error = _event_error(event)  # a chat-style error object
            if error is not None:
                raise error

    await read_sse(pool, url, headers, kwargs, state, timeout_s, on_event)
    if not state["done"]:
        raise _cut(state)


_WARM: list[bool] = []


def warm_openai_events() -> None:
    """Build the openai client's model of the Responses stream events once, before any clock
    starts: its first event otherwise costs ~0.6 s (the discriminated union of every event type
    is built on first use), charged to the first request's TTFT and queued gaps."""
    if _WARM:
        return
    from openai._models import construct_type
    from openai.types.responses import ResponseStreamEvent

    response = {"id": "", "object": "response", "status": "completed", "output": [], "usage": {}}
    for kind, fields in (
        ("response.output_text.delta", {"delta": ""}),
        ("response.reasoning_text.delta", {"delta": ""}),
        ("response.refusal.delta", {"delta": ""}),
        ("response.created", {"response": response}),
        ("response.output_item.added", {"item": {"type": "message", "content": []}}),
        ("response.output_item.added", {"item": {"type": "function_call", "name": ""}}),
        ("response.output_item.done", {"item": {"type": "message", "content": []}}),
        ("response.completed", {"response": response}),
    ):
        construct_type(type_=ResponseStreamEvent, value={"type": kind, **fields})
    _WARM.append(True)


async def receive_openai_responses(create: Any, kwargs: dict[str, Any], state: dict[str, Any]) -> None:
    """Send the request with the openai client's ``responses.create`` (``create``, resolved
    before the clock starts, with :func:`warm_openai_events` called) and read its events into
    ``state``, as :func:`receive_responses` does (each event stamped as the client yields it:
    the user clock). The client raises an
    ``APIError`` (class ``server``) for a data line holding ``{"error": {...}}``."""
    arrivals, parts, calls = state["arrivals_ns"], state["parts"], state["tool_calls"]
    perf = time.perf_counter_ns
    stream = await create(**kwargs)
    state["in_stream"] = True
    try:
        async with AnswerGrace(state):  # a body left open after the answer: tasks.wire.grace
            async for event in stream:
                now_ns = perf()
                state["chunks"] += 1
                kind = getattr(event, "type", None)
                if kind in TEXT_EVENTS:
                    text = getattr(event, "delta", None)
                    if isinstance(text, str) and text:
                        arrivals.append(now_ns)
                        parts.append(text)
                elif kind == _ARGS_DELTA or kind == _ITEM_ADDED:
                    if _call_piece(kind, event, calls):
                        arrivals.append(now_ns)
                        parts.append("")
                elif kind == _REFUSAL or kind == _REFUSAL_DONE:
                    text = _refused(kind, event, state)
                    if text:
                        arrivals.append(now_ns)
                        parts.append(text)
                elif kind == _COMPLETED or kind == _INCOMPLETE:
                    _finish(kind, event, state)
                    state["answered"]()  # its body's end awaited briefly, as h1 does
                elif kind == _FAILED or kind == "error":
                    raise _failure(kind, event)
    finally:
        await stream.close()
    if not state["done"]:
        raise _cut(state)
