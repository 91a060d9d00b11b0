"""`infermeter profile` as a user runs it: exit 2 on bad input, a tracked sweep with its MLflow
tree and plots, failed points recorded, and the Llama-2-7B shape in bfloat16 when it fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

BIN = Path(sys.executable).parent / "infermeter"


def _run(args, tmp_path, env=None, timeout=600):
    return subprocess.run(
        [str(BIN), "profile", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            **os.environ,
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "INFERMETER_WORK_DIR": str(tmp_path / "work"),
            **(env or {}),
        },
    )


def _one_line_exit_2(result, *needles):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--model", "arch:llama-9b"], ["llama-9b", "smollm2-135m", "llama-2-7b", "llama-3-8b"]),
        (["--model", "gguf:/no/such.gguf"], ["--model", "not found"]),
        (["--model", "hf:/"], ["--model", "cannot read its config"]),
        (["--model", "arch:smollm2-135m", "--dtypes", "float8"], ["dtypes"]),
        (["--model", "arch:llama-2-7b", "--prompt-lengths", "64,5000"], ["5000", "context of 4096"]),
        (["--model", "arch:smollm2-135m", "--prefill-chunk-sizes", "-4"], ["--prefill-chunk-sizes"]),
        (["--model", "arch:smollm2-135m", "--device", "tpu"], ["--device", "auto, cpu, cuda"]),
        (
            ["--model", "arch:llama-2-7b", "--prompt-lengths", "4000", "--max-new-tokens", "8,200"],
            ["max_new_tokens 200", "context of 4096"],
        ),  # the largest value is checked
        (["--model", "arch:smollm2-135m", "--max-new-tokens", "4,0"], ["--max-new-tokens"]),
        (["--model", "hf:/no/such/folder"], ["--model", "no such folder"]),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, needles):
    _one_line_exit_2(_run(args, tmp_path, timeout=120), *needles)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_gpu_exits_2(tmp_path):
    _one_line_exit_2(_run(["--model", "arch:smollm2-135m", "--device", "cuda"], tmp_path), "cuda")


def test_tracked_sweep_writes_json_child_runs_and_plots(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out.json"
    result = _run(
        [
            "--model",
            "arch:smollm2-135m",
            "--num-layers",
            "1",
            "--prompt-lengths",
            "16",
            "--batch-sizes",
            "2",
            "--dtypes",
            "float32,bfloat16",
            "--prefill-chunk-sizes",
            "0,8",
            "--max-new-tokens",
            "2,3",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--json",
            str(out),
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"points", "mlflow_run_id"}
    points = data["points"]
    assert len(points) == 2 * 2 * 2 and not any(p["failed"] for p in points)
    assert {(p["dtype"], p["prefill_chunk_size"]) for p in points} == {
        ("float32", 0),
        ("float32", 8),
        ("bfloat16", 0),
        ("bfloat16", 8),
    }
    assert sorted(p["max_new_tokens"] for p in points) == [2, 2, 2, 2, 3, 3, 3, 3]
    for p in points:  # every point keeps its own max_new_tokens
        assert p["kv_cache_bytes"] == p["kv_cache_bytes_formula"]
        assert p["kv_cache_positions"] == 16 + p["max_new_tokens"] == 16 + len(p["decode_ms"])
        assert p["random_weights"] is True and p["generated_text"] is None
    header = next(line for line in result.stdout.splitlines() if "prefill" in line and "dtype" in line)
    assert header.split()[:5] == ["N", "B", "dtype", "chunk", "T"]  # T shown: more than one value
    assert "T=3" in result.stderr  # the progress bar's point label
    assert "8/8" in result.stderr  # the progress bar reached the end

    client = MlflowClient(tracking_uri=mlflow_store[1])
    parent = client.get_run(data["mlflow_run_id"])
    assert parent.data.tags["flow"] == "profile" and parent.data.tags["random_weights"] == "True"
    assert parent.data.metrics["kv_cache_bytes"] == points[0]["kv_cache_bytes"]
    experiment = parent.info.experiment_id
    [stage] = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert stage.data.tags["stage"] == "profile"
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{stage.info.run_id}'")
    assert len(children) == 8
    assert {c.data.params["prefill_chunk_size"] for c in children} == {"0", "8"}
    assert {c.data.params["max_new_tokens"] for c in children} == {"2", "3"}
    assert {c.data.tags["child_process"] for c in children} == {"False"}  # all fit in-process
    assert {c.data.tags["mlflow.runName"] for c in children} >= {
        "profile N=16 B=2 float32 T=2",
        "profile N=16 B=2 bfloat16 chunk=8 T=3",
    }
    plots = {a.path for a in client.list_artifacts(stage.info.run_id, "plots")}
    assert plots == {
        "plots/prefill_ms_vs_prompt_length.png",
        "plots/decode_ms_vs_context_position.png",
        "plots/memory_vs_sequence_length.png",
        "plots/ttft_vs_prefill_chunk_size.png",
        "plots/peak_memory_vs_prefill_chunk_size.png",
    }


def test_a_point_over_the_memory_exits_1_and_keeps_the_others(tmp_path):
    """Llama-3-8B in float32 needs about 32 GB: refused before allocating; bfloat16 of a
    1-layer slice runs."""
    out = tmp_path / "out.json"
    result = _run(
        [
            "--model",
            "arch:llama-3-8b",
            "--prompt-lengths",
            "8",
            "--dtypes",
            "float32",
            "--max-new-tokens",
            "1",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-track",
            "--json",
            str(out),
        ],
        tmp_path,
    )
    total = psutil.virtual_memory().total
    if total > 40 * 2**30:
        pytest.skip("this machine has room for Llama-3-8B in float32")
    assert result.returncode == 1, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["mlflow_run_id"] is None
    [point] = data["points"]
    assert point["failed"] and point["error"].startswith(
        "MemoryNeedError: model arch:llama-3-8b in float32: needs about"
    )
    assert "point N=8 B=1 float32 failed: MemoryNeedError" in result.stderr
    # untracked too, each finished point was journaled as it finished
    [journal] = (tmp_path / "work").glob("*-profile-*/profile_points.jsonl")
    [kept] = [json.loads(line) for line in journal.read_text().splitlines()]
    assert kept["failed"] and kept["error"] == point["error"]


LLAMA2_7B_BF16_NEED = 14 * 2**30  # 13.5 GB of weights, plus KV, activations, the runtime


@pytest.mark.skipif(
    os.environ.get("INFERMETER_TEST_7B") != "1",
    reason="about 4 minutes on 2 cores: set INFERMETER_TEST_7B=1 to run it",
)
@pytest.mark.skipif(
    psutil.virtual_memory().available < LLAMA2_7B_BF16_NEED + 2 * 2**30,
    reason="Llama-2-7B in bfloat16 needs about 14 GiB free",
)
def test_llama_2_7b_shape_in_bfloat16(tmp_path):
    out = tmp_path / "out.json"
    result = _run(
        [
            "--model",
            "arch:llama-2-7b",
            "--prompt-lengths",
            "64",
            "--max-new-tokens",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-track",
            "--json",
            str(out),
        ],
        tmp_path,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [point] = json.loads(out.read_text())["points"]
    assert point["dtype"] == "bfloat16"  # the preset's default
    assert point["kv_cache_bytes"] == point["kv_cache_bytes_formula"] == 66 * 2 * 32 * 32 * 128 * 2
    assert point["kv_seed_formula_ratio"] == 1.0  # MHA: the seed's form is exact
    assert abs(point["weights_bytes"] - 6_738_415_616 * 2) < 1024
    assert point["last_hidden_state_shape"] == [1, 64, 4096]
