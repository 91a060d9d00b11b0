"""The stream client, error classes, load levels and records against a ground-truth SSE server.

The server (tests/groundtruth_server.py, a separate process) plays a known schedule per
request, chosen by the model name. Tolerances allow a loaded 2-core machine (+TOL_MS) but stay
far below the mistakes they guard against: counting the role chunk as the first token (TTFT
~0 instead of 100 ms) or letting the late usage chunk stretch E2E (+300 ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import polars as pl
import pytest

from tasks.scaleout.levels import run_levels
from tasks.stats import aggregate_level
from tasks.stream.client import build_request, stream_chat
from tasks.stream.level_figures import Level
from tasks.stream.load import make_client, run_level
from tasks.stream.records import RecordWriter, RequestRecord, read_jsonl, write_parquet
from tasks.stream.settings import Connection, LevelSettings, level_settings
from tasks.stream.timing import ChunkTiming, chunk_timing, tpot_ms
from tasks.wire import errors

try:
    from tests import groundtruth_server as gt
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import groundtruth_server as gt

TOL_MS = 60.0
SECRET = "sk-test-SECRET123456"


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


@pytest.fixture(params=["sse", "openai"])
def transport(request) -> str:
    """Both transports must give the same records (tasks.stream.client)."""
    return request.param


def measure(
    base_url: str,
    model: str,
    *,
    timeout_s: float = 10.0,
    warm: bool = True,
    transport: str = "sse",
    **kwargs,
) -> RequestRecord:
    """One request with a fresh client, after one warm-up request on the same connection."""

    async def main() -> RequestRecord:
        client = make_client(base_url, SECRET, timeout_s, 1, transport)
        try:
            if warm:
                await stream_chat(
                    client, model="single", prompt="w", max_tokens=4, count_tokens=words, request_id="warm"
                )
            options = {
                "prompt": "hi",
                "max_tokens": 16,
                "count_tokens": words,
                "request_id": f"req-{model}",
                **kwargs,
            }
            return await stream_chat(client, model=model, **options)
        finally:
            await client.close()

    return asyncio.run(main())


# Timing ground truth --------------------------------------------------------------------------


def test_schedule_ttft_itl_e2e_tpot(server: gt.GroundTruthServer, transport) -> None:
    r = measure(server.base_url, "schedule", level=3, max_concurrency=2, input_tokens=42, transport=transport)
    assert r.succeeded, r.error_message
    assert r.error_class is None and r.error_message is None
    # TTFT: the role-only chunk at t=0 is not a token; the first text comes at 100 ms
    assert gt.SCHEDULE_TTFT_MS <= r.ttft_ms <= gt.SCHEDULE_TTFT_MS + TOL_MS
    # ITL: text chunks - 1 gaps of ~50 ms
    assert len(r.itl_ms) == len(gt.SCHEDULE_TEXT) - 1
    for gap in r.itl_ms:
        assert gt.SCHEDULE_GAP_MS - 25 <= gap <= gt.SCHEDULE_GAP_MS + TOL_MS
    assert sum(r.itl_ms) == pytest.approx(r.e2e_ms - r.ttft_ms, abs=1e-6)
    # E2E: to the last text chunk at 100 + 4*50 = 300 ms, not to the usage chunk 300 ms later
    expected_e2e = gt.SCHEDULE_TTFT_MS + 4 * gt.SCHEDULE_GAP_MS
    assert expected_e2e <= r.e2e_ms <= expected_e2e + TOL_MS + 20
    assert r.stream_close_ms >= expected_e2e + gt.SCHEDULE_USAGE_DELAY_MS
    # E2E ends at the last text chunk, not at the usage the server sends 300 ms later (less the
    # last text chunk's own read lateness: CI read 296 ms with the cores shared)
    assert r.stream_close_ms - r.e2e_ms >= gt.SCHEDULE_USAGE_DELAY_MS - TOL_MS
    # output tokens from usage (9), not the chunk count (5) nor the word count (5)
    assert r.output_tokens == gt.SCHEDULE_USAGE_TOKENS
    assert r.output_tokens_source == "usage"
    assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / (gt.SCHEDULE_USAGE_TOKENS - 1))
    assert r.tpot_ms < min(r.itl_ms)  # multi-token chunks: TPOT and mean ITL differ
    assert r.output_text == "".join(gt.SCHEDULE_TEXT)
    assert len(r.token_offsets_ms) == 5 and r.token_offsets_ms[0] == r.ttft_ms
    assert r.token_offsets_ms[-1] == r.e2e_ms
    # identity fields
    assert (r.request_id, r.level, r.max_concurrency, r.warmup) == ("req-schedule", 3, 2, False)
    assert r.input_tokens == 42
    assert isinstance(r.send_ns, int) and 0 < r.send_ns <= time.perf_counter_ns()


def test_chunk_timing_real_values() -> None:
    """The one timing function (tasks.stream.timing) on known stamps: TTFT to the first text
    chunk, ITL between text chunks (ns stamps, not rounded offsets), E2E to the last one, TPOT
    over the output tokens after the first, None without 2 tokens and 2 text chunks."""
    send = 5_000_000_000
    t = chunk_timing(send, [send + 100_000_000, send + 150_500_000, send + 300_000_000], 9)
    assert t.token_offsets_ms == (100.0, 150.5, 300.0)
    assert (t.ttft_ms, t.e2e_ms) == (100.0, 300.0)
    assert t.itl_ms == (50.5, 149.5)
    assert t.tpot_ms == 25.0  # (300 - 100) / (9 - 1): not the mean ITL (100)
    assert chunk_timing(send, [send + 1, send + 3]).itl_ms == (2e-6,)
    one_chunk = chunk_timing(send, [send + 40_000_000], 4)  # 4 tokens in one chunk
    assert (one_chunk.ttft_ms, one_chunk.e2e_ms, one_chunk.itl_ms) == (40.0, 40.0, ())
    assert one_chunk.tpot_ms is None  # the decode is invisible, not 0 ms
    assert chunk_timing(send, [send + 1_000_000, send + 2_000_000], 1).tpot_ms is None
    assert chunk_timing(send, [send + 1_000_000, send + 2_000_000]).tpot_ms is None  # no count
    assert chunk_timing(send, []) == ChunkTiming(
        token_offsets_ms=(), ttft_ms=None, itl_ms=(), e2e_ms=None, tpot_ms=None
    )
    assert tpot_ms(10.0, 70.0, 4, [10.0, 70.0]) == 20.0 and tpot_ms(10.0, 70.0, 4, [10.0]) is None
    assert (
        tpot_ms(None, 70.0, 4, [10.0, 70.0]) is None and tpot_ms(10.0, 70.0, None, [10.0, 40.0, 70.0]) is None
    )


def test_no_usage_falls_back_to_tokenizer(server: gt.GroundTruthServer) -> None:
    seen: list[str] = []

    def count(text: str) -> int:
        seen.append(text)
        return words(text)

    r = measure(server.base_url, "no_usage", count_tokens=count)
    assert r.succeeded
    assert r.output_text == "one two three four five"
    assert seen[-1] == "one two three four five"  # tokenized once, after the stream
    assert (r.output_tokens, r.output_tokens_source) == (5, "tokenizer")
    assert len(r.itl_ms) == 1  # two text chunks
    assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / 4)
    assert r.input_tokens is None  # no usage, none given


def test_no_usage_and_no_tokenizer_leaves_count_unknown(server: gt.GroundTruthServer) -> None:
    r = measure(server.base_url, "no_usage", count_tokens=None)
    assert r.succeeded
    assert r.output_tokens is None and r.output_tokens_source is None and r.tpot_ms is None


@pytest.mark.parametrize(
    ("model", "first_ms", "text", "chunks"),
    [("reasoning", 80, "Let me think hard.Answer", 3), ("reasoning_alt", 60, "hmmok", 2)],
)
def test_reasoning_deltas_are_tokens(server, model, first_ms, text, chunks, transport) -> None:
    r = measure(server.base_url, model, transport=transport)
    assert r.succeeded
    assert first_ms <= r.ttft_ms <= first_ms + TOL_MS
    assert r.output_text == text
    assert len(r.token_offsets_ms) == chunks
    assert r.output_tokens_source == "usage"
    assert r.input_tokens == 11  # from usage.prompt_tokens when the caller gives none


def test_keepalive_comments_and_empty_chunks_ignored(server: gt.GroundTruthServer, transport) -> None:
    r = measure(server.base_url, "keepalive", transport=transport)
    assert r.succeeded
    assert 120 <= r.ttft_ms <= 120 + TOL_MS  # the empty-content chunk at 40 ms is not a token
    assert r.output_text == "tick tock"
    assert len(r.itl_ms) == 1 and 30 - 15 <= r.itl_ms[0] <= 30 + TOL_MS


def test_byte_splits_and_crlf(server: gt.GroundTruthServer, transport) -> None:
    r = measure(server.base_url, "split", transport=transport)
    assert r.succeeded, r.error_message
    assert r.output_text == "Hello world"
    assert 60 <= r.ttft_ms <= 60 + TOL_MS  # the first event completes with the second write
    assert len(r.itl_ms) == 2
    assert 30 - 15 <= r.itl_ms[0] <= 30 + TOL_MS
    if transport == "sse":  # two events in one read share its arrival time
        assert r.itl_ms[1] == 0.0
    assert r.output_tokens == 3


def test_single_token_has_no_tpot(server: gt.GroundTruthServer) -> None:
    r = measure(server.base_url, "single")
    assert r.succeeded and r.output_tokens == 1 and r.tpot_ms is None and r.itl_ms == []
    assert r.ttft_ms == r.e2e_ms


def test_request_parameters_sent(server: gt.GroundTruthServer, transport) -> None:
    server.reset()
    measure(
        server.base_url,
        "single",
        warm=False,
        max_tokens=7,
        sampling={"temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 3, "min_p": None},
        extra_body={"ignore_eos": True},
        transport=transport,
    )
    body = server.stats()["requests"][-1]
    assert body["model"] == "single"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_completion_tokens"] == 7 and body["max_tokens"] == 7
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.5, 0.9, 40, 3)
    assert body["ignore_eos"] is True and "min_p" not in body
    assert body["_authorization"] == f"Bearer {SECRET}"


def test_build_request_routes_top_k_through_extra_body() -> None:
    kwargs = build_request(model="m", prompt="p", max_tokens=5, sampling={"top_k": 2, "seed": 1})
    assert kwargs["extra_body"] == {"max_tokens": 5, "top_k": 2}
    assert kwargs["seed"] == 1 and "top_k" not in kwargs


# Error classes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "error_class"),
    [
        ("http_401", "auth"),
        ("http_403", "auth"),
        ("http_404", "not_found"),
        ("http_429", "rate_limited"),
        ("http_500", "server"),
        ("http_400", "bad_request"),
        ("stream_error", "server"),
        ("stream_error_vllm", "server"),
        ("cut", "stream_broken"),
        ("reset", "stream_broken"),
        ("bad_json", "bad_payload"),
        ("empty", "empty_response"),
    ],
)
def test_error_classes(server, model, error_class, transport) -> None:
    r = measure(server.base_url, model, warm=False, api_key_env="MY_KEY_ENV", transport=transport)
    assert r.error_class == error_class, r.error_message
    assert r.error_message
    assert not r.succeeded
    assert SECRET not in r.error_message and "SECRET123456" not in r.error_message


def test_http_errors_have_actionable_messages(server: gt.GroundTruthServer, transport) -> None:
    r401 = measure(server.base_url, "http_401", warm=False, api_key_env="MY_KEY_ENV", transport=transport)
    assert "401" in r401.error_message and "MY_KEY_ENV" in r401.error_message
    assert "[redacted]" in r401.error_message  # the server echoed the key; it is masked
    r401_default = measure(server.base_url, "http_401", warm=False, transport=transport)
    assert "api_key_env" in r401_default.error_message
    r404 = measure(server.base_url, "http_404", warm=False, transport=transport)
    assert "'http_404'" in r404.error_message and "/v1" in r404.error_message
    r429 = measure(server.base_url, "http_429", warm=False, transport=transport)
    assert "retry-after: 2" in r429.error_message and "max_concurrency" in r429.error_message
    for r in (r401, r404, r429):
        assert r.ttft_ms is None and r.stream_close_ms is None and r.output_text == ""


def test_partial_measurements_kept_on_failure(server: gt.GroundTruthServer, transport) -> None:
    r = measure(server.base_url, "cut", transport=transport)
    assert r.error_class == "stream_broken"
    assert r.output_text == "one two"
    assert 30 <= r.ttft_ms <= 30 + TOL_MS and len(r.itl_ms) == 1
    assert r.output_tokens == 2 and r.output_tokens_source == "tokenizer"
    assert r.stream_close_ms >= r.e2e_ms
    r = measure(server.base_url, "stream_error", transport=transport)
    assert r.error_class == "server" and "model crashed" in r.error_message
    assert r.output_text == "partial" and r.ttft_ms is not None
    r = measure(server.base_url, "bad_json", transport=transport)
    assert "not json" in r.error_message and r.output_text == "fine"


def test_empty_response_message(server: gt.GroundTruthServer, transport) -> None:
    r = measure(server.base_url, "empty", transport=transport)
    assert r.error_class == "empty_response" and r.ttft_ms is None
    assert r.output_tokens == 0 and r.output_tokens_source == "usage"
    assert "no text" in r.error_message


def test_connection_refused(transport) -> None:
    port = gt.free_port()
    r = measure(f"http://127.0.0.1:{port}/v1", "schedule", warm=False, transport=transport)
    assert r.error_class == "connection", r.error_message
    assert str(port) in r.error_message
    assert r.ttft_ms is None and r.stream_close_ms is None


def test_timeout(server: gt.GroundTruthServer, transport) -> None:
    start = time.perf_counter()
    r = measure(server.base_url, "slow", timeout_s=0.5, transport=transport)
    assert r.error_class == "timeout", r.error_message
    assert time.perf_counter() - start < 2.5  # the 3 s first token was not waited for
    assert "request_timeout_s" in r.error_message


def test_classify_exceptions_directly() -> None:
    request = httpx2.Request("POST", "http://h:1/v1/chat/completions")

    def wrapped(cause: Exception) -> openai.APIConnectionError:
        exc = openai.APIConnectionError(request=request)
        exc.__cause__ = cause
        return exc

    assert errors.classify(wrapped(httpx2.ConnectError("refused")))[0] == "connection"
    assert errors.classify(wrapped(httpx2.RemoteProtocolError("cut")))[0] == "stream_broken"
    assert errors.classify(wrapped(httpx2.ReadError("reset")))[0] == "stream_broken"
    assert errors.classify(wrapped(ConnectionResetError()), in_stream=True)[0] == "stream_broken"
    assert errors.classify(openai.APITimeoutError(request=request))[0] == "timeout"
    assert errors.classify(httpx2.ReadTimeout("slow"))[0] == "timeout"
    assert errors.classify(TimeoutError())[0] == "timeout"
    assert errors.classify(httpx2.RemoteProtocolError("cut"))[0] == "stream_broken"
    try:
        json.loads("{nope")
    except json.JSONDecodeError as exc:
        assert errors.classify(exc)[0] == "bad_payload"
    in_stream = openai.APIError("boom", request, body={"message": "boom"})
    assert errors.classify(in_stream) == ("server", "the server sent an error inside the stream: boom")
    assert errors.classify(errors.StreamError("empty_response", "none")) == ("empty_response", "none")
    assert errors.classify(ValueError("odd"))[0] == "unknown"
    import httpx  # legacy httpx exceptions are recognised too

    assert errors.classify(httpx.ReadTimeout("slow"))[0] == "timeout"
    assert errors.classify(httpx.ConnectError("refused"))[0] == "connection"
    assert set(errors.ERROR_CLASSES) >= {
        "auth",
        "not_found",
        "rate_limited",
        "server",
        "timeout",
        "stream_broken",
        "bad_payload",
        "empty_response",
        "connection",
    }


def test_redact_masks_keys() -> None:
    text = "key sk-abcdef123456 header Bearer xyz987 and mine my-secret-value"
    out = errors.redact(text, secrets=["my-secret-value"])
    assert "sk-abcdef123456" not in out and "xyz987" not in out and "my-secret-value" not in out


# Load levels -------------------------------------------------------------------------------------


def test_run_level_respects_max_concurrency(server: gt.GroundTruthServer) -> None:
    seen: list[RequestRecord] = []

    async def main(concurrency: int, model: str):
        client = make_client(server.base_url, None, 10.0, concurrency)
        try:
            return await run_level(
                client,
                LevelSettings(
                    model=model,
                    prompts=["a", "b"],
                    max_tokens=8,
                    max_concurrency=concurrency,
                    num_requests=9,
                    warmup=2,
                    level=1,
                    prompt_tokens=[3, 5],
                ),
                count_tokens=words,
                on_record=seen.append,
            )
        finally:
            await client.close()

    server.reset()
    # each request waits (up to 1 s) for 3 in flight: a loaded machine cannot hide the overlap
    result = asyncio.run(main(3, "rendezvous:3"))
    assert server.stats()["max_in_flight"] == 3
    assert result.max_concurrency == 3 and result.level == 1
    assert [r.warmup for r in result.records] == [True] * 2 + [False] * 9
    assert len(seen) == 11 and all(r.succeeded for r in result.records)
    assert len(result.measured) == 9
    assert len({r.request_id for r in result.records}) == 11
    assert sorted(r.input_tokens for r in result.measured) == [3] * 5 + [5] * 4
    prompts = [m["messages"][0]["content"] for m in server.stats()["requests"]]
    assert prompts[:2] == ["a", "b"]  # warm-ups round-robin too
    # 9 requests of ~155 ms, 3 at a time: at least 3 rounds
    assert 0.45 <= result.wall_s
    agg = aggregate_level(result.records, result.wall_s)
    assert agg["num_requests"] == 9 and agg["num_succeeded"] == 9
    assert agg["requests_per_s"] == pytest.approx(9 / result.wall_s)
    assert agg["output_tokens_total"] == 27

    server.reset()
    result = asyncio.run(main(1, "hold"))
    assert server.stats()["max_in_flight"] == 1
    assert 9 * 0.15 <= result.wall_s


def test_run_levels_sync(server: gt.GroundTruthServer) -> None:
    server.reset()
    # "rendezvous:2" holds each request up to 1 s for a second one in flight: at concurrency 2
    # the slots overlap even when a loaded machine starts one late; at concurrency 1 they never can
    base = LevelSettings(
        model="rendezvous:2",
        prompts=["p"],
        max_tokens=8,
        num_requests=4,
        warmup=1,
        sampling={"temperature": 0.0},
    )
    results = run_levels(
        Connection(server.base_url, None, 10.0), level_settings(base, [1, 2]), count_tokens=words
    )
    assert [(r.level, r.max_concurrency) for r in results] == [(0, 1), (1, 2)]
    assert [len(r.records) for r in results] == [5, 5]
    assert all(r.succeeded for res in results for r in res.records)
    assert all(r.max_concurrency == res.max_concurrency for res in results for r in res.records)
    assert server.stats()["max_in_flight"] == 2
    assert all(b["_authorization"] == "Bearer no-key" for b in server.stats()["requests"])


def test_level_to_dict_is_the_stage_entry() -> None:
    settings = LevelSettings(
        model="m", prompts=["p"], max_tokens=4, num_requests=1, max_concurrency=3, request_rate=2.5, level=1
    )
    warm = RequestRecord("l1-w0", level=1, max_concurrency=3, request_rate=2.5, warmup=True)
    measured = RequestRecord(
        "l1-r0",
        level=1,
        max_concurrency=3,
        request_rate=2.5,
        ttft_ms=10.0,
        e2e_ms=10.0,
        output_tokens=1,
        token_offsets_ms=[10.0],
    )
    level = Level(settings, {"ttft_ms_p50": 10.0, "client_bound": 0}, (warm, measured), 0.5)
    assert (level.level, level.max_concurrency, level.request_rate) == (1, 3, 2.5)
    assert level.measured == [measured]
    assert level.to_dict() == {
        "max_concurrency": 3,
        "request_rate": 2.5,
        "metrics": {"ttft_ms_p50": 10.0, "client_bound": 0},
        "requests": [warm.to_json(), measured.to_json()],
    }
    assert list(level.to_dict()) == ["max_concurrency", "request_rate", "metrics", "requests"]


# Records -----------------------------------------------------------------------------------------


def _record(i: int, **kw) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        level=0,
        send_ns=1000 + i,
        ttft_ms=10.0 + i,
        itl_ms=[5.0, 7.0],
        e2e_ms=22.0 + i,
        stream_close_ms=30.0 + i,
        output_tokens=4,
        output_tokens_source="usage",
        output_text="héllo 世界",
        token_offsets_ms=[10.0 + i, 15.0 + i, 22.0 + i],
        **kw,
    )


def test_to_json_shape_and_round_trip() -> None:
    ok = _record(1).to_json()
    assert {
        "ttft_ms",
        "itl_ms",
        "tpot_ms",
        "e2e_ms",
        "stream_close_ms",
        "output_tokens",
        "output_tokens_source",
        "output_text",
        "warmup",
        "error",
        "request_id",
        "level",
        "send_ns",
        "input_tokens",
    } <= set(ok)
    assert ok["error"] is None and ok["itl_ms"] == [5.0, 7.0]
    bad = RequestRecord("x", error_class="auth", error_message="401").to_json()
    assert bad["error"] == {"class": "auth", "message": "401"}
    assert RequestRecord.from_json(json.loads(json.dumps(bad))) == RequestRecord(
        "x", error_class="auth", error_message="401"
    )
    assert RequestRecord.from_json(ok) == _record(1)


def test_jsonl_writer_survives_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    root = Path(__file__).resolve().parents[1]
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(root)!r})
        from tasks.stream.records import RecordWriter, RequestRecord
        writer = RecordWriter({str(path)!r})
        for i in range(3):
            writer.write(RequestRecord(request_id=f"r{{i}}", ttft_ms=float(i)))
        os._exit(1)  # a crash: no close, no flush at exit
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    records = read_jsonl(path)
    assert [r.request_id for r in records] == ["r0", "r1", "r2"]
    assert [r.ttft_ms for r in records] == [0.0, 1.0, 2.0]
    # a line cut off mid-write by a crash is skipped; a later writer appends after it
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"request_id": "r3", "ttft')
    assert len(read_jsonl(path)) == 3
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n")
    with RecordWriter(path) as writer:
        writer(_record(4))
    with pytest.raises(ValueError, match=":4:"):
        read_jsonl(path)  # the cut line is no longer last: reported, not hidden


def test_writer_appends_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.jsonl"
    with RecordWriter(path) as writer:
        writer.write(_record(1))
    with RecordWriter(path, fsync=False) as writer:
        writer.write(_record(2, warmup=True))
    assert read_jsonl(path) == [_record(1), _record(2, warmup=True)]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_write_parquet(tmp_path: Path) -> None:
    records = [_record(1), _record(2), RequestRecord("bad", error_class="timeout", error_message="t")]
    write_parquet(records, tmp_path / "requests.parquet", tmp_path / "tokens.parquet")
    requests = pl.read_parquet(tmp_path / "requests.parquet")
    assert requests.height == 3
    assert requests.schema["itl_ms"] == pl.List(pl.Float64)
    assert requests["itl_ms"].to_list()[0] == [5.0, 7.0]
    assert requests["succeeded"].to_list() == [True, True, False]
    assert requests["error_class"].to_list() == [None, None, "timeout"]
    tokens = pl.read_parquet(tmp_path / "tokens.parquet")
    assert tokens.columns == ["request_id", "index", "offset_ms", "gap_ms", "user_offset_ms"]
    assert tokens.height == 6
    first = tokens.filter(pl.col("request_id") == "r1")
    assert first["index"].to_list() == [0, 1, 2]
    assert first["gap_ms"].to_list() == [None, 5.0, 7.0]
    # an empty run still writes typed tables
    write_parquet([], tmp_path / "e_req.parquet", tmp_path / "e_tok.parquet")
    assert pl.read_parquet(tmp_path / "e_req.parquet").schema["itl_ms"] == pl.List(pl.Float64)
    assert os.path.getsize(tmp_path / "e_tok.parquet") > 0
