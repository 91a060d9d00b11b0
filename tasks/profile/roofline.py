"""The roofline of one point: the device's measured ceilings (a copy benchmark for memory
bandwidth, a matmul benchmark for compute), the FLOPs and bytes of prefill and of a decode step,
and which ceiling each phase sits under. Standard library and torch only.

The roofline model: Williams, Waterman, Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 52(4), 2009. A phase whose arithmetic intensity
(FLOPs / bytes moved) is below the ridge point (peak FLOP/s / peak bytes/s) cannot reach the
compute ceiling: it is memory-bound; above it, compute-bound.

FLOPs (forward, a multiply-add = 2 FLOPs), after PaLM (Chowdhery et al. 2022, appendix B:
6N + 12·L·H·Q·T per token for training, i.e. 2N + 4·L·H·Q·T forward):

- matmul weights: 2 x (weight elements of every nn.Linear inside the decoder layers) x tokens,
  plus 2 x (lm_head elements) x rows through the head (prefill keeps 1 row per sequence per
  forward, ``logits_to_keep=1``; decode 1 per sequence). The embedding lookup is a gather: 0.
- attention: QK^T and (softmax)V each 2·head_dim FLOPs per (query, key) pair per head, so
  4·B·L·H·d per pair; causal: query i sees i + 1 keys, so prefill over N tokens does
  4·B·L·H·d·N(N+1)/2 and a decode step with c positions in the cache (the new one included)
  4·B·L·H·d·c. Useful FLOPs: a kernel that computes the masked half too does more.

Bytes (what a step must move at least; activations not counted):

- decode step: the weights read once (all parameters and buffers, but of an untied input
  embedding only the B rows looked up) + the KV cache held after the step (measured from the
  cache tensors: bytes after prefill + per-position bytes x positions added);
- prefill: the same weights (the embedding's B·N rows) + the KV cache it writes (measured).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = [
    "DeviceCeilings",
    "PhaseRoofline",
    "Roofline",
    "attention_flops_decode",
    "attention_flops_prefill",
    "linear_weight_elements",
    "measure_ceilings",
    "roofline",
]


@dataclass(frozen=True)
class DeviceCeilings:
    """Measured ceilings of one device and dtype."""

    device: str
    dtype: str
    copy_bandwidth_gb_per_s: float  #: best of the copy runs: 2 x bytes (read + write) / s / 1e9
    matmul_flop_per_s: float  #: best of the matmul runs: 2 n^3 / s
    copy_bytes: int  #: size of the copied tensor
    matmul_n: int  #: n of the n x n matmul

    @property
    def ridge_flop_per_byte(self) -> float:
        return self.matmul_flop_per_s / (self.copy_bandwidth_gb_per_s * 1e9)


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocation, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


_CEILINGS: dict[tuple[str, str], DeviceCeilings] = {}


def measure_ceilings(device: torch.device | str, dtype: torch.dtype, repeats: int = 5) -> DeviceCeilings:
    """Copy bandwidth and matmul rate on ``device`` in ``dtype``, measured once per process
    (cached). Copy: ``dst.copy_(src)`` of 256 MiB (CUDA: 1 GiB), larger than any CPU cache;
    matmul: n x n (n = 1024 on CPU, 8192 on CUDA). Best of ``repeats``."""
    device = torch.device(device)
    key = (str(device), str(dtype))
    if key in _CEILINGS:
        return _CEILINGS[key]
    copy_bytes = (2**30 if device.type == "cuda" else 2**28) // 4 * 4
    n = 8192 if device.type == "cuda" else 1024

    def copy_seconds() -> float:  # the tensors are freed when it returns
        elem = torch.empty((), dtype=dtype).element_size()
        src = torch.ones(copy_bytes // elem, dtype=dtype, device=device)
        dst = torch.empty_like(src)
        return _best_seconds(lambda: dst.copy_(src), device, repeats)

    def matmul_seconds() -> float:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        return _best_seconds(lambda: torch.mm(a, b), device, repeats)

    copy_s, mm_s = copy_seconds(), matmul_seconds()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the benchmark's blocks must not count as a point's memory
    ceilings = DeviceCeilings(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        copy_bandwidth_gb_per_s=2 * copy_bytes / copy_s / 1e9,
        matmul_flop_per_s=2 * n**3 / mm_s,
        copy_bytes=copy_bytes,
        matmul_n=n,
    )
    _CEILINGS[key] = ceilings
    return ceilings


def linear_weight_elements(model: torch.nn.Module, layers: torch.nn.ModuleList) -> tuple[int, int]:
    """(weight elements of every nn.Linear inside ``layers``, elements of the lm_head weight)."""
    body = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings()
    return int(body), int(head.weight.numel()) if head is not None else 0


def attention_flops_prefill(batch: int, layers: int, heads: int, head_dim: int, tokens: int) -> int:
    """4·B·L·H·d·N(N+1)/2: causal QK^T and AV over a prompt of N tokens (module docstring)."""
    return 4 * batch * layers * heads * head_dim * tokens * (tokens + 1) // 2


def attention_flops_decode(batch: int, layers: int, heads: int, head_dim: int, positions: int) -> int:
    """4·B·L·H·d·c: one query against c cached positions (the new one included)."""
    return 4 * batch * layers * heads * head_dim * positions


@dataclass(frozen=True)
class PhaseRoofline:
    """One phase on the roofline."""

    phase: str  #: "prefill" | "decode" (decode: the mean step)
    flops: float  #: FLOPs of the phase (decode: mean per step)
    bytes: float  #: bytes it must move (decode: mean per step)
    time_ms: float  #: measured time (timed repeats: prefill_ms, decode_ms_mean)
    arithmetic_intensity_flop_per_byte: float
    achieved_flop_per_s: float
    achieved_bandwidth_gb_per_s: float
    bandwidth_fraction: float  #: achieved / measured copy bandwidth
    compute_fraction: float  #: achieved / measured matmul rate
    bound: str  #: "memory-bound" | "compute-bound" (intensity vs ridge point)
    verdict: str  #: one line with the numbers


@dataclass(frozen=True)
class Roofline:
    """A point's roofline: the ceilings and both phases."""

    ceilings: DeviceCeilings
    ridge_flop_per_byte: float
    prefill: PhaseRoofline
    decode: PhaseRoofline

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self.ceilings),
            "ridge_flop_per_byte": self.ridge_flop_per_byte,
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
        }


