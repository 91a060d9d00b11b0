"""A purpose-built OpenAI-compatible SSE server with a KNOWN schedule per request.

Run as a separate process (``python tests/groundtruth_server.py``; it prints ``PORT <n>``), so
its timing does not share a GIL with the client under test. The request's ``model`` selects the
scenario (see :data:`SCENARIOS`); every scenario is a list of steps: ``("sleep", ms)``,
``("data", obj_or_str)`` (an SSE ``data:`` line), ``("raw", str)`` (raw SSE text, e.g. a
comment), ``("cut",)`` (close the socket mid-body), ``("reset",)`` (abort it: RST), or an HTTP error ``("status", code, body[, delay_ms])``.

Every scenario is also served on ``POST /v1/completions`` with the same schedule, its chunks in
the completions shape (``choices[].text``; :data:`COMPLETIONS_SCENARIOS`), and those without raw
chat bytes on ``POST /v1/responses`` as OpenAI's Responses API streams them (``event:`` and
``data:`` lines; text in ``response.output_text.delta``, usage in ``response.completed``;
:data:`RESPONSES_SCENARIOS`, with ``responses_*`` scenarios of that API's own endings), the
``ticks`` and ``load`` scenarios too.

Dynamic scenario ``load:N:BASE_MS:SLOPE_MS[:TTFT_MS]`` (a server that slows down with load, a
known law): like ``ticks`` but each gap is BASE_MS + SLOPE_MS * (requests in flight - 1), read
when the gap starts; :func:`load_law_rate` gives the rate at which a TPOT SLO breaks.

Dynamic scenario ``ticks:N:GAP_MS[:TTFT_MS]`` (for load): a role chunk, then N one-word text
chunks on absolute deadlines TTFT_MS (default GAP_MS), TTFT_MS + GAP_MS, ... after the request
was read, then usage (N tokens) and ``[DONE]``. Every chunk the server writes is stamped with
``time.perf_counter_ns()`` just before its bytes go to the socket: CLOCK_MONOTONIC, which on
Linux is one clock for all processes, so the client's ``send_ns`` and these stamps are directly
comparable and the server's own lateness is never charged to the client.

Scenario ``prefix_cache``: a server with a prefix cache over the prompt's words
(:func:`_prefix_cache_steps`), its counters under vLLM's names in ``/metrics``;
``POST /prefix_cache_mode?engine=E&block_size=N`` makes it another server's (until ``/reset``):
``engine=sglang`` counts under SGLang's names, ``engine=llamacpp`` reports the cached tokens as
llama.cpp's own server does (``timings.cache_n`` in a final ``choices: []`` chunk, no counters),
``engine=llama-cpp-python`` sends no usage at all (as the embedded llama.cpp server streams),
``block_size=N`` caches whole blocks of N words only and publishes vLLM's
``vllm:cache_config_info{block_size="N"}``.

Scenario ``fail_marked``: a known share of failed requests: a request whose prompt holds
``[fail]`` gets ``http_500``'s answer, any other ``schedule``'s (chat and completions).
Scenario ``refusal_or_524`` (chat): the model's 1st, 3rd, ... requests get ``refusal``'s
answer, the others ``http_524_slow``'s (a 524 after :data:`SLOW_ERROR_MS`).

Control endpoints: ``GET /metrics`` (Prometheus text: ``gt_requests_total``,
``gt_text_chunks_total``, ``gt_ttft_seconds`` sum/count, ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total``), ``POST /reset_prefix_cache``, ``GET /stats`` -> ``{"max_in_flight", "requests": [bodies...], "late_chunk_ns": [...]}`` (noisy
chunks written over 0.5 ms after their deadline: the instrument itself was held up),
``GET /stamps`` -> ``{prompt: {"recv_ns": int, "text_sent_ns": [int, ...]}}`` (keyed by the
first message's content, so give each request its own prompt), ``POST /reset``.

Use :func:`serve` (a context manager) from tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

# Scenario schedules -----------------------------------------------------------------------


def _chunk(
    content: str | None = None, *, role: str | None = None, finish: str | None = None, **extra_delta: Any
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    delta.update(extra_delta)
    return {
        "id": "chatcmpl-gt",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "gt",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _usage(completion_tokens: int, prompt_tokens: int = 11) -> dict[str, Any]:
    return {
        "id": "chatcmpl-gt",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "gt",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


def _completion(content: str | None = None, *, finish: str | None = None, **_ignored: Any) -> dict[str, Any]:
    """A ``/v1/completions`` stream chunk (vLLM / OpenAI shape: ``choices[].text``). A chat
    chunk's role and reasoning fields have no counterpart: they become empty text."""
    return {
        "id": "cmpl-gt",
        "object": "text_completion",
        "created": 0,
        "model": "gt",
        "choices": [{"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}],
    }


def _split_steps(chunk: Any) -> list[tuple]:
    """The "split" scenario for a chunk builder (chat or completions)."""
    first = json.dumps(chunk("Hel"))
    return [
        ("data", chunk(role="assistant")),
        ("sleep", 20),
        ("raw", "data: " + first[:25]),
        ("sleep", 40),
        ("raw", first[25:] + "\r\n\r\n"),
        ("sleep", 30),
        ("raw", f"data: {json.dumps(chunk('lo'))}\n\ndata: {json.dumps(chunk(' world'))}\n\n"),
        ("data", _usage(3)),
        ("data", "[DONE]"),
    ]


def _as_completions(steps: list[tuple]) -> list[tuple]:
    """A chat scenario replayed on ``/v1/completions``: the same schedule, each chat chunk
    rewritten as a completions chunk (its ``content`` as ``text``); errors, usage, sleeps, cuts
    and raw text stay as they are."""
    out = []
    for step in steps:
        data = step[1] if step[0] == "data" else None
        if isinstance(data, dict) and data.get("object") == "chat.completion.chunk" and data["choices"]:
            choice = data["choices"][0]
            step = ("data", _completion(choice["delta"].get("content"), finish=choice["finish_reason"]))
        out.append(step)
    return out


#: Ground truth of the "schedule" scenario (client-side expectations in ms).
SCHEDULE_TTFT_MS = 100
SCHEDULE_GAP_MS = 50
SCHEDULE_TEXT = ["Hello", " big", " world", " of", " tokens"]
SCHEDULE_USAGE_TOKENS = 9  # chunks carry several tokens: the usage count is not the chunk count
SCHEDULE_USAGE_DELAY_MS = 300

#: The "refusal" scenario's chunks (on the schedule's times) and usage; "http_524_slow"'s wait.
REFUSAL_TEXT = ["I'm sorry,", " I can't", " help with", " that."]
REFUSAL_USAGE_TOKENS = 8
SLOW_ERROR_MS = 1500

#: The "utf8_split" scenario's event ("世界" in raw UTF-8) and where it is cut: inside the
#: first character's three bytes.
UTF8_SPLIT_TEXT = "世界"
UTF8_SPLIT_EVENT = f"data: {json.dumps(_chunk(UTF8_SPLIT_TEXT), ensure_ascii=False)}\n\n".encode()
UTF8_SPLIT_AT = UTF8_SPLIT_EVENT.index(UTF8_SPLIT_TEXT.encode()) + 1

SCENARIOS: dict[str, list[tuple]] = {
    # role-only chunk at once, then 5 text chunks 100 ms / 50 ms apart, usage 300 ms later.
    "schedule": [
        ("data", _chunk(role="assistant", content="")),
        ("sleep", SCHEDULE_TTFT_MS),
        *[
            step
            for i, text in enumerate(SCHEDULE_TEXT)
            for step in ((("sleep", SCHEDULE_GAP_MS),) if i else ()) + (("data", _chunk(text)),)
        ],
        ("data", _chunk(finish="stop")),
        ("sleep", SCHEDULE_USAGE_DELAY_MS),
        ("data", _usage(SCHEDULE_USAGE_TOKENS)),
        ("data", "[DONE]"),
    ],
    # no usage chunk although include_usage was asked: the client must tokenize.
    "no_usage": [
        ("data", _chunk(role="assistant")),
        ("sleep", 20),
        ("data", _chunk("one two")),
        ("sleep", 20),
        ("data", _chunk(" three four five")),
        ("data", _chunk(finish="stop")),
        ("data", "[DONE]"),
    ],
    # reasoning deltas (vLLM / DeepSeek style) come first and count as tokens.
    "reasoning": [
        ("data", _chunk(role="assistant", content="")),
        ("sleep", 80),
        ("data", _chunk(reasoning_content="Let me think")),
        ("sleep", 40),
        ("data", _chunk(reasoning_content=" hard.")),
        ("sleep", 40),
        ("data", _chunk("Answer")),
        ("data", _usage(6)),
        ("data", "[DONE]"),
    ],
    # the newer "reasoning" field name (vLLM >= 0.10, OpenRouter)
    "reasoning_alt": [
        ("data", _chunk(role="assistant")),
        ("sleep", 60),
        ("data", _chunk(reasoning="hmm")),
        ("sleep", 30),
        ("data", _chunk("ok")),
        ("data", _usage(2)),
        ("data", "[DONE]"),
    ],
    # SSE comments and an empty-content chunk before the first token must be ignored.
    "keepalive": [
        ("raw", ": keep-alive\n\n"),
        ("data", _chunk(role="assistant")),
        ("sleep", 40),
        ("raw", ": keep-alive\n\n"),
        ("data", _chunk("")),
        ("sleep", 80),
        ("data", _chunk("tick")),
        ("sleep", 30),
        ("raw", ": ping\n\n"),
        ("data", _chunk(" tock")),
        ("data", _usage(2)),
        ("data", "[DONE]"),
    ],
    # an error object inside a 200 stream (OpenAI / llama.cpp shape)
    "stream_error": [
        ("data", _chunk(role="assistant")),
        ("sleep", 30),
        ("data", _chunk("partial")),
        ("sleep", 10),
        ("data", _error_body("model crashed", "server_error", 500)),
    ],
    # vLLM's older in-stream error shape: {"object": "error", ...}
    "stream_error_vllm": [
        ("data", _chunk("partial")),
        ("data", {"object": "error", "message": "engine dead", "type": "InternalServerError", "code": 500}),
    ],
    "http_401": [
        (
            "status",
            401,
            _error_body(
                "Incorrect API key provided: sk-test-SECRET123456. Get one at example.com",
                "invalid_request_error",
                401,
            ),
        )
    ],
    "http_403": [("status", 403, _error_body("no access to this model", "forbidden", 403))],
    "http_404": [("status", 404, _error_body("The model does not exist", "not_found", 404))],
    "http_429": [("status", 429, _error_body("Too many requests", "rate_limit", 429))],
    "http_500": [("status", 500, _error_body("internal failure", "server_error", 500))],
    "http_400": [("status", 400, _error_body("context too long", "invalid_request_error", 400))],
    # a gateway's timeout answered after a wait (Cloudflare's 524 "A Timeout Occurred": aiperf
    # PR #1333): the status's optional fourth item is the delay before the answer, in ms
    "http_524_slow": [("status", 524, _error_body("origin timed out", "timeout", 524), SLOW_ERROR_MS)],
    # a refusal (OpenAI structured outputs): the answer streamed as delta.refusal on the
    # schedule's times; on /v1/responses as response.refusal.delta events, then .done
    "refusal": [
        ("data", _chunk(role="assistant", content="")),
        ("sleep", SCHEDULE_TTFT_MS),
        *[
            step
            for i, text in enumerate(REFUSAL_TEXT)
            for step in ((("sleep", SCHEDULE_GAP_MS),) if i else ()) + (("data", _chunk(refusal=text)),)
        ],
        ("data", _chunk(finish="stop")),
        ("data", _usage(REFUSAL_USAGE_TOKENS)),
        ("data", "[DONE]"),
    ],
    # body cut after two text chunks (no terminating chunk)
    "cut": [
        ("data", _chunk(role="assistant")),
        ("sleep", 30),
        ("data", _chunk("one")),
        ("sleep", 30),
        ("data", _chunk(" two")),
        ("sleep", 10),
        ("cut",),
    ],
    # connection reset (RST) after one text chunk
    "reset": [
        ("data", _chunk("one")),
        ("sleep", 30),
        ("reset",),
    ],
    # a data line that is not JSON
    "bad_json": [
        ("data", _chunk("fine")),
        ("sleep", 10),
        ("data", "{this is not json"),
        ("data", "[DONE]"),
    ],
    # 200, role chunk, finish, usage 0, no text
    "empty": [
        ("data", _chunk(role="assistant", content="")),
        ("data", _chunk(finish="stop")),
        ("data", _usage(0)),
        ("data", "[DONE]"),
    ],
    # one text chunk carrying one token: TPOT undefined
    "single": [
        ("data", _chunk(role="assistant")),
        ("sleep", 20),
        ("data", _chunk("Yes")),
        ("data", _usage(1)),
        ("data", "[DONE]"),
    ],
    # slow first token, for timeouts
    "slow": [
        ("data", _chunk(role="assistant")),
        ("sleep", 3000),
        ("data", _chunk("late")),
        ("data", "[DONE]"),
    ],
    # byte splits: an event cut mid-JSON across two network writes 40 ms apart (the token
    # arrives when the event completes, at 60 ms), CRLF line ends, and two events in one write
    # (the second gap is 0: they arrive together).
    "split": _split_steps(lambda text=None, **kw: _chunk(text, **kw)),
    # Cases from public reports (issue 11) ------------------------------------------------
    # a three-byte UTF-8 character cut between two writes 50 ms apart (vLLM #38717): the text
    # is exact (no U+FFFD) and the token arrives with the second half, at 70 ms
    "utf8_split": [
        ("data", _chunk(role="assistant")),
        ("sleep", 20),
        ("bytes", UTF8_SPLIT_EVENT[:UTF8_SPLIT_AT]),
        ("sleep", 50),
        ("bytes", UTF8_SPLIT_EVENT[UTF8_SPLIT_AT:]),
        ("data", _usage(1)),
        ("data", "[DONE]"),
    ],
    # CRLF line ends throughout (the SSE specification allows them): timed like LF events
    "crlf": [
        ("raw", f"data: {json.dumps(_chunk(role='assistant'))}\r\n\r\n"),
        ("sleep", 40),
        ("raw", f"data: {json.dumps(_chunk('one'))}\r\n\r\n"),
        ("sleep", 30),
        ("raw", f"data: {json.dumps(_chunk(' two'))}\r\n\r\n"),
        ("sleep", 30),
        ("raw", f"data: {json.dumps(_chunk(' three'))}\r\n\r\n"),
        ("raw", f"data: {json.dumps(_usage(3))}\r\n\r\ndata: [DONE]\r\n\r\n"),
    ],
    # an in-band error in its string form after two tokens (SGLang PR #38868)
    "string_error": [
        ("data", _chunk(role="assistant")),
        ("sleep", 20),
        ("data", _chunk("Hello")),
        ("sleep", 20),
        ("data", _chunk(" world")),
        ("data", {"error": "boom"}),
    ],
    # the whole answer in one text chunk, usage 300 ms later (genai-bench PR #44)
    "one_chunk": [
        ("data", _chunk(role="assistant")),
        ("sleep", 30),
        ("data", _chunk("The whole answer at once.")),
        ("data", _chunk(finish="stop")),
        ("sleep", 300),
        ("data", _usage(6)),
        ("data", "[DONE]"),
    ],
    # three events in one write: three arrivals, two gaps of 0
    "three_in_one": [
        ("data", _chunk(role="assistant")),
        ("sleep", 30),
        ("raw", "".join(f"data: {json.dumps(_chunk(t))}\n\n" for t in ("a", " b", " c"))),
        ("data", _usage(3)),
        ("data", "[DONE]"),
    ],
    # Cases of issue 23 (stream shapes that public clients read wrong) ------------------------
    # a buffering proxy: the whole answer (4 text chunks, finish, usage, [DONE]) in one write, so
    # every chunk arrives at one instant: no decode to see (TPOT null, not 0)
    "buffered": [
        ("data", _chunk(role="assistant")),
        ("sleep", 40),
        (
            "raw",
            "".join(f"data: {json.dumps(_chunk(t))}\n\n" for t in ("All", " at", " once", " here"))
            + f"data: {json.dumps(_chunk(finish='stop'))}\n\n"
            + f"data: {json.dumps(_usage(4))}\n\ndata: [DONE]\n\n",
        ),
    ],
    # usage counts that must not be trusted: 0 for a stream with text, NaN (a JSON literal
    # Python's parser takes), a string, a negative number; the tokenizer counts instead
    **{
        f"usage_{name}": [
            ("data", _chunk(role="assistant")),
            ("sleep", 20),
            ("data", _chunk("one two")),
            ("sleep", 20),
            ("data", _chunk(" three")),
            ("data", _chunk(finish="stop")),
            (
                "raw",
                'data: {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": ' + raw + "}}\n\n",
            ),
            ("data", "[DONE]"),
        ]
        for name, raw in (("zero", "0"), ("nan", "NaN"), ("string", '"three"'), ("negative", "-3"))
    },
    # reasoning tokens in usage, both conventions and one that fits neither: 2 reasoning chunks
    # ("Let me think" = 3 words), 1 content chunk ("Yes"); reasoning_tokens 3, prompt 11
    **{
        f"reasoning_usage_{name}": [
            ("data", _chunk(role="assistant")),
            ("sleep", 30),
            ("data", _chunk(reasoning_content="Let me")),
            ("sleep", 20),
            ("data", _chunk(reasoning_content=" think")),
            ("sleep", 20),
            ("data", _chunk("Yes")),
            ("data", _chunk(finish="stop")),
            (
                "data",
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 11,
                        "completion_tokens": completion,
                        "total_tokens": total,
                        "completion_tokens_details": {"reasoning_tokens": 3},
                    },
                },
            ),
            ("data", "[DONE]"),
        ]
        for name, completion, total in (("included", 4, 15), ("separate", 1, 15), ("neither", 4, 40))
    },
    # a reply that is only a tool call: the name first, then argument fragments 20 ms apart,
    # interleaved with a second call (index 1) in the last chunks
    "tool_call": [
        ("data", _chunk(role="assistant")),
        ("sleep", 50),
        (
            "data",
            _chunk(
                tool_calls=[
                    {
                        "index": 0,
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            ),
        ),
        ("sleep", 20),
        ("data", _chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}])),
        ("sleep", 20),
        (
            "data",
            _chunk(
                tool_calls=[
                    {
                        "index": 1,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    }
                ]
            ),
        ),
        ("sleep", 20),
        ("data", _chunk(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}])),
        ("data", _chunk(finish="tool_calls")),
        ("data", _usage(12)),
        ("data", "[DONE]"),
    ],
    # text, then a clean end of the body with no finish_reason, no usage and no [DONE]: the
    # answer may have been cut anywhere (inference-perf #655)
    "no_end": [
        ("data", _chunk(role="assistant")),
        ("sleep", 20),
        ("data", _chunk("The answer is")),
        ("sleep", 20),
        ("data", _chunk(" forty")),
    ],
    # answers at once: for the achieved request rate
    "instant": [
        ("data", _chunk("ok")),
        ("data", _usage(1)),
        ("data", "[DONE]"),
    ],
    # for concurrency: each request holds the server ~150 ms
    "hold": [
        ("data", _chunk(role="assistant")),
        ("sleep", 50),
        ("data", _chunk("a")),
        ("sleep", 50),
        ("data", _chunk(" b")),
        ("sleep", 50),
        ("data", _chunk(" c")),
        ("data", _usage(3)),
        ("data", "[DONE]"),
    ],
}

