"""Memory by formula for the local profile stage: the KV-cache formulas and the cache's measured
bytes, weight bytes, and the estimate of what a point will need, checked before anything is
allocated. The live readings (RSS and its sampler, CUDA peak, memory available) are in
:mod:`tasks.memory.readings`.

This module imports only the standard library and torch, so it runs on a GPU machine that has
torch and transformers and nothing else. Definitions follow DESIGN.md, "Metric definitions",
"Local:".

KV cache, the two formulas
--------------------------
Every decoder layer caches one key and one value vector per KV head for every position it has
seen, so (DESIGN.md)::

    kv_cache_bytes_formula = batch x positions x 2 x layers x kv_heads x head_dim x dtype_bytes

The seed article writes ``batch x positions x 2 x layers x hidden_size x dtype_bytes``. That is
the same number only when every attention head has its own K/V head (``kv_heads == heads``, and
``heads x head_dim == hidden_size``). With grouped-query attention (GQA) several query heads share
one K/V head and the seed's form over-counts by ``heads / kv_heads``: SmolLM2-135M has 9 heads and
3 KV heads, so the seed's form is 3x too large; Llama-2-7B (32 / 32) is where it is exact.

Both formulas assume every layer attends to all positions. A model with sliding-window layers
(Mistral's window, Gemma's local layers) holds fewer positions in those layers, so the measured
cache is then smaller than the formula.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tasks.models.arch import text_config

__all__ = [
    "MemoryNeedError",
    "PointMemory",
    "RUNTIME_OVERHEAD_BYTES",
    "check_memory",
    "dtype_bytes",
    "estimate_point_memory",
    "format_gib",
    "kv_cache_bytes_formula",
    "kv_cache_bytes_measured",
    "kv_cache_bytes_seed_formula",
    "kv_geometry",
    "weights_bytes",
]


# --------------------------------------------------------------------------------------------
# KV cache: formula and geometry
# --------------------------------------------------------------------------------------------


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype (float32 -> 4, bfloat16 / float16 -> 2)."""
    return torch.empty((), dtype=dtype).element_size()


def _check_non_negative(**values: int) -> None:
    for name, value in values.items():
        if int(value) != value or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def kv_cache_bytes_formula(
    batch: int,
    positions: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
) -> int:
    """KV-cache size in bytes by formula, GQA-aware (DESIGN.md, "Local:").

    ``batch x positions x 2 x num_layers x num_kv_heads x head_dim x dtype_bytes``; the 2 is one
    key and one value tensor per layer. ``positions`` is the number of positions the cache
    holds (for a transformers ``DynamicCache`` after a prefill of N tokens and T one-token decode
    steps: N + T).

    Example: Llama-2-7B (32 layers, 32 KV heads, head_dim 128), batch 1, 4096 positions, fp16:
    1 x 4096 x 2 x 32 x 32 x 128 x 2 = 2147483648 bytes = 2 GiB.

    Raises:
        ValueError: an argument is negative or not an integer.
    """
    _check_non_negative(
        batch=batch,
        positions=positions,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
    )
    return int(batch * positions * 2 * num_layers * num_kv_heads * head_dim * dtype_bytes)


def kv_cache_bytes_seed_formula(
    batch: int, positions: int, num_layers: int, hidden_size: int, dtype_bytes: int
) -> int:
    """KV-cache size in bytes by the seed article's form, which uses ``hidden_size``.

    ``batch x positions x 2 x num_layers x hidden_size x dtype_bytes``. It equals
    :func:`kv_cache_bytes_formula` only when ``num_kv_heads x head_dim == hidden_size``, i.e.
    without grouped-query attention (``kv_heads == heads``). Under GQA it is too large by
    ``heads / kv_heads`` (SmolLM2-135M: 9 heads, 3 KV heads -> 3x). Kept so that reports can
    show both numbers and the ratio; use :func:`kv_cache_bytes_formula` for sizing.

    Raises:
        ValueError: an argument is negative or not an integer.
    """
    _check_non_negative(
        batch=batch,
        positions=positions,
        num_layers=num_layers,
        hidden_size=hidden_size,
        dtype_bytes=dtype_bytes,
    )
    return int(batch * positions * 2 * num_layers * hidden_size * dtype_bytes)


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config.

    - num_layers = ``num_hidden_layers``
    - num_kv_heads = ``num_key_value_heads``, defaulting to ``num_attention_heads`` (no GQA)
    - head_dim = ``config.head_dim`` when present and set, else
      ``hidden_size // num_attention_heads``

    Multimodal configs are reduced to their text decoder (``get_text_config(decoder=True)``).

    Raises:
        ValueError: the config lacks ``num_hidden_layers`` or ``num_attention_heads``.
    """
    cfg = text_config(config)
    num_layers = getattr(cfg, "num_hidden_layers", None)
    num_heads = getattr(cfg, "num_attention_heads", None)
    if num_layers is None or num_heads is None:
        raise ValueError("config has no num_hidden_layers / num_attention_heads: not a decoder config")
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return int(num_layers), int(num_kv_heads), int(head_dim)


def kv_cache_bytes_measured(cache: Any) -> int:
    """Bytes held by the key and value tensors of a transformers 5 cache (e.g. ``DynamicCache``).

    Sums ``tensor.nbytes`` over ``layer.keys`` and ``layer.values`` of every entry of
    ``cache.layers`` (each of shape [batch, kv_heads, positions, head_dim]); layers not yet
    initialised (``None``) count 0. A tensor shared between layers (KV sharing) counts once.
    For a quantised cache this counts only the full-precision residual in ``keys``/``values``.

    Raises:
        TypeError: ``cache`` has no ``layers`` attribute (e.g. a legacy tuple cache).
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"expected a transformers Cache with .layers, got {type(cache).__name__}")
    seen: set[tuple[int, int]] = set()
    total = 0
    for layer in layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if not isinstance(tensor, torch.Tensor):
                continue
            key = (tensor.data_ptr(), tensor.nbytes)
            if tensor.nbytes and key in seen:
                continue
            seen.add(key)
            total += tensor.nbytes
    return int(total)


