"""A level's timeline (issue 20, item 6): the client's figures per window on constructed records
with known times (exact counts, partial first and last windows, tokens/s), the gauge sampler
against the ground-truth instrument's /metrics (gauges of known laws, its clock as a gauge),
the stacked plot, and `infermeter stream` end to end: the level's MLflow run has the step series
(one step per window, stamped with its wall time) and the plot. No mocks: real records, a real
server, a real MLflow store."""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.endpoint.gauges import GAUGES, GaugeSample, GaugeSampler
from tasks.metrics import is_registered
from tasks.pipeline.timeline import _NOT_LOGGED, PREFIX
from tasks.report.timeline_plot import timeline_plot
from tasks.stream.records import RequestRecord
from tasks.stream.timeline import level_timeline, sample_rows, windows

try:
    from tests import gauges_server
    from tests import groundtruth_server as gt
except ImportError:
    import gauges_server
    import groundtruth_server as gt

BIN = Path(sys.executable).parent / "infermeter"
T0 = 50_000_000_000  # the level's first measured send on perf_counter_ns (any instant)
S = 1_000_000_000  # one second in ns


def _at(seconds: float) -> int:
    return T0 + round(seconds * S)


def _request(
    rid: str, send_s: float, offsets_ms: list[float], tokens: int, close_ms: float, **kw
) -> RequestRecord:
    gaps = [b - a for a, b in zip(offsets_ms, offsets_ms[1:])]
    return RequestRecord(
        rid,
        send_ns=_at(send_s),
        ttft_ms=offsets_ms[0] if offsets_ms else None,
        itl_ms=gaps,
        e2e_ms=offsets_ms[-1] if offsets_ms else None,
        stream_close_ms=close_ms,
        output_tokens=tokens,
        token_offsets_ms=offsets_ms,
        **kw,
    )


# A: sent at 0 s, 5 one-token chunks 0.5 s apart from 0.2 s, closed at 2.3 s (the level's end).
# B: sent at 0.5 s, 2 chunks of 2 tokens at 1.3 / 1.5 s, closed at 1.6 s.
# C: sent at 1.8 s, failed at 1.9 s. W: a warm-up before the level (left out).
RECORDS = [
    _request("W", -1.0, [100.0], 1, 150.0, warmup=True),
    _request("A", 0.0, [200.0, 700.0, 1200.0, 1700.0, 2200.0], 5, 2300.0),
    _request("B", 0.5, [800.0, 1000.0], 4, 1100.0),
    RequestRecord(
        "C", send_ns=_at(1.8), stream_close_ms=100.0, error_class="server", error_message="HTTP 500"
    ),
]
# gauges: running at 0.1 / 0.35 / 0.6 / 0.85 s and 1.1 / 1.6 s; the counter read once before
SAMPLES = [
    GaugeSample(_at(-0.05), {"vllm:num_preemptions_total": 5.0}),
    *(
        GaugeSample(_at(t), {"vllm:num_requests_running": run, "vllm:num_preemptions_total": pre})
        for t, run, pre in ((0.1, 1, 5), (0.35, 2, 6), (0.6, 2, 6), (0.85, 2, 7), (1.1, 2, 7), (1.6, 1, 9))
    ),
]


