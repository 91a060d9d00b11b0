"""The stream stage's workload: one typed answer to "what is sent, in what order, when".

:func:`stage_workload` reads the stage's config and builds, whatever the source (the config's
prompts, synthetic ``--input-len`` prompts, a ``--dataset`` file, shared-prefix groups, a recorded
trace), a :class:`StageWorkload`: the prompts (warm-up ones first), their token counts, their
output lengths, each prompt's blocks for the expected prefix-cache share
(``tasks.endpoint.cache.expected_cached_token_fraction``), and for a trace its recorded schedule.

Random tokens are drawn with the run's salt (``cfg.salt``, drawn per run when unset and
recorded), so a second run against a long-lived server does not find the first's prompts in its
prefix cache (vLLM #54227, #52884); warm-up prompts share nothing with the measured ones, so the
warm-up does not warm the cache the level then measures.

Imports only the standard library and the workload builders (the tokenizer is passed in).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from tasks.stream.settings import Session
from tasks.workload.conversation import KIND as CONVERSATION_KIND
from tasks.workload.conversation import read_sessions, synthetic_sessions, with_think_times
from tasks.workload.datasets import DatasetError, build_workload, parse_spec
from tasks.workload.prefix import shared_prefix_prompts
from tasks.workload.prompts import synthetic_prompts
from tasks.workload.trace import KINDS as TRACE_KINDS
from tasks.workload.trace import TraceError, build_trace, read_trace

Blocks = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class StageWorkload:
    """What the stream stage sends (module docstring).

    Attributes:
        kind: ``prompts``, ``synthetic``, ``dataset``, ``shared_prefix``, ``trace`` or
            ``conversation``.
        prompts: warm-up prompts first, then the measured ones (used round-robin past the end).
        prompt_tokens: each prompt's tokens (None entries / None: left to the server's usage).
        output_lens: each prompt's ``max_tokens`` (None: the config's), or None for all.
        blocks: each prompt's blocks ``((key, tokens), ...)``: prompts sharing a leading key
            share those tokens (a repeated text prompt is one block).
        groups: each prompt's shared-prefix group (None for a warm-up prompt), or None.
        schedule_s: a trace's send times of the measured requests (seconds after the first).
        num_requests: measured requests per level (a trace: its first ``cfg.num_requests``
            rows).
        salt: the salt of the random tokens.
        source: the file a workload came from, or None (logged as an artifact).
        sessions: a conversation workload's sessions (``tasks.workload.conversation``; the
            prompts are then the warm-up ones and each session's first turn), or None.
    """

    kind: str
    prompts: tuple[str, ...]
    prompt_tokens: tuple[int | None, ...] | None
    output_lens: tuple[int | None, ...] | None
    blocks: tuple[Blocks, ...]
    num_requests: int
    salt: int
    groups: tuple[int | None, ...] | None = None
    schedule_s: tuple[float, ...] | None = None
    source: str | None = None
    sessions: tuple[Session, ...] | None = None

    def params(self) -> dict[str, str]:
        """The MLflow params that say which workload ran (the config says how it was asked for)."""
        return {"workload": self.kind, "workload_salt": str(self.salt)}


def run_salt(cfg: Any) -> int:
    """``cfg.salt``, or a salt drawn for this run (``secrets``: never the seed, which a user
    repeats on purpose)."""
    return cfg.salt if cfg.salt is not None else secrets.randbelow(2**31)


def _text_block(prompt: str, tokens: int | None) -> Blocks:
    """A prompt as one block keyed by its text: a repeated prompt is a cache hit."""
    return ((f"text:{hashlib.sha1(prompt.encode()).hexdigest()}", tokens or 0),)


def _unique_blocks(prompts: tuple[str, ...], counts: tuple[int | None, ...] | None) -> tuple[Blocks, ...]:
    return tuple(_text_block(p, None if counts is None else counts[i]) for i, p in enumerate(prompts))


def stage_workload(cfg: Any, tokenizer: Any, *, salt: int, max_context: int | None = None) -> StageWorkload:
    """The stage's workload (module docstring).

    Args:
        cfg: a ``tasks.config.StreamConfig``.
        tokenizer: the endpoint's tokenizer.
        salt: the run's salt for random tokens.
        max_context: the model's context in tokens, when known (a trace row past it is refused).

    Raises:
        DatasetError: a bad ``--dataset`` file or spec (one line naming the file, the row and the
            field; a trace's ``TraceError`` is raised as one), or a trace of fewer rows than
            ``cfg.num_requests``.
    """
    n, warm = cfg.num_requests, cfg.warmup
    if cfg.turns or (cfg.dataset or "").startswith(f"{CONVERSATION_KIND}:"):
        return _conversation(cfg, tokenizer, salt)
    if cfg.dataset and cfg.dataset.partition(":")[0] in TRACE_KINDS:
        return _trace(cfg, tokenizer, salt, max_context)
    if cfg.prefix_groups:
        built = shared_prefix_prompts(
            tokenizer,
            groups=cfg.prefix_groups,
            prefix_len=cfg.prefix_len,
            suffix_len=cfg.input_len,
            count=n,
            popularity=cfg.prefix_popularity,
            seed=salt,
        )
        warmups, counts = _warmup_prompts(tokenizer, cfg.prefix_len + cfg.input_len, warm, salt)
        prompts = tuple(warmups) + built.prompts
        return StageWorkload(
            kind="shared_prefix",
            prompts=prompts,
            prompt_tokens=tuple(counts) + built.prompt_tokens,
            output_lens=None,
            blocks=_unique_blocks(tuple(warmups), tuple(counts)) + built.blocks,
            num_requests=n,
            salt=salt,
            groups=(None,) * warm + built.groups,
        )
    if cfg.dataset:
        parse_spec(cfg.dataset)
        workload = build_workload(cfg.dataset, tokenizer, n + warm, cfg.seed)
        counts = workload.prompt_tokens if any(c is not None for c in workload.prompt_tokens) else None
        lens = workload.output_lens if any(x is not None for x in workload.output_lens) else None
        return StageWorkload(
            kind="dataset",
            prompts=workload.prompts,
            prompt_tokens=counts,
            output_lens=lens,
            blocks=_unique_blocks(workload.prompts, counts),
            num_requests=n,
            salt=salt,
            source=cfg.dataset.partition(":")[2],
        )
    if cfg.input_len:
        texts, made = synthetic_prompts(tokenizer, cfg.input_len, n + warm, _mix(cfg.seed, salt))
        prompts, counts = tuple(texts), tuple(made)
        return StageWorkload("synthetic", prompts, counts, None, _unique_blocks(prompts, counts), n, salt)
    prompts = tuple(cfg.prompts)
    counts = tuple(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    return StageWorkload("prompts", prompts, counts, None, _unique_blocks(prompts, counts), n, salt)


def trace_too_short(dataset: str, rows: int, asked: int) -> str:
    """The message for a trace of fewer rows than the requests asked of it."""
    return (
        f"--num-requests: {asked} requests asked of --dataset {dataset}, which has {rows} rows; "
        f"give at most {rows}, or leave --num-requests out to send every row"
    )


def _mix(seed: int, salt: int) -> int:
    return int.from_bytes(hashlib.sha1(f"{seed}:{salt}".encode()).digest()[:8], "big")


def _warmup_prompts(tokenizer: Any, tokens: int, count: int, salt: int) -> tuple[list[str], list[int]]:
    """Warm-up prompts of the measured ones' length that share nothing with them."""
    if count < 1:
        return [], []
    return synthetic_prompts(tokenizer, tokens, count, _mix(-1, salt))


def _conversation(cfg: Any, tokenizer: Any, salt: int) -> StageWorkload:
    """Sessions (synthetic or a file's), warm-up prompts that share nothing with them."""
    if cfg.turns:
        sessions = synthetic_sessions(
            tokenizer, cfg.num_requests, cfg.turns, cfg.input_len, _mix(cfg.seed, salt)
        )
        warm_len, source = cfg.input_len, None
    else:
        source = cfg.dataset.partition(":")[2]
        read = read_sessions(source, tokenizer, cfg.num_requests, cfg.seed)
        # a file with fewer conversations is replayed round-robin, each replay its own think times
        sessions = tuple(read[i % len(read)] for i in range(cfg.num_requests))
        warm_len = 64
    sessions = with_think_times(sessions, cfg.think_time_s, cfg.think_time_dist, cfg.seed)
    warmups, counts = _warmup_prompts(tokenizer, warm_len, cfg.warmup, salt)
    firsts = tuple(s.turns[0] for s in sessions)
    return StageWorkload(
        kind="conversation",
        prompts=tuple(warmups) + firsts,
        prompt_tokens=tuple(counts) + (None,) * len(firsts),
        output_lens=None,
        blocks=(),  # the history is the server's live replies: no share is known in advance
        num_requests=cfg.num_requests,
        salt=salt,
        source=source,
        sessions=sessions,
    )


def _trace(cfg: Any, tokenizer: Any, salt: int, max_context: int | None) -> StageWorkload:
    """The trace's first ``cfg.num_requests`` rows (``infermeter stream`` sets it to the row
    count when --num-requests is not given: ``flows.shared.workload.check_dataset``)."""
    kind, _, path = cfg.dataset.partition(":")
    try:
        rows = read_trace(kind, path, max_context=max_context)
        if cfg.num_requests > len(rows):
            raise TraceError(trace_too_short(cfg.dataset, len(rows), cfg.num_requests))
        rows = rows[: cfg.num_requests]
        built = build_trace(rows, tokenizer, time_scale=cfg.time_scale, salt=salt)
    except TraceError as exc:
        raise DatasetError(str(exc)) from None
    warmups, counts = _warmup_prompts(tokenizer, min(rows[0].input_length, 256), cfg.warmup, salt)
    return StageWorkload(
        kind="trace",
        prompts=tuple(warmups) + built.prompts,
        prompt_tokens=tuple(counts) + built.prompt_tokens,
        output_lens=(None,) * len(warmups) + built.output_lens,
        blocks=_unique_blocks(tuple(warmups), tuple(counts)) + built.blocks,
        num_requests=len(rows),
        salt=salt,
        schedule_s=built.arrival_offsets_s,
        source=path,
    )