#: The same scenarios on ``/v1/completions`` (``choices[].text``); the reasoning and tool-call
#: ones have no completions counterpart (that endpoint has neither).
COMPLETIONS_SCENARIOS: dict[str, list[tuple]] = {
    name: _as_completions(steps)
    for name, steps in SCENARIOS.items()
    if not name.startswith(("reasoning", "tool_call", "refusal"))
}
COMPLETIONS_SCENARIOS["split"] = _split_steps(_completion)


def _response_event(kind: str, **fields: Any) -> tuple:
    """One Responses API SSE event: an ``event:`` line and its JSON ``data:`` with ``type``."""
    data = json.dumps({"type": kind, **fields})
    return ("raw", f"event: {kind}\ndata: {data}\n\n")


def _response(status: str, usage: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The ``response`` object of a created / completed / incomplete / failed event."""
    return {"id": "resp_gt", "object": "response", "model": "gt", "status": status, "output": [],
            "usage": usage, **extra}  # fmt: skip


def _responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat usage in the Responses API's names (input / output tokens, their details)."""
    out = {"input_tokens": usage.get("prompt_tokens"), "output_tokens": usage.get("completion_tokens"),
           "total_tokens": usage.get("total_tokens")}  # fmt: skip
    out["input_tokens_details"] = usage.get("prompt_tokens_details") or {"cached_tokens": 0}
    out["output_tokens_details"] = usage.get("completion_tokens_details") or {"reasoning_tokens": 0}
    return out


_DELTA = {"content": "response.output_text.delta", "reasoning_content": "response.reasoning_text.delta",
          "reasoning": "response.reasoning_text.delta", "refusal": "response.refusal.delta"}  # fmt: skip
_MESSAGE_DONE = [
    _response_event("response.output_text.done", output_index=0, content_index=0, text=""),
    _response_event("response.content_part.done", output_index=0, content_index=0),
    _response_event("response.output_item.done", output_index=0, item={"type": "message"}),
]


def _as_responses(steps: list[tuple]) -> list[tuple] | None:
    """A chat scenario replayed on ``/v1/responses``: the same schedule, each chat chunk
    rewritten as the Responses API's events (a role chunk: ``response.output_item.added``; content
    and reasoning: their ``*.delta``; tool-call fragments: the call's item and
    ``response.function_call_arguments.delta``; a finish: the ``*.done`` events; the usage:
    ``response.completed`` with it; ``[DONE]`` without a usage before: ``response.completed``
    without one); error objects become ``error`` events (``{"object": "error"}``:
    ``response.failed``); sleeps, cuts, statuses, comments and bad JSON stay. None for a
    scenario of raw chat bytes (it has no Responses counterpart)."""
    if any(s[0] == "bytes" or (s[0] == "raw" and not s[1].startswith(":")) for s in steps):
        return None
    if steps[0][0] == "status":  # an HTTP error before any stream
        return steps
    out: list[tuple] = [_response_event("response.created", response=_response("in_progress"))]
    completed = False
    for step in steps:
        data = step[1] if step[0] == "data" else None
        if data == "[DONE]":
            if not completed:
                out.append(_response_event("response.completed", response=_response("completed")))
            continue
        if not isinstance(data, dict):
            out.append(step)
            continue
        if "usage" in data:
            usage = _responses_usage(data["usage"])
            out.append(_response_event("response.completed", response=_response("completed", usage)))
            completed = True
        elif "error" in data:
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else error
            out.append(_response_event("error", code="server_error", message=message, param=None))
        elif data.get("object") == "error":
            failed = _response("failed", error={"code": "server_error", "message": data["message"]})
            out.append(_response_event("response.failed", response=failed))
        elif data.get("choices"):
            choice = data["choices"][0]
            delta = choice["delta"]
            if "role" in delta:
                out.append(_response_event("response.output_item.added", output_index=0,
                                           item={"type": "message", "role": "assistant", "content": []}))  # fmt: skip
            for key, kind in _DELTA.items():
                if key in delta:
                    out.append(_response_event(kind, output_index=0, content_index=0, delta=delta[key]))
            for call in delta.get("tool_calls") or ():
                index, function = call["index"] + 1, call["function"]
                if "name" in function:
                    item = {"type": "function_call", "name": function["name"], "arguments": ""}
                    out.append(_response_event("response.output_item.added", output_index=index, item=item))
                if function.get("arguments"):
                    out.append(_response_event("response.function_call_arguments.delta",
                                               output_index=index, delta=function["arguments"]))  # fmt: skip
            if choice["finish_reason"] is not None:
                refused = "".join(s[1]["choices"][0]["delta"].get("refusal", "") for s in steps
                                  if s[0] == "data" and isinstance(s[1], dict) and s[1].get("choices"))  # fmt: skip
                if refused:  # its whole text once more, as the API closes a refusal part
                    out.append(_response_event("response.refusal.done", output_index=0, content_index=0,
                                               refusal=refused))  # fmt: skip
                out.extend(_MESSAGE_DONE)
    return out


#: The chat scenarios on ``/v1/responses`` (:func:`_as_responses`), and the Responses API's own
#: endings: ``responses_no_completed`` (every event of a finished message but the body ends
#: before ``response.completed``: cut, not a success), ``responses_incomplete`` (stopped at
#: ``max_output_tokens``, with a usage and cached tokens: a success whose finish reason is the
#: limit), ``responses_failed`` (``response.failed`` after a token), ``responses_refusal_done``
#: (a refusal in one ``response.refusal.done``).
RESPONSES_SCENARIOS: dict[str, list[tuple]] = {
    name: converted for name, steps in SCENARIOS.items() if (converted := _as_responses(steps)) is not None
}
RESPONSES_SCENARIOS["responses_no_completed"] = [
    _response_event("response.created", response=_response("in_progress")),
    ("sleep", 20),
    _response_event("response.output_text.delta", output_index=0, content_index=0, delta="The answer"),
    ("sleep", 20),
    _response_event("response.output_text.delta", output_index=0, content_index=0, delta=" is 42"),
    *_MESSAGE_DONE,
]
RESPONSES_INCOMPLETE_USAGE = {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 7},
                              "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 14}  # fmt: skip
RESPONSES_SCENARIOS["responses_incomplete"] = [
    _response_event("response.created", response=_response("in_progress")),
    ("sleep", 30),
    _response_event("response.output_text.delta", output_index=0, content_index=0, delta="one two"),
    ("sleep", 20),
    _response_event("response.output_text.delta", output_index=0, content_index=0, delta=" three"),
    _response_event("response.incomplete", response=_response(
        "incomplete", RESPONSES_INCOMPLETE_USAGE, incomplete_details={"reason": "max_output_tokens"})),
]  # fmt: skip
# a refusal sent whole in response.refusal.done, no delta before it (the text arrives once)
RESPONSES_SCENARIOS["responses_refusal_done"] = [
    _response_event("response.created", response=_response("in_progress")),
    ("sleep", SCHEDULE_TTFT_MS),
    _response_event("response.refusal.done", output_index=0, content_index=0, refusal="".join(REFUSAL_TEXT)),
    *_MESSAGE_DONE,
    _response_event("response.completed", response=_response("completed", _responses_usage(
        _usage(REFUSAL_USAGE_TOKENS)["usage"]))),
]  # fmt: skip
RESPONSES_SCENARIOS["responses_failed"] = [
    _response_event("response.output_text.delta", output_index=0, content_index=0, delta="partial"),
    ("sleep", 10),
    _response_event("response.failed", response=_response(
        "failed", error={"code": "server_error", "message": "engine dead"})),
]  # fmt: skip


# The server ---------------------------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.generation = getattr(self, "generation", 0) + 1  # bumped by /reset
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[dict[str, Any]] = []
        self.stamps: dict[str, dict[str, Any]] = {}
        self.ttft_s_sum = 0.0  # server side: request read -> first text chunk written
        self.cached_prompts: set[str] = set()  # the "prompt_cache" scenario's cache
        self.prefix_cache: list[list[str]] = []  # the "prefix_cache" scenario's prompts (words)
        self.prefix_queries = 0  # its cumulative counters, as vLLM's (tokens = words)
        self.prefix_hits = 0
        self.prefix_engine = "vllm"  # whose names and reports (POST /prefix_cache_mode)
        self.prefix_block = 0  # cache block size in words (0: per word, not published)
        self.ttft_count = 0
        self.text_chunks = 0
        # ticks chunks written over LATE_CHUNK_S after their deadline (perf_counter_ns): the
        # instrument's own loop was held up, so what it served was not its schedule
        self.late_chunk_ns: list[int] = []

    @contextlib.contextmanager
    def request_in_flight(self) -> Iterator[None]:
        """Count one request in flight. A request still running from before a /reset is not
        counted against the new generation (it would drive the count below zero)."""
        generation = self.generation
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        finally:
            if self.generation == generation:
                self.in_flight -= 1


def _response_head(status: int, reason: str, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _send_json(writer: asyncio.StreamWriter, status: int, body: Any) -> None:
    payload = json.dumps(body).encode()
    reasons = {
        200: "OK",
        400: "Bad Request",
        401: "Unauthorized",
        403: "Forbidden",
        404: "Not Found",
        429: "Too Many Requests",
        500: "Internal Server Error",
        524: "A Timeout Occurred",
    }
    headers = {"Content-Type": "application/json", "Content-Length": str(len(payload))}
    if status == 429:
        headers["Retry-After"] = "2"
    writer.write(_response_head(status, reasons.get(status, "Error"), headers) + payload)
    await writer.drain()


def _metrics_page(state: _State) -> str:
    """Prometheus text: requests, text chunks, and a server-side TTFT summary (ticks only)."""
    return (
        "# TYPE gt_requests_total counter\n"
        f'gt_requests_total{{kind="chat"}} {len(state.requests)}\n'
        "# TYPE gt_text_chunks_total counter\n"
        f"gt_text_chunks_total {state.text_chunks}\n"
        "# TYPE gt_ttft_seconds summary\n"
        f"gt_ttft_seconds_sum {state.ttft_s_sum}\n"
        f"gt_ttft_seconds_count {state.ttft_count}\n"
        "# TYPE gt_in_flight gauge\n"
        f"gt_in_flight {state.in_flight}\n"
    ) + _prefix_cache_metrics(state)


def _prefix_cache_metrics(state: _State) -> str:
    """The prefix cache's counters under its engine's names (vLLM's by default; llama.cpp's
    own server has none), and vLLM's block size where one is set."""
    rate = state.prefix_hits / max(state.prefix_queries, 1)
    if state.prefix_engine == "sglang":  # cached tokens split by where they came from
        device = state.prefix_hits - state.prefix_hits // 3
        return (
            "# TYPE sglang:prompt_tokens counter\n"
            f'sglang:prompt_tokens_total{{model_name="m"}} {state.prefix_queries}\n'
            "# TYPE sglang:cached_tokens counter\n"
            f'sglang:cached_tokens_total{{model_name="m",cache_source="device"}} {device}\n'
            f'sglang:cached_tokens_total{{model_name="m",cache_source="host"}} {state.prefix_hits - device}\n'
            "# TYPE sglang:cache_hit_rate gauge\n"  # the last batch's: never the level's
            f'sglang:cache_hit_rate{{model_name="m"}} {rate}\n'
        )
    if state.prefix_engine == "llamacpp":
        return ""
    page = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0"}} {state.prefix_queries}\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0"}} {state.prefix_hits}\n'
        "# TYPE vllm:gpu_prefix_cache_hit_rate gauge\n"  # a lifetime rate: never the level's
        f"vllm:gpu_prefix_cache_hit_rate {rate}\n"
    )
    if state.prefix_block:
        page += (
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{state.prefix_block}",cache_dtype="auto",'
            'enable_prefix_caching="True"} 1.0\n'
        )
    return page