def _phase(name: str, flops: float, moved: float, time_ms: float, ceilings: DeviceCeilings) -> PhaseRoofline:
    seconds = time_ms / 1000
    intensity = flops / moved
    bound = "memory-bound" if intensity < ceilings.ridge_flop_per_byte else "compute-bound"
    bandwidth = moved / seconds / 1e9
    rate = flops / seconds
    fraction_bw = bandwidth / ceilings.copy_bandwidth_gb_per_s
    fraction_c = rate / ceilings.matmul_flop_per_s
    verdict = (
        f"{name}: {bound}, {bandwidth:,.1f} GB/s = {100 * fraction_bw:.0f} % of measured copy bandwidth, "
        f"{rate / 1e9:,.1f} GFLOP/s = {100 * fraction_c:.0f} % of measured matmul rate, "
        f"intensity {intensity:,.1f} FLOP/B vs ridge {ceilings.ridge_flop_per_byte:,.1f}"
    )
    return PhaseRoofline(
        name, flops, moved, time_ms, intensity, rate, bandwidth, fraction_bw, fraction_c, bound, verdict
    )


def roofline(
    model: torch.nn.Module, layers: torch.nn.ModuleList, point: Any, ceilings: DeviceCeilings
) -> Roofline:
    """Both phases of ``point`` (a :class:`~tasks.profile.result.PointMeasurement` or anything
    with its fields: batch_size, prompt_tokens, max_new_tokens, prefill_chunks, prefill_ms,
    decode_ms_mean, kv_cache_bytes(_after_prefill), kv_cache_positions(_after_prefill),
    weights_bytes, num_layers, num_attention_heads, head_dim) on ``ceilings``."""
    b, n, t = point.batch_size, point.prompt_tokens, point.max_new_tokens
    body, head = linear_weight_elements(model, layers)
    geometry = (b, point.num_layers, point.num_attention_heads, point.head_dim)
    prefill_flops = (
        2 * body * b * n + 2 * head * b * point.prefill_chunks + attention_flops_prefill(*geometry, n)
    )
    # decode step i (0-based) ends with c = N + i + 1 positions; the mean of c over T steps:
    mean_positions = n + (t + 1) / 2
    decode_flops = 2 * body * b + 2 * head * b + attention_flops_decode(*geometry, 1) * mean_positions
    embedding = model.get_input_embeddings().weight
    tied = head is not None and model.get_output_embeddings().weight.data_ptr() == embedding.data_ptr()
    row_bytes = embedding.shape[1] * embedding.element_size()
    weights_read = point.weights_bytes - (0 if tied else embedding.numel() * embedding.element_size())

    def weights(rows: int) -> int:
        return weights_read + (0 if tied else min(rows, embedding.shape[0]) * row_bytes)

    kv_prefill = point.kv_cache_bytes_after_prefill
    added = point.kv_cache_positions - point.kv_cache_positions_after_prefill
    per_position = (point.kv_cache_bytes - kv_prefill) / added if added else 0.0
    decode_bytes = weights(b) + kv_prefill + per_position * (t + 1) / 2
    return Roofline(
        ceilings=ceilings,
        ridge_flop_per_byte=ceilings.ridge_flop_per_byte,
        prefill=_phase("prefill", prefill_flops, weights(b * n) + kv_prefill, point.prefill_ms, ceilings),
        decode=_phase("decode", decode_flops, decode_bytes, point.decode_ms_mean, ceilings),
    )


