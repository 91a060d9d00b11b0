"""The openai client's receive loop (:func:`receive_openai`): one request's chunks, as the
``AsyncOpenAI`` client yields them, into the stream state of
:func:`tasks.wire.transports.new_state`, the same state as the own client's
(:func:`tasks.wire.transports.receive_sse`), so both give the same record. Why there are two
transports: :mod:`tasks.wire.transports`. Apart from it because it shares nothing with the own
client's readers but the state and :func:`tasks.wire.transports.add_tool_calls`.
"""

from __future__ import annotations

import time
from typing import Any

from tasks.wire.errors import SERVER, StreamError
from tasks.wire.grace import AnswerGrace
from tasks.wire.transports import add_tool_calls


def _in_stream_error(chunk: Any) -> StreamError:
    """The error of a chunk that is an error object without an ``error`` key (vLLM's older
    ``{"object": "error", "message": ...}``; ``{"error": {...}}`` is raised by the client)."""
    extra = chunk.model_extra or {}
    message = extra.get("message") or "the server sent an error object inside the stream"
    return StreamError(SERVER, f"the server sent an error inside the stream: {message}")


def _keep_timings(chunk: Any, state: dict[str, Any]) -> None:
    """llama.cpp's ``timings`` of an openai-client chunk (an extra field) into ``state``."""
    timings = (chunk.model_extra or {}).get("timings")
    if timings is not None:
        state["timings"] = timings


async def receive_openai(create: Any, kwargs: dict[str, Any], state: dict[str, Any]) -> None:
    """Send the request with the openai client and read its chunks into ``state``
    (:func:`new_state`).

    ``create``: the client's ``chat.completions.create``, resolved before the clock starts;
    ``kwargs``: :func:`tasks.stream.client.build_request`'s.
    """
    arrivals_ns, parts = state["arrivals_ns"], state["parts"]
    perf = time.perf_counter_ns
    stream = await create(**kwargs)
    state["in_stream"] = True
    try:
        async with AnswerGrace(state):  # the end of an answer without [DONE]: tasks.wire.grace
            async for chunk in stream:
                now_ns = perf()
                state["chunks"] += 1
                choices = chunk.choices
                if choices:
                    choice = choices[0]
                    delta = getattr(choice, "delta", None)  # a /completions choice has .text instead
                    text = delta.content if delta is not None else getattr(choice, "text", None)
                    if not text and delta is not None:
                        extra = delta.model_extra
                        if extra:
                            text = extra.get("reasoning_content") or extra.get("reasoning")
                        if not text and delta.refusal:  # ChoiceDelta.refusal, as chat_events reads it
                            text = state["refusal"] = delta.refusal
                    if not isinstance(text, str):
                        text = ""
                    called = bool(delta is not None and delta.tool_calls) and add_tool_calls(
                        delta.tool_calls, state["tool_calls"]
                    )
                    if text or called:
                        arrivals_ns.append(now_ns)
                        parts.append(text)
                    if choice.finish_reason is not None:
                        state["finish_reason"] = choice.finish_reason
                        _keep_timings(chunk, state)
                elif getattr(chunk, "object", None) == "error":
                    raise _in_stream_error(chunk)
                else:  # llama.cpp's final chunk, ``choices: []``
                    _keep_timings(chunk, state)
                if chunk.usage is not None:
                    state["usage"] = chunk.usage
                    if state["finish_reason"] is not None:  # as chat_events: the answer's close
                        state["answered"]()
    finally:
        await stream.close()
