"""Stream shapes that public clients read wrong (issue 23, items 1-7), on the ground-truth
instrument (tests/groundtruth_server.py) and the functions that judge them.

Each case names the figure that was wrong without a flag: TPOT SLOs on answers whose decode the
client cannot see, a buffered answer's gaps of 0, usage counts that are not counts, reasoning
tokens counted twice or not at all, tool calls taken for empty answers, an answer that just
stops, and the clock warning.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator

import pytest

from tasks.scaleout.levels import run_levels
from tasks.stats import aggregate_level, meets_slos
from tasks.stream import quality
from tasks.stream.capacity import slo_misses
from tasks.stream.client import stream_chat
from tasks.stream.level_result import fill_output_tokens
from tasks.stream.load import make_client, run_level
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings
from tasks.stream.timing import decode_unobserved, tpot_ms
from tasks.wire import rxclock
from tasks.wire.usage import read_usage

try:
    from tests import groundtruth_server as gt
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import groundtruth_server as gt

TOL_MS = 60.0


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


def one(base_url: str, model: str, *, transport: str = "sse", clock: str = "kernel") -> RequestRecord:
    """One request (counted by :func:`words` when the usage cannot be), after a warm-up on the
    same connection."""

    async def main() -> RequestRecord:
        client = make_client(base_url, None, 10.0, 1, transport, clock)
        try:
            await stream_chat(
                client, model="single", prompt="w", max_tokens=4, count_tokens=words, request_id="w"
            )
            return await stream_chat(
                client, model=model, prompt="hi", max_tokens=16, count_tokens=words, request_id=model
            )
        finally:
            await client.close()

    return asyncio.run(main())


def level_of(server: gt.GroundTruthServer, model: str, n: int, goodput=None):
    """One level of ``n`` requests of ``model`` through run_levels (a client process)."""
    settings = LevelSettings(
        model=model, prompts=[f"p{i}" for i in range(n)], max_tokens=16, num_requests=n, warmup=0
    )
    (level,) = run_levels(
        Connection(server.base_url, None, 10.0), [settings], count_tokens=words, goodput=goodput
    )
    return level


# 1. TPOT SLOs and one-token answers -----------------------------------------------------------


def test_one_token_answers_are_judged_on_their_other_slos(server) -> None:
    level = level_of(server, "single", 4, goodput={"tpot_ms": 50, "ttft_ms": 10_000})
    m = level.metrics
    assert m["num_succeeded"] == 4 and m["num_decode_unobserved"] == 4
    assert all(r.tpot_ms is None and r.decode_unobserved == "one_token" for r in level.measured)
    assert m["goodput_fraction"] == 1.0  # was 0.0: a TPOT SLO failed every one-token answer
    assert slo_misses(level.measured, {"tpot_ms": 50, "itl_ms": 1}) == {"tpot_ms": 0, "itl_ms": 0}
    # the other SLOs still judge them
    assert aggregate_level(level.measured, 1.0, {"tpot_ms": 50, "ttft_ms": 1})["goodput_fraction"] == 0.0


# 2. All the text in one read ------------------------------------------------------------------


@pytest.mark.parametrize("clock", ["kernel", "user"])
def test_an_answer_read_at_one_instant_has_no_tpot(server, clock) -> None:
    r = one(server.base_url, "buffered", clock=clock)
    assert r.succeeded and r.output_text == "All at once here" and r.output_tokens == 4
    assert len(r.token_offsets_ms) == 4 and r.itl_ms == [0.0, 0.0, 0.0]  # what the client saw
    assert 40 <= r.ttft_ms <= 40 + TOL_MS
    assert r.decode_unobserved == "one_read" and r.tpot_ms is None  # was 0.0, passing any SLO
    assert meets_slos(r, {"tpot_ms": 0.001, "itl_ms": 0.001, "ttft_ms": 10_000})
    schedule = one(server.base_url, "schedule")
    assert schedule.decode_unobserved is None and schedule.tpot_ms > 0
    m = aggregate_level([r, schedule], 1.0, {"tpot_ms": 0.001})
    # the buffered answer's zeros stay out of the ITL pool; the level counts it
    assert m["num_decode_unobserved"] == 1 and m["itl_ms_p50"] == pytest.approx(
        sorted(schedule.itl_ms)[1] + (sorted(schedule.itl_ms)[2] - sorted(schedule.itl_ms)[1]) * 0.5
    )
    assert m["goodput_fraction"] == 0.5  # the schedule's TPOT misses 0.001 ms; the buffered is not judged


def test_chunks_together_among_others_keep_their_zero_gaps() -> None:
    assert decode_unobserved(5, [10.0, 20.0, 20.0, 30.0]) is None
    assert tpot_ms(10.0, 30.0, 5, [10.0, 20.0, 20.0, 30.0]) == 5.0
    assert decode_unobserved(5, [10.0, 10.0]) == "one_read" and tpot_ms(10.0, 10.0, 5, [10.0, 10.0]) is None
    assert decode_unobserved(5, [10.0]) == "one_chunk" and decode_unobserved(1, [3.0, 4.0]) == "one_token"
    assert decode_unobserved(None, []) is None


# 3. The server's token count against the text ---------------------------------------------------


@pytest.mark.parametrize(
    ("model", "shown"),
    [("usage_zero", "0"), ("usage_nan", "nan"), ("usage_string", "'three'"), ("usage_negative", "-3")],
)
def test_an_untrusted_usage_count_is_replaced_by_the_tokenizer(server, model, shown) -> None:
    r = one(server.base_url, model)
    assert r.succeeded and r.output_text == "one two three"
    assert r.output_tokens == 3 and r.output_tokens_source == "tokenizer"
    assert shown in r.usage_problem and "completion" in r.usage_problem
    assert r.input_tokens == 11 and r.tpot_ms is not None


def test_a_nan_count_costs_no_record(server) -> None:
    """Before: int(NaN) raised in the client process and the level came back with no record."""
    level = level_of(server, "usage_nan", 3)
    assert [r.succeeded for r in level.measured] == [True, True, True]
    assert level.metrics["output_tokens_total"] == 9 and level.metrics["num_usage_untrusted"] == 3


@pytest.mark.parametrize(
    "raw",
    [float("nan"), math.inf, -1, "7", True, 2.5, None],
)
def test_read_usage_never_trusts_a_value_that_is_not_a_count(raw) -> None:
    reading = read_usage({"prompt_tokens": raw, "completion_tokens": raw}, carried_text=True)
    assert reading.output_tokens is None and reading.prompt_tokens is None and reading.problem
    assert read_usage({"completion_tokens": 7.0}, carried_text=True).output_tokens == 7
    assert read_usage("junk", carried_text=True).problem.startswith("usage is not an object")
    assert read_usage(None, carried_text=True).problem is None


# 4. Reasoning tokens in usage ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("convention", "tokens", "source"),
    [("included", 4, "usage"), ("separate", 4, "usage"), ("neither", 3, "tokenizer")],
)
def test_reasoning_conventions_are_read_from_the_totals(server, convention, tokens, source) -> None:
    r = one(server.base_url, f"reasoning_usage_{convention}")
    assert r.succeeded and r.output_text == "Let me thinkYes" and len(r.token_offsets_ms) == 3
    assert r.reasoning_tokens == 3 and r.usage_convention == convention
    assert (r.output_tokens, r.output_tokens_source) == (tokens, source)
    assert (r.usage_problem is not None) == (convention == "neither")


def test_reasoning_without_totals() -> None:
    details = {"completion_tokens_details": {"reasoning_tokens": 30}}
    # a count that included the reasoning could not be below it: reported apart
    apart = read_usage({"completion_tokens": 5, **details}, carried_text=True)
    assert (apart.output_tokens, apart.convention) == (35, "separate")
    unsure = read_usage({"completion_tokens": 50, **details}, carried_text=True)
    assert (unsure.output_tokens, unsure.convention, unsure.problem) == (50, "unverified", None)


# 5. Tool calls are generated text ---------------------------------------------------------------


@pytest.mark.parametrize("transport", ["sse", "openai"])
def test_a_tool_call_reply_is_timed_and_a_success(server, transport) -> None:
    r = one(server.base_url, "tool_call", transport=transport)
    assert r.succeeded, r.error_message  # was empty_response
    assert 50 <= r.ttft_ms <= 50 + TOL_MS and len(r.token_offsets_ms) == 4
    assert len(r.itl_ms) == 3 and all(20 - 10 <= gap <= 20 + TOL_MS for gap in r.itl_ms)
    assert r.tool_calls == [
        {"index": 0, "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"index": 1, "name": "get_time", "arguments": "{}"},
    ]
    assert r.output_text == "" and r.output_tokens == 12 and r.tpot_ms is not None


def test_tool_calls_are_counted_when_there_is_no_usage() -> None:
    record = RequestRecord("r", ttft_ms=1.0, e2e_ms=3.0, token_offsets_ms=[1.0, 3.0])
    record.tool_calls = [{"index": 0, "name": "f ", "arguments": "a b"}]
    fill_output_tokens(record, words)
    assert record.output_tokens == 3 and record.output_tokens_source == "tokenizer"


# 6. An answer that just stops -------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["sse", "openai"])
def test_a_body_that_ends_without_finish_usage_or_done_is_not_a_success(server, transport) -> None:
    r = one(server.base_url, "no_end", transport=transport)
    assert r.error_class == "stream_broken" and not r.succeeded
    assert "no finish_reason, no usage and no [DONE]" in r.error_message
    assert r.output_text == "The answer is forty" and len(r.token_offsets_ms) == 2  # kept
    # any one of the three ends an answer: "slow" has only [DONE], "one_chunk" no [DONE]... all pass
    assert one(server.base_url, "slow").succeeded


# 7. The clock warning ----------------------------------------------------------------------------


def test_a_level_with_no_chunk_says_nothing_of_clocks(server, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="infermeter.stream"):
        level = level_of(server, "http_500", 2)
    assert level.metrics["num_errors"] == 2 and level.metrics["arrival_clock"] is None
    assert not [m for m in caplog.messages if "clock" in m]


def test_records_that_fell_back_are_named_with_their_reason(server, monkeypatch) -> None:
    """Every other request's kernel stamps are made unusable (as a wall-clock step would): the
    warning counts those of the level, names them and says why; the others stay on the kernel."""
    real = rxclock.realtime_offset_ns
    calls = iter(range(1000))
    monkeypatch.setattr(rxclock, "realtime_offset_ns", lambda: real() + (10**12 if next(calls) % 2 else 0))

    async def main():
        client = make_client(server.base_url, None, 10.0, 1)
        try:
            settings = LevelSettings(model="ticks:3:5", prompts=["a"], max_tokens=3, num_requests=4, warmup=0)
            return await run_level(client, settings, count_tokens=None)
        finally:
            await client.close()

    records = asyncio.run(main()).records
    fell = [r for r in records if r.arrival_clock == "user"]
    kept = [r for r in records if r.arrival_clock == "kernel"]
    assert len(fell) == len(kept) == 2  # the level's start and end read the offset too
    assert all(r.clock_fallback == rxclock.CLOCK_STEPPED for r in fell)
    assert all(r.clock_fallback is None for r in kept)
    message = quality.fallback_message(0, records)
    assert message.startswith("level 0: 2 of 4 requests with text are on the user-space clock")
    assert rxclock.CLOCK_STEPPED in message and all(r.request_id in message for r in fell)
    assert not any(r.request_id in message for r in kept)
    assert quality.fallback_message(0, kept) is None
