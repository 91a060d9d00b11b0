"""Local profile: prefill and per-token decode inside a transformers model, with KV-cache and
peak-memory readings. Imports only the standard library, torch and transformers (plus
tasks.profile.memory, which imports the same), so it runs alone on a GPU machine (:func:`main`)::

    python -m tasks.profile --model arch:llama-2-7b --layers 2 --prompt-length 512 \
        --max-new-tokens 16 --device auto          # a preset of tasks.models, 2 of its layers
    python -m tasks.profile --layers 2 --hidden 4096 --heads 32 --kv-heads 32 \
        --prompt-length 512 --max-new-tokens 16 --dtype bfloat16 --device auto

The loop is gpt-fast's (pytorch-labs/gpt-fast, ``generate.py``): one ``prefill`` forward over
the whole prompt gives the first new token, then ``decode_one_token`` feeds one token per step
through the KV cache. Splitting a generation into a prefill latency and per-token decode
latencies is optimum-benchmark's latency tracker's split (prefill = time to the first token,
decode = the time of each further token). Greedy (argmax) decoding, EOS ignored.

How many tokens, how many cache positions
-----------------------------------------
A point with prompt length N and ``max_new_tokens`` = T runs one prefill forward and exactly
T decode forwards. The prefill forward already yields a token, and each decode forward yields
one more, so every sequence gets T + 1 new tokens (``generated_token_ids`` has T + 1 ids; they
equal ``model.generate(do_sample=False, max_new_tokens=T + 1)``). Each decode step feeds the
previous token into the cache, so after the point the cache holds N + T positions (the last
token produced is never fed back); after prefill it holds N. The formulas use those counts.
"""

from __future__ import annotations

import contextlib
import math
import platform
import time
from typing import Any

import torch

from tasks import stats
from tasks.profile.gpu_metrics import GPU_METRIC_KEYS, NvmlSampler
from tasks.profile.memory import (
    RssSampler,
    cuda_allocated_bytes,
    cuda_peak_bytes,
    cuda_reset_peak,
    dtype_bytes,
    kv_cache_bytes_formula,
    kv_cache_bytes_measured,
    kv_cache_bytes_seed_formula,
    kv_geometry,
    weights_bytes,
)

__all__ = [
    "DEFAULT_PROMPT_TEXT",
    "Timer",
    "decode_one_token",
    "greedy",
    "make_prompt_ids",
    "percentile",
    "prefill",
    "profile_point",
    "resolve_device",
]