def test_windows_of_known_records_count_exactly() -> None:
    w = windows(RECORDS, 1.0, T0, _at(2.3), samples=SAMPLES)
    assert [(x.start_s, x.window_s) for x in w] == [
        (0.0, 1.0),
        (1.0, 1.0),
        (pytest.approx(2.0), pytest.approx(0.3)),
    ]
    assert [x.partial for x in w] == [True, False, True]  # ramp-up, steady, cut at the end
    # in flight: w0 A 1 s + B 0.5 s; w1 A 1 s + B 0.6 s + C 0.1 s; w2 A 0.3 s of 0.3 s
    assert [x.requests_in_flight for x in w] == pytest.approx([1.5, 1.7, 1.0])
    assert [x.requests_in_flight_max for x in w] == [2, 2, 1]
    assert [(x.requests_sent, x.requests_finished, x.requests_failed) for x in w] == [
        (2, 0, 0),
        (1, 2, 1),
        (0, 1, 0),
    ]
    # TTFT by the first chunk's arrival: A's (0.2 s) in w0, B's (1.3 s) in w1
    assert [(x.ttft_ms_p50, x.ttft_count) for x in w] == [(200.0, 1), (800.0, 1), (None, 0)]
    # ITL by the gap's end: A's at 0.7 | 1.2, 1.7 and B's at 1.5 | 2.2
    assert [(x.itl_ms_mean, x.itl_ms_p50, x.itl_count) for x in w] == [
        (500.0, 500.0, 1),
        (pytest.approx(400.0), 500.0, 3),
        (500.0, 500.0, 1),
    ]
    # tokens by arrival: A 2 | 2 + B's two chunks of 2 | 1 over 0.3 s; all 9 accounted for
    assert [x.output_tokens for x in w] == [2.0, 6.0, 1.0]
    assert [x.output_tokens_per_s for x in w] == pytest.approx([2.0, 6.0, 1 / 0.3])
    # server: gauge mean / max of the window's samples, the counter's increase, None without samples
    assert w[0].server == {
        "vllm_num_preemptions_total_delta": 2.0,  # 7 at 0.85 s - 5 read before the window
        "vllm_num_requests_running": 1.75,
        "vllm_num_requests_running_max": 2,
    }
    assert (
        w[1].server["vllm_num_preemptions_total_delta"] == 2.0
        and w[1].server["vllm_num_requests_running"] == 1.5
    )
    assert set(w[2].server.values()) == {None}


def test_window_edges_and_bad_slices() -> None:
    assert windows(RECORDS, 1.0, T0, T0) == []
    with pytest.raises(ValueError, match="slice_s"):
        windows(RECORDS, 0.0, T0, _at(1.0))
    one = windows(RECORDS, 5.0, T0, _at(2.3))  # one window shorter than the slice: partial
    assert len(one) == 1 and one[0].partial and one[0].window_s == pytest.approx(2.3)
    assert one[0].output_tokens == 9.0 and one[0].requests_sent == 3


def test_repeats_are_windowed_apart_on_one_axis() -> None:
    second = [_request(f"R{i}", 10.0 + i, [100.0, 300.0], 2, 400.0, repeat=1) for i in range(2)]
    w = level_timeline([*RECORDS, *second], SAMPLES, 1.0)
    assert [x.index for x in w] == [0, 1, 2, 3, 4]
    assert [(x.repeat, x.partial) for x in w] == [(0, True), (0, False), (0, True), (1, True), (1, True)]
    assert w[3].start_s == pytest.approx(10.0) and w[4].window_s == pytest.approx(0.4)
    assert w[3].requests_sent == 1 and w[4].output_tokens == 2.0


def test_every_logged_timeline_name_is_registered() -> None:
    rows = [x.to_row() for x in level_timeline(RECORDS, SAMPLES, 1.0)]
    names = {PREFIX + key for row in rows for key in row if key not in _NOT_LOGGED}
    names |= {
        "timeline_windows",
        "timeline_slice_s",
        "timeline_gauge_samples",
        "timeline_gauge_interval_ms_p50",
    }
    names |= {"timeline_server_vllm_kv_cache_usage_perc_max", "timeline_server_sglang_num_queue_reqs"}
    assert not sorted(n for n in names if not is_registered(n))


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_stacked_plot_one_panel_per_figure_and_the_server(tmp_path) -> None:
    rows = [x.to_row() for x in level_timeline(RECORDS, SAMPLES, 0.5)]
    with_gauges = timeline_plot(rows, sample_rows(SAMPLES, T0), tmp_path / "a.png", "level 0")
    without = timeline_plot(rows, [], tmp_path / "b.png", "level 0")
    # 640 px wide; 175 px a panel: 4 client + server requests + cache use / counters | 4 + 1
    assert _png_size(with_gauges) == (640, 6 * 175) and _png_size(without) == (640, 5 * 175)