def _prefix_cache_steps(state: _State, prompt: str) -> list[tuple]:
    """``prefix_cache``: a server with a prefix cache whose tokens are the prompt's words: the
    cached tokens are the longest prefix shared with any earlier prompt (since the last
    ``POST /reset_prefix_cache``); usage reports them as vLLM does
    (``prompt_tokens_details.cached_tokens``) and the counters add them up. Answers "ok ok"."""
    words = prompt.split()
    hits = max((_shared(words, seen) for seen in state.prefix_cache), default=0)
    if state.prefix_block:  # a paged cache: whole blocks only
        hits = hits // state.prefix_block * state.prefix_block
    state.prefix_cache.append(words)
    state.prefix_queries += len(words)
    state.prefix_hits += hits
    usage = _usage(2, prompt_tokens=len(words))
    steps: list[tuple] = [
        ("data", _chunk(role="assistant")),
        ("sleep", 20),
        ("data", _chunk("ok")),
        ("sleep", 10),
        ("data", _chunk(" ok")),
        ("data", _chunk(finish="stop")),
    ]
    if state.prefix_engine == "llamacpp":  # llama.cpp #16048: usage and timings, choices: []
        usage["timings"] = {"cache_n": hits, "prompt_n": len(words) - hits, "predicted_n": 2}
        return [*steps, ("data", usage), ("data", "[DONE]")]
    if state.prefix_engine == "llama-cpp-python":  # no usage, no timings in a stream
        return [*steps, ("data", "[DONE]")]
    usage["usage"]["prompt_tokens_details"] = {"cached_tokens": hits}
    return [*steps, ("data", usage), ("data", "[DONE]")]