#: A natural English text, tiled to the requested prompt length by :func:`make_prompt_ids`.
DEFAULT_PROMPT_TEXT = (
    "A language model answers in two phases. First it reads the whole prompt at once, "
    "computing keys and values for every token and storing them in a cache; this is the "
    "prefill, and its length decides how long a user waits for the first word. Then it "
    "writes the answer one token at a time, each step reading every weight and the whole "
    "cache again to produce a single new token; this is the decode, and its speed decides "
    "how fast the words keep coming. "
)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> cuda when available else cpu; ``"cpu"`` / ``"cuda"`` / ``"cuda:1"`` as given.

    Raises:
        ValueError: an unknown device name.
        RuntimeError: cuda asked for but not available.
    """
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {resolved}; use auto, cpu or cuda")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda asked for, but torch sees no CUDA device")
    return resolved


def make_prompt_ids(
    tokenizer: Any, length: int, text: str = DEFAULT_PROMPT_TEXT
) -> torch.LongTensor:
    """Token ids of ``text`` (no special tokens: no BOS), tiled / cut to exactly ``length``.

    ``tokenizer`` is anything with ``encode(text, add_special_tokens=False)`` (a transformers
    tokenizer) or ``encode(text)`` (e.g. tiktoken). Returns a LongTensor of shape [1, length].

    Raises:
        ValueError: ``length`` < 1, or ``text`` encodes to no tokens.
    """
    if int(length) != length or length < 1:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        ids = list(tokenizer.encode(text))
    if not ids:
        raise ValueError("the prompt text encodes to no tokens")
    tiled = (ids * math.ceil(length / len(ids)))[:length]
    return torch.tensor([tiled], dtype=torch.long)


# --------------------------------------------------------------------------------------------
# The two phases (gpt-fast's prefill / decode_one_token)
# --------------------------------------------------------------------------------------------


def prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, cache: Any, chunk_size: int = 0
) -> torch.Tensor:
    """Forward the whole prompt, filling ``cache``; returns the last position's logits.

    input_ids: LongTensor [B, N]. Returns logits [B, vocab] (only the last position goes
    through the LM head, ``logits_to_keep=1``, as ``generate`` does). Afterwards the cache holds
    N positions.

    ``chunk_size`` > 0: chunked prefill (vLLM's and TGI's term): the prompt is fed in slices of
    ``chunk_size`` tokens, each attending to the cache filled by the slices before it, so the
    activations of one forward cover at most ``chunk_size`` positions instead of N. The result
    equals the unchunked prefill up to floating-point summation order. 0 = one forward.

    Raises:
        ValueError: chunk_size < 0.
    """
    if int(chunk_size) != chunk_size or chunk_size < 0:
        raise ValueError(f"chunk_size must be an integer >= 0, got {chunk_size!r}")
    n = input_ids.shape[1]
    step = chunk_size if 0 < chunk_size < n else n
    for start in range(0, n, step):
        out = model(
            input_ids=input_ids[:, start : start + step], past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )
    return out.logits[:, -1, :]


def decode_one_token(model: torch.nn.Module, token: torch.Tensor, cache: Any) -> torch.Tensor:
    """One decode step: feed ``token`` (LongTensor [B, 1]) through the cache; returns logits
    [B, vocab] for the next position. The cache grows by one position."""
    out = model(input_ids=token, past_key_values=cache, use_cache=True)
    return out.logits[:, -1, :]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice: argmax over the vocabulary. logits [B, vocab] -> LongTensor [B, 1]."""
    return torch.argmax(logits, dim=-1, keepdim=True)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


class Timer:
    """Times spans on the device's own clock.

    CPU: ``time.perf_counter_ns()`` at ``start()`` / ``stop()`` (CPU kernels run synchronously).
    CUDA: a ``torch.cuda.Event(enable_timing=True)`` pair recorded on the current stream, so a
    span is GPU time between the two events; :meth:`elapsed_ms` synchronises once and reads them
    all, so timing adds no synchronisation between steps.

    Usage: ``timer.start(); ...; timer.stop()`` any number of times, then ``timer.elapsed_ms()``
    -> list of span lengths in milliseconds, in order.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._spans: list[tuple[Any, Any]] = []
        self._open: Any = None

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def start(self) -> None:
        self._open = self._mark()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("Timer.stop() without start()")
        self._spans.append((self._open, self._mark()))
        self._open = None

    def elapsed_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [float(a.elapsed_time(b)) for a, b in self._spans]
        return [(b - a) / 1e6 for a, b in self._spans]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# Statistics (kept here so the module needs nothing beyond torch)
# --------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of unsorted values: :func:`tasks.stats.percentile`.

    Raises:
        ValueError: empty ``values`` or q outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    return stats.percentile(sorted(values), q)


def _warmup_and_runs(
    model, input_ids, max_new_tokens: int, warmup: int, repeats: int, chunk: int, window=None
):
    """Untimed-for-statistics warm-up runs (their prefill times kept), then the timed runs,
    inside ``window`` (a context manager, e.g. :class:`NvmlSampler`) when one is given."""
    warmup_prefill_ms = [
        _one_run(model, input_ids, max_new_tokens, chunk)["prefill_ms"] for _ in range(warmup)
    ]
    with window if window is not None else contextlib.nullcontext():
        runs = [_one_run(model, input_ids, max_new_tokens, chunk) for _ in range(repeats)]
    return warmup_prefill_ms, runs


def _last_hidden_state_shape(model, input_ids: torch.Tensor, chunk: int) -> list[int]:
    """[B, N, hidden] of the last hidden state, from untimed forwards with
    output_hidden_states=True; chunked like the prefill (through a cache) when ``chunk`` > 0, so
    this extra pass never needs more activation memory than the measured one."""
    from transformers import DynamicCache

    n = input_ids.shape[1]
    step = chunk if 0 < chunk < n else n
    cache = DynamicCache(config=model.config)
    rows = 0
    for start in range(0, n, step):
        out = model(
            input_ids=input_ids[:, start : start + step], past_key_values=cache, use_cache=True,
            output_hidden_states=True, logits_to_keep=1,
        )
        batch, length, hidden = out.hidden_states[-1].shape
        rows += length
        del out
    del cache
    return [int(batch), int(rows), int(hidden)]


def _median_index(values: list[float]) -> int:
    """Index of the (lower) median element of ``values``."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


