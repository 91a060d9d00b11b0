"""Recorded traces (tasks/workload/trace.py): checked before any request, prompts built from
token ids so that shared hash blocks are the same tokens, and the recorded schedule kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tasks.endpoint.cache import expected_cached_token_fraction
from tasks.models.sources import load_tokenizer
from tasks.workload.trace import BLOCK_TOKENS, TraceError, build_trace, read_trace


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("gguf:default")


def write(path: Path, rows: list) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


MOONCAKE = [
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 250, "input_length": 700, "output_length": 7, "hash_ids": [1, 3]},
    {"timestamp": 1000, "input_length": 100, "output_length": 3, "hash_ids": [4]},
]


def test_shared_blocks_are_the_same_tokens_and_the_schedule_is_kept(tmp_path, tokenizer) -> None:
    rows = read_trace("mooncake", write(tmp_path / "t.jsonl", MOONCAKE))
    trace = build_trace(rows, tokenizer, time_scale=2.0, salt=5)
    assert trace.arrival_offsets_s == (0.0, 0.125, 0.5)  # twice as fast
    assert trace.recorded_request_rate == pytest.approx(2 / 0.5)
    assert trace.output_lens == (5, 7, 3)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in trace.prompts]
    # block 1 opens both of the first two prompts: the same tokens, at least most of a block
    shared = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1], strict=False)) if a != b)
    assert shared == BLOCK_TOKENS and ids[2][:16] != ids[0][:16]
    assert trace.prompt_tokens == tuple(len(x) for x in ids)
    assert trace.prompt_tokens == tuple(r.input_length for r in rows)  # exact: stable tokens
    # a perfect cache reuses block 1 in the second request: 512 of 1400 prompt tokens
    assert trace.blocks[1] == (("h5:1", 512), ("h5:3", 188))
    assert expected_cached_token_fraction(trace.blocks) == pytest.approx(512 / 1400)
    # another salt, other tokens (a second run does not hit the first's cache)
    other = build_trace(rows, tokenizer, salt=6)
    assert other.prompts[0][:200] != trace.prompts[0][:200]
    assert build_trace(rows, tokenizer, time_scale=2.0, salt=5) == trace  # reproducible


@pytest.mark.parametrize(
    ("rows", "row", "field"),
    [
        ([MOONCAKE[0], "{not json"], 2, "not valid JSON"),
        ([MOONCAKE[0], [1, 2]], 2, "not a JSON object"),
        ([{"timestamp": 5, "output_length": 1, "hash_ids": [1]}], 1, "'input_length'"),
        ([MOONCAKE[0], {**MOONCAKE[1], "output_length": 0}], 2, "'output_length'"),
        ([MOONCAKE[1], MOONCAKE[0]], 2, "'timestamp' goes backwards"),
        ([{**MOONCAKE[0], "timestamp": "soon"}], 1, "'timestamp'"),
        ([{**MOONCAKE[0], "hash_ids": ["a"]}], 1, "'hash_ids'"),
        (
            [MOONCAKE[0], {**MOONCAKE[1], "input_length": 9000, "hash_ids": list(range(18))}],
            2,
            "longer than the model's context (8192)",
        ),
        # 600 tokens need 2 blocks of 512: one id cannot cover them, 3 name a block it lacks
        ([MOONCAKE[0], {**MOONCAKE[0], "hash_ids": [1]}], 2, "'hash_ids' has 1 ids for 'input_length' 600"),
        (
            [{**MOONCAKE[0], "hash_ids": [1, 2, 3]}],
            1,
            "'hash_ids' has 3 ids for 'input_length' 600 (2 blocks",
        ),
    ],
)
def test_a_bad_row_is_named_with_its_file_row_and_field(tmp_path, rows, row, field) -> None:
    path = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError) as caught:
        read_trace("mooncake", path, max_context=8192)
    message = str(caught.value)
    assert str(path) in message and f"row {row}" in message and field in message
    assert "\n" not in message


def test_plain_traces_need_no_hash_ids_and_bad_files_say_so(tmp_path, tokenizer) -> None:
    rows = read_trace(
        "trace", write(tmp_path / "p.jsonl", [{"timestamp": 0, "input_length": 20, "output_length": 2}])
    )
    assert expected_cached_token_fraction(build_trace(rows, tokenizer).blocks) == 0.0
    (tmp_path / "bin.jsonl").write_bytes(b'{"timestamp": 0}\n\xff\n')
    with pytest.raises(TraceError, match=r"not UTF-8 .* \(line 2\)"):
        read_trace("trace", tmp_path / "bin.jsonl")
    with pytest.raises(TraceError, match="file not found"):
        read_trace("trace", tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="no row"):
        read_trace("trace", write(tmp_path / "empty.jsonl", []))


def test_timestamps_that_look_like_seconds_are_refused_naming_the_field_and_the_fix(tmp_path) -> None:
    """0, 0.5, 1.0, 1.5 read as ms would be 4 requests in 1.5 ms (replayed 1000x too fast)."""

    def rows(stamps):
        return [{"timestamp": t, "input_length": 8, "output_length": 1} for t in stamps]

    path = write(tmp_path / "seconds.jsonl", rows([0, 0.5, 1.0, 1.5]))
    with pytest.raises(TraceError) as caught:
        read_trace("trace", path)
    message = str(caught.value)
    assert str(path) in message and "field 'timestamp'" in message and "look like seconds" in message
    assert "multiply every timestamp by 1000" in message and "\n" not in message
    with pytest.raises(TraceError, match="look like seconds"):
        read_trace(
            "mooncake", write(tmp_path / "m.jsonl", [{**MOONCAKE[2], "timestamp": t} for t in (0.25, 0.5)])
        )
    # milliseconds: whole, or with fractions but at least 1 ms apart on average
    for stamps in ([0, 500, 1000, 1500], [0, 0, 1, 2], [0, 14.5, 20.25, 34.125], [7.5]):
        got = read_trace("trace", write(tmp_path / "ms.jsonl", rows(stamps)))
        assert [r.timestamp_ms for r in got] == stamps


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 23:59:59.9805900,374,44
2023-11-16 23:59:59.9816900,396,109
2023-11-16 23:59:59.9926900,879,3
2023-11-16 23:59:59.9936901,91,7

2023-11-17 00:00:00.0036901,1024,1
"""


