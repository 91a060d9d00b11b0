"""The tokenize stage: what each prompt costs in tokens, and how the tokenizer splits it.

Counts are taken without special tokens (no BOS/EOS), the way DESIGN.md counts output tokens,
so a prompt's count here is the count of its text alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TokenizedText:
    """One prompt under one tokenizer.

    Attributes:
        tokenizer: the tokenizer's name (``model`` for the model's own).
        text: the prompt.
        ids: token ids, in order.
        pieces: each token decoded alone; a byte-level fragment of a multi-byte character
            (which decodes to U+FFFD alone) is shown as its raw vocabulary entry instead.
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


def tokenize_text(tokenizer, text: str, tokenizer_name: str = "model") -> TokenizedText:
    """Tokenize one text with a transformers tokenizer, without special tokens."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    raw = tokenizer.convert_ids_to_tokens(ids)
    pieces = []
    for token_id, vocab_entry in zip(ids, raw):
        piece = tokenizer.decode([token_id])
        pieces.append(vocab_entry if "\ufffd" in piece else piece)
    count = len(ids)
    return TokenizedText(
        tokenizer=tokenizer_name,
        text=text,
        ids=ids,
        pieces=pieces,
        token_count=count,
        chars_per_token=len(text) / count if count else None,
        bytes_per_token=len(text.encode("utf-8")) / count if count else None,
    )


def tokenize_prompts(tokenizer, prompts: list[str], tokenizer_name: str = "model") -> list[TokenizedText]:
    """Tokenize every prompt (one row each, in order)."""
    return [tokenize_text(tokenizer, text, tokenizer_name) for text in prompts]


def summary_metrics(rows: list[TokenizedText]) -> dict[str, float]:
    """Stage headline metrics per tokenizer: ``token_count_<tokenizer>_total`` and
    ``chars_per_token_<tokenizer>_mean`` (all prompts' characters over all their tokens)."""
    metrics: dict[str, float] = {}
    for name in dict.fromkeys(row.tokenizer for row in rows):
        mine = [row for row in rows if row.tokenizer == name]
        tokens = sum(row.token_count for row in mine)
        chars = sum(len(row.text) for row in mine)
        metrics[f"token_count_{name}_total"] = tokens
        metrics[f"chars_per_token_{name}_mean"] = chars / tokens if tokens else 0.0
    return metrics
