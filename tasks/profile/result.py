"""Typed results of the local profile stage; ``to_dict()`` gives the JSON contract.

- :class:`GpuMetrics`: NVML power / utilisation / energy over a CUDA point's timed repeats;
- :class:`PointMeasurement`: what :func:`tasks.profile.measure.profile_point` measured on one
  point of a loaded model;
- :class:`ProfilePointResult`: one row of :func:`tasks.profile.runner.run_sweep`: the point's
  parameters, whether and why it failed, where it ran, and its measurement.

The dicts that ``to_dict()`` returns are what leaves the package (the stage's return value,
``profile_points.json`` / ``.jsonl``, MLflow metrics, ``--json``, ``python -m tasks.profile``):
their keys, key order and values are the contract (``tests/data/profile_point_row.json`` holds
an example). Field names are those keys, so a field's unit is in its name: ``_ms``
milliseconds, ``_bytes`` bytes, ``_per_s`` per second, ``_gb_per_s`` 1e9 bytes per second,
``_w`` watts, ``_pct`` percent, ``_joules`` joules; token counts and positions are in tokens.
Sequences are tuples here (frozen all the way down) and lists in ``to_dict()``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from tasks.profile.gpu_metrics import GPU_METRIC_KEYS
from tasks.profile.grid import ProfilePoint
from tasks.stats.interval import PROFILE_INTERVAL_FIGURES, figure_intervals
from tasks.stats.samples import profile_units

__all__ = ["GpuMetrics", "PointMeasurement", "ProfilePointResult"]


def _plain(value: Any) -> Any:
    """Tuples (nested too) as lists: the JSON form of a sequence field."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class GpuMetrics:
    """NVML readings over a CUDA point's timed repeats (:mod:`tasks.profile.gpu_metrics`); a
    field is None when NVML could not read it (no nvidia-ml-py, no driver library, a metric the
    GPU does not support)."""

    gpu_power_w_mean: float | None = None  #: mean board power draw, W
    gpu_power_w_max: float | None = None  #: highest board power sample, W
    gpu_utilization_pct_mean: float | None = None  #: mean kernel-busy share, %
    gpu_utilization_pct_max: float | None = None  #: highest kernel-busy sample, %
    gpu_energy_joules: float | None = None  #: energy counter difference, J
    gpu_metric_samples: int | None = None  #: sampling rounds taken

    @classmethod
    def from_readings(cls, readings: dict[str, float | int]) -> GpuMetrics:
        """From :attr:`tasks.profile.gpu_metrics.NvmlSampler.metrics` (only the keys read)."""
        return cls(**{k: readings[k] for k in GPU_METRIC_KEYS if k in readings})

    def to_dict(self) -> dict[str, float | int | None]:
        """All six keys, in :data:`~tasks.profile.gpu_metrics.GPU_METRIC_KEYS` order."""
        return {k: getattr(self, k) for k in GPU_METRIC_KEYS}


