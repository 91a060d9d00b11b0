"""Workloads from files (``--dataset KIND:PATH``): prompts with a per-request output length.

Two kinds:

- ``sharegpt:PATH``: the ShareGPT conversation format (a JSON list of ``{"conversations":
  [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``), read as vLLM's
  ShareGPT loader does (``vllm/benchmarks/datasets.py``, ``ShareGPTDataset``): the prompt is the
  first human turn, the first model turn after it sets the request's ``max_tokens`` (its length
  in the tokenizer's tokens, without special tokens), rows are shuffled with the seed and taken
  in that order, and vLLM's ``is_valid_sequence`` filter applies (prompt and output at least
  :data:`MIN_TOKENS` tokens, prompt at most :data:`MAX_PROMPT_TOKENS`, prompt + output at
  most :data:`MAX_TOTAL_TOKENS`). Rows without a human turn followed by a model turn are
  skipped, as the real ShareGPT dumps hold many.
- ``jsonl:PATH``: one JSON object per line with ``prompt`` (text) or ``input_len`` (that many
  random tokens of the tokenizer, as ``--input-len``: :func:`tasks.workload.prompts.synthetic_prompts`),
  and optional ``output_len`` (the request's ``max_tokens``); rows kept in file order after a
  seeded shuffle, like ShareGPT's.

Per-request output lengths are sent with ``ignore_eos`` (``tasks.stream.settings``), so a server
that honours it produces exactly that many tokens. A file of the wrong shape, or with no usable
row, raises :class:`DatasetError` naming the file and the first bad row.

Imports only the standard library (the tokenizer is passed in).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.textfile import read_utf8
from tasks.workload.prompts import synthetic_prompts

#: vLLM's ShareGPT filter (``is_valid_sequence`` defaults): min tokens of prompt and output,
#: the longest prompt and the longest prompt + output.
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048

HUMAN_ROLES = {"human", "user"}
MODEL_ROLES = {"gpt", "assistant", "model", "chatgpt", "bard", "bing"}
KINDS = ("sharegpt", "jsonl")


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the flag, the file, the row and the fix."""


@dataclass(frozen=True)
class DatasetRow:
    """One candidate request of a file: ``row`` is its 1-based place (list index or line), the
    prompt text or an ``input_len`` (synthetic), and the output as text (ShareGPT's model turn)
    or an ``output_len`` in tokens (JSONL), either may be None."""

    row: int
    prompt: str | None = None
    input_len: int | None = None
    completion: str | None = None
    output_len: int | None = None


@dataclass(frozen=True)
class Workload:
    """Requests from a dataset: prompts (one per request), their token counts (None = left to
    the server's usage; set for synthetic ones), and ``max_tokens`` per request (None = the
    config's ``max_tokens``); ``source`` is the spec it came from."""

    prompts: tuple[str, ...]
    prompt_tokens: tuple[int | None, ...]
    output_lens: tuple[int | None, ...]
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "prompts": list(self.prompts),
            "prompt_tokens": list(self.prompt_tokens),
            "output_lens": list(self.output_lens),
        }


def parse_spec(spec: str) -> tuple[str, Path]:
    """``KIND:PATH`` -> (kind, path).

    Raises:
        DatasetError: an unknown kind or a missing file.
    """
    kind, sep, path = spec.partition(":")
    if not sep or kind not in KINDS or not path:
        raise DatasetError(
            f"--dataset: {spec!r} is not KIND:PATH; write sharegpt:PATH, jsonl:PATH, sharegpt-multiturn:PATH, mooncake:PATH, trace:PATH or azure:PATH"
        )
    if not Path(path).is_file():
        raise DatasetError(f"--dataset: file not found: {path}")
    return kind, Path(path)


def _bad(path: Path, row: int, what: str, fix: str, unit: str = "row") -> DatasetError:
    return DatasetError(f"--dataset: {path}: {unit} {row}: {what}; {fix}")


