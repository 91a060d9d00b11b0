"""The local profile's sweep: prompt length x batch size x dtype x prefill chunk size over one
model spec, one :func:`tasks.profile.profile_point` per point.

Plain code (standard library, torch, transformers, psutil): the profile stage of the audit and
the ``infermeter profile`` command both call :func:`run_sweep`; orchestration and tracking stay
in ``tasks/pipeline.py``.

Memory is checked before it is allocated (there is no swap: a process that runs out is killed by
the kernel, with no traceback): before a dtype's model is built or loaded, its weights plus the
smallest point's KV cache and activations must fit in the available memory; before each point,
that point's KV cache and activations must (:func:`tasks.memory.estimate_point_memory`). A point
that does not fit, or that raises, is recorded as failed with its cause, and the sweep goes on.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tasks import profile
from tasks.memory import (
    available_memory_bytes,
    check_memory,
    dtype_bytes,
    estimate_point_memory,
)
from tasks.models import default_dtype, load_model, model_config, parameter_count, resolve

__all__ = ["SweepPoint", "check_request", "run_sweep", "sweep_points"]

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SweepPoint:
    """One point's parameters (prompt length and chunk size in tokens)."""

    prompt_tokens: int
    batch_size: int
    dtype: str
    prefill_chunk_size: int = 0

    def label(self) -> str:
        chunk = f" chunk={self.prefill_chunk_size}" if self.prefill_chunk_size else ""
        return f"N={self.prompt_tokens} B={self.batch_size} {self.dtype}{chunk}"


def sweep_points(
    prompt_lengths: Sequence[int],
    batch_sizes: Sequence[int],
    dtypes: Sequence[str],
    prefill_chunk_sizes: Sequence[int] = (0,),
) -> list[SweepPoint]:
    """The cross product, dtype-major (one model per dtype), then prompt length, batch, chunk.

    A chunk size >= the prompt length is the same as no chunking: such points are dropped
    unless no smaller chunk size was asked for (then one unchunked point, chunk 0, remains).
    """
    points: list[SweepPoint] = []
    for dtype in dtypes:
        for n in prompt_lengths:
            chunks = sorted({c if 0 < c < n else 0 for c in prefill_chunk_sizes})
            for batch in batch_sizes:
                points.extend(SweepPoint(n, batch, dtype, c) for c in chunks)
    return points


def dtype_supported(dtype: str, device: torch.device) -> bool:
    """Whether ``device`` runs a matmul and a softmax in ``dtype`` (CUDA bfloat16 also needs
    ``torch.cuda.is_bf16_supported()``)."""
    if dtype not in DTYPES:
        return False
    torch_dtype = getattr(torch, dtype)
    if device.type == "cuda" and torch_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return False
    try:
        x = torch.ones(4, 4, dtype=torch_dtype, device=device)
        torch.softmax(x @ x, dim=-1)
    except (RuntimeError, TypeError):
        return False
    return True


def check_request(
    spec: str,
    dtypes: Sequence[str] | None,
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    device: str,
    num_layers: int | None = None,
) -> tuple[torch.device, list[str], Any]:
    """Validate a sweep before anything heavy happens.

    Returns (device, dtypes, config); ``dtypes`` None = the spec's default (:func:`default_dtype`).

    Raises:
        tasks.models.ModelSourceError: the spec does not resolve (unknown preset: the message
            lists the presets).
        ValueError: a dtype the device cannot run, a prompt length + max_new_tokens over the
            model's context (``max_position_embeddings``), or a device that is not there.
            Each message is one line naming the value and the alternatives.
    """
    resolve(spec)
    try:
        resolved = profile.resolve_device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device {device}: {exc}; use cpu or auto") from None
    chosen = list(dtypes) if dtypes else [default_dtype(spec)]
    runnable = [d for d in DTYPES if dtype_supported(d, resolved)]
    for dtype in chosen:
        if dtype not in runnable:
            raise ValueError(
                f"dtype {dtype!r} cannot run on {resolved}; this device runs: {', '.join(runnable)}"
            )
    config = model_config(spec, num_layers=num_layers)
    text = config.get_text_config(decoder=True)
    context = getattr(text, "max_position_embeddings", None)
    if context:
        too_long = [n for n in prompt_lengths if n + max_new_tokens > context]
        if too_long:
            raise ValueError(
                f"prompt length {too_long[0]} + max_new_tokens {max_new_tokens} exceeds the model's "
                f"context of {context} tokens; use prompt lengths <= {context - max_new_tokens}"
            )
    return resolved, chosen, config


