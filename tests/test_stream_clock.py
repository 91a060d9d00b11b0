"""Arrival times from the kernel (issue 11) against the ground-truth instrument.

The instrument (tests/groundtruth_server.py) stamps each ticks chunk when it writes it
(CLOCK_MONOTONIC, the clock the records use), so every error below is measured, not modelled.
The cases from public reports each have a scenario there; tolerances allow a loaded 2-core
machine but stay far below the mistakes they guard against.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tasks.scaleout.levels import run_levels
from tasks.stats import aggregate_level, meets_slos, percentile
from tasks.stream.client import stream_chat
from tasks.stream.load import MAX_SEND_LEAD_S, arrival_offsets_s, make_client, open_connections, run_level
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings, level_settings
from tasks.wire import rxclock

try:
    from tests import groundtruth_server as gt
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import groundtruth_server as gt

TOL_MS = 60.0
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


def one(base_url: str, model: str, *, arrival_clock: str = "kernel", transport: str = "sse") -> RequestRecord:
    """One request on a fresh client, after a warm-up request on the same connection."""

    async def main() -> RequestRecord:
        client = make_client(base_url, None, 10.0, 1, transport, arrival_clock)
        try:
            await stream_chat(
                client, model="single", prompt="w", max_tokens=4, count_tokens=None, request_id="w"
            )
            return await stream_chat(
                client, model=model, prompt="hi", max_tokens=16, count_tokens=None, request_id=model
            )
        finally:
            await client.close()

    return asyncio.run(main())


def ticks_level(server: gt.GroundTruthServer, streams: int, *, hog_ms: float = 0.0, clock: str = "kernel"):
    """A level of ``streams`` ticks streams (40 chunks 10 ms apart); with ``hog_ms``, a task
    blocks the event loop that long every 40 ms (a client that falls behind)."""

    async def main():
        stop = asyncio.Event()

        async def hog():
            while not stop.is_set():
                time.sleep(hog_ms / 1000)
                await asyncio.sleep(0.040)

        client = make_client(server.base_url, None, 30.0, streams, arrival_clock=clock)
        hogger = asyncio.ensure_future(hog()) if hog_ms else None
        try:
            return await run_level(
                client,
                LevelSettings(
                    model="ticks:40:10",
                    prompts=[f"p{i}" for i in range(streams)],
                    max_tokens=40,
                    max_concurrency=streams,
                    num_requests=streams,
                ),
                count_tokens=None,
            )
        finally:
            stop.set()
            if hogger is not None:
                await hogger
            await client.close()

    server.reset()
    result = asyncio.run(main())
    stamps = server.stamps()
    errors = []
    for r in result.measured:
        true = stamps[f"p{r.request_id.split('-r')[1]}"]["text_sent_ns"]
        got = [r.send_ns + o * 1e6 for o in r.token_offsets_ms]
        assert len(got) == len(true), r.error_message
        errors += [((got[i] - got[i - 1]) - (true[i] - true[i - 1])) / 1e6 for i in range(1, len(true))]
    return result, sorted(errors)


def instrument_burst(server: gt.GroundTruthServer) -> bool:
    """Whether the instrument wrote two consecutive chunks of a stream of the last level
    under 1 ms apart (its ticks are 10 ms apart: its own loop stalled)."""
    return any(
        later - earlier < 1_000_000
        for stamps in server.stamps().values()
        for earlier, later in zip(stamps["text_sent_ns"], stamps["text_sent_ns"][1:])
    )


# The clock ----------------------------------------------------------------------------------


def test_kernel_stamps_are_on_the_records_clock(server) -> None:
    """Every ticks chunk's kernel arrival lies after the instrument wrote it and before the
    loop read it; the gaps match the instrument's to well under a millisecond."""
    result, errors = ticks_level(server, 4)
    stamps = server.stamps()
    assert result.client["arrival_clock"] == "kernel" and result.client["client_bound"] == 0
    for r in result.measured:
        assert r.arrival_clock == "kernel" and len(r.user_token_offsets_ms) == len(r.token_offsets_ms) == 40
        sent = stamps[f"p{r.request_id.split('-r')[1]}"]["text_sent_ns"]
        for kernel_ms, user_ms, sent_ns in zip(r.token_offsets_ms, r.user_token_offsets_ms, sent):
            arrival_ns = r.send_ns + kernel_ms * 1e6
            assert sent_ns - 1e3 <= arrival_ns <= r.send_ns + user_ms * 1e6 + 1e3
    assert percentile(errors, 50) == pytest.approx(0.0, abs=0.2)
    assert result.client["coalesced_events"] == 0 and result.client["coalesced_event_fraction"] == 0.0
    assert result.client["clock_offset_drift_ms"] < 1.0
    assert result.client["client_cpu_us_per_chunk"] > 0


