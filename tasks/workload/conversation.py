"""Conversations: sessions of several turns whose history is the server's own replies.

A :class:`tasks.stream.settings.Session` holds the user turns of one conversation (and, from a file, each turn's
``max_tokens``). It is sent closed loop by one simulated user (``tasks.stream.load``): turn
``k + 1`` goes after turn ``k``'s reply has finished plus a think time, with the whole history
(every earlier user turn and the reply the server actually gave) as its messages, so the
server's prefix cache sees what it would in production (AIPerf's multi-turn with live history;
guidellm's ``turns=``). Two sources:

- synthetic (``--turns N --input-len L``): every turn ``L`` random tokens of the tokenizer
  (``tasks.workload.prompts.synthetic_prompts``, salted per run like every random workload);
- ``sharegpt-multiturn:PATH``: a ShareGPT file's whole conversations (the format of
  ``tasks.workload.datasets``): its human turns are replayed in order, each one's ``max_tokens``
  the length of the model turn that answered it in the file (as ``sharegpt:`` reads one turn;
  None for a human turn with no answer), the model turns themselves come live.

Think times (:func:`think_times_s`): fixed, or drawn from an exponential distribution of that
mean (seeded: a seed replays them), after each reply but the last.

Imports only the standard library and the stream package's dataset readers (the tokenizer is
passed in).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from tasks.stream.settings import Session
from tasks.textfile import read_utf8
from tasks.workload.datasets import HUMAN_ROLES, MODEL_ROLES, DatasetError
from tasks.workload.prompts import synthetic_prompts

KIND = "sharegpt-multiturn"
THINK_TIME_DISTS = ("fixed", "exponential")


def synthetic_sessions(
    tokenizer: Any, count: int, turns: int, input_len: int, seed: int
) -> tuple[Session, ...]:
    """``count`` sessions of ``turns`` user turns of ``input_len`` random tokens each (each
    turn's true count in ``turn_tokens``).

    Raises:
        ValueError: ``count``, ``turns`` or ``input_len`` below 1.
    """
    if count < 1 or turns < 1 or input_len < 1:
        raise ValueError("count, turns and input_len must be >= 1")
    texts, counts = synthetic_prompts(tokenizer, input_len, count * turns, seed)
    return tuple(
        Session(
            tuple(texts[i * turns : (i + 1) * turns]), turn_tokens=tuple(counts[i * turns : (i + 1) * turns])
        )
        for i in range(count)
    )


def read_sessions(path: str | Path, tokenizer: Any, count: int, seed: int = 0) -> tuple[Session, ...]:
    """Up to ``count`` conversations of a ShareGPT file (module docstring), in a seeded random
    order (``random.Random(seed)``, as ``sharegpt:``); fewer usable ones are reused round-robin
    by the level.

    Raises:
        DatasetError: a missing file, not JSON, a row that is not ``{"conversations": [...]}``
            of ``{"from": str, "value": str}`` turns (naming the row and the turn), or no row
            with a non-empty human turn.
    """
    path = Path(path)
    where = f"--dataset: {path}"
    if not path.is_file():
        raise DatasetError(f"--dataset: file not found: {path}")
    fix = 'each row is {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}'
    try:
        data = json.loads(read_utf8(path, DatasetError, "--dataset"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc}); a ShareGPT file is a JSON list") from None
    if not isinstance(data, list):
        raise DatasetError(f"{where}: a ShareGPT file is a JSON list of conversations")
    sessions = []
    for number, item in enumerate(data, start=1):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise DatasetError(f"{where}: row {number}: no 'conversations' list; {fix}")
        asked: list[str] = []
        lens: list[int | None] = []
        for place, turn in enumerate(turns, start=1):
            if not (
                isinstance(turn, dict)
                and isinstance(turn.get("from"), str)
                and isinstance(turn.get("value"), str)
            ):
                raise DatasetError(
                    f"{where}: row {number}: turn {place} is not {{'from': str, 'value': str}}; {fix}"
                )
            speaker = turn["from"].lower()
            if speaker in HUMAN_ROLES and turn["value"].strip():
                asked.append(turn["value"])
                lens.append(None)
            elif speaker in MODEL_ROLES and asked and lens[-1] is None:
                lens[-1] = len(tokenizer.encode(turn["value"], add_special_tokens=False)) or None
        if asked:
            counts = tuple(len(tokenizer.encode(text, add_special_tokens=False)) for text in asked)
            sessions.append(Session(tuple(asked), tuple(lens), number, turn_tokens=counts))
    if not sessions:
        raise DatasetError(f"{where}: no row holds a non-empty human turn; {fix}")
    random.Random(seed).shuffle(sessions)
    return tuple(sessions[:count])


def with_think_times(
    sessions: tuple[Session, ...], mean_s: float, dist: str, seed: int
) -> tuple[Session, ...]:
    """``sessions`` with a think time after each turn but the last (:func:`think_times_s`,
    session ``i`` drawn with seed ``seed + i``).

    Raises:
        ValueError: as :func:`think_times_s`.
    """
    return tuple(
        replace(s, think_s=think_times_s(mean_s, dist, len(s.turns) - 1, seed + i))
        for i, s in enumerate(sessions)
    )


def think_times_s(mean_s: float, dist: str, count: int, seed: int) -> tuple[float, ...]:
    """``count`` think times in seconds: ``mean_s`` each (``fixed``), or exponential draws of
    mean ``mean_s`` (``exponential``; ``random.Random(seed)``).

    Raises:
        ValueError: ``mean_s`` < 0 or an unknown ``dist``.
    """
    if mean_s < 0 or dist not in THINK_TIME_DISTS:
        raise ValueError(f"think time: mean_s must be >= 0 and dist one of {THINK_TIME_DISTS}")
    if dist == "fixed" or mean_s == 0:
        return (float(mean_s),) * count
    rng = random.Random(seed)
    return tuple(rng.expovariate(1.0 / mean_s) for _ in range(count))
