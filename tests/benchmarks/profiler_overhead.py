"""How much does the profiler slow the decode it measures?

Paired, interleaved runs on one model and one prompt (A B A B ...; the order inside each pair
alternates, so drift and a warm cache favour neither side):

- A, profiled: ``tasks.profile.phases.one_run`` - prefill, then T decode steps each bracketed by the
  profiler's timer, KV bytes read from the cache; its tokens/s = B x T / (sum of its reported
  decode_ms), i.e. what the profiler reports.
- B, bare: the same prefill and T ``decode_one_token`` + argmax steps with no timer inside the
  loop; tokens/s = B x T / (wall time of the whole decode loop, ``perf_counter_ns``).
- with ``--generate``: also ``model.generate`` (greedy, T + 1 new tokens) as a second
  reference, its tokens/s from wall time including its prefill (so a lower bound).

Prints the median ratio A/B of tokens/s and its spread (min, quartiles, max) over the pairs.
Target: a median ratio of at least 0.97 (the profiler costs at most 3 % of decode speed).

    .venv/bin/python tests/benchmarks/profiler_overhead.py [--model gguf:default] [--pairs 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.models.sources import load_model  # noqa: E402
from tasks.profile.measure import make_prompt_ids  # noqa: E402
from tasks.profile.phases import decode_one_token, greedy, one_run, prefill  # noqa: E402
from tasks.profile.timing import resolve_device, synchronize  # noqa: E402


def bare_decode_tokens_per_s(model, input_ids, steps: int) -> float:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    token = greedy(prefill(model, input_ids, cache))
    synchronize(input_ids.device)
    start = time.perf_counter_ns()
    for _ in range(steps):
        token = greedy(decode_one_token(model, token, cache))
    synchronize(input_ids.device)
    return input_ids.shape[0] * steps / ((time.perf_counter_ns() - start) / 1e9)


def profiled_decode_tokens_per_s(model, input_ids, steps: int) -> float:
    run = one_run(model, input_ids, steps)
    return input_ids.shape[0] * steps / (sum(run.decode_ms) / 1000)


def generate_tokens_per_s(model, input_ids, steps: int) -> float:
    start = time.perf_counter_ns()
    model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=steps + 1,
        min_new_tokens=steps + 1,
        pad_token_id=0,
    )
    synchronize(input_ids.device)
    return input_ids.shape[0] * (steps + 1) / ((time.perf_counter_ns() - start) / 1e9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gguf:default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per run")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--generate", action="store_true", help="also time model.generate")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    model, tokenizer = load_model(args.model, args.dtype, str(device))
    ids = make_prompt_ids(tokenizer, args.prompt_length).to(device)
    ids = ids.repeat(args.batch_size, 1)
    ratios, profiled, bare, generated = [], [], [], []
    with torch.inference_mode():
        for _ in range(2):  # warm-up, both paths
            profiled_decode_tokens_per_s(model, ids, args.steps)
            bare_decode_tokens_per_s(model, ids, args.steps)
        for pair in range(args.pairs):
            if pair % 2 == 0:
                a = profiled_decode_tokens_per_s(model, ids, args.steps)
                b = bare_decode_tokens_per_s(model, ids, args.steps)
            else:
                b = bare_decode_tokens_per_s(model, ids, args.steps)
                a = profiled_decode_tokens_per_s(model, ids, args.steps)
            profiled.append(a)
            bare.append(b)
            ratios.append(a / b)
            if args.generate:
                generated.append(generate_tokens_per_s(model, ids, args.steps))

    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    print(
        f"model {args.model} {args.dtype} on {device}, prompt {args.prompt_length}, "
        f"batch {args.batch_size}, {args.steps} decode steps, {args.pairs} interleaved pairs, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"profiled decode tokens/s: median {statistics.median(profiled):.1f}")
    print(f"bare loop decode tokens/s: median {statistics.median(bare):.1f}")
    if generated:
        print(f"model.generate tokens/s (incl. its prefill): median {statistics.median(generated):.1f}")
    print(
        f"ratio profiled/bare: median {statistics.median(ratios):.4f}  min {min(ratios):.4f}  "
        f"q1 {q1:.4f}  q3 {q3:.4f}  max {max(ratios):.4f}  (target >= 0.97: "
        f"{'met' if statistics.median(ratios) >= 0.97 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
