"""Local profile: one point of a loaded model (:func:`profile_point`): warm-up and timed runs of
prefill + T decode steps (:mod:`tasks.profile.phases`) inside a memory window, then the figures
(:class:`~tasks.profile.result.PointMeasurement`). Imports only the standard library, torch and
transformers (through the package's own modules, which import the same), so it runs alone on a
GPU machine (``python -m tasks.profile``, :mod:`tasks.profile.standalone`).
"""

from __future__ import annotations

import contextlib
import math
import platform
from typing import Any

import torch

from tasks.memory.formula import (
    dtype_bytes,
    kv_cache_bytes_formula,
    kv_cache_bytes_seed_formula,
    kv_geometry,
    weights_bytes,
)
from tasks.memory.readings import (
    RssSampler,
    cuda_allocated_bytes,
    cuda_peak_bytes,
    cuda_reset_peak,
)
from tasks.profile.gpu_metrics import NvmlSampler
from tasks.profile.phases import TimedRun, last_hidden_state_shape, one_run
from tasks.profile.result import GpuMetrics, PointMeasurement
from tasks.profile.timing import median_index, percentile, resolve_device

__all__ = ["DEFAULT_PROMPT_TEXT", "make_prompt_ids", "profile_point"]

#: A natural English text, tiled to the requested prompt length by :func:`make_prompt_ids`.
DEFAULT_PROMPT_TEXT = (
    "A language model answers in two phases. First it reads the whole prompt at once, "
    "computing keys and values for every token and storing them in a cache; this is the "
    "prefill, and its length decides how long a user waits for the first word. Then it "
    "writes the answer one token at a time, each step reading every weight and the whole "
    "cache again to produce a single new token; this is the decode, and its speed decides "
    "how fast the words keep coming. "
)


def make_prompt_ids(tokenizer: Any, length: int, text: str = DEFAULT_PROMPT_TEXT) -> torch.LongTensor:
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


def _warmup_and_runs(
    model, input_ids, max_new_tokens: int, warmup: int, repeats: int, chunk: int, window=None
) -> tuple[list[float], list[TimedRun]]:
    """Untimed-for-statistics warm-up runs (their prefill times kept), then the timed runs,
    inside ``window`` (a context manager, e.g. :class:`NvmlSampler`) when one is given."""
    warmup_prefill_ms = [one_run(model, input_ids, max_new_tokens, chunk).prefill_ms for _ in range(warmup)]
    with window if window is not None else contextlib.nullcontext():
        runs = [one_run(model, input_ids, max_new_tokens, chunk) for _ in range(repeats)]
    return warmup_prefill_ms, runs


