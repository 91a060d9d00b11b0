"""The server's prefix cache, measured over one load level.

Two sources, side by side (DESIGN.md, "Cached prompt tokens"):

- The server's counters: vLLM counts the prompt tokens it looked up in its prefix cache and the
  ones it found (``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, Prometheus counters
  exposed as ``..._total``; ``vllm:gpu_prefix_cache_*`` before V1). They are cumulative since the
  server started, so a level's hit rate is the increase of hits over the increase of queries
  between a scrape before the level and one after it: never the lifetime ratio, and never the
  rolling ``vllm:gpu_prefix_cache_hit_rate`` gauge (vLLM PR #46938). ``prefix_cache_hit_rate``.
- The requests' usage: ``usage.prompt_tokens_details.cached_tokens`` per request
  (``RequestRecord.cached_tokens``); ``cached_token_fraction`` = their sum over the sum of the
  same requests' ``usage.prompt_tokens`` (the server's count, chat template included, the one
  its cache counts in; not the client's ``input_tokens``).

Pure functions over scrapes (``tasks.stream.prometheus.parse`` dicts) and records; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: (hits, queries) counter names, newest first: vLLM V1, then vLLM V0's.
PREFIX_CACHE_COUNTERS: tuple[tuple[str, str], ...] = (
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
)


def prefix_cache_hit_rate(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> float | None:
    """Prompt tokens found in the prefix cache / prompt tokens looked up, over the level.

    Args:
        before, after: the server's metrics just before and just after the level
            (``tasks.stream.prometheus.scrape``).

    Returns the ratio of the counters' increases (0..1), or None when a scrape is missing, the
    server has none of :data:`PREFIX_CACHE_COUNTERS`, or it looked up no token in the level.
    """
    if not before or not after:
        return None
    for hits, queries in PREFIX_CACHE_COUNTERS:
        if all(name in before and name in after for name in (hits, queries)):
            looked_up = after[queries] - before[queries]
            return (after[hits] - before[hits]) / looked_up if looked_up > 0 else None
    return None


def cached_token_fraction(records: Iterable[Any]) -> float | None:
    """Cached prompt tokens / prompt tokens by the server's usage, over the measured successful
    requests whose usage reported both; None when none did."""
    cached = prompt = 0
    for r in records:
        if r.warmup or not r.succeeded or r.cached_tokens is None or not r.usage_prompt_tokens:
            continue
        cached += r.cached_tokens
        prompt += r.usage_prompt_tokens
    return cached / prompt if prompt else None


def level_figures(
    records: Iterable[Any], before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> dict[str, float | None]:
    """``prefix_cache_hit_rate`` (the server's counters) and ``cached_token_fraction`` (the
    requests' usage) of one level: see the module docstring."""
    return {
        "prefix_cache_hit_rate": prefix_cache_hit_rate(before, after),
        "cached_token_fraction": cached_token_fraction(records),
    }
