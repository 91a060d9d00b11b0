"""The tokenize stage: what each prompt costs in tokens, and how the tokenizer splits it.

Counts are taken without special tokens (no BOS/EOS), the way DESIGN.md counts output tokens,
so a prompt's count here is the count of its text alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tasks.tokenize.tokenizers import Tokenizer, metric_name


@dataclass(frozen=True)
class TokenizedText:
    """One prompt under one tokenizer.

    Attributes:
        tokenizer: the tokenizer's name (``model`` for the model's own, ``cl100k_base``,
            ``qwen``, ``hf:...``; see ``tasks.tokenize.tokenizers``).
        text: the prompt.
        ids: token ids, in order.
        pieces: each token decoded alone; a byte-level fragment of a multi-byte character
            (which decodes to U+FFFD alone) is shown as its bytes escaped (``\\xe8\\xaf``).
        token_count: ``len(ids)``.
        chars_per_token: Unicode code points / tokens.
        bytes_per_token: UTF-8 bytes / tokens.
    """

    tokenizer: str
    text: str
    ids: list[int]
    pieces: list[str]
    token_count: int
    chars_per_token: float | None
    bytes_per_token: float | None

    def to_row(self) -> dict:
        return asdict(self)


def tokenize_text(tokenizer: Tokenizer, text: str) -> TokenizedText:
    """Tokenize one text without special tokens (``tasks.tokenize.tokenizers.Tokenizer``)."""
    ids = tokenizer.encode(text)
    count = len(ids)
    return TokenizedText(
        tokenizer=tokenizer.name,
        text=text,
        ids=ids,
        pieces=tokenizer.pieces(ids),
        token_count=count,
        chars_per_token=len(text) / count if count else None,
        bytes_per_token=len(text.encode("utf-8")) / count if count else None,
    )


def tokenize_prompts(tokenizers: list[Tokenizer], prompts: list[str]) -> list[TokenizedText]:
    """One row per prompt x tokenizer, tokenizer-major, prompts in order."""
    return [tokenize_text(tok, text) for tok in tokenizers for text in prompts]


def summary_metrics(rows: list[TokenizedText]) -> dict[str, float]:
    """Stage headline metrics per tokenizer: ``token_count_<tokenizer>_total`` and
    ``chars_per_token_<tokenizer>_mean`` (all prompts' characters over all their tokens)."""
    metrics: dict[str, float] = {}
    for name in dict.fromkeys(row.tokenizer for row in rows):
        mine = [row for row in rows if row.tokenizer == name]
        tokens = sum(row.token_count for row in mine)
        chars = sum(len(row.text) for row in mine)
        key = metric_name(name)
        metrics[f"token_count_{key}_total"] = tokens
        metrics[f"chars_per_token_{key}_mean"] = chars / tokens if tokens else 0.0
    return metrics
