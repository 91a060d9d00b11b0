"""Real traffic through `infermeter stream` on the ground-truth instrument (issue 19): a
recorded trace replayed at its recorded times, shared-prefix groups against the instrument's
prefix cache (a cache over the prompt's words, whose counters carry vLLM's names), and the
cache kept apart between levels and runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.stats import percentile

try:
    from tests import groundtruth_server as gt
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import groundtruth_server as gt

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


def stream(
    server: gt.GroundTruthServer, tmp_path: Path, *args: str
) -> tuple[subprocess.CompletedProcess, dict]:
    """`infermeter stream` against the instrument, untracked; its --json."""
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"
    exe = ROOT / ".venv" / "bin" / "infermeter"
    command = [*([str(exe)] if exe.exists() else [sys.executable, "-m", "flows.commands.app"]), "stream"]
    command += ["--base-url", server.base_url, "--no-track", "--json", str(out), *args]
    env = {k: v for k, v in os.environ.items() if k != "INFERMETER_WORK_DIR"}
    done = subprocess.run(
        command, capture_output=True, text=True, env={**env, "INFERMETER_WORK_DIR": str(tmp_path)}
    )
    return done, json.loads(out.read_text()) if out.exists() else {}


def test_a_trace_is_replayed_at_its_recorded_times(server, tmp_path) -> None:
    """2,000 requests recorded over 20 s (bursts and lulls), replayed twice as fast to an
    instant server: every send keeps its recorded time (lateness p99 well under the 10 ms that
    flags a replay as not faithful), the achieved rate is the recorded one."""
    rows, t = [], 0.0
    for i in range(2000):
        rows.append({"timestamp": round(t, 3), "input_length": 8, "output_length": 1})
        t += 6.0 if (i // 100) % 2 else 14.0  # 100 requests 14 ms apart, then 100 6 ms apart
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    done, result = stream(
        server, tmp_path, "--model", "instant", "--dataset", f"trace:{trace}", "--time-scale", "2",
        "--max-concurrency", "256", "--warmup", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (level,) = result["levels"]
    m = level["metrics"]
    assert m["num_requests"] == 2000 and m["num_errors"] == 0
    recorded = 1999 / (rows[-1]["timestamp"] / 1000 / 2)
    assert m["recorded_request_rate"] == pytest.approx(recorded)
    assert m["achieved_request_rate"] == pytest.approx(recorded, rel=0.01)
    lateness = sorted(r["send_lateness_ms"] for r in level["requests"] if not r["warmup"])
    assert lateness[0] > -0.01 and m["send_lateness_ms_p99"] == pytest.approx(percentile(lateness, 99))
    assert m["schedule_faithful"] == 1 and m["send_lateness_ms_p99"] < 10.0
    print(
        f"trace replay: send lateness p50 {m['send_lateness_ms_p50']:.3f} ms, p99 {m['send_lateness_ms_p99']:.3f} ms"
    )


def test_a_trace_with_a_bad_row_exits_2_before_any_request(server, tmp_path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 5, "input_length": 8, "output_length": 1}\n{"timestamp": 4, "input_length": 8, "output_length": 1}\n'
    )
    server.reset()
    done, _ = stream(server, tmp_path, "--model", "instant", "--dataset", f"trace:{trace}")
    assert done.returncode == 2 and server.stats()["requests"] == []
    (line,) = done.stderr.strip().splitlines()
    assert str(trace) in line and "row 2" in line and "'timestamp' goes backwards" in line
    done, _ = stream(
        server, tmp_path, "--model", "instant", "--dataset", f"trace:{trace}", "--request-rate", "5"
    )
    assert done.returncode == 2 and "time_scale" in done.stderr


def test_shared_prefix_groups_hit_the_cache_as_constructed(server, tmp_path) -> None:
    """4 groups of a 64-token prefix, 16 tokens of each request's own, one stream: the server's
    hit rate (its counters' increase) equals the share a perfect cache would supply; the cache
    is reset before each level, so the second level expects the same, not more."""
    server.reset()
    done, result = stream(
        server, tmp_path, "--model", "prefix_cache", "--prefix-groups", "4", "--prefix-len", "64",
        "--input-len", "16", "--num-requests", "24", "--max-concurrency", "1,1", "--seed", "3",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    first, second = result["levels"]
    for level in (first, second):
        m = level["metrics"]
        groups = [r["prefix_group"] for r in level["requests"] if not r["warmup"]]
        assert set(groups) <= {0, 1, 2, 3} and len(groups) == 24
        firsts = len(set(groups))  # each group's first request misses its prefix
        assert m["expected_cached_token_fraction"] == pytest.approx((24 - firsts) * 64 / (24 * 80))
        assert m["prefix_cache_hit_rate"] == pytest.approx(m["expected_cached_token_fraction"], abs=0.02)
        assert m["cached_token_fraction"] == pytest.approx(m["prefix_cache_hit_rate"])
        assert m["prefix_cache_reset"] == 1
        assert all(r["usage_prompt_tokens"] == 80 for r in level["requests"] if not r["warmup"])


def test_a_run_that_shares_nothing_is_warned_when_it_hits_the_cache(server, tmp_path) -> None:
    """Random prompts with a fixed salt, twice against one server with the cache kept: the
    second run finds the first's prompts (the warning names the figure); salted per run (the
    default) or reset (the default), it does not."""
    server.reset()
    args = ("--model", "prefix_cache", "--input-len", "32", "--num-requests", "6", "--salt", "11")
    stream(server, tmp_path, *args, "--keep-cache")
    done, result = stream(server, tmp_path, *args, "--keep-cache")
    m = result["levels"][0]["metrics"]
    assert m["expected_cached_token_fraction"] == 0.0 and m["prefix_cache_hit_rate"] == 1.0
    assert m["prefix_cache_reset"] is None
    assert "shares nothing by construction, but prefix_cache_hit_rate = 100.0 %" in done.stdout + done.stderr
    done, result = stream(
        server,
        tmp_path,
        "--model",
        "prefix_cache",
        "--input-len",
        "32",
        "--num-requests",
        "6",
        "--keep-cache",
    )
    assert result["levels"][0]["metrics"]["prefix_cache_hit_rate"] == 0.0  # another salt
    assert "shares nothing" not in done.stdout + done.stderr
    done, result = stream(server, tmp_path, *args)  # the same salt, the cache reset first
    assert result["levels"][0]["metrics"]["prefix_cache_hit_rate"] == 0.0
    assert result["levels"][0]["metrics"]["prefix_cache_reset"] == 1
