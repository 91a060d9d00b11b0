"""The server's ``usage`` object, read so that no value it holds can mislead or crash a record.

A streamed answer's last chunk may carry ``usage`` (asked for with
``stream_options={"include_usage": true}``): ``prompt_tokens``, ``completion_tokens``,
``total_tokens``, and optionally ``completion_tokens_details.reasoning_tokens`` and
``prompt_tokens_details.cached_tokens`` (OpenAI's chat-completions reference). Servers differ
and some are wrong, so every count is checked before it is used (DESIGN.md, "Metric
definitions", rules of 2026-12-01):

- A count is trusted only when it is a non-negative integer (an integral float such as ``5.0``
  is taken as its integer); ``NaN``, a string, a negative number, ``true``: not trusted.
- ``completion_tokens`` of 0 for a stream that carried text is not trusted either.
- Reasoning tokens: OpenAI and vLLM count them inside ``completion_tokens``
  (``prompt + completion = total``: convention ``included``); other providers report them apart,
  so that ``prompt + completion + reasoning = total`` (convention ``separate``; LiveBench PR #503,
  vercel/ai PR #12425). The convention is decided from the totals, and the generated tokens are
  ``completion`` or ``completion + reasoning`` accordingly. Totals that fit neither are flagged
  (``neither``) and not trusted. Without a total (or a prompt count) to decide by: ``separate``
  when ``completion < reasoning`` (a count that includes the reasoning cannot be smaller), else
  OpenAI's documented meaning, and the convention is ``unverified``.

When the count is not trusted the caller counts the text with its tokenizer
(``output_tokens_source: tokenizer``) and keeps :attr:`UsageReading.problem` beside it.

Pure functions; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The usage conventions for reasoning tokens (module docstring).
INCLUDED, SEPARATE, NEITHER, UNVERIFIED = "included", "separate", "neither", "unverified"


@dataclass(frozen=True)
class UsageReading:
    """What a usage object says, checked.

    Attributes:
        output_tokens: the generated tokens by the usage (reasoning included under either
            convention), or None when the usage is absent or not trusted (:attr:`problem`).
        prompt_tokens: ``prompt_tokens`` when it is a count, else None.
        cached_tokens: ``prompt_tokens_details.cached_tokens`` when it is a count, else None.
        reasoning_tokens: ``completion_tokens_details.reasoning_tokens`` when it is a count.
        convention: for a usage with reasoning tokens: ``included``, ``separate``, ``neither``
            or ``unverified`` (module docstring); None without reasoning tokens.
        problem: why ``output_tokens`` is None although a usage came (one sentence naming the
            field and its value); None when trusted or when no usage came.
    """

    output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    convention: str | None = None
    problem: str | None = None


def count(value: Any) -> int | None:
    """``value`` as a token count, or None when it is not a non-negative integer (``NaN``,
    infinities, strings, booleans, negatives, fractions)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and math.isfinite(value) and value >= 0 and value.is_integer():
        return int(value)
    return None


def as_mapping(usage: Any) -> Mapping[str, Any] | None:
    """A usage as a mapping: a dict from the SSE parser as it is, the openai client's pydantic
    ``CompletionUsage`` by ``model_dump()``; None for anything else."""
    if usage is None or isinstance(usage, Mapping):
        return usage
    dump = getattr(usage, "model_dump", None)
    if callable(dump):
        try:
            data = dump()
        except Exception:  # noqa: BLE001 - a malformed model is "no usage", never a crash
            return None
        return data if isinstance(data, Mapping) else None
    return None


def _detail(usage: Mapping[str, Any], group: str, key: str) -> int | None:
    details = usage.get(group)
    return count(details.get(key)) if isinstance(details, Mapping) else None


def read_usage(usage: Any, *, carried_text: bool) -> UsageReading:
    """Check a stream's final usage (module docstring).

    Args:
        usage: the last ``usage`` the stream carried (a dict, the openai client's object, or
            None when none came).
        carried_text: whether the stream carried generated text (a count of 0 is then wrong).

    Returns a :class:`UsageReading`; never raises, whatever the server sent.
    """
    data = as_mapping(usage)
    if data is None:
        problem = None if usage is None else f"usage is not an object: {usage!r:.80}"
        return UsageReading(problem=problem)
    prompt = count(data.get("prompt_tokens"))
    cached = _detail(data, "prompt_tokens_details", "cached_tokens")
    reasoning = _detail(data, "completion_tokens_details", "reasoning_tokens")
    base = {"prompt_tokens": prompt, "cached_tokens": cached, "reasoning_tokens": reasoning}
    raw = data.get("completion_tokens")
    completion = count(raw)
    if completion is None:
        return UsageReading(
            **base, problem=f"usage completion_tokens={raw!r:.40} is not a non-negative integer"
        )
    if not reasoning:
        reading = UsageReading(**base, output_tokens=completion)
    else:
        reading = _with_reasoning(base, completion, reasoning, count(data.get("total_tokens")))
    if reading.output_tokens == 0 and carried_text:
        return UsageReading(**base, problem="usage says 0 completion tokens for a stream that carried text")
    return reading


def _with_reasoning(base: dict[str, Any], completion: int, reasoning: int, total: int | None) -> UsageReading:
    """The generated tokens of a usage that reports reasoning tokens, by its convention."""
    prompt = base["prompt_tokens"]
    if total is None or prompt is None:
        # no totals to decide by: "included" is impossible when completion < reasoning
        if completion < reasoning:
            return UsageReading(**base, output_tokens=completion + reasoning, convention=SEPARATE)
        return UsageReading(**base, output_tokens=completion, convention=UNVERIFIED)
    if prompt + completion == total:
        return UsageReading(**base, output_tokens=completion, convention=INCLUDED)
    if prompt + completion + reasoning == total:
        return UsageReading(**base, output_tokens=completion + reasoning, convention=SEPARATE)
    return UsageReading(
        **base,
        convention=NEITHER,
        problem=(
            f"usage totals fit neither reasoning convention: prompt {prompt} + completion "
            f"{completion} = {prompt + completion} (included) and + reasoning {reasoning} = "
            f"{prompt + completion + reasoning} (separate), but total_tokens = {total}"
        ),
    )