def test_an_azure_trace_keeps_its_gaps_to_the_100_ns(tmp_path, tokenizer) -> None:
    """Azure's CSV: seven fractional digits kept (1.1, 11, 1.0001 and 10 ms gaps, over midnight;
    cut to two digits, as inference-perf before PR #782, they were bursts), offsets from the
    first row, ContextTokens / GeneratedTokens as the lengths."""
    path = tmp_path / "azure.csv"
    path.write_text(AZURE, encoding="utf-8")
    rows = read_trace("azure", path, max_context=2048)
    assert [r.row for r in rows] == [2, 3, 4, 5, 7]  # lines of the file (the header is line 1)
    assert [(r.input_length, r.output_length, r.hash_ids) for r in rows] == [
        (374, 44, ()), (396, 109, ()), (879, 3, ()), (91, 7, ()), (1024, 1, ()),
    ]  # fmt: skip
    trace = build_trace(rows, tokenizer, time_scale=2.0, salt=1)
    # in 100 ns ticks, exactly: the offsets, then the gaps (halved by time_scale 2)
    assert [round(t * 2 * 1e7) for t in trace.arrival_offsets_s] == [0, 11_000, 121_000, 131_001, 231_001]
    gaps = [b - a for a, b in zip(trace.arrival_offsets_s, trace.arrival_offsets_s[1:], strict=False)]
    assert [round(g * 2 * 1e7) for g in gaps] == [11_000, 110_000, 10_001, 100_000]
    assert trace.output_lens == (44, 109, 3, 7, 1) and trace.prompt_tokens == (374, 396, 879, 91, 1024)
    bad = [
        ("TIMESTAMP,ContextTokens\n", "row 1", "header"),
        (AZURE.replace("23:59:59.9926900", "yesterday"), "row 4", "'TIMESTAMP'"),
        (AZURE.replace("23:59:59.9926900", "23:59:59.9700000"), "row 4", "'TIMESTAMP' goes backwards"),
        (AZURE.replace(",879,3", ",879,0"), "row 4", "'GeneratedTokens'"),
        (AZURE.replace(",1024,1", ",2048,1"), "row 7", "longer than the model's context (2048)"),
    ]
    for text, row, field in bad:
        path.write_text(text, encoding="utf-8")
        with pytest.raises(TraceError) as caught:
            read_trace("azure", path, max_context=2048)
        assert f"azure:{path}: {row}:" in str(caught.value) and field in str(caught.value)


