"""The server's prefix cache, measured over one load level.

Two sources, side by side (DESIGN.md, "Cached prompt tokens"):

- The server's counters: vLLM counts the prompt tokens it looked up in its prefix cache and the
  ones it found (``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, Prometheus counters
  exposed as ``..._total``; ``vllm:gpu_prefix_cache_*`` before V1); SGLang counts the cached
  prompt tokens in ``sglang:cached_tokens_total`` (one series per ``cache_source`` label value,
  summed) against ``sglang:prompt_tokens_total`` (:data:`PREFIX_CACHE_COUNTERS`). They are
  cumulative since the server started, so a level's hit rate is the increase of hits over the
  increase of queries between a scrape before the level and one after it: never the lifetime
  ratio, and never a rate gauge (vLLM's rolling ``vllm:gpu_prefix_cache_hit_rate``, vLLM PR
  #46938; SGLang's ``sglang:cache_hit_rate``, which holds the last batch alone, sglang #26608).
  ``prefix_cache_hit_rate``.
- The requests' usage: ``usage.prompt_tokens_details.cached_tokens`` per request, or where the
  server sends none, llama.cpp's own ``timings.cache_n`` of the stream's final chunk
  (``tasks.stream.client``; ``RequestRecord.cached_tokens``); ``cached_token_fraction`` = their
  sum over the sum of the same requests' ``usage.prompt_tokens`` (the server's count, chat
  template included, the one its cache counts in; not the client's ``input_tokens``).

Expected share: what a perfect cache would supply, from the workload's construction
(:func:`expected_cached_token_fraction`), counted in whole cache blocks: a paged cache (vLLM)
reuses a block only when all its tokens match, so a request sharing ``s`` leading tokens gets
``floor(s / block) * block`` (vLLM's ``vllm:cache_config_info`` gauge names its ``block_size``:
:func:`block_size_tokens`; else the user's ``cache_block_size_tokens``; else per-token reuse,
said in the warning). :func:`mismatch_warning` says when the measured share is more than
:data:`MISMATCH_POINTS` points off the expected one, with the likely cause.

Isolation: seeded prompts replayed against a long-lived server measure its cache, not the
server (vLLM #54227: mean TTFT 49x lower). Before a level's measured requests the stream stage
resets the cache where the server offers it (``tasks.endpoint.endpoint_http.reset_prefix_cache``:
vLLM's ``POST /reset_prefix_cache``, in its development mode, on the endpoint's way: its proxy,
its CA bundle); where it does not, the random prompts' per-run salt keeps one run's prompts out
of the next's cache. A reset is not a cold start (the allocator, CUDA graphs and warm pages
stay): the records say which one a level had.

Pure functions over scrapes (``tasks.endpoint.prometheus.parse`` dicts) and records (the reset's
HTTP call is :mod:`tasks.endpoint.endpoint_http`'s, beside the other calls to the endpoint: this
module makes none), and :class:`ExpectedCache`, what a perfect cache holds across a run's levels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: A warning is given when a level of a workload built to share nothing reads a hit rate at or
#: above this (vLLM PR #53920 warns the same way).
UNEXPECTED_HIT_RATE = 0.01


def reset_refused(why: str) -> str:
    """The warning for a prefix-cache reset that did not happen (``why``: what
    ``tasks.endpoint.endpoint_http.reset_prefix_cache`` returned). A server that answered without
    the route (or redirected it: not followed) keeps its cache between levels; one that did not
    answer at all is said to be unreachable, not to lack the route (a server that died during a
    run: its level's errors say the rest)."""
    if why.startswith("HTTP "):
        return (
            f"the server offers no prefix-cache reset ({why} at /reset_prefix_cache): its cache is kept "
            "between levels; random prompts are salted per run, so another run does not reuse them"
        )
    return (
        f"the prefix-cache reset got no answer from the server ({why}): it may be down or unreachable; "
        "its cache, if it keeps one, was not emptied before this level"
    )


#: (hits, queries) counter names, newest first: vLLM V1, vLLM V0's, then SGLang's (cached prompt
#: tokens, summed over its ``cache_source`` label by ``tasks.endpoint.prometheus.parse``, against
#: every prompt token: sglang ``metrics/collector.py``).
PREFIX_CACHE_COUNTERS: tuple[tuple[str, str], ...] = (
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
    ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
)

#: The scrape key that carries vLLM's cache block size (``tasks.endpoint.prometheus.parse`` keeps
#: this one label of the ``vllm:cache_config_info`` info gauge).
BLOCK_SIZE_SERIES = 'vllm:cache_config_info{block_size="'

#: The measured share (hit rate, else cached-token share) may differ from the expected one by
#: this many percentage points before a level is warned about.
MISMATCH_POINTS = 10.0


def block_size_tokens(scrape: Mapping[str, float] | None) -> int | None:
    """The server's cache block size in tokens, from its metrics (``tasks.endpoint.prometheus``'s
    scrape): vLLM's ``vllm:cache_config_info{block_size="N"}``; None when the server does not
    publish it (SGLang's radix cache and llama.cpp reuse single tokens by default)."""
    for name in scrape or ():
        if name.startswith(BLOCK_SIZE_SERIES):
            try:
                size = int(float(name[len(BLOCK_SIZE_SERIES) :].partition('"')[0]))
            except ValueError:
                continue
            if size > 0:
                return size
    return None


def prefix_cache_hit_rate(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> float | None:
    """Prompt tokens found in the prefix cache / prompt tokens looked up, over the level.

    Args:
        before, after: the server's metrics just before and just after the level
            (``tasks.endpoint.prometheus.scrape``).

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
    requests: Iterable[Sequence[tuple[str, int]]],
    seen: set[str] | None = None,
    block_size_tokens: int | None = None,
) -> float | None:
    """The share of the prompt tokens a perfect prefix cache (unbounded, never evicting) would
    supply, from the workload's construction.

    Args:
        requests: each request's blocks in send order, ``((key, tokens), ...)``: requests that
            share a key share that block's tokens (``tasks.workload.stage.StageWorkload.blocks``).
        seen: the keys already in the cache when the level starts (empty after a reset; the
            earlier levels' and the warm-up's blocks otherwise); updated in place.
        block_size_tokens: the cache's block size in tokens (vLLM's ``block_size``): only whole
            blocks of the shared prefix count, ``floor(shared / block) * block`` per request;
            None: every shared token counts (per-token reuse).

    A request's leading blocks already seen count as cached, up to the first block not seen: a
    prefix cache reuses a prefix, never a block after one it missed. None for no prompt token.
    """
    cached, total = expected_cached_tokens(requests, set() if seen is None else seen, block_size_tokens)
    return cached / total if total else None


def expected_cached_tokens(
    requests: Iterable[Sequence[tuple[str, int]]], seen: set[str], block_size_tokens: int | None = None
) -> tuple[int, int]:
    """(cached, all) prompt tokens of :func:`expected_cached_token_fraction`; ``seen`` updated
    in place (for a share over several runs, each starting from its own cache)."""
    cached = total = 0
    for blocks in requests:
        leading = True
        shared = 0
        for key, tokens in blocks:
            total += tokens
            leading = leading and key in seen
            if leading:
                shared += tokens
        if block_size_tokens and block_size_tokens > 1:
            shared = shared // block_size_tokens * block_size_tokens
        cached += shared
        seen.update(key for key, _ in blocks)
    return cached, total


def mismatch_warning(metrics: Mapping[str, Any], index: int) -> str | None:
    """The warning of a level whose measured cache share is more than :data:`MISMATCH_POINTS`
    points off the expected one (``expected_cached_token_fraction`` > 0; the measured share is
    ``prefix_cache_hit_rate``, else ``cached_token_fraction``), naming both figures and the
    likely cause; None when they agree or a figure is missing. A level expected to share
    nothing is ``tasks.scaleout.levels``' own warning."""
    expected = metrics.get("expected_cached_token_fraction")
    name = (
        "prefix_cache_hit_rate"
        if metrics.get("prefix_cache_hit_rate") is not None
        else "cached_token_fraction"
    )
    measured = metrics.get(name)
    if not expected or measured is None or abs(measured - expected) * 100 <= MISMATCH_POINTS:
        return None
    block = metrics.get("cache_block_size_tokens")
    if measured > expected:
        cause = (
            "the cache held these prompts before the level (no reset: --keep-cache, or a server "
            "without a reset route), or the chat template's shared opening tokens"
        )
    elif measured < 0.01:
        cause = (
            "the prefix cache is off (vLLM: --enable-prefix-caching; SGLang: no "
            "--disable-radix-cache), or the shared prefixes are shorter than one cache block"
            + (f" ({block} tokens)" if block else " (block size unknown: set cache_block_size_tokens)")
        )
    else:
        cause = (
            f"eviction (the cache is smaller than the level's working set), or the chat template "
            f"moving the prefixes off the {block}-token block boundaries"
            if block
            else "the cache's block size (unknown here: per-token reuse assumed; a paged cache "
            "reuses whole blocks only: set cache_block_size_tokens, --cache-block-size-tokens), "
            "or eviction (the cache is smaller than the level's working set)"
        )
    return (
        f"level {index}: {name} = {100 * measured:.1f} % but the workload's construction expects "
        f"expected_cached_token_fraction = {100 * expected:.1f} % (> {MISMATCH_POINTS:g} points "
        f"apart); likely cause: {cause}"
    )


#: The figures of a level's prefix cache that the flows' own runs carry too (the first level's,
#: beside the headline), so that ``infermeter compare --metrics prefix_cache_hit_rate`` finds
#: them on the runs it reads (the flows' runs, not their level children).
CACHE_FIGURES = ("prefix_cache_hit_rate", "cached_token_fraction", "expected_cached_token_fraction")


def first_level_figures(levels: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """:data:`CACHE_FIGURES` of the first level (``{"metrics": {...}}`` each, as the stream
    stage returns them), those it has (not None); empty without a level."""
    metrics = levels[0].get("metrics") or {} if levels else {}
    return {name: metrics[name] for name in CACHE_FIGURES if metrics.get(name) is not None}


def level_figures(
    records: Iterable[Any], before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> dict[str, float | None]:
    """``prefix_cache_hit_rate`` (the server's counters) and ``cached_token_fraction`` (the
    requests' usage) of one level: see the module docstring."""
    return {
        "prefix_cache_hit_rate": prefix_cache_hit_rate(before, after),
        "cached_token_fraction": cached_token_fraction(records),
    }


class ExpectedCache:
    """The blocks a perfect prefix cache holds during a run of levels (for each level's expected
    share, :func:`expected_cached_tokens`), and whether the missing reset was said
    (``tasks.scaleout.levels``)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.said_no_reset = False

    def level(
        self, results: Sequence[Any], settings: Any, reset: bool, block_size_tokens: int | None = None
    ) -> dict[str, Any]:
        """``prefix_cache_reset`` (1 reset before the measured requests, 0 asked but refused,
        None not asked), ``cache_block_size_tokens`` (the block size the expected share was
        counted in: the server's ``vllm:cache_config_info``, else the user's setting; None:
        per-token reuse assumed) and ``expected_cached_token_fraction`` of the level's measured
        requests in send order, over its repeats (each after its own warm-up and reset; None
        without the workload's blocks), in whole blocks.

        Args:
            results: the level's repeats (``tasks.stream.level_result.LevelResult``: ``records``,
                ``measured``); settings: its ``tasks.stream.settings.LevelSettings``.
        """
        blocks = settings.prompt_blocks
        out: dict[str, Any] = {
            "prefix_cache_reset": int(reset) if settings.reset_cache else None,
            "cache_block_size_tokens": block_size_tokens,
        }
        if not blocks:
            return out | {"expected_cached_token_fraction": None}
        cached = total = 0
        for result in results:
            for r in result.records:  # the warm-up went first: in the cache unless it was reset
                if r.warmup:
                    self.seen.update(
                        key for key, _ in blocks[settings.prompt_index(r.request_id) % len(blocks)]
                    )
            if reset:
                self.seen.clear()
            order = sorted(result.measured, key=lambda r: r.send_ns)
            hit, seen = expected_cached_tokens(
                (blocks[settings.prompt_index(r.request_id) % len(blocks)] for r in order),
                self.seen,
                block_size_tokens,
            )
            cached, total = cached + hit, total + seen
        return out | {"expected_cached_token_fraction": cached / total if total else None}


def warn_unexpected_hits(metrics: Mapping[str, Any], index: int, logger: Any) -> None:
    """Warn (``logger``, a logging.Logger or adapter) when level ``index`` of a workload built
    to share nothing found its prompts in the server's cache: its TTFT describes the cache, not
    the server (vLLM PR #53920)."""
    if metrics.get("expected_cached_token_fraction") != 0.0:
        return
    for name in ("prefix_cache_hit_rate", "cached_token_fraction"):
        value = metrics.get(name)
        if value is not None and value >= UNEXPECTED_HIT_RATE:
            logger.warning(
                "level %d shares nothing by construction, but %s = %.1f %% (>= %g %%): the server "
                "had these prompts cached, so its TTFT describes the cache (reset it between runs, "
                "or let infermeter salt the prompts: no fixed --salt)",
                index,
                name,
                100 * value,
                100 * UNEXPECTED_HIT_RATE,
            )
            return
