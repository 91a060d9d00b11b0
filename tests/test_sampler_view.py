"""The sampler's view (tasks/sweep/distribution.py) on the packaged SmolLM2: top-20 next tokens
per temperature, the nucleus top_p keeps, entropy per step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks.models.sources import load_model
from tasks.sweep.distribution import entropy_bits, next_token_distributions, nucleus
from tasks.sweep.local import chat_input_ids


def _full(model, ids) -> list[float]:
    with torch.inference_mode():
        return torch.softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1).tolist()


def test_nucleus_by_hand():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    assert nucleus(probs, 0.5) == (1, pytest.approx(0.5))
    assert nucleus(probs, 0.9) == (3, pytest.approx(0.95))
    assert nucleus(probs, 1.0)[0] == 4
    assert entropy_bits([0.5, 0.5]) == 1.0


def test_distributions_on_smollm2():
    model, tokenizer = load_model("gguf:default")
    ids = torch.tensor([tokenizer.encode("The capital of France is", add_special_tokens=False)])
    rows = next_token_distributions(
        model, tokenizer, ids, steps=2, temperatures=[0.0, 0.3, 1.0, 1.5], top_ps=[0.9]
    )
    assert [(r.step, r.temperature) for r in rows] == [(s, t) for s in (0, 1) for t in (0.0, 0.3, 1.0, 1.5)]
    step0 = {r.temperature: r for r in rows if r.step == 0}
    # greedy: one token holds all the mass; entropy 0; its nucleus is that token
    assert step0[0.0].top[0][2] == 1.0 and step0[0.0].entropy_bits == 0.0
    assert step0[0.0].nucleus == ((0.9, 1, 1.0),)
    # the same argmax at every temperature; a hotter temperature flattens the distribution
    assert len({r.top[0][0] for r in step0.values()}) == 1
    assert step0[0.3].entropy_bits < step0[1.0].entropy_bits < step0[1.5].entropy_bits
    assert step0[0.3].nucleus[0][1] <= step0[1.0].nucleus[0][1] <= step0[1.5].nucleus[0][1]
    top = step0[1.0].top
    assert len(top) == 20 and all(a[2] >= b[2] for a, b in zip(top, top[1:]))
    assert top[0][1] == tokenizer.decode([top[0][0]])
    assert math.isclose(step0[1.0].entropy_bits, entropy_bits(_full(model, ids)), rel_tol=1e-4)
    assert step0[1.0].to_dict()["top"][0].keys() == {"id", "piece", "probability"}


# --- through the CLI: `infermeter sweep --target local --distribution` (issue 12) -----------

BIN = Path(sys.executable).parent / "infermeter"
_ARGS = [
    "sweep",
    "--target",
    "local",
    "--distribution",
    "--distribution-steps",
    "2",
    "--temperature",
    "0.5,1.5",
    "--top-p",
    "0.9",
    "--samples",
    "1",
    "--max-tokens",
    "2",
    "--prompt",
    "Name a fruit.",
]


def _cli(tmp_path, *extra):
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "INFERMETER_WORK_DIR": str(tmp_path / "w"),
    }
    return subprocess.run(
        [str(BIN), *_ARGS, "--json", str(tmp_path / "out.json"), *extra],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=Path(__file__).parents[1],
    )


@pytest.mark.integration
def test_cli_distribution_json_and_tables(tmp_path):
    result = _cli(tmp_path, "--no-track")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert set(out) == {"points", "headline", "distribution", "mlflow_run_id"}
    rows = out["distribution"]
    assert [(r["step"], r["temperature"]) for r in rows] == [(0, 0.5), (0, 1.5), (1, 0.5), (1, 1.5)]
    for r in rows:
        assert len(r["top"]) == 20 and [n["top_p"] for n in r["nucleus"]] == [0.9]
        assert r["nucleus"][0]["mass"] >= 0.9
    by = {(r["step"], r["temperature"]): r for r in rows}
    for step in (0, 1):  # hotter: flatter, a wider nucleus, the same most likely token
        cold, hot = by[(step, 0.5)], by[(step, 1.5)]
        assert cold["entropy_bits"] < hot["entropy_bits"]
        assert cold["nucleus"][0]["tokens"] <= hot["nucleus"][0]["tokens"]
        assert cold["top"][0]["id"] == hot["top"][0]["id"] == cold["chosen_id"]
    # the same figures as the measurement module on the prompt the sweep sends (chat template)
    model, tokenizer = load_model("gguf:default")
    ids = chat_input_ids(tokenizer, "Name a fruit.")
    direct = next_token_distributions(model, tokenizer, ids, steps=1, temperatures=[1.5], top_ps=[0.9])[0]
    assert by[(0, 1.5)]["top"][0]["id"] == direct.top[0][0]
    assert by[(0, 1.5)]["top"][0]["probability"] == pytest.approx(direct.top[0][2], rel=1e-4)
    assert by[(0, 1.5)]["entropy_bits"] == pytest.approx(direct.entropy_bits, rel=1e-4)
    assert "sampler's view, T=0.5" in result.stdout and "sampler's view, T=1.5" in result.stdout
    assert f"({direct.top[0][0]})" in result.stdout and "top_p 0.9" in result.stdout


@pytest.mark.integration
def test_cli_distribution_tracked_in_mlflow(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    result = _cli(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_store[1])
    parent = client.get_run(out["mlflow_run_id"])
    stages = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.stage = 'sweep'",
    )
    assert len(stages) == 1
    stage = stages[0].info.run_id
    assert "sampler_view.json" in {a.path for a in client.list_artifacts(stage)}
    assert "plots/sampler_view.png" in {a.path for a in client.list_artifacts(stage, "plots")}
    table = json.loads(Path(client.download_artifacts(stage, "sampler_view.json", str(tmp_path))).read_text())
    assert len(table["data"]) == 2 * 2 * 20 and "kept_top_p_0.9" in table["columns"]
    for t in ("0.5", "1.5"):
        history = client.get_metric_history(stage, f"next_token_entropy_bits_t{t}")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == [0, 1]
    want = {(r["step"], r["temperature"]): r["entropy_bits"] for r in out["distribution"]}
    hot = sorted(client.get_metric_history(stage, "next_token_entropy_bits_t1.5"), key=lambda m: m.step)
    assert [m.value for m in hot] == pytest.approx([want[(0, 1.5)], want[(1, 1.5)]])


def test_distribution_flag_needs_local_target():
    result = subprocess.run(
        [str(BIN), "sweep", "--distribution", "--no-track"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--distribution needs --target local" in lines[0], lines