# --------------------------------------------------------------------------------------------
# One point
# --------------------------------------------------------------------------------------------


def _one_run(
    model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, chunk: int = 0
) -> dict:
    """Prefill + exactly ``max_new_tokens`` decode steps in a fresh DynamicCache, each timed."""
    from transformers import DynamicCache

    device = input_ids.device
    timer = Timer(device)
    cache = DynamicCache(config=model.config)
    _synchronize(device)

    timer.start()
    token = greedy(prefill(model, input_ids, cache, chunk))
    timer.stop()
    kv_after_prefill = kv_cache_bytes_measured(cache)
    positions_after_prefill = cache.get_seq_length()
    tokens = [token]
    for _ in range(max_new_tokens):
        timer.start()
        token = greedy(decode_one_token(model, token, cache))
        timer.stop()
        tokens.append(token)

    spans = timer.elapsed_ms()  # synchronises on CUDA
    run = {
        "prefill_ms": spans[0],
        "decode_ms": spans[1:],
        "tokens": torch.cat(tokens, dim=1),  # [B, T + 1]
        "kv_after_prefill": kv_after_prefill,
        "kv_after_decode": kv_cache_bytes_measured(cache),
        "positions_after_prefill": positions_after_prefill,
        "positions": cache.get_seq_length(),
    }
    del cache
    return run


