"""The sampler's view: the next-token distribution at the first K decode steps of one prompt,
under each temperature, with what top_p keeps (the nucleus) and the entropy. torch only (the
model and tokenizer come loaded).

The path is the greedy continuation (argmax at each step), the same under every temperature, so
the distributions of one step compare: only the temperature changes. Temperature t scales the
logits: p = softmax(logits / t) (t = 0: greedy, all mass on the argmax). The nucleus of top_p
(Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration") is the smallest set of
most likely tokens whose mass reaches top_p, as transformers' TopPLogitsWarper keeps it.
Entropy in bits: -sum p log2 p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "StepDistribution",
    "entropy_series",
    "next_token_distributions",
    "nucleus",
    "table_rows",
    "temperature_label",
]


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[int, float]:
    """(tokens kept, their mass) of the top_p nucleus of ``probs`` [vocab], computed as
    transformers' TopPLogitsWarper does (the sweep samples through it): sort ascending, drop
    the tokens whose ascending cumulative mass is <= 1 - top_p, keep at least one. (So top_p 1
    keeps every token of nonzero probability; a cumulative sum from the top would reach 1.0 by
    float rounding before the tail.)"""
    ascending = torch.sort(probs).values
    cumulative = torch.cumsum(ascending, dim=0)
    dropped = min(int((cumulative <= 1 - top_p).sum()), ascending.numel() - 1)  # a prefix
    return ascending.numel() - dropped, float(ascending[dropped:].sum())


@dataclass(frozen=True)
class StepDistribution:
    """One decode step under one temperature."""

    step: int  #: 0 = the token after the prompt
    temperature: float
    chosen_id: int  #: the greedy token the path continues with
    entropy_bits: float
    top: tuple[tuple[int, str, float], ...]  #: (id, piece, probability), most likely first
    nucleus: tuple[tuple[float, int, float], ...]  #: (top_p, tokens kept, mass kept)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "temperature": self.temperature,
            "chosen_id": self.chosen_id,
            "entropy_bits": self.entropy_bits,
            "top": [{"id": i, "piece": piece, "probability": p} for i, piece, p in self.top],
            "nucleus": [{"top_p": q, "tokens": n, "mass": m} for q, n, m in self.nucleus],
        }


def next_token_distributions(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    *,
    steps: int,
    temperatures: list[float],
    top_ps: list[float],
    top_n: int = 20,
) -> list[StepDistribution]:
    """Per step (``steps`` of them) x temperature, in that order. input_ids: LongTensor [1, N].

    Raises:
        ValueError: steps < 1, a temperature < 0, a top_p outside (0, 1].
    """
    if steps < 1 or any(t < 0 for t in temperatures) or any(not 0 < p <= 1 for p in top_ps):
        raise ValueError("steps >= 1, temperatures >= 0 and top_p in (0, 1] are required")
    out: list[StepDistribution] = []
    ids = input_ids
    with torch.inference_mode():
        for step in range(steps):
            logits = model(input_ids=ids).logits[0, -1].float()
            chosen = int(torch.argmax(logits))
            for t in temperatures:
                if t == 0:
                    probs = torch.zeros_like(logits)
                    probs[chosen] = 1.0
                else:
                    probs = torch.softmax(logits / t, dim=-1)
                positive = probs[probs > 0]
                entropy = float(-(positive * torch.log2(positive)).sum())
                values, indices = torch.topk(probs, min(top_n, probs.numel()))
                top = tuple(
                    (int(i), tokenizer.decode([int(i)]), float(v))
                    for v, i in zip(values, indices, strict=True)
                )
                kept = tuple((float(q), *nucleus(probs, q)) for q in top_ps)
                out.append(StepDistribution(step, float(t), chosen, max(entropy, 0.0), top, kept))
            ids = torch.cat([ids, torch.tensor([[chosen]], device=ids.device)], dim=1)
    return out


def entropy_bits(probs: list[float]) -> float:
    """Entropy in bits of a probability list (for hand checks)."""
    return -sum(p * math.log2(p) for p in probs if p > 0)


def temperature_label(temperature: float) -> str:
    """A temperature as metric names and titles spell it: ``0.3``, ``1``, ``1.5`` (``:g``)."""
    return f"{temperature:g}"


def entropy_series(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """``next_token_entropy_bits_t<temperature>`` -> entropy (bits) per decode step, in step
    order, from :meth:`StepDistribution.to_dict` rows."""
    out: dict[str, list[float]] = {}
    for row in sorted(rows, key=lambda r: r["step"]):
        name = f"next_token_entropy_bits_t{temperature_label(row['temperature'])}"
        out.setdefault(name, []).append(row["entropy_bits"])
    return out


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per step x temperature x rank (the MLflow table): step, temperature, rank
    (1 = most likely), id, piece, probability, entropy_bits of the step, and per top_p whether
    the nucleus keeps the token (``kept_top_p_<q>``: rank <= tokens kept)."""
    return [
        {
            "step": row["step"],
            "temperature": row["temperature"],
            "rank": rank,
            "id": top["id"],
            "piece": top["piece"],
            "probability": top["probability"],
            "entropy_bits": row["entropy_bits"],
            **{f"kept_top_p_{n['top_p']:g}": rank <= n["tokens"] for n in row["nucleus"]},
        }
        for row in rows
        for rank, top in enumerate(row["top"], start=1)
    ]
