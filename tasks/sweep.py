"""The sampling sweep: what temperature / top_p do to the output, and to speed.

A point is one combination of sampling parameters; it gets N samples of the same prompt, and
sample i uses ``seed + i`` so the point is reproducible and its samples independent. Figures per
point:

- ``identical_fraction``: the share of samples equal to the point's most common output
  (1.0 = fully deterministic).
- ``distinct_1`` / ``distinct_2``: distinct n-grams over all n-grams across the samples, counted
  on the model tokenizer's tokens (Li et al., 2016, "A Diversity-Promoting Objective Function
  for Neural Conversation Models"); tokens, not words, because Chinese has no spaces.
- output length (tokens) mean and standard deviation, TTFT and E2E means.
- ``determinism_violated``: the parameters ask for deterministic output (temperature 0) but
  the samples differ, a sign the server ignores sampling parameters.

Imports only the standard library and the stream client.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tasks.stream.client import stream_chat
from tasks.stream.records import RequestRecord


@dataclass(frozen=True)
class SweepPoint:
    """One grid point's sampling parameters (values sent to the endpoint as they are)."""

    temperature: float
    top_p: float

    def params(self) -> dict[str, float]:
        return {"temperature": self.temperature, "top_p": self.top_p}

    def key(self) -> str:
        """A short stable hash of the parameters (names runs, matches resumed points)."""
        text = json.dumps(self.params(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def expects_determinism(self) -> bool:
        return self.temperature == 0


def grid(temperatures: Sequence[float], top_ps: Sequence[float]) -> list[SweepPoint]:
    """The cross product, temperature-major, in the order given."""
    return [SweepPoint(t, p) for t, p in itertools.product(temperatures, top_ps)]


def identical_fraction(outputs: Sequence[str]) -> float | None:
    """Share of outputs equal to the most common one; None for no outputs."""
    if not outputs:
        return None
    return Counter(outputs).most_common(1)[0][1] / len(outputs)


def distinct_n(token_lists: Sequence[Sequence[int]], n: int) -> float | None:
    """Distinct n-grams / all n-grams, pooled over the samples; None when there is no n-gram."""
    ngrams = [
        tuple(tokens[i : i + n]) for tokens in token_lists for i in range(len(tokens) - n + 1)
    ]
    return len(set(ngrams)) / len(ngrams) if ngrams else None


@dataclass
class PointResult:
    """One point's samples and figures."""

    point: SweepPoint
    records: list[RequestRecord] = field(default_factory=list)
    metrics: dict[str, float | int | None] = field(default_factory=dict)


def point_metrics(
    point: SweepPoint, records: Sequence[RequestRecord], encode: Callable[[str], list[int]]
) -> dict[str, float | int | None]:
    """The point's figures from its sample records (failed samples are counted, not used)."""
    ok = [r for r in records if r.error_class is None]
    texts = [r.output_text for r in ok]
    lengths = [r.output_tokens for r in ok if r.output_tokens is not None]
    token_lists = [encode(text) for text in texts]
    same = identical_fraction(texts)
    return {
        "num_samples": len(records),
        "num_samples_failed": len(records) - len(ok),
        "identical_fraction": same,
        "distinct_1": distinct_n(token_lists, 1),
        "distinct_2": distinct_n(token_lists, 2),
        "output_tokens_mean": statistics.fmean(lengths) if lengths else None,
        "output_tokens_std": statistics.pstdev(lengths) if lengths else None,
        "ttft_ms_mean": statistics.fmean(r.ttft_ms for r in ok) if ok else None,
        "e2e_ms_mean": statistics.fmean(r.e2e_ms for r in ok) if ok else None,
        "determinism_violated": int(
            point.expects_determinism() and same is not None and same < 1.0
        ),
    }


async def run_point(
    client,
    point: SweepPoint,
    *,
    model: str,
    prompt: str,
    samples: int,
    seed: int,
    max_tokens: int,
    max_concurrency: int,
    count_tokens: Callable[[str], int],
    encode: Callable[[str], list[int]],
    api_key_env: str | None = None,
) -> PointResult:
    """Send the point's samples (sample i with seed + i), at most max_concurrency at once."""
    gate = asyncio.Semaphore(max_concurrency)

    async def one(i: int) -> RequestRecord:
        async with gate:
            return await stream_chat(
                client,
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                count_tokens=count_tokens,
                sampling={**point.params(), "seed": seed + i},
                request_id=f"{point.key()}-{i}",
                api_key_env=api_key_env,
            )

    records = list(await asyncio.gather(*(one(i) for i in range(samples))))
    return PointResult(point, records, point_metrics(point, records, encode))