def weights_bytes(model: torch.nn.Module, include_buffers: bool = True) -> int:
    """Bytes of a model's parameters (and, by default, buffers), each storage counted once.

    Tied or shared tensors (e.g. ``lm_head.weight`` tied to the input embedding) are the same
    memory, so tensors are deduplicated by ``(device, data_ptr)``. Buffers are small for
    decoder LMs (Llama: the rotary ``inv_freq``) but are memory the model holds. Meta tensors
    (no storage) count 0.
    """
    tensors = list(model.parameters())
    if include_buffers:
        tensors += list(model.buffers())
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in tensors:
        if tensor.is_meta:
            continue
        key = (str(tensor.device), tensor.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.nbytes
    return int(total)


# --------------------------------------------------------------------------------------------
# How much memory a point will need, before anything is allocated
# --------------------------------------------------------------------------------------------

#: Added to every estimate: the torch runtime's own buffers, thread pools, allocator slack.
RUNTIME_OVERHEAD_BYTES = 256 * 2**20


class MemoryNeedError(MemoryError):
    """A point needs more memory than the device has free; raised before allocating (a CPU
    process that runs out is killed by the kernel, with no swap and no traceback)."""


class PointMemory(NamedTuple):
    """Estimated bytes one profile point needs (:func:`estimate_point_memory`)."""

    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes


def estimate_point_memory(
    config: Any,
    *,
    parameters: int,
    dtype_bytes: int,
    batch: int,
    prompt_tokens: int,
    max_new_tokens: int,
    prefill_chunk_size: int = 0,
) -> PointMemory:
    """Bytes a point (batch B, prompt N, T decode steps, prefill chunk C) will need.

    - weights: ``parameters x dtype_bytes`` (exact for dense models; buffers are tiny)
    - KV cache: :func:`kv_cache_bytes_formula` at N + T positions (exact for full attention)
    - activations, the peak inside one prefill forward of q = C (or N) new positions against
      k = N cached ones (an upper estimate, not a measurement): residual stream and its norm
      (2 x B x q x hidden), q/k/v and the attention output (B x q x (2 x heads + 2 x kv_heads)
      x head_dim), K/V repeated to all heads for GQA (2 x B x heads x k x head_dim), the
      attention scores if the kernel materialises them (B x heads x q x k), the MLP's gate, up
      and product (3 x B x q x intermediate), all in the dtype; the last position's logits in
      float32 (B x vocab x 4); plus :data:`RUNTIME_OVERHEAD_BYTES`.

    Raises:
        ValueError: a count is negative, or the config is not a decoder config.
    """
    _check_non_negative(
        parameters=parameters,
        dtype_bytes=dtype_bytes,
        batch=batch,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        prefill_chunk_size=prefill_chunk_size,
    )
    cfg = text_config(config)
    layers, kv_heads, head_dim = kv_geometry(cfg)
    heads, hidden = int(cfg.num_attention_heads), int(cfg.hidden_size)
    intermediate = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
    q = prefill_chunk_size if 0 < prefill_chunk_size < prompt_tokens else prompt_tokens
    k = prompt_tokens
    elements = (
        2 * batch * q * hidden
        + batch * q * (2 * heads + 2 * kv_heads) * head_dim
        + 2 * batch * heads * k * head_dim
        + batch * heads * q * k
        + 3 * batch * q * intermediate
    )
    activations = elements * dtype_bytes + batch * int(cfg.vocab_size) * 4 + RUNTIME_OVERHEAD_BYTES
    kv = kv_cache_bytes_formula(
        batch, prompt_tokens + max_new_tokens, layers, kv_heads, head_dim, dtype_bytes
    )
    return PointMemory(int(parameters * dtype_bytes), kv, int(activations))


def format_gib(value: int) -> str:
    """Bytes as ``"1.5 GiB"`` (one decimal), for one-line messages."""
    return f"{value / 2**30:.1f} GiB"


def check_memory(what: str, need: PointMemory, available: int, weights_resident: bool) -> None:
    """Raise :class:`MemoryNeedError` when ``need`` does not fit in ``available`` bytes.

    ``weights_resident``: the model is already loaded, so only the KV cache and activations
    must still fit. The message is one line naming ``what`` (the point) and the figures.
    """
    needed = need.total_bytes - (need.weights_bytes if weights_resident else 0)
    if needed > available:
        parts = (
            f"KV cache {format_gib(need.kv_cache_bytes)} + activations {format_gib(need.activation_bytes)}"
        )
        if not weights_resident:
            parts = f"weights {format_gib(need.weights_bytes)} + {parts}"
        raise MemoryNeedError(
            f"{what}: needs about {format_gib(needed)} ({parts}) but {format_gib(available)} is "
            "available; use a smaller batch or prompt, bfloat16, or a prefill chunk size"
        )