def _shared(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def _send_text(writer: asyncio.StreamWriter, text: str) -> None:
    payload = text.encode()
    writer.write(
        _response_head(
            200, "OK", {"Content-Type": "text/plain; version=0.0.4", "Content-Length": str(len(payload))}
        )
        + payload
    )
    await writer.drain()


async def _stream(writer: asyncio.StreamWriter, steps: list[tuple], state: _State) -> bool:
    """Play a schedule. Returns False when the connection was cut on purpose."""
    if steps and steps[0][0] == "status":
        _, code, body, *delay_ms = steps[0]
        if delay_ms:  # answered after a wait, as a gateway that gave up on its origin
            await asyncio.sleep(delay_ms[0] / 1000)
        await _send_json(writer, code, body)
        return True
    writer.write(
        _response_head(
            200,
            "OK",
            {
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Transfer-Encoding": "chunked",
            },
        )
    )
    await writer.drain()
    for step in steps:
        kind = step[0]
        if kind == "sleep":
            await asyncio.sleep(step[1] / 1000)
            continue
        if kind == "until_in_flight":  # wait for step[1] requests in flight, at most step[2] ms
            deadline = time.monotonic() + step[2] / 1000
            while state.in_flight < step[1] and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            continue
        if kind == "cut":  # FIN without the terminating chunk: an incomplete chunked body
            await writer.drain()
            writer.close()
            return False
        if kind == "reset":  # RST
            writer.transport.abort()
            return False
        if kind == "bytes":  # exactly these bytes, in one write
            writer.write(_http_chunk(step[1]))
            await writer.drain()
            continue
        if kind == "raw":
            text = step[1]
        else:
            data = step[1] if isinstance(step[1], str) else json.dumps(step[1])
            text = f"data: {data}\n\n"
        writer.write(_http_chunk(text.encode()))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


#: The "prompt_cache" scenario's texts: what a greedy request returns the first time the server
#: sees a prompt (a cold prefill) and every later time (the prompt reused from its cache).
PROMPT_CACHE_TEXT = {"cold": "The sea is wide.", "warm": "The sea is deep."}


def _prompt_cache_steps(warm: bool) -> list[tuple]:
    """``prompt_cache``: as llama.cpp with its prompt cache, per prompt: the first request is
    slow (cold prefill, 150 ms to the first token) and says PROMPT_CACHE_TEXT["cold"]; later
    ones are fast (30 ms) and say PROMPT_CACHE_TEXT["warm"], whatever the seed."""
    words = PROMPT_CACHE_TEXT["warm" if warm else "cold"].split(" ")
    return [
        ("data", _chunk(role="assistant", content="")),
        ("sleep", 30 if warm else 150),
        *[("data", _chunk(w if i == 0 else f" {w}")) for i, w in enumerate(words)],
        ("data", _usage(len(words))),
        ("data", "[DONE]"),
    ]


def _rendezvous(model: str) -> list[tuple] | None:
    """``rendezvous:N``: wait up to 1 s until N requests are in flight, then hold ~150 ms. A
    loaded machine that starts one slot late still overlaps N slots; fewer slots never can."""
    parts = model.split(":")
    if parts[0] != "rendezvous" or len(parts) != 2:
        return None
    return [("until_in_flight", int(parts[1]), 1000), *SCENARIOS["hold"]]


#: The seeded generators of the ``noisy`` scenario, one per seed for the server's life: successive
#: requests (and so successive runs) draw successive, independent values.
_NOISE: dict[int, random.Random] = {}
#: Per seed of a noisy spec with a run factor: (requests served, the current run's factor).
_RUNS: dict[int, tuple[int, float]] = {}


def _ticks(model: str) -> tuple[int, float, float, float] | None:
    """``ticks:N:GAP_MS[:TTFT_MS]`` -> (N, gap_s, ttft_s, 0.0); ``load:N:BASE_MS:SLOPE_MS[:TTFT_MS]``
    -> (N, base_s, ttft_s, slope_s) (TTFT default BASE_MS); ``noisy:N:GAP_MS:TTFT_MS:SIGMA:SEED``
    -> ticks whose TTFT and every gap are the medians given times a log-normal factor
    ``exp(SIGMA * z)`` drawn for this request from the generator of SEED (a controlled jitter:
    the verdict benchmark's ground truth); ``...:SEED:SHARE:FACTOR`` also makes a random SHARE of
    the requests wait FACTOR x longer for the first token (a tail); ``...:FACTOR:RUN_SD:PER_RUN``
    also moves whole runs: every PER_RUN requests a new factor exp(RUN_SD z) on TTFT and gaps
    (machine load); else None. A noisy spec's gaps come as a 5th entry."""
    parts = model.split(":")
    if parts[0] == "noisy" and len(parts) in (6, 8, 10):
        n, gap, ttft, sigma = int(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])
        seed = int(parts[5])
        rng = _NOISE.setdefault(seed, random.Random(seed))
        share, factor = (float(parts[6]), float(parts[7])) if len(parts) >= 8 else (0.0, 1.0)
        if len(parts) == 10:  # whole runs moved: a factor exp(RUN_SD z) for each PER_RUN requests
            run_sd, per_run = float(parts[8]), int(parts[9])
            count, run = _RUNS.get(seed, (0, 1.0))
            if count % per_run == 0:
                run = math.exp(run_sd * rng.gauss(0, 1))
            _RUNS[seed] = (count + 1, run)
            gap, ttft = gap * run, ttft * run
        gaps = tuple(gap / 1000.0 * math.exp(sigma * rng.gauss(0, 1)) for _ in range(n))
        first = ttft / 1000.0 * math.exp(sigma * rng.gauss(0, 1))
        if share and rng.random() < share:  # a tail: this request waits FACTOR x longer
            first *= factor
        return n, 0.0, first, 0.0, gaps  # type: ignore[return-value]
    if parts[0] == "ticks" and len(parts) in (3, 4):
        n, gap = int(parts[1]), float(parts[2])
        return n, gap / 1000.0, (float(parts[3]) if len(parts) == 4 else gap) / 1000.0, 0.0
    if parts[0] == "load" and len(parts) in (4, 5):
        n, base, slope = int(parts[1]), float(parts[2]), float(parts[3])
        return n, base / 1000.0, (float(parts[4]) if len(parts) == 5 else base) / 1000.0, slope / 1000.0
    return None


