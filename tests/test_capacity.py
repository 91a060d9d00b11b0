"""Capacity search under SLOs and time-bounded levels, against the ground-truth instrument.

The correctness test uses the instrument's ``load:N:BASE_MS:SLOPE_MS:TTFT_MS`` scenario: every
inter-token gap is BASE + SLOPE * (requests in flight - 1), so the rate at which a TPOT SLO
breaks follows from Little's law (``groundtruth_server.load_law_rate``); the search must bracket
it within one bracket step.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from tasks.scaleout.levels import run_levels
from tasks.stream.capacity import SATURATION, SEARCH, SYNCHRONOUS, search_capacity
from tasks.stream.load import make_client, run_level
from tasks.stream.settings import Connection, LevelSettings

try:
    from tests import groundtruth_server as gt
except ImportError:
    import groundtruth_server as gt

BIN = Path(sys.executable).parent / "infermeter"


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


def _run(server, settings: LevelSettings):
    async def main():
        client = make_client(server.base_url, None, 30.0, settings.max_concurrency)
        try:
            return await run_level(client, settings, count_tokens=None)
        finally:
            await client.close()

    return asyncio.run(main())


# --duration-s ------------------------------------------------------------------------------


def test_duration_bounds_a_rate_level(server) -> None:
    """20 req/s for 0.5 s: about 10 of the 200 requests are sent (those arriving before the
    deadline), and every one sent finishes and counts, also those still in flight at 0.5 s."""
    settings = LevelSettings(
        model="ticks:5:40",  # each request lasts ~200 ms: some are in flight at the deadline
        prompts=[f"d{i}" for i in range(200)],
        max_tokens=5,
        num_requests=200,
        max_concurrency=200,
        request_rate=20.0,
        burstiness=1000.0,  # near-regular arrivals: the count is known
        duration_s=0.5,
    )
    start = time.perf_counter_ns()
    result = _run(server, settings)
    measured = result.measured
    assert 8 <= len(measured) <= 12
    first = min(r.send_ns for r in measured)
    assert all(r.send_ns - first < 0.5e9 + 30e6 for r in measured)  # nothing sent after 0.5 s
    assert all(r.succeeded and r.output_tokens == 5 for r in measured)  # in-flight ones finished
    assert result.wall_s > 0.5 + 0.15  # the last ones finished after the deadline, and count
    assert (time.perf_counter_ns() - start) / 1e9 < 2.0


def test_duration_bounds_a_closed_loop(server) -> None:
    """All at once, 2 at a time, ~100 ms each, for 0.45 s: those waiting at the semaphore when
    the time is up are not sent."""
    settings = LevelSettings(
        model="ticks:5:20",
        prompts=["x"],
        max_tokens=5,
        num_requests=100,
        max_concurrency=2,
        duration_s=0.45,
    )
    result = _run(server, settings)
    assert 6 <= len(result.measured) <= 12
    assert all(r.succeeded for r in result.measured)
    assert settings.duration_s <= result.wall_s < settings.duration_s + 0.3


def test_duration_config_key() -> None:
    from tasks.config import StreamConfig

    assert StreamConfig().duration_s is None and StreamConfig(duration_s=2.5).duration_s == 2.5
    with pytest.raises(ValueError, match="duration_s"):
        StreamConfig(duration_s=0)


# The search's logic on a known step (a plain level function, no server) ---------------------


@dataclass
class _Level:
    metrics: dict
    measured: list = field(default_factory=list)


def _law(capacity: float, sync: float, saturation: float, bound_at: float | None = None):
    """A level whose goodput fraction is 1 up to ``capacity`` req/s and 0.5 above."""

    def measure(kind, rate, concurrency):
        served = sync if kind == SYNCHRONOUS else saturation if kind == SATURATION else rate
        return _Level(
            {
                "goodput_fraction": 1.0 if served <= capacity else 0.5,
                "requests_per_s": served,
                "output_tokens_per_s": served * 10,
                "client_bound": int(bound_at is not None and rate is not None and rate >= bound_at),
                "num_requests": 20,
            }
        )

    return measure


def test_bisection_brackets_the_step() -> None:
    result = search_capacity(_law(7.3, 2.0, 12.0), {"tpot_ms": 50}, num_requests=20, max_levels=20)
    low, high = result.bracket_requests_per_s
    assert low <= 7.3 < high and (high - low) / high <= 0.05
    assert result.capacity_requests_per_s == low and result.capacity_output_tokens_per_s == low * 10
    assert [lv.kind for lv in result.levels[:2]] == [SYNCHRONOUS, SATURATION]
    assert all(lv.kind == SEARCH for lv in result.levels[2:])
    assert "within 5%" in result.stop_reason and "goodput fraction 0.5 < target 0.95" in result.last_failure
    capped = search_capacity(_law(7.3, 2.0, 12.0), {"tpot_ms": 50}, num_requests=20, max_levels=4)
    assert len(capped.levels) == 4 and "after 4 levels" in capped.stop_reason


def test_one_request_at_a_time_engine_has_its_synchronous_rate() -> None:
    """llama.cpp's server: saturation throughput = the synchronous rate (one at a time)."""
    result = search_capacity(_law(2.01, 2.0, 2.04), {"ttft_ms": 500}, num_requests=8)
    assert result.capacity_requests_per_s == 2.0 and len(result.levels) == 2
    assert "synchronous rate" in result.stop_reason


def test_client_bound_level_stops_the_search() -> None:
    result = search_capacity(_law(9.0, 2.0, 12.0, bound_at=6.0), {"tpot_ms": 50}, num_requests=20)
    assert "client-bound" in result.stop_reason and result.levels[-1].client_bound
    assert result.capacity_requests_per_s == 2.0  # the client's limit is not reported as the server's
    with pytest.raises(ValueError, match="SLO"):
        search_capacity(_law(1, 1, 1), {}, num_requests=2)


