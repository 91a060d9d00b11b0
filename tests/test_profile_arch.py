"""arch: model sources, the memory check, chunked prefill and the profile sweep.

KV bytes are checked against the GQA-aware formula exactly: for the real SmolLM2 (gguf:default)
and for slices (the first layers) of the random-weight presets, which keep every per-layer
shape, so the full model's figure is the slice's x (layers / slice layers).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tasks.memory.formula import (
    MemoryNeedError,
    check_memory,
    estimate_point_memory,
    kv_cache_bytes_formula,
    kv_cache_bytes_seed_formula,
    kv_geometry,
)
from tasks.models.arch import ARCH_PRESETS, parameter_count
from tasks.models.sources import (
    ModelSourceError,
    default_dtype,
    load_model,
    load_tokenizer,
    model_config,
    resolve,
)
from tasks.profile.grid import ProfilePoint, check_request, profile_points
from tasks.profile.measure import make_prompt_ids
from tasks.profile.phases import greedy, prefill
from tasks.profile.plots import write_profile_plots
from tasks.profile.runner import run_sweep

GIB = 2**30


# ---------------------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "name,params,geometry,hidden,heads,dtype",
    [
        ("smollm2-135m", 134_515_008, (30, 3, 64), 576, 9, "float32"),
        ("llama-2-7b", 6_738_415_616, (32, 32, 128), 4096, 32, "bfloat16"),
        ("llama-3-8b", 8_030_261_248, (32, 8, 128), 4096, 32, "bfloat16"),
    ],
)
def test_presets_have_the_public_shapes(name, params, geometry, hidden, heads, dtype):
    config = model_config(f"arch:{name}")
    assert parameter_count(config) == params  # the published parameter counts
    assert kv_geometry(config) == geometry
    assert (config.hidden_size, config.num_attention_heads) == (hidden, heads)
    assert default_dtype(f"arch:{name}") == dtype
    source = resolve(f"arch:{name}")
    assert source.kind == "arch" and source.random_weights


def test_seed_2_gib_figure_and_the_gqa_ratio():
    # the seed: Llama-2-7B shape, batch 1, 4096 tokens, fp16 -> 2 GiB of KV cache
    layers, kv_heads, head_dim = kv_geometry(model_config("arch:llama-2-7b"))
    assert kv_cache_bytes_formula(1, 4096, layers, kv_heads, head_dim, 2) == 2 * GIB
    assert kv_cache_bytes_seed_formula(1, 4096, layers, 4096, 2) == 2 * GIB  # MHA: forms agree
    # Llama-3-8B (GQA 32:8): a quarter of that; the seed's hidden_size form is 4x too large
    layers, kv_heads, head_dim = kv_geometry(model_config("arch:llama-3-8b"))
    assert kv_cache_bytes_formula(1, 4096, layers, kv_heads, head_dim, 2) == GIB // 2
    assert kv_cache_bytes_seed_formula(1, 4096, layers, 4096, 2) == 2 * GIB


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ModelSourceError) as info:
        resolve("arch:llama-9b")
    message = str(info.value)
    assert "llama-9b" in message and all(name in message for name in ARCH_PRESETS)
    assert "\n" not in message
    with pytest.raises(ModelSourceError):
        resolve("gguf:/no/such/file.gguf")
    with pytest.raises(ModelSourceError):
        resolve("nonsense")


def test_arch_tokenizer_makes_ids_inside_the_vocabulary():
    tokenizer = load_tokenizer("arch:llama-2-7b")
    ids = make_prompt_ids(tokenizer, 300)
    assert ids.shape == (1, 300) and int(ids.max()) < 32000 and int(ids.min()) >= 0
    assert not hasattr(tokenizer, "decode")  # random weights never report text


# ---------------------------------------------------------------------------- slices measured


@pytest.mark.parametrize(
    "name,layers,prompt",
    [
        ("llama-2-7b", 2, 24),
        ("llama-3-8b", 1, 24),
        ("smollm2-135m", 3, 40),
    ],
)
def test_preset_slice_kv_bytes_equal_the_formula_per_layer(name, layers, prompt):
    spec = f"arch:{name}"
    steps, batch = 2, 2
    [row] = [
        r.to_dict()
        for r in run_sweep(
            spec,
            [ProfilePoint(prompt, batch, default_dtype(spec))],
            max_new_tokens=steps,
            repeats=1,
            warmup=0,
            device="cpu",
            num_layers=layers,
        )
    ]
    assert not row["failed"], row["error"]
    full = model_config(spec)
    full_layers, kv_heads, head_dim = kv_geometry(full)
    elem = 2 if default_dtype(spec) == "bfloat16" else 4
    per_layer = kv_cache_bytes_formula(batch, prompt + steps, 1, kv_heads, head_dim, elem)
    assert row["kv_cache_bytes"] == row["kv_cache_bytes_formula"] == layers * per_layer
    assert row["kv_cache_bytes_after_prefill"] == kv_cache_bytes_formula(
        batch, prompt, layers, kv_heads, head_dim, elem
    )
    # the whole model's KV cache is the slice's, scaled by its layer count
    assert per_layer * full_layers == kv_cache_bytes_formula(
        batch, prompt + steps, full_layers, kv_heads, head_dim, elem
    )
    assert row["kv_seed_formula_ratio"] == pytest.approx(full.num_attention_heads / kv_heads)
    assert row["input_ids_shape"] == [batch, prompt]
    assert row["last_hidden_state_shape"] == [batch, prompt, full.hidden_size]
    assert row["embedding_shape"] == [full.vocab_size, full.hidden_size]
    assert row["dtype"] == default_dtype(spec) and row["random_weights"] is True
    assert row["generated_text"] is None
    # weights_bytes = parameters x dtype bytes (+ the rotary inv_freq buffer)
    params = parameter_count(model_config(spec, num_layers=layers))
    assert 0 <= row["weights_bytes"] - params * elem < 1024
    json.dumps(row)


def test_arch_path_to_a_config_json(tmp_path):
    config = {
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    spec = f"arch:{tmp_path / 'config.json'}"
    assert resolve(f"arch:{tmp_path}").location == resolve(spec).location
    assert default_dtype(spec) == "float32"
    [row] = [
        r.to_dict()
        for r in run_sweep(
            spec,
            [ProfilePoint(20, 3, "float32")],
            max_new_tokens=4,
            repeats=1,
            warmup=0,
            device="cpu",
        )
    ]
    assert row["kv_cache_bytes"] == kv_cache_bytes_formula(3, 24, 2, 2, 8, 4)
    assert row["kv_seed_formula_ratio"] == 4.0 and row["random_weights"] is True
    with pytest.raises(ValueError, match="context of 128"):
        check_request(spec, None, [100], 40, "cpu")


# ---------------------------------------------------------------------------- the real SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    return load_model("gguf:default", "float32", "cpu")


def test_smollm2_kv_bytes_equal_the_formula_and_shapes():
    rows = [
        r.to_dict()
        for r in run_sweep(
            "gguf:default",
            profile_points([16], [2], ["float32"], [0, 8]),
            max_new_tokens=3,
            repeats=1,
            warmup=0,
            device="cpu",
        )
    ]
    assert [(r["batch_size"], r["prefill_chunk_size"]) for r in rows] == [(2, 0), (2, 8)]
    for row in rows:
        assert not row["failed"], row["error"]
        b = row["batch_size"]
        assert row["kv_cache_bytes"] == row["kv_cache_bytes_formula"] == b * 19 * 2 * 30 * 3 * 64 * 4
        assert row["kv_seed_formula_ratio"] == pytest.approx(3.0)  # 9 heads, 3 KV heads
        assert row["input_ids_shape"] == [b, 16]
        assert row["last_hidden_state_shape"] == [b, 16, 576]
        assert row["embedding_shape"] == [49152, 576]
        assert row["random_weights"] is False and isinstance(row["generated_text"], str)
    assert rows[1]["prefill_chunks"] == 2 and rows[0]["prefill_chunks"] == 1
    # chunked prefill writes the same tokens as one forward
    assert rows[0]["generated_token_ids"] == rows[1]["generated_token_ids"]


@pytest.mark.parametrize("chunk", [3, 8, 19])
def test_chunked_prefill_gives_the_same_logits(smollm2, chunk):
    from transformers import DynamicCache

    model, tokenizer = smollm2
    ids = make_prompt_ids(tokenizer, 20).repeat(2, 1)
    with torch.inference_mode():
        whole_cache, chunked_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        whole = prefill(model, ids, whole_cache)
        chunked = prefill(model, ids, chunked_cache, chunk_size=chunk)
    assert whole_cache.get_seq_length() == chunked_cache.get_seq_length() == 20
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(greedy(chunked), greedy(whole))
    for a, b in zip(whole_cache.layers, chunked_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        prefill(model, ids, DynamicCache(config=model.config), chunk_size=-1)


# ---------------------------------------------------------------------------- memory check


def test_estimate_counts_weights_and_kv_exactly():
    config = model_config("arch:llama-2-7b")
    need = estimate_point_memory(
        config,
        parameters=parameter_count(config),
        dtype_bytes=2,
        batch=1,
        prompt_tokens=4096,
        max_new_tokens=0,
    )
    assert need.weights_bytes == 6_738_415_616 * 2
    assert need.kv_cache_bytes == 2 * GIB
    chunked = estimate_point_memory(
        config,
        parameters=parameter_count(config),
        dtype_bytes=2,
        batch=1,
        prompt_tokens=4096,
        max_new_tokens=0,
        prefill_chunk_size=256,
    )
    assert chunked.activation_bytes < need.activation_bytes / 4  # chunking bounds activations
    with pytest.raises(MemoryNeedError) as info:
        check_memory("N=4096 B=1 bfloat16", need, 8 * GIB, weights_resident=False)
    message = str(info.value)
    assert message.startswith("N=4096 B=1 bfloat16: needs about") and "\n" not in message
    check_memory("fits", need, 8 * GIB, weights_resident=True)  # only KV + activations left


def test_points_that_do_not_fit_fail_and_the_sweep_goes_on():
    seen = []
    calls = iter([10**12, 10**12, 10**12, 1, 1, 10**12])  # load, pt, pt, pt, load, pt

    rows = [
        r.to_dict()
        for r in run_sweep(
            "arch:smollm2-135m",
            profile_points([8, 12], [1], ["float32", "bfloat16"]),
            max_new_tokens=1,
            repeats=1,
            warmup=0,
            device="cpu",
            num_layers=1,
            on_point=lambda i, total, row: seen.append((i, total, row.failed)),
            available=lambda device: next(calls),
        )
    ]
    assert [s[:2] for s in seen] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [r["failed"] for r in rows] == [False, False, True, True]
    assert rows[2]["error"].startswith("MemoryNeedError: model arch:smollm2-135m in bfloat16: needs")
    assert rows[2]["memory_estimate_bytes"] > 0 and "prefill_ms" not in rows[2]


def test_a_point_that_fails_in_the_middle_is_recorded():
    calls = iter([10**12, 1, 10**12])
    rows = [
        r.to_dict()
        for r in run_sweep(
            "arch:smollm2-135m",
            profile_points([8, 12], [1], ["float32"]),
            max_new_tokens=1,
            repeats=1,
            warmup=0,
            device="cpu",
            num_layers=1,
            available=lambda device: next(calls),
        )
    ]
    assert [r["failed"] for r in rows] == [True, False]
    assert rows[0]["error"].startswith("MemoryNeedError: N=8 B=1 float32: needs about")


# ---------------------------------------------------------------------------- the grid, checks


def test_sweep_points_drop_chunks_that_do_not_split_the_prompt():
    points = profile_points([16, 64], [1], ["bfloat16"], [0, 32, 64])
    assert [(p.prompt_tokens, p.prefill_chunk_size) for p in points] == [(16, 0), (64, 0), (64, 32)]
    assert points[-1].label() == "N=64 B=1 bfloat16 chunk=32"


def test_check_request_refuses_bad_input():
    with pytest.raises(ModelSourceError, match="smollm2-135m"):
        check_request("arch:gpt-5", None, [16], 4, "cpu")
    with pytest.raises(ValueError, match="float8.*float32, bfloat16"):
        check_request("arch:smollm2-135m", ["float8"], [16], 4, "cpu")
    with pytest.raises(ValueError, match="context of 4096 tokens.*<= 4092"):
        check_request("arch:llama-2-7b", None, [64, 4096], 4, "cpu")
    device, dtypes, _ = check_request("arch:llama-2-7b", None, [64], 4, "cpu")
    assert device.type == "cpu" and dtypes == ["bfloat16"]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            check_request("arch:smollm2-135m", None, [16], 4, "cuda")


def test_plots_are_written_for_successful_points(tmp_path):
    results = run_sweep(
        "arch:smollm2-135m",
        profile_points([8, 16], [1], ["float32"], [0, 4]),
        max_new_tokens=2,
        repeats=1,
        warmup=0,
        device="cpu",
        num_layers=1,
    )
    paths = write_profile_plots(results, tmp_path)
    assert [p.name for p in paths] == [
        "prefill_ms_vs_prompt_length.png",
        "decode_ms_vs_context_position.png",
        "memory_vs_sequence_length.png",
        "ttft_vs_prefill_chunk_size.png",
        "peak_memory_vs_prefill_chunk_size.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in paths)
    failed = replace(results[0], error="RuntimeError: forced")
    assert failed.failed and write_profile_plots([failed], tmp_path / "none") == []