def test_hash_ids_above_2_to_the_32_stay_distinct(tmp_path, tokenizer) -> None:
    """dynamo PR #12046: a u32 cast made id 2**32 + 1 the same block as id 1."""
    rows = read_trace(
        "mooncake",
        write(
            tmp_path / "big.jsonl",
            [
                {**MOONCAKE[2], "timestamp": 1000 * i, "hash_ids": [h]}
                for i, h in enumerate((1, 2**32 + 1, 1))
            ],
        ),
    )
    assert [r.hash_ids for r in rows] == [(1,), (2**32 + 1,), (1,)]
    trace = build_trace(rows, tokenizer, salt=3)
    assert trace.prompts[0] == trace.prompts[2] != trace.prompts[1]
    assert [b[0][0] for b in trace.blocks] == ["h3:1", f"h3:{2**32 + 1}", "h3:1"]
    assert expected_cached_token_fraction(trace.blocks) == pytest.approx(100 / 300)  # only the 3rd


def test_num_requests_sends_the_first_rows_of_a_trace(tmp_path, tokenizer) -> None:
    from tasks.config import StreamConfig
    from tasks.workload.datasets import DatasetError
    from tasks.workload.stage import stage_workload

    spec = f"mooncake:{write(tmp_path / 't.jsonl', MOONCAKE)}"
    workload = stage_workload(StreamConfig(dataset=spec, num_requests=2, warmup=0), tokenizer, salt=5)
    assert workload.num_requests == 2 and workload.schedule_s == (0.0, 0.25)
    assert workload.output_lens == (5, 7) and workload.prompt_tokens == (600, 700)
    with pytest.raises(
        DatasetError, match=r"--num-requests: 4 requests asked .* which has 3 rows; give at most 3"
    ):
        stage_workload(StreamConfig(dataset=spec, num_requests=4), tokenizer, salt=5)


def test_a_trace_level_is_labelled_trace_not_rate_inf() -> None:
    from tasks.report.plots import level_rate_label

    assert level_rate_label(None, {"schedule_faithful": 1, "recorded_request_rate": 4.0}) == "trace"
    assert level_rate_label(None, {"schedule_faithful": None}) == "trace"
    assert level_rate_label(None, {"ttft_ms_p50": 3.0}) == "inf" and level_rate_label(2.0, None) == "2"


def test_late_sends_are_advised_by_what_the_level_shows() -> None:
    """A server that streams one response at a time is the limit: no "raise --max-concurrency"."""
    from tasks.stream.quality import schedule_advice
    from tasks.stream.records import RequestRecord

    def record(i, send_ms, ttft_ms, e2e_ms):
        return RequestRecord(
            f"l0-r{i}", send_ns=int(send_ms * 1e6), ttft_ms=ttft_ms, e2e_ms=e2e_ms, stream_close_ms=e2e_ms + 1
        )

    # 3 sent at once; each response starts streaming after the one before has ended
    serial = [record(0, 0, 10, 50), record(1, 1, 59, 99), record(2, 2, 108, 148)]
    advice = schedule_advice(serial, 4)
    assert "the server answered one request at a time" in advice and "up to 3 in flight" in advice
    assert "raise --max-concurrency" not in advice and "--time-scale below 1" in advice
    parallel = [record(i, i, 10, 50) for i in range(3)]  # the three stream together
    assert schedule_advice(parallel, 3).startswith("raise --max-concurrency")
    assert schedule_advice(parallel, 8).startswith("at most 3 of 8 slots were ever in use")
    one = [record(0, 0, 10, 50), record(1, 52, 10, 50)]
    assert "(--max-concurrency 1)" in schedule_advice(one, 1)
    # single-token answers show no streaming to compare: not called serial
    points = [record(i, i, 10 + 40 * i, 10 + 40 * i) for i in range(3)]
    assert schedule_advice(points, 3).startswith("raise --max-concurrency")


def test_the_advice_for_more_client_names_dask_workers_on_dask() -> None:
    """On Dask, --client-processes is refused: the advice names the workers instead."""
    from tasks.stream.quality import more_clients, schedule_advice
    from tasks.stream.records import RequestRecord

    on_dask = more_clients({"client_workers": [], "client_bound": 1})
    assert on_dask == "more Dask workers (--task-runner dask:N)"
    assert more_clients({"client_bound": 1}) == "more --client-processes"
    idle = [
        RequestRecord(f"l0-r{i}", send_ns=i * 10**8, ttft_ms=10, e2e_ms=50, stream_close_ms=51)
        for i in range(2)
    ]
    assert schedule_advice(idle, 8, on_dask).startswith(
        "at most 1 of 8 slots were ever in use, so the client was"
    )
    assert "more Dask workers (--task-runner dask:N)" in schedule_advice(idle, 8, on_dask)
    assert "--client-processes" not in schedule_advice(idle, 8, on_dask)


