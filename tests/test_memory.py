"""tasks.memory.formula and tasks.memory.readings: KV-cache formula vs the real cache, weight bytes, the
RSS sampler, CUDA no-ops.

Everything runs on a tiny random-weight Llama with GQA (4 heads, 2 KV heads): no downloads.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tasks.memory.formula import (
    dtype_bytes,
    kv_cache_bytes_formula,
    kv_cache_bytes_measured,
    kv_cache_bytes_seed_formula,
    kv_geometry,
    weights_bytes,
)
from tasks.memory.readings import RssSampler, cuda_peak_bytes, cuda_reset_peak

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_model(dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).to(dtype).eval()


# ---------------------------------------------------------------------------- formulas


def test_llama2_7b_fp16_4096_tokens_is_exactly_2_gib():
    assert kv_cache_bytes_formula(1, 4096, 32, 32, 128, 2) == 2147483648 == 2 * 1024**3
    # no GQA: the seed's hidden_size form agrees (hidden 4096 = 32 heads x 128)
    assert kv_cache_bytes_seed_formula(1, 4096, 32, 4096, 2) == 2147483648


def test_seed_formula_over_counts_by_heads_over_kv_heads_under_gqa():
    # SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64
    gqa = kv_cache_bytes_formula(1, 2048, 30, 3, 64, 4)
    seed = kv_cache_bytes_seed_formula(1, 2048, 30, 576, 4)
    assert gqa == 1 * 2048 * 2 * 30 * 3 * 64 * 4 == 94371840
    assert seed == 3 * gqa
    # the tiny test model: 4 heads / 2 KV heads -> 2x
    layers, kv_heads, head_dim = kv_geometry(LlamaConfig(**TINY))
    assert kv_cache_bytes_seed_formula(3, 17, layers, 64, 2) == 2 * kv_cache_bytes_formula(
        3, 17, layers, kv_heads, head_dim, 2
    )


def test_formula_rejects_negative_or_fractional_arguments():
    with pytest.raises(ValueError, match="positions"):
        kv_cache_bytes_formula(1, -1, 2, 2, 16, 4)
    with pytest.raises(ValueError, match="batch"):
        kv_cache_bytes_seed_formula(1.5, 8, 2, 64, 4)


def test_kv_geometry_defaults_and_explicit_head_dim():
    assert kv_geometry(LlamaConfig(**TINY)) == (2, 2, 16)
    no_gqa = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    assert kv_geometry(LlamaConfig(**no_gqa)) == (2, 4, 16)  # kv heads default to heads
    assert kv_geometry(LlamaConfig(**{**TINY, "head_dim": 32})) == (2, 2, 32)

    class Bare:  # a config without head_dim / num_key_value_heads attributes at all
        num_hidden_layers, num_attention_heads, hidden_size = 3, 8, 512

    assert kv_geometry(Bare()) == (3, 8, 64)
    with pytest.raises(ValueError):
        kv_geometry(object())


def test_dtype_bytes():
    assert [dtype_bytes(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [4, 2, 2]


# ---------------------------------------------------------------------------- measured cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,prompt,steps", [(1, 1, 1), (1, 9, 4), (3, 17, 5)])
def test_measured_cache_equals_formula(dtype, batch, prompt, steps):
    model = tiny_model(dtype)
    layers, kv_heads, head_dim = kv_geometry(model.config)
    elem = dtype_bytes(dtype)
    cache = DynamicCache(config=model.config)
    assert kv_cache_bytes_measured(cache) == 0  # nothing stored yet
    ids = torch.randint(0, 256, (batch, prompt))
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert kv_cache_bytes_measured(cache) == kv_cache_bytes_formula(
            batch, prompt, layers, kv_heads, head_dim, elem
        )
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == prompt + steps
    assert kv_cache_bytes_measured(cache) == kv_cache_bytes_formula(
        batch, prompt + steps, layers, kv_heads, head_dim, elem
    )
    # and the seed's hidden_size form is 2x the real cache for this GQA model
    assert kv_cache_bytes_seed_formula(batch, prompt + steps, layers, 64, elem) == (
        2 * kv_cache_bytes_measured(cache)
    )


def test_measured_rejects_a_non_cache():
    with pytest.raises(TypeError):
        kv_cache_bytes_measured(((torch.zeros(1), torch.zeros(1)),))


# ---------------------------------------------------------------------------- weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_bytes_counts_parameters_and_buffers_once(dtype):
    model = tiny_model(dtype)
    params = sum(p.numel() for p in model.parameters())
    assert params == model.num_parameters() == 106816
    elem = dtype_bytes(dtype)
    assert weights_bytes(model, include_buffers=False) == params * elem
    buffers = {b.data_ptr(): b.nbytes for b in model.buffers()}
    assert weights_bytes(model) == params * elem + sum(buffers.values())


def test_weights_bytes_counts_tied_embeddings_once():
    untied = tiny_model()
    tied = tiny_model(tie_word_embeddings=True)
    assert tied.lm_head.weight.data_ptr() == tied.get_input_embeddings().weight.data_ptr()
    embedding = 256 * 64
    assert weights_bytes(tied, include_buffers=False) == (
        weights_bytes(untied, include_buffers=False) - embedding * 4
    )
    assert weights_bytes(tied, include_buffers=False) == (106816 - embedding) * 4


# ---------------------------------------------------------------------------- RSS sampler


def test_rss_sampler_sees_a_deliberate_allocation():
    # In a fresh interpreter: after other tests, memory freed but kept by the allocator can
    # absorb the block without any RSS growth, which is the allocator's truth, not the sampler's.
    code = (
        "import time, torch\n"
        "from tasks.memory.readings import RssSampler\n"
        "with RssSampler() as s:\n"
        "    block = torch.ones(50_000_000, dtype=torch.float32)  # 200 MB, every page touched\n"
        "    time.sleep(1.0)  # ~200 sampling intervals\n"
        "    del block\n"
        "print(s.baseline_bytes, s.peak_bytes, s.peak_delta_bytes, s.samples)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    baseline, peak, delta, samples = map(int, out.stdout.split())
    assert baseline > 0 and peak >= baseline and delta == peak - baseline
    assert delta >= 150_000_000
    assert samples >= 2


def test_rss_sampler_idle_block_has_a_small_delta():
    with RssSampler() as sampler:
        time.sleep(0.05)
    assert 0 <= sampler.peak_delta_bytes < 30_000_000
    assert sampler.samples >= 2


# ---------------------------------------------------------------------------- CUDA helpers


def test_cuda_helpers_are_no_ops_off_cuda():
    assert cuda_reset_peak("cpu") is None
    assert cuda_peak_bytes("cpu") is None
    assert cuda_peak_bytes(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_sees_an_allocation():
    cuda_reset_peak("cuda")
    block = torch.ones(25_000_000, device="cuda")  # 100 MB
    peak = cuda_peak_bytes("cuda")
    del block
    assert peak.allocated_bytes >= 100_000_000
    assert peak.reserved_bytes >= peak.allocated_bytes