# Correctness against the instrument's known law ----------------------------------------------

TOKENS, BASE_MS, SLOPE_MS, TTFT_MS, TPOT_SLO_MS = 10, 20.0, 10.0, 20.0, 50.0


def test_search_finds_the_law_rate_on_the_instrument(server) -> None:
    law_rate = gt.load_law_rate(TOKENS, BASE_MS, SLOPE_MS, TTFT_MS, TPOT_SLO_MS)  # 8.51 req/s
    base = LevelSettings(
        model=f"load:{TOKENS}:{BASE_MS:g}:{SLOPE_MS:g}:{TTFT_MS:g}",
        prompts=["p"],
        max_tokens=TOKENS,
        num_requests=30,
        warmup=1,
        burstiness=1000.0,  # near-regular arrivals: the law assumes a steady number in flight
        # The machine is shared: a few ms of event-loop lag, and the chunks a late read then
        # finds together, are not this test's subject (a CI run with other suites beside it
        # saw 2.2 % of the gaps coalesced and stopped the search as client-bound).
        lag_tolerance_ms=50.0,
        coalesced_tolerance=0.2,
    )
    connection = Connection(server.base_url)
    slos = {"tpot_ms": TPOT_SLO_MS, "ttft_ms": 500.0}
    numbers = iter(range(100))

    def measure(kind, rate, concurrency):
        i = next(numbers)
        settings = replace(base, level=i, request_rate=rate, max_concurrency=concurrency, seed=i)
        return run_levels(connection, [settings], count_tokens=None, goodput=slos)[0]

    result = search_capacity(measure, slos, num_requests=30, target=0.95, max_levels=10)
    low, high = result.bracket_requests_per_s
    step = high - low
    assert (high - low) / high <= 0.05, result.stop_reason
    assert low - step <= law_rate <= high + step, (result.to_dict()["bracket_requests_per_s"], law_rate)
    sync = result.levels[0]
    assert sync.requests_per_s == pytest.approx(1000 / (TTFT_MS + (TOKENS - 1) * BASE_MS), rel=0.1)
    assert result.levels[1].requests_per_s > law_rate  # saturation lies above the law's rate
    assert "tpot_ms >" in result.last_failure  # the failing SLO is named


# The command and the flow: MLflow parent, a child per level, the plot ------------------------


def test_capacity_command_tracks_levels_and_plot(server, tmp_path: Path) -> None:
    store = tmp_path / "mlruns"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
    env["INFERMETER_WORK_DIR"] = str(tmp_path / "work")
    out = tmp_path / "capacity.json"
    command = [str(BIN), "capacity", "--base-url", server.base_url, "--model", "load:6:20:10:20"]
    options = ["--tokenizer", "gguf:default", "--goodput", "tpot_ms:40", "--num-requests", "12"]
    options += ["--max-levels", "4", "--burstiness", "1000", "--client-bound-tolerance-ms", "50"]
    proc = subprocess.run(
        [*command, *options, "--json", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"capacity", "levels", "mlflow_run_id"}
    capacity = data["capacity"]
    assert len(capacity["levels"]) == len(data["levels"]) <= 4
    assert capacity["capacity_requests_per_s"] > 0 and capacity["stop_reason"]
    assert "capacity:" in proc.stdout and "stopped:" in proc.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run = client.get_run(data["mlflow_run_id"])
    host = server.base_url.split("//")[1].split("/")[0]
    assert re.fullmatch(rf"capacity \d\d-\d\d \d\d:\d\d:\d\d {host} load:6:20:10:20", run.info.run_name)
    assert run.data.metrics["capacity_requests_per_s"] == pytest.approx(capacity["capacity_requests_per_s"])
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert len(children) == len(capacity["levels"])
    assert {c.data.params["kind"] for c in children} >= {"synchronous", "saturation"}
    plots = [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
    assert "plots/capacity.png" in plots

    for flag, value in (("--goodput", "queue_ms:5"), ("--target", "1.5")):
        bad = subprocess.run(
            [*command, flag, value, "--no-track"], capture_output=True, text=True, timeout=120, env=env
        )
        assert bad.returncode == 2 and flag in bad.stderr, bad.stderr[-500:]


def test_capacity_where_every_request_fails_exits_1(server, tmp_path: Path) -> None:
    """Every request answered with HTTP 500: no capacity (no bracket) and exit 1 naming the
    first error, the parent run FAILED with it as its error tag, ``--json`` written all the
    same (issue 23, item 8: before, exit 0 and a FINISHED run: a scheduled job showed green)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "INFERMETER_WORK_DIR": str(tmp_path / "work")}
    out = tmp_path / "capacity.json"
    command = [str(BIN), "capacity", "--base-url", server.base_url, "--model", "http_500"]
    options = ["--tokenizer", "gguf:default", "--goodput", "ttft_ms:500", "--num-requests", "3"]
    options += ["--warmup", "0", "--client-bound-tolerance-ms", "50", "--json", str(out)]
    proc = subprocess.run([*command, *options], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    expected = (
        "every request failed; first error (server): HTTP 500: server error. Server said: internal failure"
    )
    assert f"capacity failed: {expected}" in proc.stderr
    data = json.loads(out.read_text())
    capacity = data["capacity"]
    assert capacity["capacity_requests_per_s"] is None and capacity["bracket_requests_per_s"] is None
    assert capacity["stop_reason"].startswith("no capacity")
    requests = [r for level in data["levels"] for r in level["requests"]]
    assert len(requests) == 3 and all(r["error"]["class"] == "server" for r in requests)

    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(data["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.tags["error"] == expected