def test_connect_and_request_written_are_recorded_apart(server) -> None:
    r = one(server.base_url, "ticks:3:10")
    assert r.connect_ms is None  # the warm-up's connection was reused
    assert 0 < r.request_sent_ms < r.ttft_ms

    async def fresh() -> RequestRecord:
        client = make_client(server.base_url, None, 10.0, 1)
        try:
            return await stream_chat(
                client, model="ticks:3:10", prompt="x", max_tokens=3, count_tokens=None, request_id="x"
            )
        finally:
            await client.close()

    r = asyncio.run(fresh())
    assert 0 < r.connect_ms <= r.request_sent_ms < r.ttft_ms


def test_a_levels_connections_are_opened_before_its_start(server) -> None:
    """Each client process opens its streams' connections before it says it is ready: no
    measured request waits for a handshake (before, all but the warm-up's paid one, and at 512
    streams the first wave left 70-80 ms late). One that cannot be opened is left to the request."""
    settings = LevelSettings(
        model="ticks:3:10", prompts=["a"], max_tokens=3, num_requests=24, max_concurrency=16, warmup=1
    )
    (level,) = run_levels(
        Connection(server.base_url, None, 10.0), [settings], count_tokens=None, client_processes=2
    )
    assert level.metrics["num_errors"] == 0
    assert [r.connect_ms for r in level.measured] == [None] * 24
    assert max(r.request_sent_ms for r in level.measured) < 50  # no handshake queue in front

    async def opened() -> tuple[int, int, int, int]:
        client = make_client(server.base_url, None, 10.0, 4)
        nowhere = make_client(f"http://127.0.0.1:{gt.free_port()}/v1", None, 2.0, 4)
        httpx_client = make_client(server.base_url, None, 10.0, 4, "openai")
        four = replace(settings, num_requests=3, max_concurrency=4)  # 3 requests: 3 connections
        try:
            return (
                await open_connections(client, four),
                await open_connections(client, four),  # idle already: none more
                await open_connections(nowhere, four),  # refused: no error, the requests will say it
                await open_connections(httpx_client, four),  # httpx's pool opens on demand
            )
        finally:
            for c in (client, nowhere, httpx_client):
                await c.close()

    assert asyncio.run(opened()) == (3, 0, 0, 0)


def test_user_clock_when_asked_and_when_the_transport_has_no_stamps(server, caplog) -> None:
    r = one(server.base_url, "ticks:5:10", arrival_clock="user")
    assert r.arrival_clock == "user" and r.user_token_offsets_ms == [] and r.coalesced_events == 0
    assert len(r.token_offsets_ms) == 5
    # the openai transport reads through httpx: no socket of ours, the user clock, said once
    base = LevelSettings(model="ticks:5:10", prompts=["a", "b"], max_tokens=5, num_requests=2, warmup=0)
    logger = logging.getLogger("test.clock")
    with caplog.at_level(logging.WARNING, logger="test.clock"):
        levels = run_levels(
            Connection(server.base_url, None, 10.0, "openai"),
            level_settings(base, [1, 2]),
            count_tokens=None,
            logger=logger,
        )
    assert [level.metrics["arrival_clock"] for level in levels] == ["user", "user"]
    assert all(r.arrival_clock == "user" for level in levels for r in level.records)
    said = [m for m in caplog.messages if "user-space clock" in m]
    assert len(said) == 1 and "openai transport" in said[0]
    assert (
        levels[0].metrics["client_bound"] in (0, 1) and levels[0].metrics["coalesced_event_fraction"] is None
    )


def test_a_blocked_loop_coalesces_and_is_flagged_a_free_one_is_not(server) -> None:
    """64 streams: a loop blocked 25 ms every 40 ms lets the kernel queue two or three chunks of
    a stream, which one late read takes together: they are counted and the level is flagged.
    The free loop's level is not."""
    for _ in range(3):
        free, free_errors = ticks_level(server, 64)
        # This test is about the client: where the instrument's own loop stalled and wrote a
        # stream's chunks together (seen 2 levels in 30, and in a CI run: 1.5 % flagged), a
        # client read over 1 ms late counts them as coalesced, rightly: measure the free loop again.
        if not instrument_burst(server):
            break
    blocked, blocked_errors = ticks_level(server, 64, hog_ms=25)
    assert free.client["arrival_clock"] == blocked.client["arrival_clock"] == "kernel"
    assert free.client["coalesced_event_fraction"] <= 0.01 and free.client["client_bound"] == 0, free.client
    assert blocked.client["coalesced_event_fraction"] > 0.05 and blocked.client["client_bound"] == 1
    # what the flag stands for: the coalesced gaps are wrong by up to a gap
    assert percentile(blocked_errors, 99) > 2.0 > percentile(free_errors, 99)


