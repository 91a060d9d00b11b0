"""The sampling sweep: what temperature / top_p / top_k / seed do to the output, and to speed.

A point is one combination of sampling parameters (temperature, top_p, top_k, base seed,
max_tokens and any extra request-body field); it gets N samples of the same prompt, and sample
i uses ``seed + i`` so the point is reproducible and its samples independent. Figures per point:

- ``identical_fraction``: the share of samples equal to the point's most common output
  (1.0 = fully deterministic).
- ``distinct_1`` / ``distinct_2``: distinct n-grams over all n-grams across the samples, counted
  on the model tokenizer's tokens (Li et al., 2016, "A Diversity-Promoting Objective Function
  for Neural Conversation Models"); tokens, not words, because Chinese has no spaces.
- output length (tokens) mean and standard deviation, TTFT and E2E means (ms).
- ``determinism_violated``: the parameters ask for deterministic output (temperature 0, or
  top_k 1) but the samples differ, a sign the server ignores sampling parameters.

Targets: an OpenAI-compatible endpoint through the stream client (``run_points``: every point
runs concurrently, at most ``max_concurrency`` requests in flight across the sweep), or the local
model in transformers (``run_point_local``: ``generate`` with the same parameters, sample i drawn
with its own ``torch.Generator`` seeded ``seed + i``).

A point's ``key`` hashes its parameters with the prompt, the sample count and the target's
identity (server kind + model + model file hash, never URL or port): a rerun of the same sweep
finds the points already finished by it.

Imports only the standard library, the stream client, and (for the local target) torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.stream.client import stream_chat
from tasks.stream.records import RequestRecord


@dataclass(frozen=True)
class SweepPoint:
    """One point's sampling parameters (sent to the target as they are; None = not sent).

    ``extra`` holds extra request-body fields as sorted ``(name, JSON text)`` pairs, so the
    point stays hashable.
    """

    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    max_tokens: int = 32
    extra: tuple[tuple[str, str], ...] = ()

    @classmethod
    def make(cls, *, extra_body: Mapping[str, Any] | None = None, **values: Any) -> "SweepPoint":
        extra = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in (extra_body or {}).items()))
        return cls(extra=extra, **values)

    def extra_body(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.extra}

    def params(self) -> dict[str, Any]:
        """The point as flat params: the sampling fields, then ``extra_body.<name>``."""
        data: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "max_tokens": self.max_tokens,
        }
        data.update({f"extra_body.{k}": v for k, v in self.extra_body().items()})
        return data

    def sampling(self, sample: int) -> dict[str, Any]:
        """What a request of sample ``sample`` sends (seed + sample), None fields left out."""
        sent = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed + sample}
        sent.update(self.extra_body())
        return {k: v for k, v in sent.items() if v is not None}

    def key(self, context: Mapping[str, Any] | None = None) -> str:
        """A short stable hash of the parameters and ``context`` (prompt, samples, target
        identity): names runs and matches a resumed point."""
        text = json.dumps({"point": self.params(), **(context or {})}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def expects_determinism(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def label(self) -> str:
        parts = [f"T={self.temperature}"]
        parts += [f"{k}={v}" for k, v in (("top_p", self.top_p), ("top_k", self.top_k)) if v is not None]
        parts += [f"seed={self.seed}", f"max_tokens={self.max_tokens}"]
        parts += [f"{k}={v}" for k, v in self.extra]
        return " ".join(parts)


def grid(
    temperatures: Sequence[float],
    top_ps: Sequence[float | None] = (None,),
    top_ks: Sequence[int | None] = (),
    *,
    seed: int = 0,
    max_tokens: int = 32,
    extra_body: Mapping[str, Any] | None = None,
) -> list[SweepPoint]:
    """The cross product temperature x top_p x top_k, temperature-major, in the order given
    (no top_k values = top_k not sent)."""
    return [
        SweepPoint.make(temperature=t, top_p=p, top_k=k, seed=seed, max_tokens=max_tokens,
                        extra_body=extra_body)
        for t, p, k in itertools.product(temperatures, top_ps or (None,), top_ks or (None,))
    ]


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
    """One point's samples and figures. ``error_class``: the most common error class among
    its failed samples (None when every sample succeeded); such a point is a failed point."""

    point: SweepPoint
    records: list[RequestRecord] = field(default_factory=list)
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    error_class: str | None = None

    @property
    def failed(self) -> bool:
        return self.error_class is not None

    def sample_rows(self) -> list[dict[str, Any]]:
        """One row per sample: index, seed, text, token count, TTFT / E2E (ms), error."""
        return [
            {"sample": i, "seed": self.point.seed + i, "output_text": r.output_text,
             "output_tokens": r.output_tokens, "ttft_ms": r.ttft_ms, "e2e_ms": r.e2e_ms,
             "error_class": r.error_class, "error_message": r.error_message}
            for i, r in enumerate(self.records)
        ]


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
        "determinism_violated": int(
            point.expects_determinism() and same is not None and same < 1.0
        ),
    }


def finish_point(
    point: SweepPoint, records: list[RequestRecord], encode: Callable[[str], list[int]]
) -> PointResult:
    classes = Counter(r.error_class for r in records if r.error_class is not None)
    error_class = classes.most_common(1)[0][0] if classes else None
    return PointResult(point, records, point_metrics(point, records, encode), error_class)


async def run_points(
    client,
    points: Sequence[SweepPoint],
    *,
    model: str,
    prompt: str,
    samples: int,
    max_concurrency: int,
    count_tokens: Callable[[str], int],
    encode: Callable[[str], list[int]],
    api_key_env: str | None = None,
    on_point: Callable[[PointResult], Awaitable[None] | None] | None = None,
    key: Callable[[SweepPoint], str] = SweepPoint.key,
) -> list[PointResult]:
    """Run every point's samples concurrently, at most ``max_concurrency`` requests in flight
    across the whole sweep (sample i of a point with seed + i). ``on_point`` is called (and
    awaited, when it returns an awaitable) as each point finishes; results come back in the
    order of ``points``. A request that fails becomes a record with its error class.
    """
    gate = asyncio.Semaphore(max_concurrency)

    async def one(point: SweepPoint, i: int) -> RequestRecord:
        async with gate:
            return await stream_chat(
                client, model=model, prompt=prompt, max_tokens=point.max_tokens,
                count_tokens=count_tokens, sampling=point.sampling(i),
                request_id=f"{key(point)}-{i}", max_concurrency=max_concurrency,
                api_key_env=api_key_env,
            )

    async def whole(point: SweepPoint) -> PointResult:
        records = list(await asyncio.gather(*(one(point, i) for i in range(samples))))
        result = finish_point(point, records, encode)
        if on_point is not None:
            maybe = on_point(result)
            if asyncio.iscoroutine(maybe):
                await maybe
        return result

    return list(await asyncio.gather(*(whole(p) for p in points)))


class _Clock:
    """A transformers streamer that only timestamps: ``put`` is called with the prompt first,
    then with each generated token (``perf_counter_ns``)."""

    def __init__(self) -> None:
        self.calls_ns: list[int] = []

    def put(self, value) -> None:
        self.calls_ns.append(time.perf_counter_ns())

    def end(self) -> None:
        pass


class _SeededSampler:
    """A logits processor that applies the point's temperature / top-k / top-p (transformers'
    own warpers, in generate's order) and draws the next token with a seeded
    ``torch.Generator``, leaving only that token possible; generate runs with its own warpers
    off, so its unseeded draw must pick it. (generate takes no generator argument, and puts
    custom processors before its warpers.)"""

    def __init__(self, generator, temperature: float, top_k: int | None, top_p: float | None) -> None:
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
        )

        self.generator = generator
        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p))

    def __call__(self, input_ids, scores):
        import torch

        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        chosen = torch.multinomial(probs, 1, generator=self.generator)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(1, chosen, 0.0)


def run_point_local(
    model, tokenizer, point: SweepPoint, *, prompt: str, samples: int,
    encode: Callable[[str], list[int]],
) -> PointResult:
    """The point's samples from a local transformers model, one after another.

    Temperature 0 is greedy decoding (``do_sample=False``); otherwise transformers samples with
    the point's temperature, top_p and top_k (None = the model's generation_config default),
    sample i drawing from a ``torch.Generator`` seeded ``seed + i``. Extra body fields that are
    generate arguments (``repetition_penalty``, ``min_p``, ...) are passed on. TTFT / E2E are
    measured from just before ``generate`` to the first / last generated token (ms); the output
    token count is the number of generated ids (source ``generate``). An exception in a sample
    is recorded as that sample's error class (the exception's type name).
    """
    import torch
    from transformers import LogitsProcessorList

    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        input_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    input_ids = input_ids.to(model.device)
    sample = point.temperature > 0
    defaults = model.generation_config
    top_k = point.top_k if point.top_k is not None else defaults.top_k
    top_p = point.top_p if point.top_p is not None else defaults.top_p
    # generate's own warpers off: greedy at T=0, else _SeededSampler does the warping and draw
    kwargs: dict[str, Any] = {
        "max_new_tokens": point.max_tokens, "do_sample": sample,
        "temperature": 1.0 if sample else None, "top_k": 0 if sample else None,
        "top_p": 1.0 if sample else None, **point.extra_body(),
    }
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    records = []
    for i in range(samples):
        record = RequestRecord(request_id=f"local-{i}", input_tokens=int(input_ids.shape[1]))
        clock = _Clock()
        generator = torch.Generator(device=model.device).manual_seed(point.seed + i)
        send_ns = time.perf_counter_ns()
        record.send_ns = send_ns
        try:
            with torch.inference_mode():
                out = model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), streamer=clock,
                    pad_token_id=pad, logits_processor=LogitsProcessorList(
                        [_SeededSampler(generator, point.temperature, top_k, top_p)] if sample else []
                    ), **kwargs,
                )
            new_ids = out[0, input_ids.shape[1]:].tolist()
            if new_ids and new_ids[-1] == tokenizer.eos_token_id:
                new_ids = new_ids[:-1]
            record.output_text = tokenizer.decode(new_ids, skip_special_tokens=True)
            record.output_tokens = len(new_ids)
            record.output_tokens_source = "generate"
            token_ns = clock.calls_ns[1:]  # the first put is the prompt
            if token_ns and new_ids:
                record.token_offsets_ms = [(t - send_ns) / 1e6 for t in token_ns]
                record.ttft_ms = record.token_offsets_ms[0]
                record.e2e_ms = record.token_offsets_ms[-1]
                record.itl_ms = [b - a for a, b in zip(record.token_offsets_ms, record.token_offsets_ms[1:])]
            else:
                record.error_class, record.error_message = "empty_response", "generate produced no token"
        except Exception as exc:  # noqa: BLE001 - a failed sample is a record, not a crash
            record.error_class, record.error_message = type(exc).__name__, str(exc)[:500]
        records.append(record)
    return finish_point(point, records, encode)