def _sharegpt_rows(path: Path) -> list[DatasetRow]:
    fix = 'each row is {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}'
    try:
        data = json.loads(read_utf8(path, DatasetError, "--dataset"))
    except json.JSONDecodeError as exc:
        raise DatasetError(
            f"--dataset: {path}: not valid JSON ({exc}); a ShareGPT file is a JSON list"
        ) from None
    if not isinstance(data, list):
        raise DatasetError(f"--dataset: {path}: a ShareGPT file is a JSON list of conversations")
    rows = []
    for number, item in enumerate(data, start=1):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise _bad(path, number, "no 'conversations' list", fix)
        for turn in turns:
            if not (
                isinstance(turn, dict)
                and isinstance(turn.get("from"), str)
                and isinstance(turn.get("value"), str)
            ):
                raise _bad(path, number, "a turn is not {'from': str, 'value': str}", fix)
        human = next((i for i, t in enumerate(turns) if t["from"].lower() in HUMAN_ROLES), None)
        if human is None:
            rows.append(DatasetRow(number))
            continue
        reply = next((t for t in turns[human + 1 :] if t["from"].lower() in MODEL_ROLES), None)
        rows.append(DatasetRow(number, prompt=turns[human]["value"], completion=reply and reply["value"]))
    return rows


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _jsonl_rows(path: Path) -> list[DatasetRow]:
    fix = 'write {"prompt": "...", "output_len": 128} or {"input_len": 512, "output_len": 128}'
    rows = []
    for number, line in enumerate(read_utf8(path, DatasetError, "--dataset").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad(path, number, f"not valid JSON ({exc.msg})", fix, "line") from None
        if not isinstance(item, dict):
            raise _bad(path, number, "not a JSON object", fix, "line")
        prompt, input_len, output_len = item.get("prompt"), item.get("input_len"), item.get("output_len")
        if (prompt is None) == (input_len is None):
            raise _bad(path, number, "give exactly one of 'prompt' and 'input_len'", fix, "line")
        if prompt is not None and not (isinstance(prompt, str) and prompt.strip()):
            raise _bad(path, number, "'prompt' must be a non-empty string", fix, "line")
        for name, value in (("input_len", input_len), ("output_len", output_len)):
            if value is not None and not _positive_int(value):
                raise _bad(path, number, f"{name!r} must be an integer >= 1, got {value!r}", fix, "line")
        rows.append(DatasetRow(number, prompt=prompt, input_len=input_len, output_len=output_len))
    if not rows:
        raise DatasetError(f"--dataset: {path} holds no row; {fix}, one per line")
    return rows


def read_rows(spec: str) -> tuple[str, Path, list[DatasetRow]]:
    """Parse the file named by ``spec`` and check its shape (no tokenizer needed).

    Returns ``(kind, path, rows)``; ShareGPT rows without a usable turn pair have no prompt.

    Raises:
        DatasetError: bad spec, missing file, wrong shape (naming the first bad row), or (ShareGPT)
            no conversation with a human turn followed by a model turn.
    """
    kind, path = parse_spec(spec)
    rows = _sharegpt_rows(path) if kind == "sharegpt" else _jsonl_rows(path)
    if kind == "sharegpt" and not any(r.prompt and r.completion for r in rows):
        first = rows[0].row if rows else None
        where = f"row {first} (and every other)" if first else "the list is empty"
        raise DatasetError(
            f"--dataset: {path} holds no usable conversation: {where} has no human turn followed "
            "by a non-empty model turn"
        )
    return kind, path, rows


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_workload(spec: str, tokenizer: Any, count: int, seed: int = 0) -> Workload:
    """Up to ``count`` requests from the dataset, in a seeded random order (module docstring).

    Args:
        spec: ``sharegpt:PATH`` or ``jsonl:PATH``.
        tokenizer: a transformers tokenizer (ShareGPT lengths; JSONL ``input_len`` rows).
        count: requests wanted (warm-up + measured); fewer usable rows are used round-robin.
        seed: ``random.Random(seed)`` shuffles the rows (and draws synthetic prompts).

    Raises:
        DatasetError: as :func:`read_rows`, or no ShareGPT row passes the length filter (the
            message names the first row that failed and why).
    """
    kind, path, rows = read_rows(spec)
    rng = random.Random(seed)
    order = list(rows)
    rng.shuffle(order)
    prompts: list[str] = []
    counts: list[int | None] = []
    lens: list[int | None] = []
    rejects: list[tuple[int, str]] = []
    for row in order:
        if len(prompts) >= count:
            break
        if kind == "jsonl":
            if row.input_len is not None:
                texts, made = synthetic_prompts(tokenizer, row.input_len, 1, seed + row.row)
                prompts.append(texts[0])
                counts.append(made[0])
            else:
                prompts.append(row.prompt)
                counts.append(None)
            lens.append(row.output_len)
            continue
        if not (row.prompt and row.completion):
            continue
        prompt_len, output_len = len(_encode(tokenizer, row.prompt)), len(_encode(tokenizer, row.completion))
        if prompt_len < MIN_TOKENS or output_len < MIN_TOKENS:
            why = f"prompt {prompt_len} / output {output_len} tokens, fewer than {MIN_TOKENS}"
        elif prompt_len > MAX_PROMPT_TOKENS or prompt_len + output_len > MAX_TOTAL_TOKENS:
            why = f"prompt {prompt_len} + output {output_len} tokens, over {MAX_PROMPT_TOKENS} / {MAX_TOTAL_TOKENS}"
        else:
            prompts.append(row.prompt)
            counts.append(None)
            lens.append(output_len)
            continue
        rejects.append((row.row, why))
    if not prompts:
        number, why = min(rejects)  # rows were read: every one usable-shaped failed the filter
        raise DatasetError(
            f"--dataset: {path} holds no usable conversation under vLLM's length filter; first: "
            f"row {number}: {why}"
        )
    return Workload(tuple(prompts), tuple(counts), tuple(lens), spec)