def test_https_reads_are_stamped_before_decryption(tmp_path, monkeypatch) -> None:
    """TLS: the stamp belongs to the raw read that delivered the encrypted bytes. Through
    run_levels, whose client process trusts the instrument's certificate (SSL_CERT_FILE)."""
    cert, key = gt.self_signed_cert(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    with gt.serve(tls=(cert, key)) as tls_server:
        assert tls_server.base_url.startswith("https://")
        settings = LevelSettings(
            model="ticks:20:10", prompts=["warm", *(f"p{i}" for i in range(8))], max_tokens=20,
            num_requests=8, max_concurrency=8, warmup=1,
        )  # fmt: skip
        (level,) = run_levels(Connection(tls_server.base_url, None, 10.0), [settings], count_tokens=None)
        stamps = tls_server.stamps()
    assert level.metrics["arrival_clock"] == "kernel" and level.metrics["num_errors"] == 0, [
        r.error_message for r in level.records
    ][:3]
    errors = []
    for r in level.measured:
        true = stamps[f"p{r.request_id.split('-r')[1]}"]["text_sent_ns"]
        got = [r.send_ns + o * 1e6 for o in r.token_offsets_ms]
        assert r.arrival_clock == "kernel" and len(got) == len(true) == 20
        assert all(t - 1e3 <= g for g, t in zip(got, true))  # never before the write
        errors += [((got[i] - got[i - 1]) - (true[i] - true[i - 1])) / 1e6 for i in range(1, len(true))]
    assert percentile(sorted(errors), 50) == pytest.approx(0.0, abs=0.2)
    # the handshake is the connection's, not the request's; the level's connections were opened
    # before its start (tasks.stream.load.open_connections): no measured request paid one
    (warm,) = [r for r in level.records if r.warmup]
    assert warm.connect_ms is not None and warm.connect_ms < warm.request_sent_ms
    assert [r.connect_ms for r in level.measured] == [None] * 8


def test_client_processes_by_default_one_per_128_streams() -> None:
    from tasks.scaleout.multiproc import auto_processes

    cores = len(os.sched_getaffinity(0))
    assert [auto_processes(n) for n in (1, 64, 128)] == [1, 1, 1]
    assert auto_processes(129) == min(2, cores) and auto_processes(1024) == min(8, cores)


# Cases from public reports ------------------------------------------------------------------


def test_utf8_character_split_across_writes(server) -> None:
    """vLLM #38717: a character's bytes in two writes 50 ms apart."""
    r = one(server.base_url, "utf8_split")
    assert r.succeeded and r.output_text == gt.UTF8_SPLIT_TEXT and "\ufffd" not in r.output_text
    assert 70 <= r.ttft_ms <= 70 + TOL_MS  # the token arrived with the second half
    assert r.arrival_clock == "kernel"


def test_crlf_events_are_timed_like_lf(server) -> None:
    r = one(server.base_url, "crlf")
    assert r.succeeded and r.output_text == "one two three" and r.output_tokens == 3
    assert 40 <= r.ttft_ms <= 40 + TOL_MS
    assert len(r.itl_ms) == 2 and all(30 - 1 <= gap <= 30 + TOL_MS for gap in r.itl_ms)


def test_string_in_band_error_after_two_tokens(server) -> None:
    """SGLang PR #38868: ``data: {"error": "boom"}``; the partial tokens count nowhere."""
    bad = one(server.base_url, "string_error")
    assert bad.error_class == "server" and "boom" in bad.error_message
    assert bad.output_text == "Hello world" and len(bad.token_offsets_ms) == 2
    good = one(server.base_url, "ticks:3:10")
    metrics = aggregate_level([bad, good], 1.0, {"ttft_ms": 10_000})
    assert metrics["num_errors"] == 1 and metrics["errors_server"] == 1
    assert metrics["output_tokens_total"] == good.output_tokens == 3
    assert metrics["goodput_fraction"] == 0.5 and metrics["goodput_requests_per_s"] == 1.0


def test_whole_answer_in_one_chunk_has_no_tpot(server) -> None:
    """genai-bench PR #44: one text chunk, usage 300 ms later."""
    r = one(server.base_url, "one_chunk")
    assert r.succeeded and r.output_tokens == 6 and r.output_tokens_source == "usage"
    assert 30 <= r.ttft_ms <= 30 + TOL_MS and r.e2e_ms == r.ttft_ms
    assert r.stream_close_ms >= r.ttft_ms + 300
    assert r.tpot_ms is None and r.itl_ms == []
    # no TPOT: it neither passes nor fails a TPOT SLO; its other SLOs judge it
    assert meets_slos(r, {"tpot_ms": 0.001, "ttft_ms": 10_000})
    assert not meets_slos(r, {"tpot_ms": 10_000, "ttft_ms": 1})


def test_three_events_in_one_write(server) -> None:
    r = one(server.base_url, "three_in_one")
    assert r.succeeded and r.output_text == "a b c" and len(r.token_offsets_ms) == 3
    assert r.itl_ms == [0.0, 0.0]  # they arrived together: one read, one kernel stamp
    # written together and read at once they share their stamp rightly: not coalesced, unless
    # this (loaded) machine handled the read over 1 ms late
    late = r.user_token_offsets_ms[-1] - r.token_offsets_ms[-1] > rxclock.LATE_READ_NS / 1e6
    assert r.coalesced_events == (2 if late else 0)


def test_achieved_request_rate_through_the_cli(server, tmp_path) -> None:
    """vLLM #21104: 2,000 requests at 200 req/s (burstiness 1000: near-even gaps) to an instant
    server, through `infermeter stream`: the achieved send rate is within 1 % of the schedule's
    and the send lateness does not grow with the request index."""
    n, rate, burstiness, seed = 2000, 200.0, 1000.0, 7
    out = tmp_path / "out.json"
    command = [
        str(ROOT / ".venv" / "bin" / "infermeter"), "stream", "--base-url", server.base_url,
        "--model", "instant", "--prompt", "x", "--max-tokens", "1", "--max-concurrency", "64",
        "--request-rate", str(rate), "--burstiness", str(burstiness), "--seed", str(seed),
        "--num-requests", str(n), "--warmup", "1", "--no-track", "--json", str(out),
    ]  # fmt: skip
    if not Path(command[0]).exists():
        command[:1] = [sys.executable, "-m", "flows.cli.main"]
    server.reset()
    done = subprocess.run(
        command, capture_output=True, text=True, env={"INFERMETER_WORK_DIR": str(tmp_path), **_env()}
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (level,) = json.loads(out.read_text())["levels"]
    metrics = level["metrics"]
    offsets = arrival_offsets_s(n, rate, burstiness, seed)
    scheduled_rate = (n - 1) / offsets[-1]
    assert metrics["num_requests"] == n and metrics["num_errors"] == 0
    assert metrics["achieved_request_rate"] == pytest.approx(scheduled_rate, rel=0.01)
    measured = sorted(
        (r for r in level["requests"] if not r["warmup"]), key=lambda r: int(r["request_id"].split("-r")[1])
    )
    lateness = [r["send_lateness_ms"] for r in measured]
    # early only by less than the lead a send starts with (tasks.stream.load.SendLead)
    assert all(value is not None and value > -MAX_SEND_LEAD_S * 1e3 for value in lateness)
    first, last = sorted(lateness[: n // 4]), sorted(lateness[-n // 4 :])
    assert percentile(last, 50) < percentile(first, 50) + 1.0, (percentile(first, 50), percentile(last, 50))
    assert metrics["send_lateness_ms_p99"] == pytest.approx(percentile(sorted(lateness), 99))


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "INFERMETER_WORK_DIR"}


def test_clock_drift_and_coalescing_warnings_name_their_figures(caplog) -> None:
    """A realtime step during a level cannot be staged here (it would move the machine's wall
    clock), so the level's figures are given: the warnings name the drift and the coalesced share."""
    from tasks.stream.quality import SAME_HOST_NOTE, warn_client

    settings = LevelSettings(model="m", prompts=["p"], max_tokens=1, num_requests=1, level=3)
    logger = logging.getLogger("test.clock.warn")
    with caplog.at_level(logging.WARNING, logger="test.clock.warn"):
        warn_client(
            {"arrival_clock": "kernel", "clock_offset_drift_ms": 2.5, "client_bound": 1,
             "coalesced_event_fraction": 0.095},
            settings,
            logger,
        )  # fmt: skip
        warn_client(
            {"arrival_clock": "kernel", "clock_offset_drift_ms": 0.2, "client_bound": 0}, settings, logger
        )
        bound = {"arrival_clock": "kernel", "client_bound": 1, "coalesced_event_fraction": 0.02}
        warn_client(bound, settings, logger, same_host=True)  # a server on the client's cores
    assert len(caplog.messages) == 3
    assert caplog.messages[2].endswith(SAME_HOST_NOTE) and SAME_HOST_NOTE not in caplog.messages[1]
    assert "level 3: CLOCK_REALTIME moved 2.500 ms" in caplog.messages[0]
    said = caplog.messages[1]
    assert "over 1.00 % of its ITL gaps may be off by more than 1 ms" in said
    assert "(9.50 % of its gaps came coalesced)" in said
