"""Where one request's time goes inside the model: per-part time of one prefill and N decode
steps under ``torch.profiler``, apart from the timed repeats (the profiler costs time, so these
runs are labelled "profiled" and never feed prefill_ms / decode_ms). Standard library, torch
and transformers only (runs alone on a GPU machine).

How the parts are found (:func:`find_parts`), for any decoder that follows the usual layout:

- the decoder layers: the ``nn.ModuleList`` whose length is the config's ``num_hidden_layers``
  (Llama's ``model.layers``, GPT-2's ``transformer.h``); none -> :class:`DecoderLayersNotFound`;
- ``embedding`` / ``lm_head``: ``get_input_embeddings()`` / ``get_output_embeddings()``;
- inside each layer, by the child's own name: ``q_proj`` ``k_proj`` ``v_proj`` ``o_proj``
  (fused ``qkv_proj`` / ``query_key_value`` / ``c_attn`` -> ``qkv_proj``), ``mlp`` /
  ``feed_forward``; any module whose class name has ``Norm`` -> ``norm``; ``Rotary`` ->
  ``rotary`` (the cos/sin tables), plus the attention module's ``apply_rotary_pos_emb`` (the
  global of its Python module, wrapped while profiling and restored after);
- ``attention_kernel``: the ATen ops the attention module calls itself that compute
  softmax(QK^T)V (:data:`KERNEL_OPS`: SDPA, or eager's matmul + softmax);
- ``kv_cache_update``: the cache's ``update`` (wrapped on the cache instance);
- ``sampling``: the argmax after each forward (:func:`tasks.profile.phases.greedy`).

Each part is a ``record_function`` range (forward pre/post hooks on modules). A part's time is
exclusive: its range minus the part ranges nested in it. On CPU the time is the ranges' CPU
wall time; on CUDA it is the device time of the kernels launched inside them. ``other`` is the
step's time that no part claimed (glue reshapes, masks, the attention module's own ops beyond
the kernel, the Python between): parts + other = the profiled step, nothing dropped. Parts an
architecture has no module for are listed in ``unmapped_parts``; their time lands in ``other``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tasks.profile.phases import decode_one_token, greedy, prefill

__all__ = [
    "KERNEL_OPS",
    "PARTS",
    "Breakdown",
    "DecoderLayersNotFound",
    "PhaseBreakdown",
    "find_decoder_layers",
    "find_parts",
    "profile_breakdown",
]

#: The parts, in table order; "other" is the remainder.
PARTS = (
    "embedding",
    "norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "rotary",
    "kv_cache_update",
    "attention_kernel",
    "o_proj",
    "mlp",
    "lm_head",
    "sampling",
)
#: ATen ops called by the attention module itself that compute softmax(QK^T)V.
KERNEL_OPS = frozenset(
    {
        "aten::scaled_dot_product_attention",
        "aten::matmul",
        "aten::bmm",
        "aten::baddbmm",
        "aten::softmax",
        "aten::_softmax",
        "aten::_safe_softmax",
    }
)
_PREFIX = "infermeter::"
_STEP = _PREFIX + "step::"
_CHILD_PART = {
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "o_proj": "o_proj",
    "qkv_proj": "qkv_proj",
    "query_key_value": "qkv_proj",
    "c_attn": "qkv_proj",
    "mlp": "mlp",
    "feed_forward": "mlp",
}
_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
_ATTENTION = "_attention"  # the attention module's own range: its kernel ops, the rest is other


class DecoderLayersNotFound(ValueError):
    """The model has no ``nn.ModuleList`` of ``num_hidden_layers`` decoder layers."""


def find_decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """(dotted name, the ModuleList) of the decoder layers: the first ``nn.ModuleList`` whose
    length is the text config's ``num_hidden_layers``.

    Raises:
        DecoderLayersNotFound: no such list (the message names what was looked for).
    """
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if config is not None else None
    want = getattr(text, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and want is not None and len(module) == want > 0:
            return name, module
    raise DecoderLayersNotFound(
        f"--breakdown: found no decoder layers in {type(model).__name__}: looked for an "
        f"nn.ModuleList of config.num_hidden_layers ({want}) blocks (e.g. model.layers, transformer.h)"
    )


def find_parts(model: torch.nn.Module) -> tuple[str, list[tuple[torch.nn.Module, str]], list[Any]]:
    """(layers' name, [(module, part)], [attention modules]) for :func:`profile_breakdown`.

    Raises:
        DecoderLayersNotFound: see :func:`find_decoder_layers`.
    """
    layers_name, layers = find_decoder_layers(model)
    found: list[tuple[torch.nn.Module, str]] = []
    attentions: list[Any] = []
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is not None:
        found.append((embedding, "embedding"))
    if head is not None:
        found.append((head, "lm_head"))
    inside = {id(m) for layer in layers for m in layer.modules()}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        kind = type(module).__name__
        if "Norm" in kind:
            found.append((module, "norm"))
        elif "Rotary" in kind:
            found.append((module, "rotary"))
        elif id(module) in inside and leaf in _CHILD_PART:
            found.append((module, _CHILD_PART[leaf]))
        elif id(module) in inside and leaf in _ATTENTION_NAMES:
            found.append((module, _ATTENTION))
            attentions.append(module)
    return layers_name, found, attentions


def _ranged(fn, part: str):
    """``fn`` inside a ``record_function`` range named for ``part``."""

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with record_function(_PREFIX + part):
            return fn(*args, **kwargs)

    return inner


@contextlib.contextmanager
def _instrumented(found: list[tuple[torch.nn.Module, str]], attentions: list[Any]):
    """Hooks opening and closing each part's range; the attention modules' Python modules'
    ``apply_rotary_pos_emb`` wrapped. All removed / restored on exit."""
    handles, patched = [], []

    def hooks(part: str):
        stack: list[Any] = []

        def pre(module, args):
            rf = record_function(_PREFIX + part)
            rf.__enter__()
            stack.append(rf)

        def post(module, args, output):
            stack.pop().__exit__(None, None, None)

        return pre, post

    try:
        for module, part in found:
            pre, post = hooks(part)
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        for source in {type(a).__module__ for a in attentions}:
            namespace = sys.modules.get(source)
            original = getattr(namespace, "apply_rotary_pos_emb", None)
            if callable(original):
                namespace.apply_rotary_pos_emb = _ranged(original, "rotary")
                patched.append((namespace, original))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for namespace, original in patched:
            namespace.apply_rotary_pos_emb = original


@dataclass(frozen=True)
class PhaseBreakdown:
    """One phase: the profiled step time (prefill: the one step; decode: the mean step) and
    each part's exclusive ms (``other`` last), all in ms."""

    phase: str  #: "prefill" | "decode"
    steps: int  #: profiled steps averaged (prefill 1)
    step_ms: float  #: profiled step time (CPU: range wall time; CUDA: kernel time)
    parts_ms: tuple[tuple[str, float], ...]  #: (part, ms) for PARTS present, then ("other", ms)

    def to_dict(self) -> dict[str, Any]:
        """{"phase", "steps", "step_ms", "parts": [{"part", "ms", "share"}]}; share = ms / step_ms."""
        return {
            "phase": self.phase,
            "steps": self.steps,
            "step_ms": self.step_ms,
            "parts": [
                {"part": p, "ms": ms, "share": ms / self.step_ms if self.step_ms else None}
                for p, ms in self.parts_ms
            ],
        }


@dataclass(frozen=True)
class Breakdown:
    """A point's profiled breakdown, or why it failed (``error``; the point's timing stands)."""

    error: str | None = None  #: "ExceptionClass: message" when profiling failed
    clock: str | None = None  #: "cpu_wall" | "cuda_kernels"
    decoder_layers: str | None = None  #: dotted name of the layers' ModuleList
    unmapped_parts: tuple[str, ...] = ()  #: parts this architecture has no module for
    prefill: PhaseBreakdown | None = None
    decode: PhaseBreakdown | None = None
    trace_path: str | None = None  #: the Chrome trace (Perfetto), when one was written

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": "profiled runs, apart from the timed repeats",
            "failed": self.error is not None,
            "error": self.error,
            "clock": self.clock,
            "decoder_layers": self.decoder_layers,
            "unmapped_parts": list(self.unmapped_parts),
            "prefill": self.prefill.to_dict() if self.prefill else None,
            "decode": self.decode.to_dict() if self.decode else None,
            "trace_path": self.trace_path,
        }


