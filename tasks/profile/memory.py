"""Memory measurement for the local profile stage: KV-cache formula and measurement, weight
bytes, a peak-RSS sampler running in a separate process, and CUDA peak-memory helpers.

This module imports only the standard library and torch at import time (psutil is imported
lazily, and only where RSS is read), so it runs on a GPU machine that has torch and
transformers and nothing else. Definitions follow DESIGN.md, "Metric definitions", "Local:".

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

import os
import subprocess
import sys
from typing import Any, NamedTuple

import torch

__all__ = [
    "CudaPeak",
    "MemoryNeedError",
    "PointMemory",
    "RssSampler",
    "available_memory_bytes",
    "cuda_allocated_bytes",
    "cuda_peak_bytes",
    "cuda_reset_peak",
    "dtype_bytes",
    "estimate_point_memory",
    "kv_cache_bytes_formula",
    "kv_cache_bytes_measured",
    "kv_cache_bytes_seed_formula",
    "kv_geometry",
    "check_memory",
    "rss_bytes",
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
        batch=batch, positions=positions, num_layers=num_layers,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
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
        batch=batch, positions=positions, num_layers=num_layers,
        hidden_size=hidden_size, dtype_bytes=dtype_bytes,
    )
    return int(batch * positions * 2 * num_layers * hidden_size * dtype_bytes)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except TypeError:
            return get()
    return config


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
    cfg = _text_config(config)
    num_layers = getattr(cfg, "num_hidden_layers", None)
    num_heads = getattr(cfg, "num_attention_heads", None)
    if num_layers is None or num_heads is None:
        raise ValueError(
            "config has no num_hidden_layers / num_attention_heads: not a decoder config"
        )
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
# Resident set size: read it, and sample its peak from another process
# --------------------------------------------------------------------------------------------


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process in bytes (default: this one).

    Uses psutil when installed, else ``/proc/<pid>/statm`` (Linux).

    Raises:
        RuntimeError: neither psutil nor /proc is available.
    """
    pid = os.getpid() if pid is None else pid
    try:
        import psutil
    except ImportError:
        try:
            with open(f"/proc/{pid}/statm", encoding="ascii") as handle:
                return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError as exc:
            raise RuntimeError("reading RSS needs psutil or /proc") from exc
    return int(psutil.Process(pid).memory_info().rss)


# The sampler child: imports only the standard library (and psutil when it is there). It prints
# "ready <rss>" after its first sample, polls until its stdin closes (the parent's stop signal, or
# the parent's death), takes one last sample and prints "peak <bytes> <samples>".
_SAMPLER_CODE = r"""
import os, sys, threading, time
pid = int(sys.argv[1]); interval = float(sys.argv[2])
try:
    import psutil
    _proc = psutil.Process(pid)
    def rss():
        return _proc.memory_info().rss
except ImportError:
    _page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/%d/statm" % pid, "rb") as f:
            return int(f.read().split()[1]) * _page
stop = threading.Event()
def wait_for_eof():
    sys.stdin.buffer.read()
    stop.set()
threading.Thread(target=wait_for_eof, daemon=True).start()
peak = rss(); samples = 1
sys.stdout.write("ready %d\n" % peak); sys.stdout.flush()
while not stop.is_set():
    time.sleep(interval)
    try:
        value = rss()
    except Exception:
        break
    samples += 1
    if value > peak:
        peak = value
sys.stdout.write("peak %d %d\n" % (peak, samples)); sys.stdout.flush()
"""


