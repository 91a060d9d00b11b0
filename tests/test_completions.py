"""``--api completions``: ``/v1/completions`` streamed with the chat endpoint's definitions.

The ground-truth instrument plays every chat scenario on ``/v1/completions`` with the same
schedule, its chunks in the completions shape (``choices[].text``), so the same expectations
hold: TTFT to the first text, one ITL per gap, E2E to the last text, usage over the chunk count,
and the same error classes. Both transports (our HTTP/1.1 + SSE parser, the openai client).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.config import StreamConfig
from tasks.stream.client import build_request
from tasks.stream.load import make_client, run_level
from tasks.stream.records import RequestRecord
from tasks.stream.settings import LevelSettings

try:
    from tests import groundtruth_server as gt
    from tests import one_request
    from tests.one_request import TOL_MS
except ImportError:
    import groundtruth_server as gt
    import one_request
    from one_request import TOL_MS

BIN = Path(sys.executable).parent / "infermeter"


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


@pytest.fixture(params=["sse", "openai"])
def transport(request) -> str:
    return request.param


def measure(base_url: str, model: str, *, api: str = "completions", **kwargs) -> RequestRecord:
    """One completions request with a fresh client, after a warm-up on the same connection. (tests/one_request.py)"""
    return one_request.measure(base_url, model, api=api, **kwargs)


def test_schedule_same_definitions_as_chat(server, transport) -> None:
    r = measure(server.base_url, "schedule", transport=transport)
    assert r.succeeded, r.error_message
    assert r.output_text == "".join(gt.SCHEDULE_TEXT)
    # the first chunk (the chat role chunk, here empty text) is not a token: TTFT at 100 ms
    assert gt.SCHEDULE_TTFT_MS <= r.ttft_ms <= gt.SCHEDULE_TTFT_MS + TOL_MS
    assert len(r.itl_ms) == len(gt.SCHEDULE_TEXT) - 1
    assert all(gt.SCHEDULE_GAP_MS - 25 <= gap <= gt.SCHEDULE_GAP_MS + TOL_MS for gap in r.itl_ms)
    expected_e2e = gt.SCHEDULE_TTFT_MS + 4 * gt.SCHEDULE_GAP_MS  # not the usage 300 ms later
    assert expected_e2e <= r.e2e_ms <= expected_e2e + TOL_MS + 20
    # E2E ends at the last text chunk, not at the usage the server sends 300 ms later (less the
    # last text chunk's own read lateness: CI read 296 ms with the cores shared)
    assert r.stream_close_ms - r.e2e_ms >= gt.SCHEDULE_USAGE_DELAY_MS - TOL_MS
    assert (r.output_tokens, r.output_tokens_source) == (gt.SCHEDULE_USAGE_TOKENS, "usage")
    assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / (gt.SCHEDULE_USAGE_TOKENS - 1))
    chat = measure(server.base_url, "schedule", transport=transport, api="chat")
    assert chat.output_text == r.output_text and len(chat.itl_ms) == len(r.itl_ms)
    assert abs(chat.ttft_ms - r.ttft_ms) < TOL_MS


def test_no_usage_keepalive_split_single(server, transport) -> None:
    r = measure(server.base_url, "no_usage", transport=transport)
    assert r.output_text == "one two three four five"
    assert (r.output_tokens, r.output_tokens_source) == (5, "tokenizer")
    r = measure(server.base_url, "keepalive", transport=transport)
    assert 120 <= r.ttft_ms <= 120 + TOL_MS and r.output_text == "tick tock"  # empty text at 40 ms
    r = measure(server.base_url, "split", transport=transport)
    assert r.succeeded, r.error_message
    assert r.output_text == "Hello world" and 60 <= r.ttft_ms <= 60 + TOL_MS and len(r.itl_ms) == 2
    r = measure(server.base_url, "single", transport=transport)
    assert r.output_tokens == 1 and r.tpot_ms is None and r.itl_ms == []


@pytest.mark.parametrize(
    ("model", "error_class"),
    [
        ("http_401", "auth"),
        ("http_404", "not_found"),
        ("http_429", "rate_limited"),
        ("http_500", "server"),
        ("stream_error", "server"),
        ("stream_error_vllm", "server"),
        ("cut", "stream_broken"),
        ("reset", "stream_broken"),
        ("bad_json", "bad_payload"),
        ("empty", "empty_response"),
    ],
)
def test_error_classes(server, model, error_class, transport) -> None:
    r = measure(server.base_url, model, transport=transport)
    assert r.error_class == error_class, r.error_message
    assert not r.succeeded and r.error_message


def test_partial_text_kept_on_a_cut(server, transport) -> None:
    r = measure(server.base_url, "cut", transport=transport)
    assert r.error_class == "stream_broken" and r.output_text == "one two"
    assert 30 <= r.ttft_ms <= 30 + TOL_MS and len(r.itl_ms) == 1


def test_request_body_and_path(server, transport) -> None:
    server.reset()
    measure(
        server.base_url,
        "single",
        transport=transport,
        max_tokens=7,
        sampling={"temperature": 0.5, "top_k": 40},
        extra_body={"ignore_eos": True},
    )
    body = server.stats()["requests"][-1]
    assert body["_path"] == "/v1/completions"
    assert body["prompt"] == "hi" and "messages" not in body
    assert body["max_tokens"] == 7 and "max_completion_tokens" not in body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_k"], body["ignore_eos"]) == (0.5, 40, True)


def test_build_request_shapes() -> None:
    chat = build_request(model="m", prompt="p", max_tokens=5)
    text = build_request(model="m", prompt="p", max_tokens=5, api="completions")
    assert chat["messages"] == [{"role": "user", "content": "p"}] and chat["max_completion_tokens"] == 5
    assert text["prompt"] == "p" and text["max_tokens"] == 5 and text["extra_body"] == {}


def test_level_on_completions_against_true_send_times(server) -> None:
    """A 4-stream level of ``ticks`` on /v1/completions: every measured arrival is at or after
    the chunk's true send time (causality) and within a few ms of it."""
    server.reset()

    async def main():
        client = make_client(server.base_url, None, 30.0, 4)
        try:
            settings = LevelSettings(
                model="ticks:10:20",
                prompts=[f"c{i}" for i in range(8)],
                max_tokens=10,
                num_requests=8,
                max_concurrency=4,
                api="completions",
            )
            return await run_level(client, settings, count_tokens=None)
        finally:
            await client.close()

    result = asyncio.run(main())
    stamps = server.stamps()
    assert len(result.measured) == 8 and all(r.succeeded for r in result.measured)
    errors_ms = []
    for r in result.measured:
        true_ns = stamps[f"c{r.request_id.split('-r')[1]}"]["text_sent_ns"]
        assert len(true_ns) == len(r.token_offsets_ms) == 10 and r.output_tokens == 10
        for offset, sent in zip(r.token_offsets_ms, true_ns, strict=True):
            errors_ms.append(r.send_ns / 1e6 + offset - sent / 1e6)
    assert min(errors_ms) >= -0.05  # causality (CLOCK_MONOTONIC on both sides)
    assert sorted(errors_ms)[len(errors_ms) // 2] < 5.0
    assert all(body["_path"] == "/v1/completions" for body in server.stats()["requests"])


def test_config_key_and_command_flag(server, tmp_path: Path) -> None:
    assert StreamConfig().api == "chat"
    with pytest.raises(ValueError, match="api"):
        StreamConfig(api="embeddings")
    out = tmp_path / "out.json"
    base = [str(BIN), "stream", "--base-url", server.base_url, "--model", "ticks:4:10"]
    flags = ["--tokenizer", "gguf:default", "--max-concurrency", "2", "--num-requests", "4"]
    proc = subprocess.run(
        [*base, *flags, "--api", "completions", "--no-track", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    data = json.loads(out.read_text())
    assert set(data) == {"levels", "mlflow_run_id"}
    requests = [r for r in data["levels"][0]["requests"] if not r["warmup"]]
    assert len(requests) == 4 and all(r["error"] is None and r["output_tokens"] == 4 for r in requests)
    bad = subprocess.run(
        [*base, "--api", "embeddings", "--no-track"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "--api" in bad.stderr
