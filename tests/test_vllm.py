"""The embedded vLLM server (CPU build, ``.venv-vllm`` from ``make vllm``): what a production
engine gives that llama.cpp does not, seen from outside through the stream stage.

One real vLLM server for the module (about 45 s to start, about 5 GB RSS). Skipped, with the
command that installs it, when ``.venv-vllm`` is absent; ``.ci/run`` installs it, so CI runs
these. The life-cycle tests (missing environment, a server that dies, one that never becomes
healthy) need no running server.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tasks.config import EndpointConfig, ServerConfig, StreamConfig
from tasks.server import (
    EngineNotInstalledError, ServerStartError, check_engine, embedded_server, vllm_python,
)

BIN = Path(sys.executable).parent / "infermeter"

try:
    vllm_python()
    MISSING = None
except EngineNotInstalledError as exc:
    MISSING = str(exc)
needs_vllm = pytest.mark.skipif(MISSING is not None, reason=f"{MISSING} (then rerun these tests)")


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}


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
    from tasks.endpoint import open_endpoint

    with open_endpoint(EndpointConfig(), ServerConfig(engine="vllm", startup_timeout_s=300)) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def sweep(vllm_endpoint, mlflow_store, tmp_path_factory) -> dict:
    """The stream stage at concurrency 1 and 8, exactly 32 output tokens per request."""
    from tasks.pipeline import stream_stage
    from tasks.tracking import TrackingTarget

    cfg = StreamConfig(max_concurrency=[1, 8], num_requests=8, warmup=1, output_len=32,
                       prompts=["Explain in two sentences what a KV cache is."])
    return stream_stage.fn(cfg, vllm_endpoint, TrackingTarget("vllm-tests", None, True), None,
                           str(tmp_path_factory.mktemp("vllm-stream")))


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


def test_continuous_batching_seen_from_outside(sweep) -> None:
    one, eight = (lv["metrics"] for lv in sweep["levels"])
    # A server answering one request at a time makes request k of 8 sent at once wait for k
    # whole requests: the median waits for 3.5 of them.
    queueing_ttft_ms = one["ttft_ms_p50"] + 3.5 * one["e2e_ms_p50"]
    throughput_gain = eight["output_tokens_per_s"] / one["output_tokens_per_s"]
    print(f"\nvLLM TTFT p50: c=1 {one['ttft_ms_p50']:.0f} ms, c=8 {eight['ttft_ms_p50']:.0f} ms "
          f"(x{eight['ttft_ms_p50'] / one['ttft_ms_p50']:.2f}); one-at-a-time service would give "
          f"about {queueing_ttft_ms:.0f} ms; tokens/s x{throughput_gain:.2f}; "
          f"E2E p50 c=1 {one['e2e_ms_p50']:.0f} ms, c=8 {eight['e2e_ms_p50']:.0f} ms")
    # Batched prefill on 2 CPU cores is compute-bound, so TTFT at 8 is several times the c=1
    # figure (8 prompts' prefill in one step); what batching removes is the wait for the
    # other requests' decode: the first token of the median request arrives before one
    # single-stream request would have finished.
    assert eight["ttft_ms_p50"] < queueing_ttft_ms / 4
    assert eight["ttft_ms_p50"] < one["e2e_ms_p50"]
    assert eight["e2e_ms_p50"] < 4 * one["e2e_ms_p50"]  # one at a time: about 4.5 x
    assert throughput_gain > 2


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
        print(f"\nc={level['max_concurrency']}: TTFT mean client {m['ttft_ms_mean']:.1f} ms, "
              f"server {m['server_ttft_ms_mean']:.1f} ms (diff {m['ttft_ms_mean_client_minus_server']:+.1f}); "
              f"ITL mean client {m['itl_ms_mean']:.1f}, server {m['server_itl_ms_mean']:.1f}; "
              f"E2E diff {m['e2e_ms_mean_client_minus_server']:+.1f} ms; "
              f"queue mean {m['server_queue_ms_mean']:.1f} ms")
        # the client's clock starts before the request leaves, so it may not read less than the
        # server's, and on 127.0.0.1 not much more
        assert m["server_client_disagree"] == 0
        assert m["ttft_ms_mean_client_minus_server"] > -5
    client = MlflowClient()
    run = client.get_run(sweep["mlflow_run_id"])
    children = client.search_runs([run.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert len(children) == 2
    for child in children:
        logged = child.data.metrics
        assert {"ttft_ms_mean", "server_ttft_ms_mean", "ttft_ms_mean_client_minus_server",
                "server_client_disagree"} <= set(logged)