def load_law_rate(n: int, base_ms: float, slope_ms: float, ttft_ms: float, tpot_slo_ms: float) -> float:
    """The request rate (req/s) at which the ``load`` scenario's TPOT reaches ``tpot_slo_ms``.

    Each gap is ``base + slope * (k - 1)`` with k requests in flight, so TPOT = base + slope *
    (L - 1) at a steady L in flight, which meets the SLO up to L* = 1 + (SLO - base) / slope.
    A request then lasts D* = TTFT + (n - 1) * SLO, and Little's law (L = rate * D) gives the
    rate L* / D*. (Steady arrivals; ramp-up and ramp-down requests see fewer in flight.)
    """
    in_flight = 1 + (tpot_slo_ms - base_ms) / slope_ms
    return in_flight / ((ttft_ms + (n - 1) * tpot_slo_ms) / 1000.0)


def _tick_bytes(chunk: Any) -> tuple[bytes, list[bytes]]:
    return (
        f"data: {json.dumps(chunk(role='assistant', content=''))}\n\n".encode(),
        [f"data: {json.dumps(chunk(f' w{i}'))}\n\n".encode() for i in range(4096)],
    )


_TICK_ROLE, _TICK_TEXT = _tick_bytes(_chunk)
_TICK_BYTES = {"chat": (_TICK_ROLE, _TICK_TEXT), "completions": _tick_bytes(_completion)}
_TICK_BYTES["responses"] = (
    _response_event("response.created", response=_response("in_progress"))[1].encode(),
    [_response_event("response.output_text.delta", output_index=0, content_index=0, delta=f" w{i}")[1].encode()
     for i in range(4096)],
)  # fmt: skip