@dataclass(frozen=True)
class PointMeasurement:
    """One measured point (prompt length N, batch B, T = max_new_tokens decode steps).

    Times in ms, sizes in bytes, rates per second; how each is taken: see
    :func:`tasks.profile.measure.profile_point`. ``gpu_metrics`` is None off CUDA; its keys are
    then absent from :meth:`to_dict` (on CUDA all six are there, None when NVML read nothing).
    """

    prompt_tokens: int  #: N, prompt length in tokens
    batch_size: int  #: B, sequences per forward
    max_new_tokens: int  #: T, decode steps (each sequence gets T + 1 new tokens)
    repeats: int  #: timed repeats
    warmup: int  #: untimed warm-up runs before them
    prefill_chunk_size: int  #: tokens per prefill forward; 0 = one forward
    prefill_chunks: int  #: forwards the prefill took
    prefill_ms: float  #: median prefill time over the timed repeats (forward + argmax)
    prefill_ms_runs: tuple[float, ...]  #: each timed repeat's prefill time
    warmup_prefill_ms: tuple[float, ...]  #: each warm-up run's prefill time
    prefill_tokens_per_s: float  #: B x N / prefill seconds
    ttft_local_ms: float  #: = prefill_ms: local time to first token (no tokenizer, queue, network)
    decode_ms: tuple[float, ...]  #: the T step times of the median timed repeat (by total decode)
    decode_ms_runs: tuple[tuple[float, ...], ...]  #: every timed repeat's T step times
    decode_ms_mean: float  #: over decode_ms
    decode_ms_p50: float
    decode_ms_p90: float
    decode_ms_p95: float
    decode_ms_p99: float
    decode_ms_max: float
    decode_tokens_per_s: float  #: B / (decode_ms_p50 / 1000): one step makes B tokens
    weights_bytes: int  #: parameters + buffers, shared tensors once
    kv_cache_bytes_after_prefill: int  #: measured bytes of the cache tensors after prefill
    kv_cache_bytes: int  #: measured bytes of the cache tensors after the T decode steps
    kv_cache_positions_after_prefill: int  #: positions the cache holds after prefill (N)
    kv_cache_positions: int  #: positions it holds after decode (N + T)
    kv_cache_bytes_formula_after_prefill: int  #: GQA-aware formula at N positions
    kv_cache_bytes_formula: int  #: GQA-aware formula at N + T positions
    kv_cache_bytes_seed_formula: int  #: the seed's hidden_size form at N + T positions
    kv_seed_formula_ratio: float | None  #: seed / formula (= heads / kv_heads); None if formula 0
    peak_memory_bytes: int  #: CPU: peak RSS minus RSS before; CUDA: max_memory_allocated
    peak_memory_source: str  #: "rss_sampler_delta" | "cuda_max_memory_allocated"
    peak_memory_baseline_bytes: int | None  #: RSS / allocated bytes before the point
    peak_memory_reserved_bytes: int | None  #: CUDA max_memory_reserved; None on CPU
    decode_bandwidth_gb_per_s: float | None  #: CUDA: bytes read per step / step time; else None
    gpu_metrics: GpuMetrics | None  #: CUDA: NVML readings; None on CPU (keys left out)
    device: str  #: "cpu", "cuda", "cuda:1"
    device_name: str  #: GPU name, or the CPU's processor / machine string
    dtype: str  #: "float32", "bfloat16", "float16"
    torch_num_threads: int
    attn_implementation: str | None  #: the model config's _attn_implementation
    input_ids_shape: tuple[int, ...]  #: [B, N]
    last_hidden_state_shape: tuple[int, ...]  #: [B, N, hidden]
    embedding_shape: tuple[int, ...]  #: [vocab, hidden]
    generated_token_ids: tuple[int, ...]  #: the T + 1 new ids of the median repeat's first row
    new_tokens_per_sequence: int  #: T + 1
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_attention_heads: int

    def to_dict(self) -> dict[str, Any]:
        """The point's keys in field order, ``gpu_metrics`` spread in place (CUDA) or left out."""
        out: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "gpu_metrics":
                out.update(value.to_dict() if value is not None else {})
            else:
                out[field.name] = _plain(value)
        return out


@dataclass(frozen=True)
class ProfilePointResult:
    """One point of a sweep (:func:`tasks.profile.runner.run_sweep`), ran or failed.

    ``point`` carries the max_new_tokens the point ran with. ``error`` is None, or
    ``"ExceptionClass: message"`` on one line (``PointProcessDied: ...`` when a child process
    was killed); ``measurement`` and ``generated_text`` are None for a failed point.
    """

    model: str  #: the model spec (gguf:, hf:, arch:)
    point: ProfilePoint
    device: str  #: the resolved device, "cpu" / "cuda"
    random_weights: bool  #: an arch: spec: real timing and memory, meaningless text
    error: str | None
    memory_estimate_bytes: int  #: the estimate the memory check used (weights + KV + activations)
    child_process: bool  #: whether the point ran in a spawned child process
    measurement: PointMeasurement | None = None
    generated_text: str | None = None  #: the decoded generated_token_ids; None for random weights
    #: --breakdown: the profiled breakdown and roofline (tasks.profile.roofline.PointAnalysis)
    analysis: Any = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def parameters(self) -> dict[str, Any]:
        """The values that identify the point (model, prompt_tokens, batch_size, dtype,
        prefill_chunk_size, max_new_tokens, device, random_weights)."""
        return {
            "model": self.model,
            **asdict(self.point),
            "device": self.device,
            "random_weights": self.random_weights,
        }

    def to_dict(self) -> dict[str, Any]:
        """The row: :meth:`parameters`, failed, error, memory_estimate_bytes, child_process,
        then (a point that ran) the measurement's keys not already there, generated_text, and
        ``prefill_ms_ci_low`` / ``_high``, ``decode_ms_p50_ci_low`` / ``_high`` (95 % percentile
        bootstrap over the timed repeats, ``tasks.stats.interval``; None below 2 repeats).

        Keys the measurement shares with the parameters keep their place; the measurement's
        values win, except ``dtype``, which stays the point's (the names are the same).
        """
        row = {
            **self.parameters(),
            "failed": self.failed,
            "error": self.error,
            "memory_estimate_bytes": self.memory_estimate_bytes,
            "child_process": self.child_process,
        }
        if self.measurement is not None:
            row.update(self.measurement.to_dict())
            row["dtype"] = self.point.dtype
            row["generated_text"] = self.generated_text
            # 95 % intervals over the timed repeats (and their decode steps), beside the figures
            row.update(figure_intervals(profile_units(row), PROFILE_INTERVAL_FIGURES))
        if self.analysis is not None:  # only under --breakdown: keys "breakdown", "roofline"
            row.update(self.analysis.to_dict())
        return row
