"""The per-part breakdown (tasks/profile/breakdown.py) on real models: the parts and "other"
add up to the profiled step, every Llama part is found (SmolLM2 and a 2-layer random-weight
preset), an unknown architecture (GPT-2) names what it cannot map, a model without findable
decoder layers fails with one line, and a failed breakdown keeps the point's timing."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tasks.models.sources import load_model
from tasks.profile.breakdown import (
    PARTS,
    DecoderLayersNotFound,
    check_decoder_layers,
    find_decoder_layers,
    profile_breakdown,
)
from tasks.profile.breakdown_report import analysis_metrics, breakdown_rows, write_analysis
from tasks.profile.measure import make_prompt_ids, profile_point
from tasks.profile.roofline import analyse_point

LLAMA_PARTS = [p for p in PARTS if p != "qkv_proj"]


def _check_sums(breakdown) -> None:
    for phase in (breakdown.prefill, breakdown.decode):
        parts = dict(phase.parts_ms)
        total = sum(parts.values())
        assert phase.step_ms > 0
        assert abs(total - phase.step_ms) <= 0.10 * phase.step_ms  # nothing dropped
        # parts are exclusive: no time counted twice, so "other" is never negative
        assert parts["other"] >= -0.01 * phase.step_ms
        assert list(parts)[-1] == "other"


@pytest.mark.parametrize("spec,layers", [("arch:smollm2-135m", 2), ("gguf:default", None)])
def test_parts_add_up_on_llama(spec, layers, tmp_path):
    model, tokenizer = load_model(spec, "float32", "cpu", num_layers=layers)
    ids = make_prompt_ids(tokenizer, 16)
    trace = tmp_path / "trace.json"
    result = profile_breakdown(model, ids, decode_steps=2, trace_path=str(trace))
    assert result.error is None and result.clock == "cpu_wall"
    assert result.decoder_layers == "model.layers" and result.unmapped_parts == ()
    assert result.decode.steps == 2 and result.prefill.steps == 1
    for phase in (result.prefill, result.decode):
        assert [p for p, _ in phase.parts_ms] == [*LLAMA_PARTS, "other"]
        assert all(ms > 0 for p, ms in phase.parts_ms if p != "other")
    _check_sums(result)
    # the Chrome trace holds the labelled step ranges
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"infermeter::step::prefill", "infermeter::step::decode:1", "infermeter::lm_head"} <= names


def test_unknown_architecture_names_what_it_cannot_map():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)).eval()
    result = profile_breakdown(model, torch.arange(1, 17)[None], decode_steps=2)
    assert result.decoder_layers == "transformer.h"
    # GPT-2: fused c_attn (qkv_proj), learned positions (no rotary), the output projection is
    # c_proj (a name shared with the MLP's, so not taken for o_proj)
    assert result.unmapped_parts == ("rotary", "o_proj")
    parts = dict(result.decode.parts_ms)
    assert parts["qkv_proj"] > 0 and parts["mlp"] > 0 and "q_proj" not in parts
    _check_sums(result)


def test_no_decoder_layers_is_one_line():
    model, _ = load_model("arch:smollm2-135m", "float32", "cpu", num_layers=2)
    model.config.num_hidden_layers = 5  # no ModuleList of 5 blocks in this model
    with pytest.raises(DecoderLayersNotFound) as info:
        find_decoder_layers(model)
    message = str(info.value)
    assert "\n" not in message and "nn.ModuleList of config.num_hidden_layers (5)" in message
    assert message.startswith("--breakdown:")
    assert check_decoder_layers("arch:smollm2-135m", 2) == "model.layers"  # meta device, no weights


def test_failed_breakdown_keeps_the_timing(tmp_path):
    model, tokenizer = load_model("arch:smollm2-135m", "float32", "cpu", num_layers=2)
    ids = make_prompt_ids(tokenizer, 16)
    point = profile_point(
        model, prompt_ids=ids, batch_size=1, max_new_tokens=2, repeats=1, warmup=0, device="cpu"
    )
    good = analyse_point(model, ids, point, decode_steps=2)
    row = {**point.to_dict(), **good.to_dict()}
    assert row["breakdown"]["failed"] is False and row["roofline"]["failed"] is False
    assert row["breakdown"]["label"] == "profiled runs, apart from the timed repeats"
    figures = analysis_metrics(row)
    assert figures["breakdown_decode_lm_head_ms"] > 0 and figures["decode_memory_bound"] in (0, 1)
    assert len(breakdown_rows(row)) == 2 * (len(LLAMA_PARTS) + 1)
    written = {p.name for p in write_analysis(row, tmp_path)}
    assert written == {"breakdown_shares.png", "roofline.png"}  # no trace was asked for

    model.config.num_hidden_layers = 5  # the breakdown cannot find the layers now
    bad = analyse_point(model, ids, point, decode_steps=2).to_dict()
    assert bad["breakdown"]["failed"] and bad["breakdown"]["error"].startswith("DecoderLayersNotFound: ")
    assert bad["roofline"]["failed"]
    assert point.prefill_ms > 0 and len(point.decode_ms) == 2  # the measurement stands


def test_profile_breakdown_lands_in_mlflow_with_its_table_plots_and_trace(tmp_path):
    """``infermeter profile --breakdown`` as a user runs it: the point's MLflow run holds the
    per-part table, the stacked-share and roofline plots and the Chrome trace (issue 12)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "INFERMETER_WORK_DIR": str(tmp_path / "work"),
    }
    command = [str(Path(sys.executable).parent / "infermeter"), "profile", "--model", "arch:smollm2-135m"]
    command += ["--num-layers", "2", "--prompt-lengths", "16", "--max-new-tokens", "2", "--repeats", "1"]
    result = subprocess.run(
        [*command, "--breakdown", "--json", str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "memory-bound" in result.stdout or "compute-bound" in result.stdout
    [point] = json.loads(out.read_text())["points"]
    assert point["breakdown"] and point["roofline"]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.stage = 'profile_point'"
    )
    assert len(runs) == 1
    listed = {a.path for a in client.list_artifacts(runs[0].info.run_id, "breakdown")}
    assert {
        "breakdown/breakdown_table.json",
        "breakdown/breakdown_shares.png",
        "breakdown/roofline.png",
        "breakdown/trace.json",
    } <= listed, listed
