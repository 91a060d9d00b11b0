"""Recorded traces (tasks/workload/trace.py): checked before any request, prompts built from
token ids so that shared hash blocks are the same tokens, and the recorded schedule kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tasks.cache import expected_cached_token_fraction
from tasks.models import load_tokenizer
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
        ([MOONCAKE[0], {**MOONCAKE[1], "input_length": 9000}], 2, "longer than the model's context (8192)"),
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
