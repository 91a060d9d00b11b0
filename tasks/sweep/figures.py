"""A point's figures from its samples: determinism, diversity, length, speed.

- ``identical_fraction``: the share of samples equal to the point's most common output
  (1.0 = fully deterministic).
- ``distinct_1`` / ``distinct_2``: distinct n-grams over all n-grams across the samples, counted
  on the model tokenizer's tokens (Li et al., 2016, "A Diversity-Promoting Objective Function
  for Neural Conversation Models"); tokens, not words, because Chinese has no spaces.
- output length (tokens) mean and standard deviation, TTFT and E2E means (ms).
- ``determinism_violated``: the parameters ask for deterministic output (temperature 0, or
  top_k 1) but the samples differ, a sign the server ignores sampling parameters.
- ``determinism_note``: a deterministic point whose warm-up (the first, cold request) gave
  another output than its warm samples, which agree with each other. llama.cpp reuses the
  longest common prompt prefix from its cache, and a cold prefill and one that reuses the cached
  prompt give slightly different logits (measured on the embedded server: the cold request's
  TTFT 163 ms against 35 ms warm, and its greedy text differed); the samples are judged warm.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.stream.records import RequestRecord
from tasks.sweep.points import SweepPoint


def identical_fraction(outputs: Sequence[str]) -> float | None:
    """Share of outputs equal to the most common one; None for no outputs."""
    if not outputs:
        return None
    return Counter(outputs).most_common(1)[0][1] / len(outputs)


def distinct_n(token_lists: Sequence[Sequence[int]], n: int) -> float | None:
    """Distinct n-grams / all n-grams, pooled over the samples; None when there is no n-gram."""
    ngrams = [tuple(tokens[i : i + n]) for tokens in token_lists for i in range(len(tokens) - n + 1)]
    return len(set(ngrams)) / len(ngrams) if ngrams else None


@dataclass
class PointResult:
    """One point's samples and figures. ``error_class``: the most common error class among
    its failed samples (None when every sample succeeded); such a point is a failed point."""

    point: SweepPoint
    records: list[RequestRecord] = field(default_factory=list)
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    error_class: str | None = None
    warmup: RequestRecord | None = None
    determinism_note: str | None = None
    #: why a point that has no samples failed ("KilledWorker: ..."): its Dask task was lost
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error_class is not None

    def sample_rows(self) -> list[dict[str, Any]]:
        """One row per sample: index, seed, text, token count, TTFT / E2E (ms), error."""
        return [_row(i, self.point.seed + i, r) for i, r in enumerate(self.records)]

    def warmup_row(self) -> dict[str, Any] | None:
        """The warm-up request as a sample row (``sample`` None; seed = the point's); None when
        the point had none."""
        return None if self.warmup is None else _row(None, self.point.seed, self.warmup)


def _row(index: int | None, seed: int, r: RequestRecord) -> dict[str, Any]:
    return {
        "sample": index,
        "seed": seed,
        "output_text": r.output_text,
        "output_tokens": r.output_tokens,
        "ttft_ms": r.ttft_ms,
        "e2e_ms": r.e2e_ms,
        "error_class": r.error_class,
        "error_message": r.error_message,
    }


#: The note a point gets when its cold warm-up and its (agreeing) warm samples differ.
COLD_WARM_NOTE = (
    "the warm-up (cold) output differs from the warm samples, which agree with each other: the "
    "server's prompt cache changes the numerics (a cold prefill and one that reuses the cached "
    "prompt give slightly different logits), not the sampler; the samples are judged warm"
)


def determinism_note(
    point: SweepPoint, records: Sequence[RequestRecord], warmup: RequestRecord | None
) -> str | None:
    """:data:`COLD_WARM_NOTE` when ``point`` expects determinism, its warm-up succeeded and
    its successful samples all agree on an output other than the warm-up's; else None."""
    if warmup is None or warmup.error_class is not None or not point.expects_determinism():
        return None
    texts = {r.output_text for r in records if r.error_class is None}
    if len(texts) != 1 or texts == {warmup.output_text}:
        return None
    return COLD_WARM_NOTE


def point_metrics(
    point: SweepPoint, records: Sequence[RequestRecord], encode: Callable[[str], list[int]]
) -> dict[str, float | int | None]:
    """The point's figures from its sample records (failed samples are counted, not used)."""
    ok = [r for r in records if r.error_class is None]
    texts = [r.output_text for r in ok]
    lengths = [r.output_tokens for r in ok if r.output_tokens is not None]
    token_lists = [encode(text) for text in texts]
    same = identical_fraction(texts)
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    return {
        "num_samples": len(records),
        "num_samples_failed": len(records) - len(ok),
        "identical_fraction": same,
        "distinct_1": distinct_n(token_lists, 1),
        "distinct_2": distinct_n(token_lists, 2),
        "output_tokens_mean": statistics.fmean(lengths) if lengths else None,
        "output_tokens_std": statistics.pstdev(lengths) if lengths else None,
        "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
        "e2e_ms_mean": statistics.fmean(e2e) if e2e else None,
        "determinism_violated": int(point.expects_determinism() and same is not None and same < 1.0),
    }


def finish_point(
    point: SweepPoint,
    records: list[RequestRecord],
    encode: Callable[[str], list[int]],
    warmup: RequestRecord | None = None,
) -> PointResult:
    """The point's result from its sample records; ``warmup`` (the request made before them) is
    kept beside the figures, never in them (a failed warm-up does not fail the point)."""
    classes = Counter(r.error_class for r in records if r.error_class is not None)
    error_class = classes.most_common(1)[0][0] if classes else None
    metrics = point_metrics(point, records, encode)
    note = determinism_note(point, records, warmup)
    return PointResult(point, records, metrics, error_class, warmup, note)