# The sampler against the instrument ----------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    """The instrument with vLLM-named gauges of known laws (tests/gauges_server.py)."""
    with gauges_server.serve() as handle:
        yield handle


def _stream(server: gt.GroundTruthServer, prompt: str, model: str) -> None:
    body = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": prompt}]})
    request = urllib.request.Request(
        f"{server.base_url}/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def test_sampler_reads_the_instruments_gauges_every_250_ms_on_the_clients_clock(server) -> None:
    server.reset()
    sampler = GaugeSampler(server.base_url, names=(*GAUGES, "gt_monotonic_seconds", "gt_step"))
    with sampler:
        sampler.start()
        time.sleep(0.3)  # idle first
        # two requests of 20 chunks 50 ms apart (about 1 s each), the second 0.25 s later
        streams = [threading.Thread(target=_stream, args=(server, "first", "ticks:20:50"))]
        streams.append(threading.Thread(target=_stream, args=(server, "second", "ticks:20:50")))
        streams[0].start()
        time.sleep(0.25)
        streams[1].start()
        for thread in streams:
            thread.join()
        time.sleep(0.6)  # idle after
    samples = sampler.samples
    sampler.stop()  # stopped already by the context: no-op
    gaps_ms = [(b.t_ns - a.t_ns) / 1e6 for a, b in zip(samples, samples[1:])]
    assert len(samples) >= 8 and 230 <= statistics.median(gaps_ms) <= 270, gaps_ms
    for s in samples:  # the instrument's own clock reading lies within the GET that read it
        server_ns = s.values["gt_monotonic_seconds"] * 1e9
        assert abs(server_ns - s.t_ns) <= s.fetch_ms * 1e6 / 2 + 1e6, (server_ns - s.t_ns, s.fetch_ms)
    # the gauge that steps every 500 ms reads the step of the sample's own stamp (off a step's
    # edge by more than the GET's half-duration)
    step_ns = gauges_server.STEP_S * 1e9
    clear = [
        s for s in samples if min(s.t_ns % step_ns, step_ns - s.t_ns % step_ns) > s.fetch_ms * 1e6 / 2 + 1e6
    ]
    assert len(clear) >= len(samples) // 2
    assert all(s.values["gt_step"] == s.t_ns // step_ns for s in clear)
    assert len({s.values["gt_step"] for s in samples}) >= 4  # it changed during the sampling
    stamps = server.stamps()
    (first, second) = (stamps["first"], stamps["second"])
    both = (second["recv_ns"], first["text_sent_ns"][-1])  # both in flight (server's stamps)
    idle_after = max(first["text_sent_ns"][-1], second["text_sent_ns"][-1])
    margin = 20e6
    inside = [s for s in samples if both[0] + margin < s.t_ns < both[1] - margin]
    after = [s for s in samples if s.t_ns > idle_after + margin]
    before = [s for s in samples if s.t_ns < first["recv_ns"] - margin]
    assert inside and after and before
    assert {s.values["vllm:num_requests_running"] for s in inside} == {2}
    assert {s.values["vllm:kv_cache_usage_perc"] for s in inside} == {0.02}  # 1 % per request
    assert {s.values["vllm:num_requests_running"] for s in after + before} == {0}
    assert {s.values["vllm:num_requests_waiting"] for s in samples} == {0}


def test_a_server_without_metrics_is_sampled_to_nothing_without_error() -> None:
    sampler = GaugeSampler(f"http://127.0.0.1:{gt.free_port()}/v1", timeout_s=0.5)
    assert sampler.sample_once() is None
    with sampler:
        sampler.start()
        time.sleep(0.3)
    assert sampler.samples == []


# End to end: infermeter stream, the level's MLflow run -------------------------------------


def test_stream_command_logs_each_levels_timeline_on_its_run(server, tmp_path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "INFERMETER_WORK_DIR": str(tmp_path / "work")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    out = tmp_path / "out.json"
    server.reset()
    command = [str(BIN), "stream", "--base-url", server.base_url, "--model", "ticks:24:50"]
    options = ["--max-concurrency", "2", "--num-requests", "4", "--warmup", "0", "--slice-s", "0.5"]
    proc = subprocess.run(
        [*command, *options, "--json", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    records = data["levels"][0]["requests"]
    sends = [r["send_ns"] for r in records]
    span_s = (max(r["send_ns"] + r["stream_close_ms"] * 1e6 for r in records) - min(sends)) / 1e9

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    parent = client.get_run(data["mlflow_run_id"])
    runs = client.search_runs([parent.info.experiment_id], "tags.stage = 'stream_level'")
    assert len(runs) == 1
    child = runs[0].info.run_id
    n = -(-round(span_s * 1e9) // round(0.5e9))  # ceil(span / slice)
    assert runs[0].data.metrics["timeline_windows"] == n and runs[0].data.metrics["timeline_slice_s"] == 0.5

    def history(name: str) -> list:
        return sorted(client.get_metric_history(child, name), key=lambda m: m.step)

    flight = history("timeline_requests_in_flight")
    assert [m.step for m in flight] == list(range(n))
    stamps = [m.timestamp for m in flight]  # each window's start in wall time, 500 ms apart
    assert all(480 <= b - a <= 520 for a, b in zip(stamps, stamps[1:])), stamps
    assert runs[0].info.start_time - 1000 <= stamps[0] <= stamps[-1] <= runs[0].info.end_time
    assert [m.value for m in history("timeline_window_partial")] == [1.0] + [0.0] * (n - 2) + [1.0]
    assert max(m.value for m in flight) == pytest.approx(2.0, abs=0.05)
    assert sum(m.value for m in history("timeline_output_tokens")) == pytest.approx(4 * 24)
    assert sum(m.value for m in history("timeline_requests_sent")) == 4
    running = history("timeline_server_vllm_num_requests_running_max")
    assert len(running) >= n - 1 and max(m.value for m in running) == 2.0
    assert runs[0].data.metrics["timeline_gauge_samples"] >= 4 * span_s - 2
    assert 230 <= runs[0].data.metrics["timeline_gauge_interval_ms_p50"] <= 270
    files = {a.path for a in client.list_artifacts(child, "timeline")}
    assert files == {f"timeline/level0_{name}" for name in ("timeline.png", "windows.csv", "gauges.csv")}


def test_the_sampler_keeps_one_connection_and_opens_another_when_the_server_closes() -> None:
    """Every 250 ms a GET: on one kept connection (no new one on the server each time, no connect
    in fetch_ms), retried once on a new one when the server closed it while idle; a server that
    closes after each answer gets a new connection each time."""
    import http.server

    opened: list[int] = []
    closing = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version, timeout = "HTTP/1.1", 0.5  # an idle connection closed after 0.5 s

        def setup(self) -> None:
            opened.append(1)
            super().setup()

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = f"vllm:num_requests_running {len(opened)}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            if closing.is_set():
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sampler = GaugeSampler(f"http://127.0.0.1:{server.server_address[1]}/v1")
    try:
        kept = [sampler.sample_once() for _ in range(4)]
        time.sleep(1.0)  # the server closes the idle connection: the next GET is retried on a new one
        kept.append(sampler.sample_once())
        closing.set()
        closed = [sampler.sample_once() for _ in range(3)]
    finally:
        sampler.stop()
        server.shutdown()
        server.server_close()
    assert [s.values["vllm:num_requests_running"] for s in kept] == [1, 1, 1, 1, 2]
    assert [s.values["vllm:num_requests_running"] for s in closed] == [2, 3, 4]  # closed after each
    assert len(opened) == 4 and len(sampler.samples) == 8