def test_a_schedule_of_hours_is_said_before_its_level_starts() -> None:
    """A trace in the wrong unit (1e15 between rows) or a mistyped rate would otherwise wait."""
    from tasks.stream.quality import long_schedule_message
    from tasks.stream.settings import LevelSettings

    def level(num_requests: int, **fields) -> LevelSettings:
        return LevelSettings(
            model="m", prompts=["p"], max_tokens=4, num_requests=num_requests, level=2, **fields
        )

    assert long_schedule_message(level(2, schedule_s=(0.0, 7200.0, 1e15))) == (
        "level 2 will take 2 hours: the trace's last request is sent 7200 s after the first; "
        "--duration-s ends a level sooner (check the trace's timestamp unit, or the rate)"
    )
    slow = long_schedule_message(level(3, request_rate=1e-9))
    assert "will take 5.56e+05 hours: at the rate, the last request is sent 2e+09 s" in slow
    assert long_schedule_message(level(3601, request_rate=1.0)) is None  # exactly the hour
    assert long_schedule_message(level(3602, request_rate=1.0)) is not None
    assert long_schedule_message(level(3, request_rate=1e-9, duration_s=5.0)) is None  # ended by it
    assert long_schedule_message(level(3)) is None  # all at once: no schedule


def test_a_level_with_failed_requests_says_how_many_of_which_and_the_first() -> None:
    """Its latency figures are over the successes only: a server that died mid-level leaves few."""
    from tasks.stream.quality import failures_message
    from tasks.stream.records import RequestRecord

    ok = RequestRecord("l1-r0", ttft_ms=10.0, e2e_ms=50.0)
    warm = RequestRecord("l1-w0", warmup=True, error_class="connection", error_message="down")
    cut = RequestRecord("l1-r1", error_class="stream_broken", error_message="the stream was cut")
    refused = [
        RequestRecord(f"l1-r{i}", error_class="connection", error_message=f"refused {i}") for i in (2, 3)
    ]
    assert failures_message(1, [warm, ok, cut, *refused]) == (
        "level 1: 3 of 4 requests failed (connection 2, stream_broken 1); its latency figures are "
        "over the 1 that succeeded; first error (stream_broken): the stream was cut"
    )
    assert failures_message(1, [warm, ok]) is None  # a failed warm-up is not the level's


def test_think_times_fixed_or_drawn_with_their_mean_and_replayed_by_the_seed() -> None:
    from tasks.workload.conversation import think_times_s

    assert think_times_s(1.5, "fixed", 3, seed=0) == (1.5, 1.5, 1.5)
    drawn = think_times_s(2.0, "exponential", 20_000, seed=4)
    assert (
        drawn
        == think_times_s(2.0, "exponential", 20_000, seed=4)
        != think_times_s(2.0, "exponential", 20_000, seed=5)
    )
    mean = sum(drawn) / len(drawn)
    assert abs(mean - 2.0) < 0.06  # 4 standard errors of the mean (2 / sqrt(20000) = 0.014)
    assert min(drawn) >= 0 and sum(1 for t in drawn if t > 2.0) / len(drawn) == pytest.approx(
        math.exp(-1), abs=0.02
    )
    with pytest.raises(ValueError):
        think_times_s(-1.0, "fixed", 1, seed=0)


def test_synthetic_sessions_have_their_turns_of_the_asked_length() -> None:
    from tasks.workload.conversation import synthetic_sessions, with_think_times

    tokenizer = load_tokenizer("gguf:default")
    sessions = with_think_times(synthetic_sessions(tokenizer, 3, 4, 16, seed=1), 0.5, "fixed", seed=0)
    assert len(sessions) == 3 and all(len(s.turns) == 4 and s.think_s == (0.5,) * 3 for s in sessions)
    texts = [t for s in sessions for t in s.turns]
    assert len(set(texts)) == 12  # nothing repeats: only the history is shared
    assert all(abs(len(tokenizer.encode(t, add_special_tokens=False)) - 16) <= 1 for t in texts)
