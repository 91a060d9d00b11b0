"""The profile grid: which points a sweep runs (prompt length x batch size x dtype x prefill
chunk size x max_new_tokens), their labels, and the checks made before anything heavy happens.

Plain code (standard library, torch, transformers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tasks.models.sources import default_dtype, model_config, resolve
from tasks.profile.timing import resolve_device

__all__ = [
    "DTYPES",
    "ProfilePoint",
    "check_request",
    "chosen_dtypes",
    "point_label",
    "profile_points",
    "steps_swept",
]

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ProfilePoint:
    """One point's parameters (prompt length, chunk size and max_new_tokens in tokens).

    ``max_new_tokens`` None = the ``max_new_tokens`` given to :func:`run_sweep`.
    """

    prompt_tokens: int
    batch_size: int
    dtype: str
    prefill_chunk_size: int = 0
    max_new_tokens: int | None = None

    def label(self, steps: bool = False) -> str:
        """``N=128 B=4 bfloat16 chunk=64``; ``steps``: also ``T=32`` (max_new_tokens), for a
        sweep over more than one max_new_tokens value."""
        chunk = f" chunk={self.prefill_chunk_size}" if self.prefill_chunk_size else ""
        shown = f" T={self.max_new_tokens}" if steps and self.max_new_tokens is not None else ""
        return f"N={self.prompt_tokens} B={self.batch_size} {self.dtype}{chunk}{shown}"


def profile_points(
    prompt_lengths: Sequence[int],
    batch_sizes: Sequence[int],
    dtypes: Sequence[str],
    prefill_chunk_sizes: Sequence[int] = (0,),
    max_new_tokens: int | Sequence[int] | None = None,
) -> list[ProfilePoint]:
    """The cross product, dtype-major (one model per dtype), then prompt length, batch, chunk,
    max_new_tokens (None: the points carry None and take :func:`run_sweep`'s value).

    A chunk size >= the prompt length is the same as no chunking: such points are dropped
    unless no smaller chunk size was asked for (then one unchunked point, chunk 0, remains).
    """
    steps_values = _as_list(max_new_tokens) if max_new_tokens is not None else [None]
    points: list[ProfilePoint] = []
    for dtype in dtypes:
        for n in prompt_lengths:
            chunks = sorted({c if 0 < c < n else 0 for c in prefill_chunk_sizes})
            for batch in batch_sizes:
                points.extend(ProfilePoint(n, batch, dtype, c, t) for c in chunks for t in steps_values)
    return points


def _as_list(values: int | Sequence[int]) -> list[int]:
    return [int(values)] if isinstance(values, int) else [int(v) for v in values]


def steps_swept(points: Sequence[ProfilePoint] | Sequence[dict]) -> bool:
    """Whether the points (or result rows) hold more than one max_new_tokens value; labels
    then show ``T=``."""
    values = {p["max_new_tokens"] if isinstance(p, dict) else p.max_new_tokens for p in points}
    return len(values) > 1


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


def chosen_dtypes(spec: str, dtypes: Sequence[str] | None) -> list[str]:
    """The dtypes asked for, or (None or empty) the spec's default (:func:`default_dtype`)."""
    return list(dtypes) if dtypes else [default_dtype(spec)]


def check_request(
    spec: str,
    dtypes: Sequence[str] | None,
    prompt_lengths: Sequence[int],
    max_new_tokens: int | Sequence[int],
    device: str,
    num_layers: int | None = None,
) -> tuple[torch.device, list[str], Any]:
    """Validate a sweep before anything heavy happens.

    Returns (device, dtypes, config); ``dtypes`` None = the spec's default (:func:`default_dtype`).
    ``max_new_tokens``: one value or the swept values; the context check uses the largest.

    Raises:
        tasks.models.sources.ModelSourceError: the spec does not resolve (unknown preset: the message
            lists the presets).
        ValueError: a dtype the device cannot run, a prompt length + max_new_tokens over the
            model's context (``max_position_embeddings``), or a device that is not there.
            Each message is one line naming the value and the alternatives.
    """
    resolve(spec)
    try:
        resolved = resolve_device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device {device}: {exc}; use cpu or auto") from None
    chosen = chosen_dtypes(spec, dtypes)
    runnable = [d for d in DTYPES if dtype_supported(d, resolved)]
    for dtype in chosen:
        if dtype not in runnable:
            raise ValueError(
                f"dtype {dtype!r} cannot run on {resolved}; this device runs: {', '.join(runnable)}"
            )
    config = model_config(spec, num_layers=num_layers)
    text = config.get_text_config(decoder=True)
    context = getattr(text, "max_position_embeddings", None)
    steps = max(_as_list(max_new_tokens))
    if context:
        too_long = [n for n in prompt_lengths if n + steps > context]
        if too_long:
            fix = (
                f"use prompt lengths <= {context - steps} or a smaller max_new_tokens"
                if steps < context
                else f"use max_new_tokens < {context}"
            )
            raise ValueError(
                f"prompt length {too_long[0]} + max_new_tokens {steps} exceeds the model's "
                f"context of {context} tokens; {fix}"
            )
    return resolved, chosen, config


def point_label(row: dict, steps: bool = False) -> str:
    """The label of a result row (see :meth:`ProfilePoint.label`; ``steps``: show ``T=``)."""
    return ProfilePoint(
        row["prompt_tokens"],
        row["batch_size"],
        row["dtype"],
        row.get("prefill_chunk_size", 0),
        row.get("max_new_tokens"),
    ).label(steps)
