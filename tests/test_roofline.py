"""The roofline (tasks/profile/roofline.py): FLOP and byte counts of a small Llama (GQA, tied
embeddings) asserted exactly against hand-computed values, the verdict rule, and the measured
ceilings."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.profile.breakdown import find_decoder_layers
from tasks.profile.measure import profile_point
from tasks.profile.roofline import (
    DeviceCeilings,
    attention_flops_decode,
    attention_flops_prefill,
    linear_weight_elements,
    measure_ceilings,
    roofline,
)

# hidden 64, 4 heads of 16, 2 KV heads (GQA), MLP 128, 2 layers, vocab 100, tied head
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=100,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    prompt = torch.arange(1, 9, dtype=torch.long)[None]  # N = 8
    point = profile_point(
        model, prompt_ids=prompt, batch_size=1, max_new_tokens=4, repeats=1, warmup=0, device="cpu"
    )
    return model, point


def test_weight_elements_by_hand(small):
    model, _ = small
    _, layers = find_decoder_layers(model)
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up/down 3 x 64x128 = 36,864
    assert linear_weight_elements(model, layers) == (2 * 36_864, 100 * 64)


def test_attention_flops_by_hand():
    # causal: query i sees i + 1 keys; QK^T and AV: 4 FLOPs x head_dim per pair per head
    assert attention_flops_prefill(1, 2, 4, 16, 8) == 4 * 2 * 4 * 16 * 36  # 36 = 1 + ... + 8
    assert attention_flops_decode(2, 2, 4, 16, 10) == 4 * 2 * 2 * 4 * 16 * 10


def test_flops_and_bytes_exact(small):
    model, point = small
    # parameters: embedding 6,400 + 2 x (36,864 + two norms of 64) + final norm 64 = 80,448
    # floats; buffers: rotary inv_freq and original_inv_freq, head_dim / 2 = 8 floats each
    assert point.weights_bytes == 80_448 * 4 + 2 * 8 * 4 == 321_856
    # KV: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes = 512 bytes per position
    assert (point.kv_cache_bytes_after_prefill, point.kv_cache_bytes) == (8 * 512, 12 * 512)
    _, layers = find_decoder_layers(model)
    ceilings = DeviceCeilings("cpu", "float32", 10.0, 1e11, 2**20, 64)  # ridge 10 FLOP/B
    roof = roofline(model, layers, point, ceilings)
    # prefill: 2 x 73,728 x 8 tokens + lm_head on 1 row 2 x 6,400 + attention 18,432
    assert roof.prefill.flops == 1_179_648 + 12_800 + 18_432 == 1_210_880
    # decode: mean cache positions over 4 steps = 8 + (1 + 4) / 2 = 10.5
    assert roof.decode.flops == 147_456 + 12_800 + 4 * 2 * 4 * 16 * 10.5 == 165_632
    # tied embedding: the weights are read once; KV after prefill + 512 x mean positions added
    assert roof.prefill.bytes == 321_856 + 4_096
    assert roof.decode.bytes == 321_856 + 4_096 + 512 * 2.5 == 327_232
    assert roof.decode.arithmetic_intensity_flop_per_byte == pytest.approx(165_632 / 327_232)
    assert roof.decode.bound == "memory-bound"  # 0.51 < ridge 10
    seconds = point.decode_ms_mean / 1000
    assert roof.decode.achieved_bandwidth_gb_per_s == pytest.approx(327_232 / seconds / 1e9)
    assert roof.decode.bandwidth_fraction == pytest.approx(roof.decode.achieved_bandwidth_gb_per_s / 10.0)
    assert "memory-bound" in roof.decode.verdict and "% of measured copy bandwidth" in roof.decode.verdict
    low_ridge = DeviceCeilings("cpu", "float32", 1000.0, 1e9, 2**20, 64)  # ridge 0.001
    assert roofline(model, layers, point, low_ridge).prefill.bound == "compute-bound"
    row = roof.to_dict()
    assert row["ridge_flop_per_byte"] == pytest.approx(10.0) and row["decode"]["flops"] == 165_632


def test_untied_embedding_reads_only_the_looked_up_rows():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "tie_word_embeddings": False})).eval()
    point = profile_point(
        model,
        prompt_ids=torch.arange(1, 9, dtype=torch.long)[None],
        batch_size=2,
        max_new_tokens=2,
        repeats=1,
        warmup=0,
        device="cpu",
    )
    _, layers = find_decoder_layers(model)
    roof = roofline(model, layers, point, DeviceCeilings("cpu", "float32", 10.0, 1e11, 2**20, 64))
    table = 100 * 64 * 4
    assert point.weights_bytes == 321_856 + table  # the head is its own 6,400 floats now
    # decode: B = 2 rows of 256 bytes; KV (B = 2): 16 x 512 after prefill, + 1,024 x 1.5
    assert roof.decode.bytes == 321_856 + 2 * 256 + 8_192 + 1_024 * 1.5


def test_measured_ceilings_are_positive_and_cached():
    first = measure_ceilings("cpu", torch.float32, repeats=2)
    assert first.copy_bandwidth_gb_per_s > 0 and first.matmul_flop_per_s > 0
    assert first.ridge_flop_per_byte == first.matmul_flop_per_s / (first.copy_bandwidth_gb_per_s * 1e9)
    assert measure_ceilings("cpu", torch.float32) is first
