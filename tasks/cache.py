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

Isolation: seeded prompts replayed against a long-lived server measure its cache, not the
server (vLLM #54227: mean TTFT 49x lower). Before a level's measured requests the stream stage
resets the cache where the server offers it (:func:`reset_prefix_cache`: vLLM's
``POST /reset_prefix_cache``, in its development mode); where it does not, the random prompts'
per-run salt keeps one run's prompts out of the next's cache. A reset is not a cold start (the
allocator, CUDA graphs and warm pages stay): the records say which one a level had.

Pure functions over scrapes (``tasks.stream.prometheus.parse`` dicts) and records, and one HTTP
call (:func:`reset_prefix_cache`).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: A warning is given when a level of a workload built to share nothing reads a hit rate at or
#: above this (vLLM PR #53920 warns the same way).
UNEXPECTED_HIT_RATE = 0.01


def reset_prefix_cache(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str | None:
    """Ask the server to empty its prefix cache: ``POST <root>/reset_prefix_cache`` (vLLM; the
    route exists in its development mode, ``VLLM_SERVER_DEV_MODE=1``).

    Returns None when the server said yes (HTTP 2xx), else why not, in a few words (``HTTP 404``,
    ``connection refused``): a server without the route keeps its cache.
    """
    root = base_url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    request = urllib.request.Request(f"{root}/reset_prefix_cache", data=b"", method="POST")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


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


def expected_cached_token_fraction(
    requests: Iterable[Sequence[tuple[str, int]]], seen: set[str] | None = None
) -> float | None:
    """The share of the prompt tokens a perfect prefix cache (unbounded, never evicting) would
    supply, from the workload's construction.

    Args:
        requests: each request's blocks in send order, ``((key, tokens), ...)``: requests that
            share a key share that block's tokens (``tasks.workload.stage.StageWorkload.blocks``).
        seen: the keys already in the cache when the level starts (empty after a reset; the
            earlier levels' and the warm-up's blocks otherwise); updated in place.

    A request's leading blocks already seen count as cached, up to the first block not seen: a
    prefix cache reuses a prefix, never a block after one it missed. None for no prompt token.
    """
    cached, total = expected_cached_tokens(requests, set() if seen is None else seen)
    return cached / total if total else None


def expected_cached_tokens(requests: Iterable[Sequence[tuple[str, int]]], seen: set[str]) -> tuple[int, int]:
    """(cached, all) prompt tokens of :func:`expected_cached_token_fraction`; ``seen`` updated
    in place (for a share over several runs, each starting from its own cache)."""
    cached = total = 0
    for blocks in requests:
        leading = True
        for key, tokens in blocks:
            total += tokens
            leading = leading and key in seen
            if leading:
                cached += tokens
        seen.update(key for key, _ in blocks)
    return cached, total


def level_figures(
    records: Iterable[Any], before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> dict[str, float | None]:
    """``prefix_cache_hit_rate`` (the server's counters) and ``cached_token_fraction`` (the
    requests' usage) of one level: see the module docstring."""
    return {
        "prefix_cache_hit_rate": prefix_cache_hit_rate(before, after),
        "cached_token_fraction": cached_token_fraction(records),
    }
