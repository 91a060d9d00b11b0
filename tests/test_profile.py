"""tasks.profile (measure, phases, timing): the prefill / decode loop on a tiny random-weight GQA
Llama (no downloads).

The greedy loop is checked against transformers' own ``generate``, so its timings are the
timings of the model's real greedy path; KV bytes are checked against the formula exactly.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.memory.formula import dtype_bytes, kv_cache_bytes_formula, weights_bytes
from tasks.profile.measure import make_prompt_ids, profile_point
from tasks.profile.phases import decode_one_token, greedy, prefill
from tasks.profile.standalone import main
from tasks.profile.timing import Timer, percentile, resolve_device

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 2, 2, 16, 64


def tiny_model(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).to(dtype).eval()


@pytest.fixture(scope="module")
def model32() -> LlamaForCausalLM:
    return tiny_model(torch.float32)


@pytest.fixture(scope="module")
def model16() -> LlamaForCausalLM:
    return tiny_model(torch.bfloat16)


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, n=8, batch=1, steps=4, repeats=2, warmup=1) -> dict:
    """The point as it leaves the package: PointMeasurement.to_dict()."""
    return profile_point(
        model,
        prompt_ids=prompt(n),
        batch_size=batch,
        max_new_tokens=steps,
        repeats=repeats,
        warmup=warmup,
        device="cpu",
    ).to_dict()


# ---------------------------------------------------------------------------- the point


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,n,steps", [(1, 1, 1), (1, 12, 5), (3, 20, 3), (2, 7, 8)])
def test_point_kv_bytes_shapes_and_counts(model32, model16, dtype, batch, n, steps):
    model = model32 if dtype == torch.float32 else model16
    elem = dtype_bytes(dtype)
    point = run(model, n=n, batch=batch, steps=steps, repeats=2, warmup=1)

    # the cache holds N positions after prefill and N + T after T one-token decode steps
    assert point["kv_cache_positions_after_prefill"] == n
    assert point["kv_cache_positions"] == n + steps
    after_prefill = kv_cache_bytes_formula(batch, n, LAYERS, KV_HEADS, HEAD_DIM, elem)
    after_decode = kv_cache_bytes_formula(batch, n + steps, LAYERS, KV_HEADS, HEAD_DIM, elem)
    assert point["kv_cache_bytes_after_prefill"] == after_prefill
    assert point["kv_cache_bytes_formula_after_prefill"] == after_prefill
    assert point["kv_cache_bytes"] == after_decode
    assert point["kv_cache_bytes_formula"] == after_decode
    assert point["kv_cache_bytes_seed_formula"] == 2 * after_decode
    assert point["kv_seed_formula_ratio"] == 2.0  # heads / kv_heads = 4 / 2

    assert point["prompt_tokens"] == n and point["batch_size"] == batch
    assert point["max_new_tokens"] == steps
    assert point["input_ids_shape"] == [batch, n]
    assert point["last_hidden_state_shape"] == [batch, n, HIDDEN]
    assert point["embedding_shape"] == [256, HIDDEN]
    assert (point["num_layers"], point["num_kv_heads"], point["head_dim"]) == (2, 2, 16)
    assert point["dtype"] == str(dtype).removeprefix("torch.") and point["device"] == "cpu"
    assert point["weights_bytes"] == weights_bytes(model)

    assert len(point["decode_ms"]) == steps
    assert len(point["decode_ms_runs"]) == 2 and all(len(r) == steps for r in point["decode_ms_runs"])
    assert point["decode_ms"] in point["decode_ms_runs"]
    assert len(point["generated_token_ids"]) == steps + 1 == point["new_tokens_per_sequence"]


def test_point_timings_and_rates_are_consistent(model32):
    point = run(model32, n=16, batch=2, steps=6, repeats=3, warmup=2)
    assert point["prefill_ms"] > 0 and all(t > 0 for t in point["prefill_ms_runs"])
    assert len(point["prefill_ms_runs"]) == 3
    assert len(point["warmup_prefill_ms"]) == 2 and point["warmup"] == 2
    assert point["prefill_ms"] == sorted(point["prefill_ms_runs"])[1]
    assert point["ttft_local_ms"] == point["prefill_ms"]
    assert point["prefill_tokens_per_s"] == pytest.approx(2 * 16 / (point["prefill_ms"] / 1000))
    d = point["decode_ms"]
    assert all(t > 0 for t in d)
    assert point["decode_ms_mean"] == pytest.approx(sum(d) / len(d))
    assert min(d) <= point["decode_ms_p50"] <= point["decode_ms_p90"] <= point["decode_ms_p99"]
    assert point["decode_ms_p99"] <= point["decode_ms_max"] == max(d)
    assert point["decode_tokens_per_s"] == pytest.approx(2 / (point["decode_ms_p50"] / 1000))
    # CPU: peak is a delta from the RSS sampler; nothing CUDA-only is filled in
    assert point["peak_memory_source"] == "rss_sampler_delta"
    assert point["peak_memory_bytes"] >= 0 and point["peak_memory_baseline_bytes"] > 0
    assert point["decode_bandwidth_gb_per_s"] is None
    json.dumps(point)  # plain JSON types only


def test_greedy_decode_is_deterministic_and_is_generates_greedy_path(model32):
    n, steps, batch = 10, 7, 2
    first = run(model32, n=n, batch=batch, steps=steps, repeats=1, warmup=0)
    second = run(model32, n=n, batch=batch, steps=steps, repeats=2, warmup=1)
    assert first["generated_token_ids"] == second["generated_token_ids"]

    ids = prompt(n).repeat(batch, 1)
    with torch.inference_mode():
        # T decode steps after the prefill make T + 1 new tokens
        out = model32.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            pad_token_id=0,
        )
        shorter = model32.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=0,
        )
    assert out[0, n:].tolist() == first["generated_token_ids"]
    assert out[1, n:].tolist() == first["generated_token_ids"]  # tiled rows decode alike
    assert shorter[0, n:].tolist() == first["generated_token_ids"][:steps]


def test_prefill_and_decode_one_token_shapes(model32):
    from transformers import DynamicCache

    cache = DynamicCache(config=model32.config)
    with torch.inference_mode():
        logits = prefill(model32, prompt(5).repeat(3, 1), cache)
        assert logits.shape == (3, 256) and cache.get_seq_length() == 5
        token = greedy(logits)
        assert token.shape == (3, 1) and token.dtype == torch.long
        logits = decode_one_token(model32, token, cache)
        assert logits.shape == (3, 256) and cache.get_seq_length() == 6


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt_ids=torch.zeros(2, 4, dtype=torch.long)),
        dict(prompt_ids=torch.zeros(1, 0, dtype=torch.long)),
        dict(prompt_ids=torch.zeros(1, 4)),
        dict(batch_size=0),
        dict(max_new_tokens=0),
        dict(repeats=0),
        dict(warmup=-1),
    ],
)
def test_point_rejects_bad_arguments(model32, kwargs):
    args = dict(prompt_ids=prompt(4), batch_size=1, max_new_tokens=1, repeats=1, warmup=0, device="cpu")
    with pytest.raises(ValueError):
        profile_point(model32, **{**args, **kwargs})


# ---------------------------------------------------------------------------- helpers


class FakeTokenizer:
    """Words -> ids; records whether special tokens were asked for."""

    def __init__(self):
        self.calls = []

    def encode(self, text, add_special_tokens=True):
        self.calls.append(add_special_tokens)
        return [len(word) for word in text.split()]


def test_make_prompt_ids_tiles_to_exact_length_without_special_tokens():
    tok = FakeTokenizer()
    ids = make_prompt_ids(tok, 7, text="a bb ccc")
    assert tok.calls == [False]
    assert ids.dtype == torch.long and ids.shape == (1, 7)
    assert ids.tolist() == [[1, 2, 3, 1, 2, 3, 1]]
    assert make_prompt_ids(tok, 2, text="a bb ccc").tolist() == [[1, 2]]
    long = make_prompt_ids(tok, 1000)  # the default natural text
    assert long.shape == (1, 1000)
    with pytest.raises(ValueError):
        make_prompt_ids(tok, 0)
    with pytest.raises(ValueError):
        make_prompt_ids(tok, 5, text="   ")


def test_make_prompt_ids_accepts_an_encode_without_keywords():
    class Plain:  # tiktoken-like
        def encode(self, text):
            return [7, 8]

    assert make_prompt_ids(Plain(), 3).tolist() == [[7, 8, 7]]


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        resolve_device("tpu")
    with pytest.raises(ValueError):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            resolve_device("cuda")


def test_percentile_matches_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_cpu_timer_measures_spans_in_ms():
    timer = Timer("cpu")
    timer.start()
    time.sleep(0.02)
    timer.stop()
    timer.start()
    timer.stop()
    spans = timer.elapsed_ms()
    assert len(spans) == 2
    assert 15 <= spans[0] < 500 and 0 <= spans[1] < spans[0]
    with pytest.raises(RuntimeError):
        Timer("cpu").stop()


def test_standalone_entry_point_prints_a_point(capsys):
    code = main(
        [
            "--num-layers",
            "1",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "1",
            "--vocab",
            "128",
            "--prompt-lengths",
            "12",
            "--max-new-tokens",
            "3",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--dtype",
            "float32",
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    point = json.loads(capsys.readouterr().out)
    assert point["random_weights"] is True and point["model"] is None  # shape flags, no preset
    assert point["input_ids_shape"] == [1, 12] and len(point["decode_ms"]) == 3
    assert point["kv_cache_bytes"] == point["kv_cache_bytes_formula"] == 1 * 15 * 2 * 1 * 1 * 16 * 4
    assert point["kv_seed_formula_ratio"] == 4.0


def test_standalone_entry_point_fails_with_one_line_on_bad_shape(capsys):
    assert main(["--hidden", "60", "--heads", "8", "--vocab", "64", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error:")