def _check_point_arguments(prompt_ids: torch.Tensor, **counts: tuple[int, int]) -> None:
    """Raise ValueError unless prompt_ids is a LongTensor [1, N >= 1] and each count is an
    integer at least its floor (``name=(value, floor)``)."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must have shape [1, N] with N >= 1, got {list(prompt_ids.shape)}")
    if prompt_ids.dtype != torch.long:
        raise ValueError(f"prompt_ids must be a LongTensor, got {prompt_ids.dtype}")
    for name, (value, least) in counts.items():
        if int(value) != value or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


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
) -> PointMeasurement:
    """Measure one point (prompt length N, batch B, T decode steps) of a causal LM.

    ``model`` must already sit on ``device`` in the dtype to measure; it is put in eval mode.
    ``prompt_ids``: LongTensor [1, N], tiled to [B, N]. Under ``torch.inference_mode()``, each
    of ``warmup + repeats`` runs uses a fresh ``DynamicCache(config=model.config)``, times one
    prefill over [B, N] (forward + argmax of the first new token) and then exactly
    ``max_new_tokens`` greedy decode steps, each timed on its own
    (:func:`~tasks.profile.phases.one_run`). EOS is ignored. Warm-up runs are left out of the
    statistics (their prefill times are kept). ``prefill_chunk_size`` > 0 feeds the prompt in
    chunks through the cache (:func:`~tasks.profile.phases.prefill`); the prefill time then
    covers all chunks (it is still the local TTFT).

    The result's fields are documented on :class:`~tasks.profile.result.PointMeasurement`; how
    the less obvious ones are taken:

    - prefill_ms is the median over the timed repeats; decode_ms is the step list of the median
      timed repeat by total decode time (lower median for an even count), and its statistics
      and generated_token_ids come from that repeat;
    - kv_cache_bytes* are read from the cache after prefill and after decode; the formulas
      (:mod:`tasks.memory.formula`) use the positions read from the cache;
    - peak_memory_bytes: CPU: peak RSS (sampled by a separate process,
      :class:`~tasks.memory.readings.RssSampler`) during the point (warm-up and timed
      repeats) minus the RSS before it; CUDA: torch.cuda.max_memory_allocated over the point
      after reset_peak_memory_stats (absolute, weights included);
    - decode_bandwidth_gb_per_s (CUDA only): bytes read per decode step (weights + the cache
      held after the step) summed over the median repeat's steps / its decode time; a lower
      bound on traffic (activations are not counted);
    - gpu_metrics (CUDA only): NVML over the timed repeats, not the warm-ups
      (:mod:`tasks.profile.gpu_metrics`);
    - last_hidden_state_shape: from one extra forward with output_hidden_states=True after the
      timed runs.

    Raises:
        ValueError: prompt_ids is not [1, N] with N >= 1, or batch_size / max_new_tokens /
            repeats < 1, or warmup < 0 or prefill_chunk_size < 0, or the model is not on
            ``device``.
        RuntimeError: cuda asked for but not available (from :func:`resolve_device`).
    """
    _check_point_arguments(
        prompt_ids,
        batch_size=(batch_size, 1),
        max_new_tokens=(max_new_tokens, 1),
        repeats=(repeats, 1),
        warmup=(warmup, 0),
        prefill_chunk_size=(prefill_chunk_size, 0),
    )
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

        hidden_shape = last_hidden_state_shape(model, input_ids, prefill_chunk_size)

    prefill_runs = [r.prefill_ms for r in runs]
    prefill_ms = percentile(prefill_runs, 50)
    median_run = runs[median_index([sum(r.decode_ms) for r in runs])]
    decode_ms = median_run.decode_ms
    decode_p50 = percentile(decode_ms, 50)

    cfg = model.config.get_text_config(decoder=True)
    num_layers, num_kv_heads, head_dim = kv_geometry(cfg)
    hidden_size = int(cfg.hidden_size)
    elem = dtype_bytes(dtype)
    positions_prefill = median_run.kv_cache_positions_after_prefill
    positions = median_run.kv_cache_positions

    def kv_formula(held: int) -> int:
        return kv_cache_bytes_formula(batch_size, held, num_layers, num_kv_heads, head_dim, elem)

    formula = kv_formula(positions)
    seed = kv_cache_bytes_seed_formula(batch_size, positions, num_layers, hidden_size, elem)
    wbytes = weights_bytes(model)

    bandwidth = None
    if device.type == "cuda":
        per_step = [wbytes + kv_formula(positions_prefill + i + 1) for i in range(max_new_tokens)]
        bandwidth = sum(per_step) / (sum(decode_ms) / 1000) / 1e9

    return PointMeasurement(
        prompt_tokens=n,
        batch_size=int(batch_size),
        max_new_tokens=int(max_new_tokens),
        repeats=int(repeats),
        warmup=int(warmup),
        prefill_chunk_size=int(prefill_chunk_size),
        prefill_chunks=math.ceil(n / prefill_chunk_size) if 0 < prefill_chunk_size < n else 1,
        prefill_ms=prefill_ms,
        prefill_ms_runs=tuple(prefill_runs),
        warmup_prefill_ms=tuple(warmup_prefill_ms),
        prefill_tokens_per_s=batch_size * n / (prefill_ms / 1000),
        ttft_local_ms=prefill_ms,
        decode_ms=tuple(decode_ms),
        decode_ms_runs=tuple(tuple(r.decode_ms) for r in runs),
        decode_ms_mean=sum(decode_ms) / len(decode_ms),
        decode_ms_p50=decode_p50,
        decode_ms_p90=percentile(decode_ms, 90),
        decode_ms_p95=percentile(decode_ms, 95),
        decode_ms_p99=percentile(decode_ms, 99),
        decode_ms_max=max(decode_ms),
        decode_tokens_per_s=batch_size / (decode_p50 / 1000),
        weights_bytes=wbytes,
        kv_cache_bytes_after_prefill=median_run.kv_cache_bytes_after_prefill,
        kv_cache_bytes=median_run.kv_cache_bytes,
        kv_cache_positions_after_prefill=positions_prefill,
        kv_cache_positions=positions,
        kv_cache_bytes_formula_after_prefill=kv_formula(positions_prefill),
        kv_cache_bytes_formula=formula,
        kv_cache_bytes_seed_formula=seed,
        kv_seed_formula_ratio=seed / formula if formula else None,
        peak_memory_bytes=int(peak_memory_bytes),
        peak_memory_source=source,
        peak_memory_baseline_bytes=baseline,
        peak_memory_reserved_bytes=reserved,
        decode_bandwidth_gb_per_s=bandwidth,
        gpu_metrics=GpuMetrics.from_readings(gpu.metrics) if gpu is not None else None,
        device=str(device),
        device_name=(
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else (platform.processor() or platform.machine())
        ),
        dtype=str(dtype).removeprefix("torch."),
        torch_num_threads=torch.get_num_threads(),
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        input_ids_shape=tuple(input_ids.shape),
        last_hidden_state_shape=tuple(hidden_shape),
        embedding_shape=tuple(model.get_input_embeddings().weight.shape),
        generated_token_ids=tuple(median_run.tokens[0].tolist()),
        new_tokens_per_sequence=max_new_tokens + 1,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden_size,
        num_attention_heads=int(cfg.num_attention_heads),
    )