def profile_point(
    model: torch.nn.Module,
    *,
    prompt_ids: torch.Tensor,
    batch_size: int,
    max_new_tokens: int,
    repeats: int,
    warmup: int,
    device: torch.device | str,
    prefill_chunk_size: int = 0,
) -> dict[str, Any]:
    """Measure one point (prompt length N, batch B, T decode steps) of a causal LM.

    ``model`` must already sit on ``device`` in the dtype to measure; it is put in eval mode.
    ``prompt_ids``: LongTensor [1, N], tiled to [B, N]. Under ``torch.inference_mode()``, each
    of ``warmup + repeats`` runs uses a fresh ``DynamicCache(config=model.config)``, times one
    prefill over [B, N] (forward + argmax of the first new token) and then exactly
    ``max_new_tokens`` greedy decode steps, each timed on its own (see :class:`Timer`). EOS is
    ignored. Warm-up runs are left out of the statistics (their prefill times are kept).
    ``prefill_chunk_size`` > 0 feeds the prompt in chunks through the cache (see :func:`prefill`);
    the prefill time then covers all chunks (it is still the local TTFT).

    Returned keys (times in ms, sizes in bytes, rates per second):

    - prompt_tokens (N), batch_size (B), max_new_tokens (T, = decode steps), repeats, warmup
    - prefill_chunk_size (0 = one forward), prefill_chunks (forwards the prefill took)
    - prefill_ms: median prefill time over the timed repeats; prefill_ms_runs: each repeat's;
      warmup_prefill_ms: each warm-up run's
    - prefill_tokens_per_s = B x N / prefill seconds
    - ttft_local_ms = prefill_ms: the local time to first token is the prefill forward plus
      its argmax (no tokenizer, queue or network, unlike the stream stage's ttft_ms)
    - decode_ms: the T per-step times of the median timed repeat (the repeat whose total
      decode time is the median; lower median for an even count); decode_ms_runs: every
      timed repeat's list; decode_ms_mean/_p50/_p90/_p95/_p99/_max: over decode_ms
    - decode_tokens_per_s = B / (decode_ms_p50 / 1000): one step makes B tokens
    - weights_bytes (parameters + buffers, shared tensors once)
    - kv_cache_bytes_after_prefill / kv_cache_bytes: measured bytes of the cache's key/value
      tensors after prefill (N positions) and after decode (N + T positions)
    - kv_cache_positions_after_prefill (N) / kv_cache_positions (N + T), read from the cache
    - kv_cache_bytes_formula_after_prefill / kv_cache_bytes_formula: DESIGN.md's GQA-aware
      formula for those positions; kv_cache_bytes_seed_formula: the seed's hidden_size form
      after decode; kv_seed_formula_ratio = seed / formula (= heads / kv_heads when
      heads x head_dim == hidden_size)
    - peak_memory_bytes: CPU: peak RSS (sampled by a separate process, :class:`RssSampler`)
      during the point (warm-up and timed repeats) minus the RSS before it; CUDA:
      torch.cuda.max_memory_allocated over the point after reset_peak_memory_stats (absolute,
      weights included).
      peak_memory_source says which; peak_memory_baseline_bytes is the RSS / allocated bytes
      before; peak_memory_reserved_bytes (CUDA only, else None)
    - decode_bandwidth_gb_per_s (CUDA only, else None): bytes read per decode step (weights +
      the cache held after the step) summed over the median repeat's steps / its decode time,
      in 1e9 bytes/s; a lower bound on traffic (activations are not counted)
    - CUDA only (absent on CPU): gpu_power_w_mean / gpu_power_w_max (W),
      gpu_utilization_pct_mean / gpu_utilization_pct_max (%), gpu_energy_joules (J) and
      gpu_metric_samples, sampled by NVML over the timed repeats (not the warm-ups), see
      :mod:`tasks.profile.gpu_metrics`; each is None when NVML (nvidia-ml-py and the driver's library)
      cannot read it
    - device, device_name, dtype, torch_num_threads, attn_implementation
    - input_ids_shape [B, N]; last_hidden_state_shape [B, N, hidden] (from one extra forward with
      output_hidden_states=True after the timed runs); embedding_shape [vocab, hidden]
    - generated_token_ids: the T + 1 new token ids of the first sequence of the median repeat
      (prefill's token, then one per decode step); new_tokens_per_sequence = T + 1
    - num_layers, num_kv_heads, head_dim, hidden_size, num_attention_heads

    Raises:
        ValueError: prompt_ids is not [1, N] with N >= 1, or batch_size / max_new_tokens /
            repeats < 1, or warmup < 0 or prefill_chunk_size < 0, or the model is not on
            ``device``.
        RuntimeError: cuda asked for but not available (from :func:`resolve_device`).
    """
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must have shape [1, N] with N >= 1, got {list(prompt_ids.shape)}")
    if prompt_ids.dtype != torch.long:
        raise ValueError(f"prompt_ids must be a LongTensor, got {prompt_ids.dtype}")
    for name, value, least in (
        ("batch_size", batch_size, 1), ("max_new_tokens", max_new_tokens, 1),
        ("repeats", repeats, 1), ("warmup", warmup, 0),
        ("prefill_chunk_size", prefill_chunk_size, 0),
    ):
        if int(value) != value or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")

    device = resolve_device(device)
    first_param = next(model.parameters())
    if first_param.device.type != device.type:
        raise ValueError(f"the model sits on {first_param.device}, not on {device}; move it first")
    model.eval()
    dtype = first_param.dtype
    n = int(prompt_ids.shape[1])
    input_ids = prompt_ids.to(device).repeat(batch_size, 1).contiguous()  # [B, N]

    with torch.inference_mode():
        # The memory window spans the whole point, warm-up included: the first run is the one
        # that allocates (activations, KV cache); later runs reuse what the allocator kept.
        rss: RssSampler | None = None
        gpu: NvmlSampler | None = None
        if device.type == "cuda":
            cuda_reset_peak(device)
            baseline = cuda_allocated_bytes(device)
            gpu = NvmlSampler(device)
            warmup_prefill_ms, runs = _warmup_and_runs(
                model, input_ids, max_new_tokens, warmup, repeats, prefill_chunk_size, gpu
            )
            peak = cuda_peak_bytes(device)
            assert peak is not None
            peak_memory_bytes, reserved = peak.allocated_bytes, peak.reserved_bytes
            source = "cuda_max_memory_allocated"
        else:
            with RssSampler() as rss:
                warmup_prefill_ms, runs = _warmup_and_runs(
                    model, input_ids, max_new_tokens, warmup, repeats, prefill_chunk_size
                )
            peak_memory_bytes, baseline, reserved = rss.peak_delta_bytes, rss.baseline_bytes, None
            source = "rss_sampler_delta"

        last_hidden_state_shape = _last_hidden_state_shape(model, input_ids, prefill_chunk_size)

    prefill_runs = [r["prefill_ms"] for r in runs]
    prefill_ms = percentile(prefill_runs, 50)
    median_run = runs[_median_index([sum(r["decode_ms"]) for r in runs])]
    decode_ms = median_run["decode_ms"]
    decode_p50 = percentile(decode_ms, 50)

    cfg = model.config.get_text_config(decoder=True)
    num_layers, num_kv_heads, head_dim = kv_geometry(cfg)
    hidden_size = int(cfg.hidden_size)
    elem = dtype_bytes(dtype)
    positions_prefill = median_run["positions_after_prefill"]
    positions = median_run["positions"]
    formula = kv_cache_bytes_formula(batch_size, positions, num_layers, num_kv_heads, head_dim, elem)
    seed = kv_cache_bytes_seed_formula(batch_size, positions, num_layers, hidden_size, elem)
    wbytes = weights_bytes(model)

    bandwidth = None
    if device.type == "cuda":
        per_step = [
            wbytes + kv_cache_bytes_formula(
                batch_size, positions_prefill + i + 1, num_layers, num_kv_heads, head_dim, elem
            )
            for i in range(max_new_tokens)
        ]
        bandwidth = sum(per_step) / (sum(decode_ms) / 1000) / 1e9

    return {
        "prompt_tokens": n,
        "batch_size": int(batch_size),
        "max_new_tokens": int(max_new_tokens),
        "repeats": int(repeats),
        "warmup": int(warmup),
        "prefill_chunk_size": int(prefill_chunk_size),
        "prefill_chunks": math.ceil(n / prefill_chunk_size) if 0 < prefill_chunk_size < n else 1,
        "prefill_ms": prefill_ms,
        "prefill_ms_runs": prefill_runs,
        "warmup_prefill_ms": warmup_prefill_ms,
        "prefill_tokens_per_s": batch_size * n / (prefill_ms / 1000),
        "ttft_local_ms": prefill_ms,
        "decode_ms": decode_ms,
        "decode_ms_runs": [r["decode_ms"] for r in runs],
        "decode_ms_mean": sum(decode_ms) / len(decode_ms),
        "decode_ms_p50": decode_p50,
        "decode_ms_p90": percentile(decode_ms, 90),
        "decode_ms_p95": percentile(decode_ms, 95),
        "decode_ms_p99": percentile(decode_ms, 99),
        "decode_ms_max": max(decode_ms),
        "decode_tokens_per_s": batch_size / (decode_p50 / 1000),
        "weights_bytes": wbytes,
        "kv_cache_bytes_after_prefill": median_run["kv_after_prefill"],
        "kv_cache_bytes": median_run["kv_after_decode"],
        "kv_cache_positions_after_prefill": positions_prefill,
        "kv_cache_positions": positions,
        "kv_cache_bytes_formula_after_prefill": kv_cache_bytes_formula(
            batch_size, positions_prefill, num_layers, num_kv_heads, head_dim, elem
        ),
        "kv_cache_bytes_formula": formula,
        "kv_cache_bytes_seed_formula": seed,
        "kv_seed_formula_ratio": seed / formula if formula else None,
        "peak_memory_bytes": int(peak_memory_bytes),
        "peak_memory_source": source,
        "peak_memory_baseline_bytes": baseline,
        "peak_memory_reserved_bytes": reserved,
        "decode_bandwidth_gb_per_s": bandwidth,
        **({**dict.fromkeys(GPU_METRIC_KEYS), **gpu.metrics} if gpu is not None else {}),
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda"
            else (platform.processor() or platform.machine())
        ),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_num_threads": torch.get_num_threads(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "input_ids_shape": list(input_ids.shape),
        "last_hidden_state_shape": last_hidden_state_shape,
        "embedding_shape": list(model.get_input_embeddings().weight.shape),
        "generated_token_ids": median_run["tokens"][0].tolist(),
        "new_tokens_per_sequence": max_new_tokens + 1,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_size": hidden_size,
        "num_attention_heads": int(cfg.num_attention_heads),
    }
