"""The embedded vLLM server (CPU build, ``.venv-vllm`` from ``make vllm``): what a production
engine gives that llama.cpp does not, seen from outside through the stream stage.

One real vLLM server for the module (about 45 s to start, about 5 GB RSS). Skipped, with the
command that installs it, when ``.venv-vllm`` is absent; ``.ci/run`` installs it, so CI runs
these. The life-cycle tests (missing environment, a server that dies, one that never becomes
healthy) need no running server.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tasks.config import EndpointConfig, ServerConfig, StreamConfig
from tasks.engines.server import (
    EngineNotInstalledError,
    ServerStartError,
    check_engine,
    embedded_server,
    vllm_python,
)

BIN = Path(sys.executable).parent / "infermeter"

try:
    vllm_python()
    MISSING = None
except EngineNotInstalledError as exc:
    MISSING = str(exc)
needs_vllm = pytest.mark.skipif(MISSING is not None, reason=f"{MISSING} (then rerun these tests)")


def _descendants() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    }


# The server-side cross-check (no server needed) ------------------------------------------------


def test_histogram_quantiles_from_a_levels_bucket_increases() -> None:
    from tasks.endpoint.prometheus import histogram_quantile, level_view, parse

    def page(counts):
        bounds = ("0.1", "0.2", "+Inf")
        lines = [
            f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{b}",model_name="m"}} {c}'
            for b, c in zip(bounds, counts)
        ]
        return "\n".join(
            lines
            + [
                f"vllm:time_to_first_token_seconds_count {counts[-1]}",
                f"vllm:time_to_first_token_seconds_sum {counts[-1] * 0.15}",
            ]
        )

    buckets = {0.1: 2.0, 0.2: 6.0, math.inf: 8.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # 0.1 + 0.1 x (4-2)/(6-2)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.04)  # first bucket: from 0, 0.8 of 2
    assert histogram_quantile(0.99, buckets) == 0.2  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    # a level sees only its own increase: 3 + 5 earlier observations are subtracted
    view = level_view(parse(page([3, 5, 5])), parse(page([5, 11, 13])))
    assert view["server_vllm_time_to_first_token_seconds_p50"] == pytest.approx(0.15)
    assert view["server_vllm_time_to_first_token_seconds_count_delta"] == 8


def test_cross_check_flags_a_client_the_server_contradicts() -> None:
    from tasks.endpoint.prometheus import cross_check

    server = {
        "server_vllm_time_to_first_token_seconds_mean": 0.100,
        "server_vllm_time_to_first_token_seconds_p50": 0.090,
        "server_vllm_e2e_request_latency_seconds_mean": 2.0,
    }
    agree = cross_check({**server, "ttft_ms_mean": 104.0, "e2e_ms_mean": 2010.0})
    assert agree["server_ttft_ms_mean"] == pytest.approx(100.0)
    assert agree["server_ttft_ms_p50"] == pytest.approx(90.0)
    assert agree["ttft_ms_mean_client_minus_server"] == pytest.approx(4.0)
    assert agree["server_client_disagree"] == 0
    # a client that starts the clock late or counts a role-only chunk reads TTFT below the
    # server's own: flagged (tolerance 25 ms + 10 % of 100 ms)
    assert cross_check({**server, "ttft_ms_mean": 60.0, "e2e_ms_mean": 2010.0})["server_client_disagree"] == 1
    assert (
        cross_check({**server, "ttft_ms_mean": 140.0, "e2e_ms_mean": 2010.0})["server_client_disagree"] == 1
    )
    # ... unless the client's own loop lag explains it
    lagged = {**server, "ttft_ms_mean": 140.0, "e2e_ms_mean": 2010.0, "client_loop_lag_ms_p99": 10.0}
    assert cross_check(lagged)["server_client_disagree"] == 0
    assert cross_check({"ttft_ms_mean": 50.0}) == {}  # no /metrics: nothing to compare


# Life cycle -----------------------------------------------------------------------------------


def test_missing_vllm_environment_is_one_line_naming_make_vllm(tmp_path) -> None:
    env = {**__import__("os").environ, "INFERMETER_VLLM_VENV": str(tmp_path / "absent")}
    for args in (["server", "--engine", "vllm"], ["stream", "--engine", "vllm", "--no-track"]):
        done = subprocess.run([str(BIN), *args], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "make vllm" in lines[0] and "vllm" in lines[0], done.stderr
    with pytest.raises(ServerStartError, match="use one of"):
        check_engine("tgi")


@needs_vllm
def test_vllm_that_dies_at_start_names_the_engine_and_its_log(tmp_path) -> None:
    before = _descendants()
    # longer than the model's 8192 positions: vLLM refuses the config and exits
    with pytest.raises(ServerStartError) as caught:
        with embedded_server(engine="vllm", n_ctx=100_000, startup_timeout_s=300, log_dir=tmp_path):
            pytest.fail("the server should not have become healthy")
    message = str(caught.value)
    assert message.startswith("vllm server exited with code") and "log" in message
    assert "max_model_len" in message or "max-model-len" in message.lower()  # the log's tail
    assert _descendants() <= before


@needs_vllm
def test_vllm_not_healthy_in_time_is_stopped_with_its_whole_process_group(tmp_path) -> None:
    before = _descendants()
    started = time.monotonic()
    with pytest.raises(ServerStartError, match=r"^vllm server not healthy after 4 s"):
        with embedded_server(engine="vllm", startup_timeout_s=4, log_dir=tmp_path):
            pytest.fail("vLLM cannot load in 4 s")
    assert time.monotonic() - started < 40  # stopped, not waited for
    assert _descendants() <= before


# Against one running vLLM server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_endpoint() -> Iterator:
    if MISSING:
        pytest.skip(f"{MISSING} (then rerun these tests)")
    from tasks.endpoint.spec import open_endpoint

    with open_endpoint(EndpointConfig(), ServerConfig(engine="vllm", startup_timeout_s=300)) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def sweep(vllm_endpoint, mlflow_store, tmp_path_factory) -> dict:
    """The stream stage at concurrency 1 and 8, exactly 32 output tokens per request."""
    from tasks.pipeline import stream_stage
    from tasks.tracking import TrackingTarget

    cfg = StreamConfig(
        max_concurrency=[1, 8],
        num_requests=8,
        warmup=1,
        output_len=32,
        prompts=["Explain in two sentences what a KV cache is."],
    )
    return stream_stage.fn(
        cfg,
        vllm_endpoint,
        TrackingTarget("vllm-tests", None, True),
        None,
        str(tmp_path_factory.mktemp("vllm-stream")),
    )


def test_embedded_vllm_identity_and_key(vllm_endpoint) -> None:
    import urllib.error
    import urllib.request

    assert vllm_endpoint.server_kind == "vllm"
    identity = vllm_endpoint.identity()
    assert identity["endpoint_kind"] == "vllm" and identity["endpoint_model"] == "SmolLM2-135M-Instruct"
    assert len(identity["endpoint_model_sha256"]) == 64
    with pytest.raises(urllib.error.HTTPError) as denied:  # the random key is required
        urllib.request.urlopen(f"{vllm_endpoint.base_url}/models", timeout=10)
    assert denied.value.code == 401


def test_usage_chunk_counts_and_ignore_eos_give_exactly_max_tokens(sweep) -> None:
    for level in sweep["levels"]:
        measured = [r for r in level["requests"] if not r["warmup"]]
        assert len(measured) == 8
        for record in measured:
            assert record["error"] is None
            assert record["output_tokens_source"] == "usage"  # the final usage-only chunk
            assert record["output_tokens"] == 32  # ignore_eos: never stops early
        assert level["metrics"]["num_short_outputs"] == 0


def test_the_responses_api_streams_tokens_and_its_usage(vllm_endpoint) -> None:
    """``--api responses`` against vLLM's own ``/v1/responses`` (issue 31, item 8): a success
    with its text deltas timed one by one and the output count from ``response.completed``'s
    usage (or ``response.incomplete``'s: the limit reached), exactly the limit with ignore_eos."""
    import asyncio

    from tasks.stream.client import stream_chat
    from tasks.stream.load import make_client

    async def main():
        client = make_client(vllm_endpoint.base_url, vllm_endpoint.api_key(), 120.0, 1)
        try:
            return await stream_chat(
                client, model=vllm_endpoint.model, prompt="Count to twenty.", max_tokens=8,
                count_tokens=None, request_id="responses", api="responses",
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        finally:
            await client.close()

    record = asyncio.run(main())
    assert record.succeeded, record.error_message
    assert (record.output_tokens, record.output_tokens_source) == (8, "usage")
    assert record.usage_prompt_tokens and len(record.token_offsets_ms) >= 2 and record.ttft_ms > 0


def test_continuous_batching_seen_from_outside(sweep) -> None:
    one, eight = (lv["metrics"] for lv in sweep["levels"])
    runs = [
        sorted((r for r in lv["requests"] if not r["warmup"]), key=lambda r: r["send_ns"])
        for lv in sweep["levels"]
    ]
    ttfts = sorted(r["ttft_ms"] for r in runs[1])
    ends = [(r["send_ns"] - runs[1][0]["send_ns"]) / 1e6 + r["e2e_ms"] for r in runs[1]]
    throughput_gain = eight["output_tokens_per_s"] / one["output_tokens_per_s"]
    print(
        f"\nvLLM c=1: TTFT p50 {one['ttft_ms_p50']:.0f} ms, E2E p50 {one['e2e_ms_p50']:.0f} ms; c=8 sent "
        f"at once: TTFTs {', '.join(f'{t:.0f}' for t in ttfts)} ms, all finished within "
        f"{max(ends) - min(ends):.0f} ms of each other, the last at {max(ends):.0f} ms (one at a "
        f"time: about {8 * one['e2e_ms_p50']:.0f}); tokens/s x{throughput_gain:.2f}"
    )
    # A server answering one request at a time finishes 8 sent at once a whole E2E apart, the
    # last after about 8 of them. Continuous batching decodes them in lockstep: they finish
    # together, the last well before 8 E2Es. (How long the 7 that join a running batch wait for
    # their first token is the engine's own business: vLLM 0.32's CPU build on 2 cores admits
    # them about 4 s later, curl sees the same, so it is not asserted.)
    assert max(ends) - min(ends) < one["e2e_ms_p50"] / 2
    assert max(ends) < 0.8 * 8 * one["e2e_ms_p50"]
    assert ttfts[-1] - ttfts[1] < one["e2e_ms_p50"] / 2  # the 7 joiners share one prefill step
    assert throughput_gain > 1.25


def test_server_metrics_scraped_beside_the_clients(sweep, mlflow_store) -> None:
    from mlflow.tracking import MlflowClient

    for level in sweep["levels"]:
        m = level["metrics"]
        # the scrape window holds the 8 measured requests, not the warm-up
        assert m["server_vllm_time_to_first_token_seconds_count_delta"] == 8
        assert m["server_vllm_generation_tokens_total_delta"] == 8 * 32
        for name in ("ttft_ms", "itl_ms", "e2e_ms"):
            diff = m[f"{name}_mean_client_minus_server"]
            assert diff == pytest.approx(m[f"{name}_mean"] - m[f"server_{name}_mean"])
        assert m["server_ttft_ms_p50"] <= m["server_ttft_ms_p99"]
        assert "server_queue_ms_mean" in m
        print(
            f"\nc={level['max_concurrency']}: TTFT mean client {m['ttft_ms_mean']:.1f} ms, "
            f"server {m['server_ttft_ms_mean']:.1f} ms (diff {m['ttft_ms_mean_client_minus_server']:+.1f}); "
            f"ITL mean client {m['itl_ms_mean']:.1f}, server {m['server_itl_ms_mean']:.1f}; "
            f"E2E diff {m['e2e_ms_mean_client_minus_server']:+.1f} ms; "
            f"queue mean {m['server_queue_ms_mean']:.1f} ms"
        )
        # the client's clock starts before the request leaves, so it may not read less than the
        # server's, and on 127.0.0.1 not much more
        assert m["server_client_disagree"] == 0
        assert m["ttft_ms_mean_client_minus_server"] > -5
    client = MlflowClient()
    run = client.get_run(sweep["mlflow_run_id"])
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert len(children) == 2
    for child in children:
        logged = child.data.metrics
        assert {
            "ttft_ms_mean",
            "server_ttft_ms_mean",
            "ttft_ms_mean_client_minus_server",
            "server_client_disagree",
        } <= set(logged)


def test_prefix_cache_measured_reset_and_isolated(vllm_endpoint, tmp_path) -> None:
    """The embedded vLLM (prefix caching on, as vLLM defaults; dev mode for the reset; prompt
    token details on): random prompts that share nothing hit nothing; two groups sharing a
    256-token prefix read a hit rate within 10 points of the share a perfect cache would supply
    and a lower TTFT than the same lengths unshared (the cache reset before them); the same
    salted prompts again with the cache kept are found in it (what the warning is for)."""
    from tasks.pipeline import stream_stage
    from tasks.tracking import TrackingTarget

    def run(**workload) -> dict:
        cfg = StreamConfig(max_concurrency=[1], num_requests=6, warmup=1, max_tokens=4, **workload)
        out = stream_stage.fn(
            cfg, vllm_endpoint, TrackingTarget("vllm-cache", None, False), None, str(tmp_path)
        )
        return out["levels"][0]["metrics"]

    plain = run(input_len=288, salt=7, keep_cache=True)
    again = run(input_len=288, salt=7, keep_cache=True)  # before the next run resets the cache
    shared = run(prefix_groups=2, prefix_len=256, input_len=32, seed=1)
    print(
        f"\nvLLM prefix cache: shared hit rate {shared['prefix_cache_hit_rate']:.3f} (expected "
        f"{shared['expected_cached_token_fraction']:.3f}), TTFT p50 {shared['ttft_ms_p50']:.0f} ms vs "
        f"{plain['ttft_ms_p50']:.0f} ms unshared; the same salted prompts again: hit rate "
        f"{again['prefix_cache_hit_rate']:.3f}"
    )
    assert plain["expected_cached_token_fraction"] == 0.0 and plain["prefix_cache_hit_rate"] < 0.01
    assert plain["prefix_cache_reset"] is None
    assert shared["prefix_cache_reset"] == 1  # the dev-mode route answered
    assert shared["expected_cached_token_fraction"] > 0.3
    assert abs(shared["prefix_cache_hit_rate"] - shared["expected_cached_token_fraction"]) <= 0.10
    assert shared["cached_token_fraction"] == pytest.approx(shared["prefix_cache_hit_rate"], abs=0.02)
    assert shared["ttft_ms_p50"] < plain["ttft_ms_p50"]
    assert again["expected_cached_token_fraction"] == 0.0 and again["prefix_cache_hit_rate"] > 0.5


def test_a_conversation_finds_its_history_in_the_cache(vllm_endpoint, tmp_path) -> None:
    """3-turn synthetic conversations on the embedded vLLM (prefix caching on, as vLLM
    defaults): each turn's prompt holds the previous one and the reply vLLM gave, so the cached
    tokens grow with the turn: the previous turn's prompt, short of at most one block (vLLM's CPU
    block holds 128 tokens; its partly filled last block is not cached)."""
    from tasks.pipeline import stream_stage
    from tasks.tracking import TrackingTarget

    cfg = StreamConfig(max_concurrency=[1], num_requests=2, warmup=1, turns=3, input_len=128, output_len=16)
    result = stream_stage.fn(
        cfg, vllm_endpoint, TrackingTarget("vllm-tests", None, False), None, str(tmp_path)
    )
    (level,) = result["levels"]
    m = level["metrics"]
    print(
        "\nvLLM conversation by turn (TTFT p50 ms / prompt tokens / cached tokens): "
        + "; ".join(
            f"turn {k} {m[f'ttft_ms_p50_turn{k}']:.0f} / {m[f'input_tokens_mean_turn{k}']:.0f} / "
            f"{m[f'cached_tokens_mean_turn{k}']:.0f}"
            for k in (1, 2, 3)
        )
    )
    assert m["num_sessions"] == 2 and m["num_errors"] == 0 and m["num_requests_turn3"] == 2
    assert m["cached_tokens_mean_turn1"] < 64  # at most the chat template's opening blocks
    assert m["cached_tokens_mean_turn1"] < m["cached_tokens_mean_turn2"] < m["cached_tokens_mean_turn3"]
    turns: dict[str, list[dict]] = {}
    for r in sorted((r for r in level["requests"] if not r["warmup"]), key=lambda r: r["send_ns"]):
        turns.setdefault(r["session_id"], []).append(r)
    for session in turns.values():
        for earlier, later in zip(session, session[1:]):
            assert later["cached_tokens"] > earlier["cached_tokens"]
            assert (
                earlier["usage_prompt_tokens"] - 128 <= later["cached_tokens"] <= later["usage_prompt_tokens"]
            )
