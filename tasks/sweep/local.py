"""The sweep against the local model in transformers: ``generate`` with the point's parameters,
sample i drawn with its own ``torch.Generator`` seeded ``seed + i``; and the local target's
identity. torch and transformers are imported inside the functions (the remote sweep needs
neither)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tasks.stream.records import RequestRecord
from tasks.stream.timing import chunk_timing
from tasks.sweep.figures import PointResult, finish_point
from tasks.sweep.points import SweepPoint


def local_identity(spec: str) -> dict[str, str]:
    """What identifies a local (transformers) sweep target across runs, in the keys of
    ``Endpoint.identity``: kind, model name, and the GGUF file's hash when there is one."""
    from tasks.models.sources import resolve

    source = resolve(spec)
    ident = {"endpoint_kind": "local-transformers", "endpoint_model": source.name}
    digest = source.file_sha256()
    if digest:
        ident["endpoint_model_sha256"] = digest
    return ident


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
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
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


def chat_input_ids(tokenizer, prompt: str):
    """The prompt as the model sees it: LongTensor [1, N] of the one-user-message chat template
    with the generation prompt, or the plain prompt's ids when the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def run_point_local(
    model,
    tokenizer,
    point: SweepPoint,
    *,
    prompt: str,
    samples: int,
    encode: Callable[[str], list[int]],
) -> PointResult:
    """The point's samples from a local transformers model, one after another.

    Temperature 0 is greedy decoding (``do_sample=False``); otherwise transformers samples with
    the point's temperature, top_p and top_k (None = the model's generation_config default),
    sample i drawing from a ``torch.Generator`` seeded ``seed + i``. Extra body fields that are
    generate arguments (``repetition_penalty``, ``min_p``, ...) are passed on. TTFT / E2E are
    measured from just before ``generate`` to the first / last generated token (ms), by
    ``tasks.stream.timing.chunk_timing`` (each token is one chunk here); the output
    token count is the number of generated ids (source ``generate``). An exception in a sample
    is recorded as that sample's error class (the exception's type name).
    """
    import torch
    from transformers import LogitsProcessorList

    input_ids = chat_input_ids(tokenizer, prompt).to(model.device)
    sample = point.temperature > 0
    defaults = model.generation_config
    top_k = point.top_k if point.top_k is not None else defaults.top_k
    top_p = point.top_p if point.top_p is not None else defaults.top_p
    # generate's own warpers off: greedy at T=0, else _SeededSampler does the warping and draw
    kwargs: dict[str, Any] = {
        "max_new_tokens": point.max_tokens,
        "do_sample": sample,
        "temperature": 1.0 if sample else None,
        "top_k": 0 if sample else None,
        "top_p": 1.0 if sample else None,
        **point.extra_body(),
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
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    streamer=clock,
                    pad_token_id=pad,
                    logits_processor=LogitsProcessorList(
                        [_SeededSampler(generator, point.temperature, top_k, top_p)] if sample else []
                    ),
                    **kwargs,
                )
            new_ids = out[0, input_ids.shape[1] :].tolist()
            if new_ids and new_ids[-1] == tokenizer.eos_token_id:
                new_ids = new_ids[:-1]
            record.output_text = tokenizer.decode(new_ids, skip_special_tokens=True)
            record.output_tokens = len(new_ids)
            record.output_tokens_source = "generate"
            # the first put is the prompt; a trailing EOS (dropped above) carries no text
            token_ns = clock.calls_ns[1 : 1 + len(new_ids)]
            if token_ns and new_ids:
                timing = chunk_timing(send_ns, token_ns, record.output_tokens)
                record.token_offsets_ms = list(timing.token_offsets_ms)
                record.itl_ms = list(timing.itl_ms)
                record.ttft_ms, record.e2e_ms = timing.ttft_ms, timing.e2e_ms
                record.tpot_ms = timing.tpot_ms
            else:
                record.error_class, record.error_message = "empty_response", "generate produced no token"
        except Exception as exc:  # noqa: BLE001 - a failed sample is a record, not a crash
            record.error_class, record.error_message = type(exc).__name__, str(exc)[:500]
        records.append(record)
    return finish_point(point, records, encode)
