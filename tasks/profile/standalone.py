"""The standalone entry point ``python -m tasks.profile``: one point of a random-weight model,
JSON on stdout. Needs only torch and transformers, so it runs on a GPU machine without the rest
of the project (prefect, mlflow, polars)::

    python -m tasks.profile --model arch:llama-2-7b --num-layers 2 --prompt-lengths 512 \
        --max-new-tokens 16 --device auto          # a preset of tasks.models.arch, 2 of its layers
    python -m tasks.profile --num-layers 2 --hidden 4096 --heads 32 --kv-heads 32 \
        --prompt-lengths 512 --max-new-tokens 16 --dtype bfloat16 --device auto

The flags that ``infermeter profile`` also has are spelt as there (``--model``,
``--num-layers``, ``--prompt-lengths``, ``--max-new-tokens``, ``--repeats``, ``--warmup``,
``--device``); ``--prompt-lengths`` takes one value here, since this entry point profiles one
point (``infermeter profile`` and ``tests/benchmarks/gpu_check.py`` sweep).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tasks.profile.measure import profile_point
from tasks.profile.timing import resolve_device


def random_llama(
    *,
    num_layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int | None = None,
    vocab: int = 32000,
    max_positions: int = 4096,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> torch.nn.Module:
    """A LlamaForCausalLM with random weights, built directly on ``device`` in ``dtype``.

    ``intermediate`` defaults to Llama's 8/3 x hidden rounded up to a multiple of 256 (4096 ->
    11008, Llama-2-7B's). Real timing and memory, meaningless text.

    Raises:
        ValueError: hidden is not divisible by heads, or heads by kv_heads.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be divisible by heads, and heads by kv_heads")
    if intermediate is None:
        intermediate = -(-(8 * hidden // 3) // 256) * 256
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(seed)
    with torch.device(resolve_device(device)):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


#: The shape flags of the standalone entry point, with their defaults when no --model is given.
_SHAPE_DEFAULTS = {"hidden": 4096, "heads": 32, "kv_heads": None, "intermediate": None, "vocab": 32000}


def _build_standalone(
    args: argparse.Namespace, device: torch.device
) -> tuple[torch.nn.Module, int, str | None]:
    """The model of ``python -m tasks.profile``: (model, vocab size, the --model spec or None).

    Raises:
        ValueError: shape flags beside --model, a spec that is not arch:, an unknown preset, a
            dtype the device cannot run, a prompt + max_new_tokens over the model's context.
        tasks.memory.formula.MemoryNeedError: the point would not fit in the available memory.
    """
    if args.model is None:
        shape = {
            k: _SHAPE_DEFAULTS[k] if getattr(args, k) is None else getattr(args, k) for k in _SHAPE_DEFAULTS
        }
        dtype = args.dtype or "bfloat16"
        model = random_llama(
            num_layers=2 if args.num_layers is None else args.num_layers,
            hidden=shape["hidden"],
            heads=shape["heads"],
            kv_heads=shape["kv_heads"] or shape["heads"],
            intermediate=shape["intermediate"],
            vocab=shape["vocab"],
            max_positions=max(4096, args.prompt_lengths + args.max_new_tokens),
            dtype=getattr(torch, dtype),
            device=device,
            seed=args.seed,
        )
        return model, shape["vocab"], None

    from tasks.memory.formula import check_memory, dtype_bytes, estimate_point_memory
    from tasks.memory.readings import available_memory_bytes
    from tasks.models.arch import parameter_count
    from tasks.models.sources import build_arch_model, default_dtype
    from tasks.profile.grid import check_request

    given = [f"--{k.replace('_', '-')}" for k in _SHAPE_DEFAULTS if getattr(args, k) is not None]
    if given:
        raise ValueError(f"--model sets the shape: drop {', '.join(given)} (--num-layers may stay)")
    if not args.model.startswith("arch:"):
        raise ValueError(
            f"--model {args.model!r}: this entry point builds arch: specs only (arch:NAME or "
            "arch:PATH/config.json); use `infermeter profile` for gguf: and hf: models"
        )
    dtype = args.dtype or default_dtype(args.model)
    _, _, config = check_request(
        args.model, [dtype], [args.prompt_lengths], args.max_new_tokens, str(device), args.num_layers
    )
    need = estimate_point_memory(
        config,
        parameters=parameter_count(config),
        dtype_bytes=dtype_bytes(getattr(torch, dtype)),
        batch=args.batch_size,
        prompt_tokens=args.prompt_lengths,
        max_new_tokens=args.max_new_tokens,
    )
    check_memory(f"{args.model} in {dtype}", need, available_memory_bytes(device), weights_resident=False)
    model = build_arch_model(args.model, dtype, str(device), num_layers=args.num_layers)
    return model, int(config.get_text_config(decoder=True).vocab_size), args.model


def main(argv: list[str] | None = None) -> int:
    """``python -m tasks.profile``: one point of a random-weight model, JSON on stdout.

    The model is an ``--model arch:NAME`` preset of :data:`tasks.models.arch.ARCH_PRESETS`
    (smollm2-135m, llama-2-7b, llama-3-8b) or ``arch:PATH/config.json``, with ``--num-layers``
    keeping its first N layers and ``--dtype`` defaulting to the preset's; or, without
    ``--model``, a Llama of the shape flags (--num-layers 2, --hidden 4096, --heads 32,
    --kv-heads = --heads, bfloat16 by default). ``--prompt-lengths`` takes one prompt length
    (default 512): one point. Prompt ids are random (seeded). Needs only torch and
    transformers. Exit 2 with one ``error:`` line on bad input (a comma list of prompt lengths
    included), 1 when the point would not fit in memory (checked before the model is built). Presets' weights use seed 0 (like
    ``infermeter profile``); ``--seed`` sets the shape flags' weights and the prompt ids.
    """
    from tasks.memory.formula import MemoryNeedError

    parser = argparse.ArgumentParser(
        prog="python -m tasks.profile",
        description="Profile one point of a random-weight model; print the result as JSON.",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="arch:NAME (smollm2-135m, llama-2-7b, llama-3-8b) or "
        "arch:PATH/config.json; default: a Llama of the shape flags",
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="keep the first N layers of --model (default: all); shape flags: 2",
    )
    parser.add_argument("--hidden", type=int, default=None, help="shape flag, default 4096")
    parser.add_argument("--heads", type=int, default=None, help="shape flag, default 32")
    parser.add_argument("--kv-heads", type=int, default=None, help="shape flag, default: --heads (no GQA)")
    parser.add_argument("--intermediate", type=int, default=None, help="shape flag, default 8/3 x hidden")
    parser.add_argument("--vocab", type=int, default=None, help="shape flag, default 32000")
    parser.add_argument(
        "--prompt-lengths", default="512", help="the point's prompt length in tokens (one value: one point)"
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default: the preset's (bfloat16 for 7B shapes), bfloat16 for shape flags",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.prompt_lengths = int(args.prompt_lengths)
    except ValueError:
        print(
            f"error: --prompt-lengths {args.prompt_lengths}: give one whole number; this entry "
            "point profiles one point (`infermeter profile` sweeps a list)",
            file=sys.stderr,
        )
        return 2
    floors = {
        "num_layers": 1,
        "prompt_lengths": 1,
        "batch_size": 1,
        "max_new_tokens": 1,
        "repeats": 1,
        "warmup": 0,
    }
    for name, floor in floors.items():
        value = getattr(args, name, None)
        if value is not None and value < floor:
            print(f"error: --{name.replace('_', '-')} {value}: must be at least {floor}", file=sys.stderr)
            return 2

    try:
        device = resolve_device(args.device)
        model, vocab, spec = _build_standalone(args, device)
        generator = torch.Generator().manual_seed(args.seed)
        prompt_ids = torch.randint(0, vocab, (1, args.prompt_lengths), generator=generator)
        measurement = profile_point(
            model,
            prompt_ids=prompt_ids,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            warmup=args.warmup,
            device=device,
        )
    except MemoryNeedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    point = {**measurement.to_dict(), "model": spec, "random_weights": True}
    print(json.dumps(point, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