def _attribute(events, use_device: bool) -> dict[str, dict[str, float]]:
    """Per step range (``step::prefill``, ``step::decode:i``): {part: exclusive us, "_step": us}.

    Walks the profiler's CPU event tree; an event belongs to its innermost part range. CPU:
    a part range's duration minus its nearest nested part ranges'. CUDA: each op's kernels'
    device time goes to its innermost part (unclaimed -> other)."""
    steps: dict[str, dict[str, float]] = {}

    def duration(ev) -> float:
        return float(ev.time_range.end - ev.time_range.start)

    def kernels(ev) -> float:
        return float(sum(k.duration for k in getattr(ev, "kernels", [])))

    def visit(ev, owner: str | None, acc: dict[str, float]) -> None:
        part = None
        if ev.name.startswith(_PREFIX):
            part = ev.name[len(_PREFIX) :]
        elif owner == _ATTENTION and ev.name in KERNEL_OPS:
            part = "attention_kernel"
        if use_device:
            acc[part or owner or "other"] = acc.get(part or owner or "other", 0.0) + kernels(ev)
            acc["_step"] = acc.get("_step", 0.0) + kernels(ev)
        elif part is not None:
            acc[part] = acc.get(part, 0.0) + duration(ev)
            acc[owner or "other"] = acc.get(owner or "other", 0.0) - duration(ev)
        for child in ev.cpu_children:
            visit(child, part or owner, acc)

    for ev in events:
        if ev.cpu_parent is None and ev.name.startswith(_STEP):
            acc: dict[str, float] = {} if use_device else {"_step": duration(ev), "other": duration(ev)}
            for child in ev.cpu_children:
                visit(child, None, acc)
            steps[ev.name[len(_STEP) :]] = acc
    return steps


