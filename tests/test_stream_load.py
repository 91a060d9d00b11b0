"""Load levels against the ground-truth instrument: arrivals, the measured-vs-true error of every
chunk, 256 concurrent streams, the client-bound flag, prompts, the stage and the command.

The instrument stamps every chunk with its send time on CLOCK_MONOTONIC (shared by all
processes on Linux, read by time.perf_counter_ns), so a measured arrival can be compared with
the true send time of the same chunk: the error is never negative (causality), and its size is
the client's lateness.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.config import StreamConfig
from tasks.stats import percentile
from tasks.stream.lag import LoopLagProbe
from tasks.stream.load import arrival_offsets_s, level_grid, make_client, run_level
from tasks.stream.records import RecordWriter, read_jsonl
from tasks.stream.settings import Connection, LevelSettings
from tasks.workload.prompts import PromptsError, read_prompts_file, synthetic_prompts
from tasks.workload.stage import StageWorkload
from tests.prefect_home import migrated_home

try:
    from tests import groundtruth_server as gt
except ImportError:
    import groundtruth_server as gt

BIN = Path(sys.executable).parent / "infermeter"


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


def _level(server, model, concurrency, num_requests, *, prompts=None, on_record=None, **kwargs):
    async def main():
        client = make_client(server.base_url, None, 30.0, concurrency)
        try:
            return await run_level(
                client,
                LevelSettings(
                    model=model,
                    prompts=prompts or [f"p{i}" for i in range(num_requests)],
                    max_tokens=64,
                    max_concurrency=concurrency,
                    num_requests=num_requests,
                    warmup=0,
                    level=0,
                    **kwargs,
                ),
                count_tokens=None,
                on_record=on_record,
            )
        finally:
            await client.close()

    return asyncio.run(main())


def _errors_ms(result, stamps):
    """Measured-minus-true TTFT (per request) and ITL (per gap) in ms, and every chunk's
    arrival-minus-send offset in ns (the causality check)."""
    ttft, itl, offsets_ns = [], [], []
    for r in result.measured:
        true = stamps[f"p{r.request_id.split('-r')[1]}"]["text_sent_ns"]
        measured = [r.send_ns + round(o * 1e6) for o in r.token_offsets_ms]
        assert len(measured) == len(true), (r.request_id, r.error_message)
        ttft.append((measured[0] - true[0]) / 1e6)
        itl += [
            ((measured[i] - measured[i - 1]) - (true[i] - true[i - 1])) / 1e6 for i in range(1, len(true))
        ]
        offsets_ns += [m - t for m, t in zip(measured, true)]
    return sorted(ttft), sorted(itl), offsets_ns


# Arrivals and levels --------------------------------------------------------------------------


def test_arrival_offsets_poisson_and_gamma() -> None:
    assert arrival_offsets_s(3, None) == [0.0, 0.0, 0.0]
    a = arrival_offsets_s(4000, 8.0, 1.0, seed=1)
    assert a == arrival_offsets_s(4000, 8.0, 1.0, seed=1)  # the seed replays the arrivals
    assert a != arrival_offsets_s(4000, 8.0, 1.0, seed=2)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.06)
    # Poisson: coefficient of variation 1; gamma shape 0.25: 1/sqrt(0.25) = 2
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.08)
    bursty = arrival_offsets_s(4000, 8.0, 0.25, seed=1)
    bgaps = [y - x for x, y in zip(bursty, bursty[1:])]
    assert statistics.fmean(bgaps) == pytest.approx(1 / 8, rel=0.12)
    assert statistics.pstdev(bgaps) / statistics.fmean(bgaps) == pytest.approx(2.0, rel=0.12)
    with pytest.raises(ValueError):
        arrival_offsets_s(2, 0.0)


def test_level_grid_is_the_cross_product() -> None:
    assert level_grid([1, 4], [2.0, None]) == [(1, 2.0), (1, None), (4, 2.0), (4, None)]
    assert level_grid([3]) == [(3, None)]


def test_settings_from_config_one_typed_level_each() -> None:
    """--max-concurrency reaches the level through one typed field, settings.max_concurrency."""
    from tasks.endpoint.spec import Endpoint
    from tasks.stream.settings import settings_from_config

    endpoint = Endpoint(
        base_url="http://h:1/v1",
        model="m",
        api_key_env="K",
        server_kind="openai-compatible",
        tokenizer="gguf:default",
    )
    cfg = StreamConfig(
        max_concurrency=[1, 4],
        request_rate=[2.0, None],
        seed=7,
        warmup=2,
        num_requests=5,
        output_len=12,
        temperature=0.5,
        burstiness=0.5,
        client_bound_tolerance_ms=3.0,
    )
    levels = settings_from_config(cfg, endpoint, StageWorkload("prompts", ("a", "b"), (3, 4), None, (), 5, 0))
    assert [(s.level, s.max_concurrency, s.request_rate, s.seed) for s in levels] == [
        (0, 1, 2.0, 7),
        (1, 1, None, 8),
        (2, 4, 2.0, 9),
        (3, 4, None, 10),
    ]
    first = levels[0]
    assert (first.model, first.prompts, first.prompt_tokens) == ("m", ("a", "b"), (3, 4))
    assert (first.max_tokens, first.num_requests, first.warmup) == (12, 5, 2)
    assert first.sampling == {"temperature": 0.5} and first.extra_body == {"ignore_eos": True}
    assert first.ignore_eos and (first.burstiness, first.lag_tolerance_ms) == (0.5, 3.0)
    assert first.api_key_env == "K" and first.reset_cache  # the prefix cache reset by default
    plain = settings_from_config(
        StreamConfig(), endpoint, StageWorkload("prompts", ("a",), None, None, (), 8, 0)
    )[0]
    assert plain.extra_body is None and not plain.ignore_eos and plain.max_tokens == 64


def test_config_rates() -> None:
    assert StreamConfig(request_rate=[2, math.inf, None]).request_rate == [2.0, None, None]
    for bad in ([0], [-1.0], [math.nan]):
        with pytest.raises(ValueError, match="request rate"):
            StreamConfig(request_rate=bad)


def test_request_rate_paces_the_sends(server) -> None:
    result = _level(server, "single", 20, 16, request_rate=40.0, seed=5)
    assert result.request_rate == 40.0
    assert all(r.request_rate == 40.0 and r.succeeded for r in result.records)
    sends = sorted(r.send_ns for r in result.measured)
    expected = arrival_offsets_s(16, 40.0, 1.0, 5)
    for sent, want in zip(sends, expected):
        # on schedule up to scheduling noise (generous: a shared, loaded 2-core box)
        assert want * 1e3 - 5 <= (sent - sends[0]) / 1e6 <= want * 1e3 + 100
    allatonce = _level(server, "single", 16, 16)
    spread_ms = (
        max(r.send_ns for r in allatonce.measured) - min(r.send_ns for r in allatonce.measured)
    ) / 1e6
    assert spread_ms < 0.5 * expected[-1] * 1e3


# Measured against the truth ---------------------------------------------------------------------


def test_every_chunk_measured_against_its_true_send_time(server) -> None:
    server.reset()
    result = _level(server, "ticks:20:10", 16, 16)
    ttft, itl, offsets_ns = _errors_ms(result, server.stamps())
    assert len(itl) == 16 * 19
    assert min(offsets_ns) >= 0  # no chunk is seen before the instrument sent it
    assert percentile(itl, 50) == pytest.approx(0.0, abs=1.0)
    # magnitudes: generous, since other jobs share the 2 cores (tests/benchmarks/stream_client.py
    # prints the real figures); the exact checks are the counts and the causality above
    assert percentile(ttft, 50) < 20.0
    assert percentile(itl, 99) < 60.0 and percentile(ttft, 99) < 60.0
    assert result.client["client_loop_lag_samples"] > 10


def test_256_concurrent_streams_lose_no_record(server, tmp_path: Path) -> None:
    server.reset()
    journal = tmp_path / "requests.jsonl"
    with RecordWriter(journal) as writer:
        # 2 s a request: all 256 are in flight even when the 2 shared cores start them slowly
        # (at 1 s, 225 of 256 overlapped once on a loaded machine)
        result = _level(server, "ticks:20:100", 256, 256, on_record=writer.write)
    assert server.stats()["max_in_flight"] == 256
    records = read_jsonl(journal)
    assert len(records) == 256 and len({r.request_id for r in records}) == 256
    assert all(r.succeeded and r.output_tokens == 20 and len(r.token_offsets_ms) == 20 for r in records), [
        r.error_message for r in records if not r.succeeded
    ][:3]
    assert len(result.measured) == 256
    _, _, offsets_ns = _errors_ms(result, server.stamps())
    assert len(offsets_ns) == 256 * 20 and min(offsets_ns) >= 0


def test_client_bound_flag_agrees_with_the_measured_error(server) -> None:
    """The flag against the truth, on two levels: a free loop and one that a callback blocks
    4 ms every 7 ms (a period that drifts against the instrument's 10 ms ticks, so the lateness
    varies from chunk to chunk; with a 10 ms period it can lock to the ticks, every chunk late by
    the same amount and the ITL error near 0, measured 0.8-2.7 ms p99 over 8 runs, against
    2.3-4.7 ms at 7 ms). The blocked level's ITL error passes 2 ms and it is flagged; on each level
    the flag says what the measured error says (error p99 > the 1 ms tolerance), except where
    the error or the lag lies within a factor 2 of the tolerance, where a sampled lag cannot
    decide."""

    async def level(block: bool):
        stop = asyncio.Event()

        async def hog():
            while not stop.is_set():
                time.sleep(0.004)
                await asyncio.sleep(0.003)

        # the user clock: the loop-lag flag is its judge (the kernel clock's is coalescing,
        # tests/test_stream_clock.py)
        client = make_client(server.base_url, None, 30.0, 4, arrival_clock="user")
        hogger = asyncio.ensure_future(hog()) if block else None
        try:
            return await run_level(
                client,
                LevelSettings(
                    model="ticks:30:10",
                    prompts=[f"p{i}" for i in range(4)],
                    max_tokens=64,
                    max_concurrency=4,
                    num_requests=4,
                    warmup=0,
                    level=0,
                ),
                count_tokens=None,
            )
        finally:
            stop.set()
            if hogger is not None:
                await hogger
            await client.close()

    for block in (False, True):
        server.reset()
        result = asyncio.run(level(block))
        _, itl, _ = _errors_ms(result, server.stamps())
        error_p99 = percentile(itl, 99)
        if block:
            assert error_p99 > 2.0 and result.client["client_bound"] == 1, result.client
        lag_p99 = result.client["client_loop_lag_ms_p99"]
        # near the tolerance either way (a short level keeps ~30 lag samples: its p99 is about
        # its largest one), the sampled lag cannot decide; a CI run had error 0.37 ms, lag 1.43 ms
        if not 0.5 <= error_p99 <= 2.0 and not 0.5 <= lag_p99 <= 2.0:
            assert result.client["client_bound"] == int(error_p99 > 1.0), (block, error_p99, result.client)

    async def idle():
        async with LoopLagProbe() as probe:
            await asyncio.sleep(0.3)
        return probe

    probe = asyncio.run(idle())
    assert len(probe.lags_ms) > 50 and min(probe.lags_ms) >= 0
    assert percentile(sorted(probe.lags_ms), 50) < 1.0


def test_prometheus_parse_and_level_view() -> None:
    from tasks.endpoint import prometheus

    page_before = (
        "# HELP x\n# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 3\n'
        'vllm:time_to_first_token_seconds_sum{model="m"} 1.5\n'
        'vllm:time_to_first_token_seconds_count{model="m"} 10\n'
        'vllm:generation_tokens_total{model="m"} 100\nvllm:num_requests_running 2\n'
    )
    page_after = page_before.replace(" 1.5", " 2.7").replace(" 10\n", " 13\n").replace(" 100\n", " 160\n")
    before, after = prometheus.parse(page_before), prometheus.parse(page_after)
    assert (
        before["vllm:generation_tokens_total"] == 100
        and "vllm:time_to_first_token_seconds_bucket" not in before
    )
    view = prometheus.level_view(before, after)
    assert view["server_vllm_generation_tokens_total_delta"] == 60
    assert view["server_vllm_time_to_first_token_seconds_mean"] == pytest.approx(1.2 / 3)
    assert not any("running" in k for k in view)  # gauges are not deltas
    assert prometheus.level_view(None, after) == {}
    assert prometheus.metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    assert prometheus.scrape(f"http://127.0.0.1:{gt.free_port()}/v1") is None


def test_client_processes_merge_records_on_one_clock(server, tmp_path: Path) -> None:
    from tasks.scaleout.multiproc import run_level_processes

    server.reset()
    journal = tmp_path / "requests.jsonl"
    with RecordWriter(journal) as writer:
        result = run_level_processes(
            2,
            Connection(server.base_url, None, 30.0),
            LevelSettings(
                model="ticks:10:10",
                prompts=[f"p{i}" for i in range(8)],
                max_tokens=16,
                max_concurrency=4,
                num_requests=8,
                warmup=0,
                level=2,
            ),
            count_tokens=None,
            on_record=writer.write,
        )
    assert server.stats()["max_in_flight"] == 4
    assert sorted(r.request_id for r in result.measured) == [f"l2-r{i}" for i in range(8)]
    assert len(read_jsonl(journal)) == 8 and all(r.succeeded for r in result.measured)
    _, itl, offsets_ns = _errors_ms(result, server.stamps())
    assert min(offsets_ns) >= 0  # the two processes' clocks agree with the instrument's
    assert percentile(itl, 50) == pytest.approx(0.0, abs=1.0)
    assert result.client["client_processes"] == 2 and result.wall_s > 0.09

    words = lambda text: len(text.split())  # noqa: E731
    result = run_level_processes(
        2,
        Connection(server.base_url, None, 30.0),
        LevelSettings(
            model="no_usage",
            prompts=["a", "b", "c"],
            max_tokens=16,
            max_concurrency=2,
            num_requests=4,
            warmup=1,
            level=0,
        ),
        count_tokens=words,
    )
    assert [r.warmup for r in result.records] == [True] + [False] * 4
    assert all(r.output_tokens == 5 and r.output_tokens_source == "tokenizer" for r in result.records)
    assert all(r.tpot_ms is not None for r in result.records)
    with pytest.raises(ValueError, match="client_processes"):
        run_level_processes(
            3,
            Connection(server.base_url, None, 1.0),
            LevelSettings(
                model="x", prompts=["a"], max_tokens=1, max_concurrency=2, num_requests=1, warmup=0, level=0
            ),
            count_tokens=None,
        )


# Prompts ------------------------------------------------------------------------------------------


def test_prompts_files(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("first\n\nsecond line\n", encoding="utf-8")
    assert read_prompts_file(tmp_path / "p.txt") == ["first", "second line"]
    (tmp_path / "p.json").write_text(json.dumps(["a", "b"]), encoding="utf-8")
    assert read_prompts_file(tmp_path / "p.json") == ["a", "b"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n"y"\n', encoding="utf-8")
    assert read_prompts_file(tmp_path / "p.jsonl") == ["x", "y"]
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(PromptsError, match="no prompt"):
        read_prompts_file(tmp_path / "empty.txt")
    with pytest.raises(PromptsError, match="not found"):
        read_prompts_file(tmp_path / "absent.txt")
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(PromptsError, match="not valid JSON"):
        read_prompts_file(tmp_path / "bad.json")


def test_synthetic_prompts_have_the_set_length() -> None:
    from tasks.models.sources import load_tokenizer

    tokenizer = load_tokenizer("gguf:default")
    texts, counts = synthetic_prompts(tokenizer, 64, 6, seed=3)
    assert counts == [64] * 6
    assert [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts] == counts
    assert len(set(texts)) == 6
    assert synthetic_prompts(tokenizer, 64, 6, seed=3)[0] == texts
    assert synthetic_prompts(tokenizer, 64, 6, seed=4)[0] != texts


# The stage (shared by the audit and `infermeter stream`) and the command -----------------------


def test_stream_stage_levels_plots_and_synthetic_prompts(server, mlflow_store, tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    from tasks.endpoint.spec import Endpoint
    from tasks.pipeline import stream_stage
    from tasks.tracking import TrackingTarget

    endpoint = Endpoint(
        base_url=server.base_url,
        model="ticks:8:5",
        api_key_env=None,
        server_kind="openai-compatible",
        tokenizer="gguf:default",
    )
    cfg = StreamConfig(
        max_concurrency=[1, 2],
        request_rate=[50.0, None],
        num_requests=3,
        warmup=1,
        input_len=16,
        output_len=12,
        seed=7,
        goodput={"ttft_ms": 1000},
    )
    server.reset()
    result = stream_stage.fn(cfg, endpoint, TrackingTarget("stream-tests", None, True), None, str(tmp_path))
    levels = result["levels"]
    assert [(lv["max_concurrency"], lv["request_rate"]) for lv in levels] == [
        (1, 50.0),
        (1, None),
        (2, 50.0),
        (2, None),
    ]
    for lv in levels:
        m = lv["metrics"]
        assert m["num_requests"] == 3 and m["num_succeeded"] == 3
        assert m["goodput_fraction"] == 1.0
        assert m["client_bound"] in (0, 1) and m["client_loop_lag_ms_p99"] is not None
        assert m["num_short_outputs"] == 3  # the instrument sends 8 tokens for 12 asked
        assert [r["warmup"] for r in lv["requests"]] == [True, False, False, False]
        assert all(r["input_tokens"] == 16 for r in lv["requests"])
        # the server's view from its /metrics, scraped after the warm-up and after the level
        assert m["server_gt_requests_total_delta"] == 3
        assert m["server_gt_text_chunks_total_delta"] == 3 * 8
        # each request's first chunk leaves the server before the client reads it: the means
        # (not the client's p50: one late request lifts the server's mean of 3 above it)
        assert 0.005 <= m["server_gt_ttft_seconds_mean"] < m["ttft_ms_mean"] / 1000 + 0.001
    bodies = [b for b in server.stats()["requests"] if b["model"] == "ticks:8:5"]
    assert len(bodies) == 16
    assert all(b["ignore_eos"] is True and b["max_completion_tokens"] == 12 for b in bodies)
    assert len(read_jsonl(tmp_path / "requests.jsonl")) == 16

    client = MlflowClient()
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.params["request_rate"] == "[50.0, null]"  # compact list (issue 14)
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    # a PNG per load metric, and each level's TTFT and ITL histograms (4 levels)
    assert {"plots/load_ttft_ms.png", "plots/load_output_tokens_per_s.png"} <= plots
    assert len(plots) == 5 + 2 * 4
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == [
        "stream c=1 rate=50",
        "stream c=1 rate=inf",
        "stream c=2 rate=50",
        "stream c=2 rate=inf",
    ]
    for child in children:
        assert "client_loop_lag_ms_p99" in child.data.metrics
        hists = [a.path.rsplit("/", 1)[1] for a in client.list_artifacts(child.info.run_id, "plots")]
        assert len(hists) == 2 and all(h.endswith(("_ttft_hist.png", "_itl_hist.png")) for h in hists)


def _cli(args, tmp_path, env=None):
    return subprocess.run(
        [str(BIN), "stream", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "INFERMETER_WORK_DIR": str(tmp_path / "w"),
            **(env or {}),
        },
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-concurrency", "0"], "--max-concurrency"),  # the flag typed (issue 14)
        (["--request-rate", "2,fast"], "--request-rate"),
        (["--request-rate", "0"], "0 is not > 0"),
        (["--tokenizer", "arch:nope", "--max-tokens", "4"], "--tokenizer: model 'arch:nope'"),
        (["--goodput", "speed_ms:3"], "--goodput"),
        (["--prompts", "/nonexistent/prompts.txt"], "--prompts"),
        (["--base-url", "localhost:8000/v1", "--model", "m"], "--base-url"),
        (
            [
                "--base-url",
                "http://127.0.0.1:9/v1",
                "--model",
                "m",
                "--api-key-env",
                "INFERMETER_TEST_UNSET_KEY",
            ],
            "INFERMETER_TEST_UNSET_KEY",
        ),
        (
            ["--base-url", f"http://127.0.0.1:{gt.free_port()}/v1", "--model", "m"],
            "nothing accepts connections at 127.0.0.1:",
        ),
    ],
)
def test_command_bad_input_exits_2_with_one_line(tmp_path, args, needle) -> None:
    result = _cli([*args, "--no-track"], tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr


def test_command_json_against_the_instrument(server, tmp_path) -> None:
    (tmp_path / "prompts.txt").write_text("one\ntwo\n", encoding="utf-8")
    out = tmp_path / "out.json"
    smoke = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"  # audit-shaped
    result = _cli(
        [
            "--config",
            str(smoke),
            "--base-url",
            server.base_url,
            "--model",
            "hold",
            "--prompts",
            str(tmp_path / "prompts.txt"),
            "--max-concurrency",
            "1,2",
            "--request-rate",
            "inf",
            "--num-requests",
            "2",
            "--warmup",
            "1",
            "--no-track",
            "--json",
            str(out),
        ],
        tmp_path,
        env={"INFERMETER_TEST_KEY": "sk-should-not-leak"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data) == {"levels", "mlflow_run_id"} and data["mlflow_run_id"] is None
    assert [(lv["max_concurrency"], lv["request_rate"]) for lv in data["levels"]] == [(1, None), (2, None)]
    request = data["levels"][1]["requests"][1]
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
    } <= set(request)
    assert request["error"] is None and request["output_text"] == "a b c"
    assert len(request["itl_ms"]) == 2 and request["output_tokens_source"] == "usage"
    assert "client_bound" in data["levels"][0]["metrics"]


def test_ctrl_c_keeps_the_records_and_exits_in_seconds(server, tmp_path) -> None:
    """A Ctrl-C at the terminal (SIGINT to the whole process group) mid-run: the command exits
    130 within seconds, every finished request is in the journal, and the temporary Prefect
    API server it started is gone (it lives in its own session, so the Ctrl-C does not kill
    it before the interrupted run is reported)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        PREFECT_HOME=str(migrated_home(tmp_path / "prefect")),
        INFERMETER_WORK_DIR=str(tmp_path / "w"),
        INFERMETER_PREFECT_IDLE_S="0",  # the temporary server this test watches go
    )
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(BIN),
                "stream",
                "--base-url",
                server.base_url,
                "--model",
                "ticks:50:20",
                "--num-requests",
                "400",
                "--max-concurrency",
                "2",
                "--warmup",
                "0",
                "--no-track",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        journal = []
        while time.monotonic() < deadline and len(journal) < 3:
            assert proc.poll() is None, log.read_text()[-2000:]
            journal = list((tmp_path / "w").glob("*-stream-*/requests.jsonl"))
            journal = journal and journal[0].read_text().splitlines()
            time.sleep(0.2)
        assert len(journal) >= 3, log.read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        interrupted = time.monotonic()
        assert proc.wait(timeout=120) == 130
        # measured here: 2.6 s; before the API server had its own session: 74 to 145 s
        assert time.monotonic() - interrupted < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "Interrupted: the requests and points that finished are kept in" in " ".join(text.split())
    assert "marked KILLED" not in text and "Crash detected" not in text  # --no-track: no runs to mark
    kept = read_jsonl(next((tmp_path / "w").glob("*-stream-*/requests.jsonl")))
    assert len(kept) >= len(journal) and all(r.succeeded and r.output_tokens == 50 for r in kept)
    # the temporary server is not linked ("View at" would point at a server gone by now);
    # tests/test_run_states.py checks that it is gone
    assert "View at" not in text