@dataclass(frozen=True)
class PointAnalysis:
    """A point's breakdown (:mod:`tasks.profile.breakdown`) and roofline; each may have failed
    (``breakdown.error``, ``roofline_error``) while the point's timing stands."""

    breakdown: Any  #: tasks.profile.breakdown.Breakdown
    roofline: Roofline | None
    roofline_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """{"breakdown": {...}, "roofline": {...} | {"failed": true, "error": ...}}."""
        return {
            "breakdown": self.breakdown.to_dict(),
            "roofline": (
                {"failed": False, "error": None, **self.roofline.to_dict()}
                if self.roofline is not None
                else {"failed": True, "error": self.roofline_error}
            ),
        }


def _describe(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:1000]


def analyse_point(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    measurement: Any,
    *,
    decode_steps: int,
    trace_path: str | None = None,
) -> PointAnalysis:
    """The breakdown (one profiled prefill + ``decode_steps`` steps of ``input_ids`` [B, N]) and
    the roofline of a measured point, after its timed repeats. A failure of either is recorded
    in the result, never raised (the point's timing is kept)."""
    from tasks.profile.breakdown import Breakdown, find_decoder_layers, profile_breakdown

    try:
        breakdown = profile_breakdown(
            model,
            input_ids,
            decode_steps=decode_steps,
            prefill_chunk_size=measurement.prefill_chunk_size,
            trace_path=trace_path,
        )
    except Exception as exc:  # noqa: BLE001 - recorded on the point; its timing stands
        breakdown = Breakdown(error=_describe(exc))
    try:
        _, layers = find_decoder_layers(model)
        ceilings = measure_ceilings(input_ids.device, next(model.parameters()).dtype)
        return PointAnalysis(breakdown, roofline(model, layers, measurement, ceilings))
    except Exception as exc:  # noqa: BLE001 - recorded on the point
        return PointAnalysis(breakdown, None, _describe(exc))
