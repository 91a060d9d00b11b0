"""The two phases of a generation, timed: gpt-fast's ``prefill`` and ``decode_one_token``, one
timed run of them (:func:`one_run`), and the untimed pass that reads the hidden-state shape.
Standard library, torch and transformers only.

The loop is gpt-fast's (pytorch-labs/gpt-fast, ``generate.py``): one ``prefill`` forward over
the whole prompt gives the first new token, then ``decode_one_token`` feeds one token per step
through the KV cache. Splitting a generation into a prefill latency and per-token decode
latencies is optimum-benchmark's latency tracker's split (prefill = time to the first token,
decode = the time of each further token). Greedy (argmax) decoding, EOS ignored.

How many tokens, how many cache positions
-----------------------------------------
A point with prompt length N and ``max_new_tokens`` = T runs one prefill forward and exactly
T decode forwards. The prefill forward already yields a token, and each decode forward yields
one more, so every sequence gets T + 1 new tokens (``generated_token_ids`` has T + 1 ids; they
equal ``model.generate(do_sample=False, max_new_tokens=T + 1)``). Each decode step feeds the
previous token into the cache, so after the point the cache holds N + T positions (the last
token produced is never fed back); after prefill it holds N. The formulas use those counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tasks.memory.formula import kv_cache_bytes_measured
from tasks.profile.timing import Timer, synchronize

__all__ = ["TimedRun", "decode_one_token", "greedy", "last_hidden_state_shape", "one_run", "prefill"]


def prefill(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any, chunk_size: int = 0) -> torch.Tensor:
    """Forward the whole prompt, filling ``cache``; returns the last position's logits.

    input_ids: LongTensor [B, N]. Returns logits [B, vocab] (only the last position goes
    through the LM head, ``logits_to_keep=1``, as ``generate`` does). Afterwards the cache holds
    N positions.

    ``chunk_size`` > 0: chunked prefill (vLLM's and TGI's term): the prompt is fed in slices of
    ``chunk_size`` tokens, each attending to the cache filled by the slices before it, so the
    activations of one forward cover at most ``chunk_size`` positions instead of N. The result
    equals the unchunked prefill up to floating-point summation order. 0 = one forward.

    Raises:
        ValueError: chunk_size < 0.
    """
    if int(chunk_size) != chunk_size or chunk_size < 0:
        raise ValueError(f"chunk_size must be an integer >= 0, got {chunk_size!r}")
    n = input_ids.shape[1]
    step = chunk_size if 0 < chunk_size < n else n
    for start in range(0, n, step):
        out = model(
            input_ids=input_ids[:, start : start + step],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return out.logits[:, -1, :]


def decode_one_token(model: torch.nn.Module, token: torch.Tensor, cache: Any) -> torch.Tensor:
    """One decode step: feed ``token`` (LongTensor [B, 1]) through the cache; returns logits
    [B, vocab] for the next position. The cache grows by one position."""
    out = model(input_ids=token, past_key_values=cache, use_cache=True)
    return out.logits[:, -1, :]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice: argmax over the vocabulary. logits [B, vocab] -> LongTensor [B, 1]."""
    return torch.argmax(logits, dim=-1, keepdim=True)


@dataclass(frozen=True)
class TimedRun:
    """One prefill and its decode steps in a fresh cache (:func:`one_run`)."""

    prefill_ms: float  #: the prefill's span (forward(s) + argmax)
    decode_ms: list[float]  #: each decode step's span, in order
    tokens: torch.Tensor  #: LongTensor [B, T + 1], the new tokens (prefill's, then one per step)
    kv_cache_bytes_after_prefill: int  #: measured bytes of the cache tensors after prefill
    kv_cache_bytes: int  #: measured bytes after the last decode step
    kv_cache_positions_after_prefill: int  #: positions held after prefill (N)
    kv_cache_positions: int  #: positions held at the end (N + T)


def one_run(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, chunk: int = 0) -> TimedRun:
    """Prefill + exactly ``max_new_tokens`` decode steps in a fresh DynamicCache, each timed on
    the device's clock (:class:`~tasks.profile.timing.Timer`). input_ids: LongTensor [B, N]."""
    from transformers import DynamicCache

    device = input_ids.device
    timer = Timer(device)
    cache = DynamicCache(config=model.config)
    synchronize(device)

    timer.start()
    token = greedy(prefill(model, input_ids, cache, chunk))
    timer.stop()
    kv_after_prefill = kv_cache_bytes_measured(cache)
    positions_after_prefill = cache.get_seq_length()
    tokens = [token]
    for _ in range(max_new_tokens):
        timer.start()
        token = greedy(decode_one_token(model, token, cache))
        timer.stop()
        tokens.append(token)

    spans = timer.elapsed_ms()  # synchronises on CUDA
    run = TimedRun(
        prefill_ms=spans[0],
        decode_ms=spans[1:],
        tokens=torch.cat(tokens, dim=1),
        kv_cache_bytes_after_prefill=kv_after_prefill,
        kv_cache_bytes=kv_cache_bytes_measured(cache),
        kv_cache_positions_after_prefill=positions_after_prefill,
        kv_cache_positions=cache.get_seq_length(),
    )
    del cache
    return run


def last_hidden_state_shape(model, input_ids: torch.Tensor, chunk: int) -> list[int]:
    """[B, N, hidden] of the last hidden state, from untimed forwards with
    output_hidden_states=True; chunked like the prefill (through a cache) when ``chunk`` > 0, so
    this extra pass never needs more activation memory than the measured one."""
    from transformers import DynamicCache

    n = input_ids.shape[1]
    step = chunk if 0 < chunk < n else n
    cache = DynamicCache(config=model.config)
    rows = 0
    for start in range(0, n, step):
        out = model(
            input_ids=input_ids[:, start : start + step],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        batch, length, hidden = out.hidden_states[-1].shape
        rows += length
        del out
    del cache
    return [int(batch), int(rows), int(hidden)]
