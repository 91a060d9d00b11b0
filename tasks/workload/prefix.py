"""Shared-prefix workloads: groups of requests whose prompts open with the same tokens.

As SGLang's ``generated-shared-prefix`` dataset and inference-perf's ``shared_prefix``: ``G``
groups, each with a prefix of ``prefix_len`` tokens; every request draws a group (uniformly, or
by Zipf popularity: group ``k`` (1-based) with weight ``1 / k**s``, SGLang's choice for skewed
traffic), and its prompt is the group's prefix then ``suffix_len`` tokens of its own. Prompts are
built from token ids that re-encode to themselves (:func:`tasks.workload.trace.stable_vocab`), so
the shared part is the same token ids in every request of a group (joining strings and
tokenizing again would move the boundary: inference-perf PR #491), then decoded once.

Imports only the standard library; the tokenizer is passed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tasks.workload.trace import stable_vocab


@dataclass(frozen=True)
class PrefixWorkload:
    """Prompts of a shared-prefix workload, in send order.

    Attributes:
        prompts: one text per request.
        prompt_tokens: each prompt's tokens (``prefix_len + suffix_len``, exact).
        groups: each request's group (0-based).
        blocks: each request's blocks for the expected cache share
            (``tasks.endpoint.cache.expected_cached_token_fraction``): ``(("g<seed>:<group>", prefix_len),
            ("s<seed>:<i>", suffix_len))``.
    """

    prompts: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    groups: tuple[int, ...]
    blocks: tuple[tuple[tuple[str, int], ...], ...]


def parse_popularity(spec: str) -> float | None:
    """``uniform`` -> None; ``zipf:S`` -> S (> 0).

    Raises:
        ValueError: anything else, naming the forms that are accepted.
    """
    if spec == "uniform":
        return None
    kind, _, value = spec.partition(":")
    try:
        exponent = float(value)
    except ValueError:
        exponent = -1.0
    if kind != "zipf" or not exponent > 0:
        raise ValueError(f"prefix popularity {spec!r}: write uniform or zipf:S with S > 0 (e.g. zipf:1.1)")
    return exponent


def shared_prefix_prompts(
    tokenizer: Any,
    *,
    groups: int,
    prefix_len: int,
    suffix_len: int,
    count: int,
    popularity: str = "uniform",
    seed: int = 0,
) -> PrefixWorkload:
    """``count`` requests over ``groups`` shared prefixes (module docstring).

    Args:
        tokenizer: a transformers tokenizer.
        groups: number of prefixes (>= 1); prefix_len / suffix_len: tokens (>= 1 each).
        count: requests; popularity: ``uniform`` or ``zipf:S``.
        seed: ``random.Random`` seeds of the group draws and of every token.

    Raises:
        ValueError: a count below 1 or a bad popularity.
    """
    if min(groups, prefix_len, suffix_len, count) < 1:
        raise ValueError("groups, prefix_len, suffix_len and count must be >= 1")
    exponent = parse_popularity(popularity)
    vocab = stable_vocab(tokenizer)
    rng = random.Random(f"{seed}:groups")
    weights = None if exponent is None else [1.0 / (k**exponent) for k in range(1, groups + 1)]
    drawn = rng.choices(range(groups), weights=weights, k=count)
    prefixes = [random.Random(f"{seed}:prefix:{g}").choices(vocab, k=prefix_len) for g in range(groups)]
    prompts, blocks = [], []
    for i, group in enumerate(drawn):
        suffix = random.Random(f"{seed}:suffix:{i}").choices(vocab, k=suffix_len)
        prompts.append(tokenizer.decode(prefixes[group] + suffix, skip_special_tokens=True))
        blocks.append(((f"g{seed}:{group}", prefix_len), (f"s{seed}:{i}", suffix_len)))
    return PrefixWorkload(tuple(prompts), (prefix_len + suffix_len,) * count, tuple(drawn), tuple(blocks))