def _tick_tail(api: str, n: int) -> bytes:
    """A ticks stream's end: usage and ``[DONE]``, or ``response.completed`` with the usage."""
    if api == "responses":
        usage = _responses_usage(_usage(n)["usage"])
        return _response_event("response.completed", response=_response("completed", usage))[1].encode()
    return (f"data: {json.dumps(_usage(n))}\n\n" + "data: [DONE]\n\n").encode()


#: How late after its deadline a noisy scenario's chunk may be written before ``GET /stats``
#: lists it in ``late_chunk_ns`` (that scenario waits out its deadlines to a few microseconds).
LATE_CHUNK_S = 0.0005


async def _stream_ticks(
    writer: asyncio.StreamWriter,
    spec: tuple[int, float, float, float],
    stamps: list[int],
    state: _State | None = None,
    api: str = "chat",
) -> None:
    """Play a ticks scenario on absolute deadlines; append each text chunk's send stamp. With a
    slope (``load``), each gap is base + slope * (requests in flight - 1), read when the gap
    starts."""
    n, gap_s, ttft_s, slope_s = spec[:4]
    gaps = spec[4] if len(spec) > 4 else None  # the noisy scenario's drawn gaps
    role, texts = _TICK_BYTES[api]
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer.write(
        _response_head(
            200,
            "OK",
            {
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Transfer-Encoding": "chunked",
            },
        )
        + _http_chunk(role)
    )
    perf = time.perf_counter_ns
    due = start + ttft_s
    for i in range(n):
        if i and gaps is not None:
            due += gaps[i]
        elif i:
            due += gap_s + (slope_s * (state.in_flight - 1) if slope_s and state is not None else 0.0)
        delay = due - loop.time()
        if gaps is not None:  # noisy: to the deadline itself, not the loop's 1 ms timer ticks
            if delay > 0.002:
                await asyncio.sleep(delay - 0.002)
            while loop.time() < due:
                pass
        elif delay > 0:
            await asyncio.sleep(delay)
        if writer.is_closing():  # the client went away (a pre-flight probe reads one chunk)
            return
        data = _http_chunk(texts[i % len(texts)])
        stamps.append(perf())
        if gaps is not None and state is not None and loop.time() - due > LATE_CHUNK_S:
            state.late_chunk_ns.append(stamps[-1])
        writer.write(data)
    writer.write(_http_chunk(_tick_tail(api, n)) + b"0\r\n\r\n")
    await writer.drain()


