"""Where the stream stage's prompts come from: a file, the config, or synthetic random tokens.

Synthetic prompts follow vLLM's random dataset (``benchmarks/benchmark_dataset.py``,
``RandomDataset``): token ids drawn at random from the tokenizer's vocabulary (special tokens
excluded), decoded to text. Decoding and re-encoding does not always round-trip to the same
length, so the text is re-encoded and trimmed or topped up (as vLLM does since 0.10) until it
encodes to exactly ``input_len`` tokens where that is reachable; the count it does encode to is
returned as the prompt's ``input_tokens`` (without special tokens and without the chat
template, which the server adds).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import yaml

from tasks.textfile import read_utf8


class PromptsError(ValueError):
    """A prompts file that cannot be used; the message names the file and the fix."""


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts from a file (``--prompts`` of ``stream`` and ``tokenize``): ``.json`` (a list of
    strings), ``.yaml`` / ``.yml`` (a YAML list of strings), ``.jsonl`` (one object per line
    with a ``prompt`` key, or one JSON string per line), else plain text with one prompt per
    non-empty line. The file is read as UTF-8.

    Raises:
        PromptsError: the file is missing, not UTF-8 (naming the byte offset and line),
            malformed (a JSONL file: naming the line) or holds no prompt.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptsError(f"--prompts: file not found: {path}")
    text = read_utf8(path, PromptsError, "--prompts")
    suffix = path.suffix.lower()
    how = {
        ".json": "a JSON list of non-empty strings",
        ".yaml": "a YAML list of non-empty strings",
        ".yml": "a YAML list of non-empty strings",
        ".jsonl": 'one JSON string or {"prompt": ...} object per line',
    }.get(suffix, "one prompt per line")
    if suffix in (".json", ".yaml", ".yml"):
        try:
            data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            said = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc).splitlines()[0]
            raise PromptsError(
                f"--prompts: {path}: not valid {suffix[1:].upper()} ({said}); write {how}"
            ) from None
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise PromptsError(f"--prompts: {path} must hold {how}")
        prompts = data
    elif suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptsError(
                    f"--prompts: {path}: line {number}: not valid JSON ({exc.msg}); write {how}"
                ) from None
            value = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(value, str):
                raise PromptsError(
                    f"--prompts: {path}: line {number}: expected a string or an object with a 'prompt' string"
                )
            prompts.append(value)
    else:
        prompts = text.splitlines()
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise PromptsError(f"--prompts: {path} holds no prompt; write {how}")
    return prompts


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def synthetic_prompts(
    tokenizer: Any, input_len: int, count: int, seed: int = 0
) -> tuple[list[str], list[int]]:
    """``count`` prompts of ``input_len`` random tokens each, and the token count of each.

    Args:
        tokenizer: a transformers tokenizer (``encode``, ``decode``, ``all_special_ids``,
            ``len()``).
        input_len: wanted tokens per prompt (>= 1), counted without special tokens.
        count: number of prompts; seed: ``random.Random(seed)`` drives the draws.

    Returns ``(texts, token_counts)``; a count can differ from ``input_len`` by a token or two
    when no random top-up lands exactly (rare; the true count is what is recorded).

    Raises:
        ValueError: input_len or count < 1.
    """
    if input_len < 1 or count < 1:
        raise ValueError("input_len and count must be >= 1")
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    texts, counts = [], []
    for _ in range(count):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for _attempt in range(8):
            encoded = _encode(tokenizer, text)
            if len(encoded) > input_len:
                text = tokenizer.decode(encoded[:input_len], skip_special_tokens=True)
            elif len(encoded) < input_len:
                extra = [rng.choice(vocab) for _ in range(input_len - len(encoded))]
                text = tokenizer.decode(encoded + extra, skip_special_tokens=True)
            else:
                break
        texts.append(text)
        counts.append(len(_encode(tokenizer, text)))
    return texts, counts