def _phase(name: str, accs: list[dict[str, float]]) -> PhaseBreakdown:
    """Mean over ``accs`` (us) in ms; the attention module's own remainder joins ``other``."""
    n = len(accs)

    def mean(key: str) -> float:
        return sum(a.get(key, 0.0) for a in accs) / n / 1000

    parts = [(p, mean(p)) for p in PARTS if any(p in a for a in accs)]
    parts.append(("other", mean("other") + mean(_ATTENTION)))
    return PhaseBreakdown(phase=name, steps=n, step_ms=mean("_step"), parts_ms=tuple(parts))


def profile_breakdown(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    decode_steps: int,
    prefill_chunk_size: int = 0,
    trace_path: str | None = None,
) -> Breakdown:
    """One warm-up, then one profiled prefill and ``decode_steps`` decode steps (greedy) of
    ``input_ids`` (LongTensor [B, N], on the model's device) in a fresh ``DynamicCache``.

    Returns the :class:`Breakdown` (decode = the mean of the profiled steps); writes the Chrome
    trace to ``trace_path`` when given.

    Raises:
        DecoderLayersNotFound: the model's decoder layers cannot be found (checked first).
        ValueError: decode_steps < 1.
        Anything torch.profiler raises (the caller records it as the breakdown's error).
    """
    from transformers import DynamicCache

    if int(decode_steps) != decode_steps or decode_steps < 1:
        raise ValueError(f"decode_steps must be an integer >= 1, got {decode_steps!r}")
    layers_name, found, attentions = find_parts(model)
    use_device = input_ids.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_device else [])

    def generate(ranges: bool) -> None:
        cache = DynamicCache(config=model.config)
        cache.update = _ranged(cache.update, "kv_cache_update")  # this instance only
        mark = record_function if ranges else (lambda _name: contextlib.nullcontext())
        with mark(_STEP + "prefill"):
            logits = prefill(model, input_ids, cache, prefill_chunk_size)
            with record_function(_PREFIX + "sampling"):
                token = greedy(logits)
        for i in range(decode_steps):
            with mark(f"{_STEP}decode:{i}"):
                logits = decode_one_token(model, token, cache)
                with record_function(_PREFIX + "sampling"):
                    token = greedy(logits)

    with torch.inference_mode(), _instrumented(found, attentions):
        generate(False)  # warm-up: first-call allocations and lazy init stay out of the profile
        with profile(activities=activities) as prof:
            generate(True)
            if use_device:
                torch.cuda.synchronize(input_ids.device)
    steps = _attribute(prof.events(), use_device)
    if "prefill" not in steps:
        raise RuntimeError("the profiler recorded no prefill range")
    decode = [steps[k] for k in steps if k.startswith("decode:")]
    if trace_path:
        prof.export_chrome_trace(trace_path)
    present = {p for _, p in found} | {"kv_cache_update", "sampling"}
    if attentions:
        present.add("attention_kernel")
    if any(
        callable(getattr(sys.modules.get(type(a).__module__), "apply_rotary_pos_emb", None))
        for a in attentions
    ):
        present.add("rotary")
    fused = "qkv_proj" in present
    unmapped = tuple(
        p
        for p in PARTS
        if p not in present
        and not (fused and p in ("q_proj", "k_proj", "v_proj"))
        and not (not fused and p == "qkv_proj")
    )
    return Breakdown(
        clock="cuda_kernels" if use_device else "cpu_wall",
        decoder_layers=layers_name,
        unmapped_parts=unmapped,
        prefill=_phase("prefill", [steps["prefill"]]),
        decode=_phase("decode", decode),
        trace_path=trace_path,
    )


def check_decoder_layers(spec: str, num_layers: int | None = None) -> str:
    """Where the spec's decoder layers are (dotted name), from the model built on the meta
    device (no weights, no memory): the check ``--breakdown`` makes before loading.

    Raises:
        DecoderLayersNotFound: see :func:`find_decoder_layers`.
        ModelSourceError: the spec does not resolve (from :func:`tasks.models.sources.model_config`).
    """
    from transformers import AutoModelForCausalLM

    from tasks.models.sources import model_config

    config = model_config(spec, num_layers=num_layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return find_decoder_layers(model)[0]