class RssSampler:
    """Peak resident memory of this process during a ``with`` block, sampled by a child process.

    DESIGN.md, "Local:" ``peak_memory_bytes`` on CPU = peak RSS sampled by a separate process
    during the point, minus the RSS before it. The child (``python -c``, standard library plus
    psutil) polls this process's RSS every ``interval_s`` (default 5 ms); sampling from another
    process keeps the poller off this process's GIL and out of its RSS. ``__enter__`` returns
    only after the child has taken its first sample, so the child's start-up (about 0.1 s) is
    paid before the measured region. On exit the child's stdin is closed, it takes a last sample
    and reports its peak; this process also reads its own RSS once more at exit.

    After the block:
        baseline_bytes: RSS of this process just before the block (bytes).
        peak_bytes: highest RSS seen during the block (bytes, >= baseline_bytes).
        peak_delta_bytes: ``peak_bytes - baseline_bytes``.
        samples: how many samples the child took.

    A sampled peak can miss a spike shorter than the interval. RSS also reflects the allocator:
    memory freed but kept by malloc still counts, so a second run in one process can show a
    smaller delta than the first.

    Raises:
        RuntimeError: the child did not start or did not report (message has its stderr).
    """

    def __init__(self, interval_s: float = 0.005, start_timeout_s: float = 30.0) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self.start_timeout_s = start_timeout_s
        self.baseline_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.peak_delta_bytes: int | None = None
        self.samples: int = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> RssSampler:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER_CODE, str(os.getpid()), repr(self.interval_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self._proc.stdout.readline()  # blocks until the first sample is taken
        if not line.startswith("ready"):
            self._fail("did not start")
        self.baseline_bytes = rss_bytes()
        return self

    def __exit__(self, *exc_info: object) -> None:
        final = rss_bytes()
        proc = self._proc
        assert proc is not None
        try:
            out, _err = proc.communicate(input="", timeout=self.start_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            if exc_info[0] is None:
                raise RuntimeError("RSS sampler did not report its peak in time") from None
            return
        peak_line = [ln for ln in out.splitlines() if ln.startswith("peak")]
        if not peak_line:
            if exc_info[0] is None:
                self._fail("reported no peak")
            return
        _, peak, samples = peak_line[-1].split()
        self.samples = int(samples)
        assert self.baseline_bytes is not None
        self.peak_bytes = max(int(peak), final, self.baseline_bytes)
        self.peak_delta_bytes = self.peak_bytes - self.baseline_bytes

    def _fail(self, what: str) -> None:
        proc = self._proc
        err = ""
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                err = (proc.communicate(timeout=5)[1] or "").strip()
            except (subprocess.TimeoutExpired, ValueError):
                pass
        raise RuntimeError(f"RSS sampler {what}: {err.splitlines()[-1] if err else 'no stderr'}")


# --------------------------------------------------------------------------------------------
# CUDA peak memory (no-ops on other devices)
# --------------------------------------------------------------------------------------------


class CudaPeak(NamedTuple):
    """Peak CUDA memory since the last reset, in bytes."""

    allocated_bytes: int  # torch.cuda.max_memory_allocated: bytes held by live tensors
    reserved_bytes: int  # torch.cuda.max_memory_reserved: bytes the caching allocator held


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def cuda_reset_peak(device: torch.device | str | None) -> None:
    """Synchronise and reset CUDA peak-memory statistics of ``device``; does nothing off CUDA."""
    if _is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device: torch.device | str | None) -> CudaPeak | None:
    """Peak allocated and reserved CUDA bytes on ``device`` since :func:`cuda_reset_peak`.

    Returns None off CUDA. DESIGN.md's ``peak_memory_bytes`` on CUDA is ``allocated_bytes``
    (absolute: weights and everything else live count too, unlike the CPU RSS delta).
    """
    if not _is_cuda(device):
        return None
    torch.cuda.synchronize(device)
    return CudaPeak(
        allocated_bytes=int(torch.cuda.max_memory_allocated(device)),
        reserved_bytes=int(torch.cuda.max_memory_reserved(device)),
    )


def cuda_allocated_bytes(device: torch.device | str | None) -> int | None:
    """Bytes currently allocated by tensors on a CUDA ``device``; None off CUDA."""
    if not _is_cuda(device):
        return None
    return int(torch.cuda.memory_allocated(device))



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
        parameters=parameters, dtype_bytes=dtype_bytes, batch=batch,
        prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
        prefill_chunk_size=prefill_chunk_size,
    )
    cfg = _text_config(config)
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


def available_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Memory free for a new allocation: CPU ``psutil.virtual_memory().available`` (what the
    kernel can give without swapping; ``MemAvailable`` of /proc/meminfo without psutil), CUDA ``torch.cuda.mem_get_info()[0]`` plus what torch's
    caching allocator holds but does not use."""
    if _is_cuda(device):
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        import psutil
    except ImportError:  # a machine with only torch and transformers: Linux's own figure
        with open("/proc/meminfo", encoding="ascii") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        return int(fields["MemAvailable"].split()[0]) * 1024
    return int(psutil.virtual_memory().available)


def _gib(value: int) -> str:
    return f"{value / 2**30:.1f} GiB"


def check_memory(what: str, need: PointMemory, available: int, weights_resident: bool) -> None:
    """Raise :class:`MemoryNeedError` when ``need`` does not fit in ``available`` bytes.

    ``weights_resident``: the model is already loaded, so only the KV cache and activations
    must still fit. The message is one line naming ``what`` (the point) and the figures.
    """
    needed = need.total_bytes - (need.weights_bytes if weights_resident else 0)
    if needed > available:
        parts = f"KV cache {_gib(need.kv_cache_bytes)} + activations {_gib(need.activation_bytes)}"
        if not weights_resident:
            parts = f"weights {_gib(need.weights_bytes)} + {parts}"
        raise MemoryNeedError(
            f"{what}: needs about {_gib(needed)} ({parts}) but {_gib(available)} is available; "
            "use a smaller batch or prompt, bfloat16, or a prefill chunk size"
        )
