"""Workloads from files (``--dataset sharegpt:PATH`` / ``jsonl:PATH``): parsing, vLLM's ShareGPT
rules, seeded sampling, per-request output lengths sent with ignore_eos, and bad files (exit 2
naming the file and the first bad row). The files are written by the tests themselves; the
tokenizer is the packaged model's own (gguf:default), and the command runs against the
ground-truth instrument, which records every request body."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.config import StreamConfig
from tasks.models.sources import load_tokenizer
from tasks.workload.datasets import DatasetError, build_workload, read_rows
from tasks.workload.stage import stage_workload

try:
    from tests import groundtruth_server as gt
except ImportError:
    import groundtruth_server as gt

BIN = Path(sys.executable).parent / "infermeter"

CONVERSATIONS = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "Explain in two sentences what a KV cache is, please."},
            {
                "from": "gpt",
                "value": "It stores the keys and values of past tokens so decode does not recompute them.",
            },
            {"from": "human", "value": "And why does it grow?"},
        ],
    },
    {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn first"}]},  # skipped
    {
        "id": "c",
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "user", "value": "Name three prime numbers and say why they are prime."},
            {"from": "assistant", "value": "Two, three and five: each has no divisor but one and itself."},
        ],
    },
    {
        "id": "d",
        "conversations": [{"from": "human", "value": "Hi there you"}, {"from": "gpt", "value": "Yo"}],
    },
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("gguf:default")


def _write(path: Path, data) -> Path:
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_sharegpt_first_human_turn_and_model_turn_length(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "sg.json", CONVERSATIONS)
    workload = build_workload(f"sharegpt:{path}", tokenizer, count=10, seed=0)
    # 'b' has no human turn, 'd' has a 1-token reply (< vLLM's minimum of 4): two rows remain
    by_prompt = dict(zip(workload.prompts, workload.output_lens, strict=True))
    first, third = CONVERSATIONS[0]["conversations"], CONVERSATIONS[2]["conversations"]
    assert by_prompt == {
        first[0]["value"]: _tokens(tokenizer, first[1]["value"]),  # the first model turn after it
        third[1]["value"]: _tokens(tokenizer, third[2]["value"]),  # 'user' / 'assistant' count too
    }
    assert all(n is None for n in workload.prompt_tokens)  # left to the server's usage


def test_sampling_follows_the_seed(tmp_path: Path, tokenizer) -> None:
    rows = [{"prompt": f"question number {i}", "output_len": 5 + i} for i in range(20)]
    path = _write(tmp_path / "w.jsonl", "\n".join(json.dumps(r) for r in rows))
    a = build_workload(f"jsonl:{path}", tokenizer, count=6, seed=1)
    b = build_workload(f"jsonl:{path}", tokenizer, count=6, seed=1)
    c = build_workload(f"jsonl:{path}", tokenizer, count=6, seed=2)
    assert a == b and a.prompts != c.prompts and len(a.prompts) == 6
    for prompt, length in zip(a.prompts, a.output_lens, strict=True):
        assert length == 5 + int(prompt.rsplit(" ", 1)[1])  # each row keeps its own length


def test_jsonl_input_len_rows_are_synthetic(tmp_path: Path, tokenizer) -> None:
    path = _write(
        tmp_path / "w.jsonl",
        '{"input_len": 32, "output_len": 7}\n\n{"prompt": "plain text prompt"}\n',
    )
    workload = build_workload(f"jsonl:{path}", tokenizer, count=2, seed=0)
    rows = dict(
        zip(workload.prompts, zip(workload.prompt_tokens, workload.output_lens, strict=True), strict=True)
    )
    assert rows["plain text prompt"] == (None, None)
    (synthetic,) = [p for p in rows if p != "plain text prompt"]
    assert rows[synthetic][0] == _tokens(tokenizer, synthetic) and abs(rows[synthetic][0] - 32) <= 2
    assert rows[synthetic][1] == 7
    workload = stage_workload(
        StreamConfig(dataset=f"jsonl:{path}", num_requests=1, warmup=1), tokenizer, salt=0
    )
    assert len(workload.prompts) == 2 and workload.prompt_tokens is not None
    assert sorted(workload.output_lens, key=str) == [7, None]


@pytest.mark.parametrize(
    ("kind", "content", "expected"),
    [
        ("sharegpt", {"not": "a list"}, "JSON list"),
        ("sharegpt", [CONVERSATIONS[0], {"conversation": []}], "row 2: no 'conversations' list"),
        ("sharegpt", [{"conversations": [{"from": "human", "value": 3}]}], "row 1: a turn is not"),
        ("sharegpt", [CONVERSATIONS[1]], "no usable conversation: row 1"),
        ("sharegpt", "{broken", "not valid JSON"),
        (
            "jsonl",
            '{"prompt": "ok"}\n{"output_len": 3}\n',
            "line 2: give exactly one of 'prompt' and 'input_len'",
        ),
        ("jsonl", '{"prompt": "ok", "output_len": 0}\n', "line 1: 'output_len' must be an integer >= 1"),
        ("jsonl", '{"prompt": "ok"}\n[1, 2]\n', "line 2: not a JSON object"),
        ("jsonl", '{"prompt": "ok"}\nnot json\n', "line 2: not valid JSON"),
        ("jsonl", "\n\n", "holds no row"),
    ],
)
def test_bad_files_name_the_file_and_first_bad_row(tmp_path: Path, kind, content, expected) -> None:
    path = _write(tmp_path / f"bad.{kind}", content)
    with pytest.raises(DatasetError) as info:
        read_rows(f"{kind}:{path}")
    assert expected in str(info.value) and str(path) in str(info.value)


def test_bad_specs() -> None:
    with pytest.raises(DatasetError, match="KIND:PATH"):
        read_rows("csv:/x")
    with pytest.raises(DatasetError, match="file not found"):
        read_rows("jsonl:/no/such/file.jsonl")


def test_length_filter_leaving_nothing_names_the_first_row(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "short.json", [CONVERSATIONS[3]])
    with pytest.raises(DatasetError, match=r"first: row 1: prompt 3 / output 2 tokens, fewer than 4"):
        build_workload(f"sharegpt:{path}", tokenizer, count=3)


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


def test_stream_command_drives_a_sharegpt_file(server, tmp_path: Path, tokenizer) -> None:
    """Each request carries its row's prompt, max_tokens = its model turn's length, ignore_eos."""
    path = _write(tmp_path / "sg.json", CONVERSATIONS)
    out = tmp_path / "out.json"
    server.reset()
    base = [
        str(BIN),
        "stream",
        "--base-url",
        server.base_url,
        "--model",
        "single",
        "--tokenizer",
        "gguf:default",
    ]
    proc = subprocess.run(
        [*base, "--dataset", f"sharegpt:{path}", "--max-concurrency", "1", "--num-requests", "3"]
        + ["--warmup", "1", "--seed", "3", "--no-track", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(json.loads(out.read_text())) == {"levels", "mlflow_run_id"}  # no new --json keys
    expected = {
        CONVERSATIONS[0]["conversations"][0]["value"]: _tokens(
            tokenizer, CONVERSATIONS[0]["conversations"][1]["value"]
        ),
        CONVERSATIONS[2]["conversations"][1]["value"]: _tokens(
            tokenizer, CONVERSATIONS[2]["conversations"][2]["value"]
        ),
    }
    bodies = [
        b
        for b in server.stats()["requests"]
        if b["model"] == "single" and b["messages"][0]["content"] != "ping"
    ]
    assert len(bodies) == 4  # warm-up + 3 measured
    for body in bodies:
        prompt = body["messages"][0]["content"]
        assert body["max_tokens"] == body["max_completion_tokens"] == expected[prompt]
        assert body["ignore_eos"] is True

    bad = _write(tmp_path / "bad.json", [CONVERSATIONS[0], {"conversation": []}])
    proc = subprocess.run(
        [*base, "--dataset", f"sharegpt:{bad}", "--no-track"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and str(bad) in proc.stderr and "row 2" in proc.stderr
    # every conversation fails vLLM's length filter (fewer than 4 tokens each way): exit 2
    # before the run, naming the file and the first row, like a wrong shape
    short = _write(
        tmp_path / "short.json",
        [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}] * 2,
    )
    proc = subprocess.run(
        [*base, "--dataset", f"sharegpt:{short}", "--no-track"], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert str(short) in lines[0] and "row 1" in lines[0] and "length filter" in lines[0]
    proc = subprocess.run(
        [*base, "--dataset", f"jsonl:{bad}", "--prompt", "x", "--no-track"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--dataset" in proc.stderr


def test_output_lengths_follow_their_prompts_across_client_processes(server, tmp_path: Path) -> None:
    """With 2 client processes each request still carries its own row's output length (the
    processes continue after the warm-up's prompts: the lengths must rotate with them)."""
    rows = [{"prompt": f"row {i} says hello", "output_len": 5 + i} for i in range(6)]
    path = _write(tmp_path / "rows.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    server.reset()
    command = [str(BIN), "stream", "--base-url", server.base_url, "--model", "single"]
    command += ["--tokenizer", "gguf:default", "--dataset", f"jsonl:{path}", "--max-concurrency", "2"]
    command += ["--client-processes", "2", "--num-requests", "4", "--warmup", "1", "--no-track"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wanted = {r["prompt"]: r["output_len"] for r in rows}
    bodies = [b for b in server.stats()["requests"] if b["messages"][0]["content"] in wanted]
    assert len(bodies) == 5  # warm-up + 4 measured
    for body in bodies:
        assert body["max_tokens"] == wanted[body["messages"][0]["content"]], body