def _touch_weights(model: torch.nn.Module, device: torch.device) -> None:
    """One untimed one-token forward right after loading: transformers may map a checkpoint's
    weights lazily (safetensors mmap), so without it the first point's peak RSS would count
    the weights being paged in."""
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)


def run_sweep(
    spec: str,
    points: Sequence[SweepPoint],
    *,
    max_new_tokens: int,
    repeats: int,
    warmup: int,
    device: torch.device | str,
    num_layers: int | None = None,
    on_point: Callable[[int, int, dict], None] | None = None,
    available: Callable[[torch.device], int] = available_memory_bytes,
) -> list[dict[str, Any]]:
    """Profile every point; returns one dict per point, in order.

    Each dict has the point's parameters (model, prompt_tokens, batch_size, dtype,
    prefill_chunk_size, max_new_tokens, device, random_weights), ``failed`` (bool), ``error``
    (None, or ``"ExceptionClass: message"``) and ``memory_estimate_bytes`` (the estimate the
    check used); a point that ran also has every key of :func:`tasks.profile.profile_point` and
    ``generated_text`` (None for random weights: their text means nothing). ``on_point(index,
    total, result)`` is called after each point, outside any timed region.

    Raises nothing for a point's failure (memory, a torch error): it is recorded.
    """
    device = profile.resolve_device(device)
    source = resolve(spec)
    results: list[dict[str, Any]] = []
    by_dtype: dict[str, list[SweepPoint]] = {}
    for point in points:
        by_dtype.setdefault(point.dtype, []).append(point)
    config = model_config(spec, num_layers=num_layers)
    parameters = parameter_count(config)

    def estimate(point: SweepPoint):
        return estimate_point_memory(
            config, parameters=parameters, dtype_bytes=dtype_bytes(getattr(torch, point.dtype)),
            batch=point.batch_size, prompt_tokens=point.prompt_tokens,
            max_new_tokens=max_new_tokens, prefill_chunk_size=point.prefill_chunk_size,
        )

    def record(point: SweepPoint, data: dict, error: BaseException | None) -> None:
        row = {
            "model": spec, **asdict(point), "max_new_tokens": max_new_tokens,
            "device": str(device), "random_weights": source.random_weights,
            "failed": error is not None,
            "error": None if error is None else f"{type(error).__name__}: {error}"[:1000],
            "memory_estimate_bytes": estimate(point).total_bytes, **data,
        }
        row["dtype"] = point.dtype
        results.append(row)
        if on_point is not None:
            on_point(len(results) - 1, len(points), row)

    for dtype, group in by_dtype.items():
        smallest = min(group, key=lambda p: estimate(p).total_bytes)
        try:
            check_memory(
                f"model {spec} in {dtype}", estimate(smallest), available(device), weights_resident=False
            )
            model, tokenizer = load_model(spec, dtype, str(device), num_layers=num_layers)
            _touch_weights(model, device)
        except Exception as exc:  # every point of this dtype fails with the same cause
            for point in group:
                record(point, {}, exc)
            continue
        try:
            for point in group:
                try:
                    check_memory(point.label(), estimate(point), available(device), weights_resident=True)
                    prompt_ids = profile.make_prompt_ids(tokenizer, point.prompt_tokens)
                    data = profile.profile_point(
                        model, prompt_ids=prompt_ids, batch_size=point.batch_size,
                        max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup,
                        device=device, prefill_chunk_size=point.prefill_chunk_size,
                    )
                except Exception as exc:  # noqa: BLE001 - recorded; the sweep goes on
                    if device.type == "cuda":
                        torch.cuda.empty_cache()  # after an OOM, hand the cached blocks back
                    record(point, {}, exc)
                    continue
                data["generated_text"] = (
                    None if source.random_weights
                    else tokenizer.decode(data.get("generated_token_ids", []))
                )
                record(point, data, None)
        finally:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def point_label(row: dict) -> str:
    """The label of a result row (see :meth:`SweepPoint.label`)."""
    return SweepPoint(
        row["prompt_tokens"], row["batch_size"], row["dtype"], row.get("prefill_chunk_size", 0)
    ).label()

