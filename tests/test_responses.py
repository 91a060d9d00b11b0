"""``--api responses``: OpenAI's Responses API (``/v1/responses``) streamed with the chat
endpoint's definitions (issue 31, item 8).

The ground-truth instrument plays the chat scenarios on ``/v1/responses`` with the same
schedule, as the Responses API's events (``event:`` + ``data:`` lines; text in
``response.output_text.delta``, usage in ``response.completed``), so the chat expectations hold:
TTFT to the first text, one ITL per gap, E2E to the last text, usage over the chunk count, the
same error classes; and a body that ends before ``response.completed`` or
``response.incomplete`` is cut (``stream_broken``), never a success (vLLM PR #54628's review).
Both transports (our HTTP/1.1 + SSE parser, the openai client's ``responses.create``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.config import StreamConfig
from tasks.stats import aggregate_level
from tasks.stream.client import build_request
from tasks.stream.load import make_client, run_level
from tasks.stream.records import RequestRecord
from tasks.stream.settings import LevelSettings
from tasks.wire.responses import chat_usage

try:
    from tests import groundtruth_server as gt
    from tests import one_request
    from tests.one_request import TOL_MS, words
except ImportError:
    import groundtruth_server as gt
    import one_request
    from one_request import TOL_MS, words

BIN = Path(sys.executable).parent / "infermeter"


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


@pytest.fixture(params=["sse", "openai"])
def transport(request) -> str:
    return request.param


def measure(base_url: str, model: str, *, api: str = "responses", **kwargs) -> RequestRecord:
    """One request with a fresh client, after a warm-up on the same connection. (tests/one_request.py)"""
    return one_request.measure(base_url, model, api=api, **kwargs)


def test_schedule_same_definitions_as_chat(server, transport) -> None:
    r = measure(server.base_url, "schedule", transport=transport)
    assert r.succeeded, r.error_message
    assert r.output_text == "".join(gt.SCHEDULE_TEXT)
    # the output item and an empty delta come at once: not tokens; TTFT at 100 ms
    assert gt.SCHEDULE_TTFT_MS <= r.ttft_ms <= gt.SCHEDULE_TTFT_MS + TOL_MS
    assert len(r.itl_ms) == len(gt.SCHEDULE_TEXT) - 1
    assert all(gt.SCHEDULE_GAP_MS - 25 <= gap <= gt.SCHEDULE_GAP_MS + TOL_MS for gap in r.itl_ms)
    expected_e2e = gt.SCHEDULE_TTFT_MS + 4 * gt.SCHEDULE_GAP_MS  # not response.completed 300 ms later
    assert expected_e2e <= r.e2e_ms <= expected_e2e + TOL_MS + 20
    # E2E ends at the last text chunk, not at the usage the server sends 300 ms later (less the
    # last text chunk's own read lateness: CI read 296 ms with the cores shared)
    assert r.stream_close_ms - r.e2e_ms >= gt.SCHEDULE_USAGE_DELAY_MS - TOL_MS
    # usage from response.completed (output_tokens), not the chunk count
    assert (r.output_tokens, r.output_tokens_source) == (gt.SCHEDULE_USAGE_TOKENS, "usage")
    assert (r.input_tokens, r.usage_prompt_tokens, r.cached_tokens) == (11, 11, 0)
    assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / (gt.SCHEDULE_USAGE_TOKENS - 1))
    assert r.arrival_clock == ("kernel" if transport == "sse" else "user")
    chat = measure(server.base_url, "schedule", transport=transport, api="chat")
    assert chat.output_text == r.output_text and len(chat.itl_ms) == len(r.itl_ms)
    assert abs(chat.ttft_ms - r.ttft_ms) < TOL_MS


def test_reasoning_deltas_tool_calls_and_an_incomplete_answer(server, transport) -> None:
    r = measure(server.base_url, "reasoning", transport=transport)  # reasoning_text deltas first
    assert r.succeeded and r.output_text == "Let me think hard.Answer"
    assert 80 <= r.ttft_ms <= 80 + TOL_MS and len(r.itl_ms) == 2 and r.output_tokens == 6
    r = measure(server.base_url, "tool_call", transport=transport)  # a reply that is only a call
    assert r.succeeded, r.error_message
    assert [(c["name"], c["arguments"]) for c in r.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    assert 50 <= r.ttft_ms <= 50 + TOL_MS and len(r.itl_ms) == 4
    # stopped at max_output_tokens: response.incomplete ends it as a success, with its usage
    r = measure(server.base_url, "responses_incomplete", transport=transport)
    assert r.succeeded and r.output_text == "one two three", r.error_message
    usage = gt.RESPONSES_INCOMPLETE_USAGE
    assert (r.output_tokens, r.output_tokens_source) == (usage["output_tokens"], "usage")
    assert (r.usage_prompt_tokens, r.cached_tokens) == (11, 7)
    r = measure(server.base_url, "no_usage", transport=transport)  # completed without a usage
    assert r.succeeded and (r.output_tokens, r.output_tokens_source) == (5, "tokenizer")


@pytest.mark.parametrize(
    ("model", "error_class"),
    [
        ("http_401", "auth"),
        ("http_500", "server"),
        ("stream_error", "server"),  # an error event
        ("string_error", "server"),
        ("responses_failed", "server"),  # response.failed
        ("cut", "stream_broken"),
        ("reset", "stream_broken"),
        ("no_end", "stream_broken"),  # text, then the body ends cleanly
        ("responses_no_completed", "stream_broken"),  # every *.done event, no response.completed
        ("bad_json", "bad_payload"),
        ("empty", "empty_response"),
    ],
)
def test_error_classes(server, model, error_class, transport) -> None:
    r = measure(server.base_url, model, transport=transport)
    assert r.error_class == error_class, r.error_message
    assert not r.succeeded and r.error_message


def test_a_stream_that_ends_before_completed_is_cut_not_a_success(server, transport) -> None:
    """The bug of vLLM PR #54628's review: a body that ends after the message's last event but
    before ``response.completed`` counted as a success. Here: ``stream_broken`` with what was
    measured kept, and a level counts it among its errors of that class."""
    r = measure(server.base_url, "responses_no_completed", transport=transport)
    assert r.error_class == "stream_broken" and "before response.completed" in r.error_message
    assert r.output_text == "The answer is 42" and 20 <= r.ttft_ms <= 20 + TOL_MS and len(r.itl_ms) == 1

    async def main():
        client = make_client(server.base_url, None, 10.0, 2, transport)
        try:
            settings = LevelSettings(
                model="responses_no_completed", prompts=["a", "b"], max_tokens=8, num_requests=3,
                warmup=0, max_concurrency=2, api="responses",
            )  # fmt: skip
            return await run_level(client, settings, count_tokens=words)
        finally:
            await client.close()

    metrics = aggregate_level(asyncio.run(main()).measured, 1.0)
    assert (metrics["num_requests"], metrics["num_succeeded"], metrics["errors_stream_broken"]) == (3, 0, 3)
    assert metrics["error_rate"] == 1.0


def test_request_body_and_path(server, transport) -> None:
    server.reset()
    measure(
        server.base_url,
        "single",
        transport=transport,
        max_tokens=7,
        sampling={"temperature": 0.5, "top_p": 0.9, "seed": 3, "top_k": 40},
        extra_body={"ignore_eos": True},
        history=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    )
    body = server.stats()["requests"][-1]
    assert body["_path"] == "/v1/responses"
    assert body["input"] == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "hi"},
    ]
    assert body["max_output_tokens"] == 7 and body["stream"] is True and body["store"] is False
    assert not {"messages", "prompt", "max_tokens", "max_completion_tokens", "stream_options"} & set(body)
    assert (body["temperature"], body["top_p"], body["seed"], body["top_k"], body["ignore_eos"]) == (
        0.5, 0.9, 3, 40, True,
    )  # fmt: skip
    assert build_request(model="m", prompt="p", max_tokens=5, api="responses")["input"] == "p"


def test_usage_in_the_chat_names() -> None:
    sent = {
        "input_tokens": 20, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 29,
    }  # fmt: skip
    assert chat_usage(sent) == {
        "prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29,
        "prompt_tokens_details": {"cached_tokens": 16}, "completion_tokens_details": {"reasoning_tokens": 4},
    }  # fmt: skip
    assert chat_usage(None) is None and chat_usage({}) is None


def test_level_on_responses_against_true_send_times(server) -> None:
    """A 4-stream level of ``ticks`` on /v1/responses, kernel clock: every measured arrival is
    at or after the event's true send time (causality) and within a few ms of it."""
    server.reset()

    async def main():
        client = make_client(server.base_url, None, 30.0, 4)
        try:
            settings = LevelSettings(
                model="ticks:10:20", prompts=[f"r{i}" for i in range(8)], max_tokens=10,
                num_requests=8, max_concurrency=4, api="responses",
            )  # fmt: skip
            return await run_level(client, settings, count_tokens=None)
        finally:
            await client.close()

    result = asyncio.run(main())
    stamps = server.stamps()
    assert len(result.measured) == 8 and all(r.succeeded for r in result.measured)
    errors_ms = []
    for r in result.measured:
        assert r.arrival_clock == "kernel" and r.output_tokens_source == "usage"
        true_ns = stamps[f"r{r.request_id.split('-r')[1]}"]["text_sent_ns"]
        assert len(true_ns) == len(r.token_offsets_ms) == 10 and r.output_tokens == 10
        for offset, sent in zip(r.token_offsets_ms, true_ns, strict=True):
            errors_ms.append(r.send_ns / 1e6 + offset - sent / 1e6)
    assert min(errors_ms) >= -0.05  # causality (CLOCK_MONOTONIC on both sides)
    assert sorted(errors_ms)[len(errors_ms) // 2] < 5.0
    assert all(body["_path"] == "/v1/responses" for body in server.stats()["requests"])


def test_config_key_and_command_flag(server, tmp_path: Path) -> None:
    assert StreamConfig(api="responses").api == "responses"
    StreamConfig(api="responses", turns=2, input_len=8)  # a conversation goes as input messages
    with pytest.raises(ValueError, match="--api completions"):
        StreamConfig(api="completions", turns=2, input_len=8)
    server.reset()
    out = tmp_path / "out.json"
    command = [str(BIN), "stream", "--base-url", server.base_url, "--model", "ticks:4:10",
               "--tokenizer", "gguf:default", "--max-concurrency", "2", "--num-requests", "4",
               "--api", "responses", "--no-track", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    requests = [r for r in json.loads(out.read_text())["levels"][0]["requests"] if not r["warmup"]]
    assert len(requests) == 4 and all(r["error"] is None and r["output_tokens"] == 4 for r in requests)
    bodies = server.stats()["requests"]
    assert all(body["_path"] == "/v1/responses" for body in bodies)
    assert bodies[0]["input"] == "ping"  # the pre-flight probed the endpoint the run streams from