async def _handle(state: _State, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = {}
            for line in header_lines:
                if ":" in line:
                    key, value = line.split(":", 1)
                    headers[key.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            body = await reader.readexactly(length) if length else b""

            if method == "GET" and path.startswith("/stats"):
                await _send_json(
                    writer,
                    200,
                    {
                        "max_in_flight": state.max_in_flight,
                        "requests": state.requests,
                        "late_chunk_ns": state.late_chunk_ns,
                    },
                )
                continue
            if method == "POST" and path.startswith("/prefix_cache_mode"):
                query = dict(part.split("=", 1) for part in path.partition("?")[2].split("&") if "=" in part)
                state.prefix_engine = query.get("engine", "vllm")
                state.prefix_block = int(query.get("block_size", "0"))
                await _send_json(writer, 200, {"ok": True})
                continue
            if method == "POST" and path.startswith("/reset_prefix_cache"):  # vLLM's (dev mode)
                state.prefix_cache.clear()
                await _send_json(writer, 200, {"ok": True})
                continue
            if method == "POST" and path.startswith("/reset"):
                state.__init__()
                await _send_json(writer, 200, {"ok": True})
                continue
            if method == "GET" and path.startswith("/metrics"):
                await _send_text(writer, _metrics_page(state))
                continue
            if method == "GET" and path.startswith("/stamps"):
                await _send_json(writer, 200, state.stamps)
                continue
            if not path.endswith(("/completions", "/responses")):
                await _send_json(writer, 404, _error_body(f"no route {path}", "not_found", 404))
                continue
            api = "chat" if path.endswith("/chat/completions") else "completions"
            if path.endswith("/responses"):
                api = "responses"

            recv_ns = time.perf_counter_ns()
            request = json.loads(body or b"{}")
            request["_authorization"] = headers.get("authorization")
            request["_path"] = path
            state.requests.append(request)
            ticks = _ticks(str(request.get("model", "")))
            if ticks is not None:
                text_sent: list[int] = []
                if api == "chat":
                    key = str((request.get("messages") or [{}])[0].get("content"))
                elif api == "responses":  # the text, or the first message's
                    said = request.get("input")
                    key = str(said[0].get("content") if isinstance(said, list) and said else said)
                else:
                    key = str(request.get("prompt"))
                state.stamps[key] = {"recv_ns": recv_ns, "text_sent_ns": text_sent}
                with state.request_in_flight():
                    await _stream_ticks(writer, ticks, text_sent, state, api)
                state.text_chunks += len(text_sent)
                if text_sent:
                    state.ttft_s_sum += (text_sent[0] - recv_ns) / 1e9
                    state.ttft_count += 1
                continue
            model = str(request.get("model", ""))
            if api == "responses":
                steps = RESPONSES_SCENARIOS.get(model)
            elif model == "prompt_cache":  # llama.cpp's prompt cache: the first (cold) answer differs
                prompt = str((request.get("messages") or [{}])[0].get("content"))
                steps = _prompt_cache_steps(prompt in state.cached_prompts)
                state.cached_prompts.add(prompt)
            elif model == "fail_marked":  # failures known in advance: the prompts marked [fail]
                said = " ".join(str(m.get("content")) for m in request.get("messages") or [])
                said = said if api == "chat" else str(request.get("prompt"))
                scenarios = SCENARIOS if api == "chat" else COMPLETIONS_SCENARIOS
                steps = scenarios["http_500" if "[fail]" in said else "schedule"]
            elif model == "refusal_or_524" and api == "chat":  # refusal, slow 524, refusal, ...
                nth = sum(1 for r in state.requests if r.get("model") == model)
                steps = SCENARIOS["refusal" if nth % 2 else "http_524_slow"]
            elif model == "prefix_cache":
                # every message's words, in order: a conversation's history is its prompt's prefix
                said = " ".join(str(m.get("content")) for m in request.get("messages") or [])
                steps = _prefix_cache_steps(state, said)
            else:
                scenarios = SCENARIOS if api == "chat" else COMPLETIONS_SCENARIOS
                steps = scenarios.get(model) or _rendezvous(model)
            if steps is None:
                await _send_json(
                    writer, 404, _error_body(f"unknown model {request.get('model')!r}", "not_found", 404)
                )
                continue
            with state.request_in_flight():
                keep = await _stream(writer, steps, state)
            if not keep:
                return
    except (ConnectionError, asyncio.CancelledError):
        return
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _main(port: int, cert: str | None = None, key: str | None = None) -> None:
    state = _State()
    tls = None
    if cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(cert, key)
    server = await asyncio.start_server(
        lambda r, w: _handle(state, r, w), "127.0.0.1", port, backlog=1024, ssl=tls
    )
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


# Test helpers -------------------------------------------------------------------------------


def free_port() -> int:
    """A port that was free a moment ago and has nothing listening on it now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GroundTruthServer:
    """Handle on a running server process: ``base_url`` (…/v1), ``stats()``, ``reset()``."""

    def __init__(self, process: subprocess.Popen, port: int, cafile: str | None = None) -> None:
        self.process = process
        self.port = port
        self.scheme = "https" if cafile else "http"
        self.base_url = f"{self.scheme}://127.0.0.1:{port}/v1"
        self._tls = ssl.create_default_context(cafile=cafile) if cafile else None

    def _call(self, method: str, path: str) -> Any:
        request = urllib.request.Request(
            f"{self.scheme}://127.0.0.1:{self.port}{path}",
            method=method,
            data=b"" if method == "POST" else None,
        )
        with urllib.request.urlopen(request, timeout=10, context=self._tls) as response:
            return json.loads(response.read())

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/stats")

    def stamps(self) -> dict[str, dict[str, Any]]:
        """Per prompt: ``recv_ns`` and ``text_sent_ns`` (perf_counter_ns) of ticks requests."""
        return self._call("GET", "/stamps")

    def reset(self) -> None:
        self._call("POST", "/reset")

    def prefix_cache_mode(self, engine: str = "vllm", block_size: int = 0) -> None:
        """The ``prefix_cache`` scenario as ``engine``'s (vllm, sglang, llamacpp,
        llama-cpp-python) with whole
        blocks of ``block_size`` words (0: per word), until :meth:`reset`."""
        self._call("POST", f"/prefix_cache_mode?engine={engine}&block_size={block_size}")


def self_signed_cert(folder: str | os.PathLike[str]) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (``openssl``), valid one day: (cert, key) paths."""
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.contextmanager
def serve(tls: tuple[str, str] | None = None, script: str | None = None) -> Iterator[GroundTruthServer]:
    """Start the server in a child process on a free port; stop it on exit. ``tls``: (cert,
    key) paths: serve HTTPS with them (clients trust the cert as their CA). ``script``: a
    wrapper of this module to run instead (it prints ``PORT <n>`` likewise)."""
    process = subprocess.Popen(
        [sys.executable, os.path.abspath(script or __file__), "0", *(tls or ())],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"ground-truth server did not start: {line!r}")
        yield GroundTruthServer(process, int(line.split()[1]), tls[0] if tls else None)
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout:
            process.stdout.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, *sys.argv[2:4]))
