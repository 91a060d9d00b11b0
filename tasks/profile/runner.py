"""The local profile's sweep: prompt length x batch size x dtype x prefill chunk size x
max_new_tokens over one model spec, one :func:`tasks.profile.measure.profile_point` per point.

Plain code (standard library, torch, transformers, psutil): the profile stage of the audit and
the ``infermeter profile`` command both call :func:`run_sweep`, which returns one typed
:class:`~tasks.profile.result.ProfilePointResult` per point; orchestration and tracking stay in
``tasks/pipeline/profile.py``.

Memory is checked before it is allocated (there is no swap: a process that runs out is killed by
the kernel, with no traceback): before a dtype's model is built or loaded, its weights plus the
smallest point's KV cache and activations must fit in the available memory; before each point,
that point's KV cache and activations must (:func:`tasks.memory.formula.estimate_point_memory`, at the
point's own max_new_tokens). A point that does not fit, or that raises, is recorded as failed
with its cause, and the sweep goes on.

Points that may not fit run in a child process. An estimate is an estimate: a point whose
whole need (weights included) exceeds :data:`CHILD_PROCESS_FRACTION` of the memory available
when its dtype's turn comes runs in a ``multiprocessing`` *spawn* child that loads the model and
profiles only that point, after the points that clearly fit have run in this process and this
process's copy of the model has been released. If the kernel's out-of-memory killer ends the
child (SIGKILL, a negative exit code), only the child dies: the point is recorded failed as
``PointProcessDied: ...`` naming the signal, the estimate and the available memory, and the sweep
goes on. A Python exception inside the child is recorded exactly like one in this process. A
child with no result within a limit derived from its estimate (:mod:`tasks.profile.limits`) is
killed and recorded as ``PointTimedOut: ...``; the sweep goes on.
"""

from __future__ import annotations

import gc
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from tasks.bare_main import bare_main
from tasks.memory.formula import (
    MemoryNeedError,
    PointMemory,
    check_memory,
    dtype_bytes,
    estimate_point_memory,
    format_gib,
)
from tasks.memory.readings import available_memory_bytes
from tasks.models.arch import parameter_count
from tasks.models.sources import load_model, model_config, resolve
from tasks.profile.grid import ProfilePoint, steps_swept
from tasks.profile.limits import child_time_limit_s, hang_for_test, receive_or_kill
from tasks.profile.measure import make_prompt_ids, profile_point
from tasks.profile.result import PointMeasurement, ProfilePointResult
from tasks.profile.timing import resolve_device

__all__ = ["CHILD_PROCESS_FRACTION", "PointProcessDied", "run_sweep"]


#: A point whose estimated need (weights + KV cache + activations, bytes) exceeds this share of
#: the memory available runs in a spawned child process (:func:`run_sweep`, ``child_fraction``).
CHILD_PROCESS_FRACTION = 0.5


class PointProcessDied(RuntimeError):
    """The child process that ran a point ended without a result (e.g. SIGKILL from the
    kernel's out-of-memory killer)."""


def _touch_weights(model: torch.nn.Module, device: torch.device) -> None:
    """One untimed one-token forward right after loading: transformers may map a checkpoint's
    weights lazily (safetensors mmap), so without it the first point's peak RSS would count
    the weights being paged in."""
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)


def _describe(exc: BaseException) -> str:
    """``"ExceptionClass: message"`` on one line (whitespace runs folded to one space), at most
    1000 characters: a failed point's ``error``."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:1000]


def _profile_loaded(
    model: torch.nn.Module,
    tokenizer: Any,
    point: ProfilePoint,
    random_weights: bool,
    repeats: int,
    warmup: int,
    device: torch.device,
    breakdown_steps: int = 0,
    trace_dir: str | None = None,
) -> tuple[PointMeasurement, str | None, Any]:
    """One point on a loaded model: :func:`tasks.profile.measure.profile_point`, the
    generated text (None for random weights: their text means nothing), and with
    ``breakdown_steps`` > 0 the point's profiled breakdown and roofline, run after the timed
    repeats (:func:`tasks.profile.roofline.analyse_point`; else None)."""
    prompt_ids = make_prompt_ids(tokenizer, point.prompt_tokens)
    measurement = profile_point(
        model,
        prompt_ids=prompt_ids,
        batch_size=point.batch_size,
        max_new_tokens=point.max_new_tokens,
        repeats=repeats,
        warmup=warmup,
        device=device,
        prefill_chunk_size=point.prefill_chunk_size,
    )
    text = None if random_weights else tokenizer.decode(list(measurement.generated_token_ids))
    analysis = None
    if breakdown_steps:
        from tasks.profile.roofline import analyse_point

        input_ids = prompt_ids.to(device).repeat(point.batch_size, 1)
        trace = f"{trace_dir}/trace-{point.label(True).replace(' ', '_')}.json" if trace_dir else None
        analysis = analyse_point(
            model, input_ids, measurement, decode_steps=breakdown_steps, trace_path=trace
        )
    return measurement, text, analysis


def _point_in_child(
    conn: Any,
    spec: str,
    device: str,
    num_layers: int | None,
    point: ProfilePoint,
    repeats: int,
    warmup: int,
    breakdown_steps: int = 0,
    trace_dir: str | None = None,
) -> None:
    """The body of a spawned child: load the model, profile one point, send
    ``("ok", (measurement, generated_text))`` or ``("error", "ExceptionClass: message")``
    through ``conn``."""
    try:
        hang_for_test(point)
        resolved = resolve_device(device)
        model, tokenizer = load_model(spec, point.dtype, str(resolved), num_layers=num_layers)
        _touch_weights(model, resolved)
        message: tuple[str, Any] = (
            "ok",
            _profile_loaded(
                model,
                tokenizer,
                point,
                resolve(spec).random_weights,
                repeats,
                warmup,
                resolved,
                breakdown_steps,
                trace_dir,
            ),
        )
    except Exception as exc:  # noqa: BLE001 - sent to the parent, recorded there
        message = ("error", _describe(exc))
    conn.send(message)
    conn.close()


def _run_in_child(
    spec: str,
    point: ProfilePoint,
    *,
    device: torch.device,
    num_layers: int | None,
    repeats: int,
    warmup: int,
    breakdown_steps: int = 0,
    trace_dir: str | None = None,
    limit_s: float = float("inf"),
) -> tuple[tuple[str, Any] | None, int | None]:
    """Run one point in a ``multiprocessing`` spawn child; returns (its message or None when it
    ended without one, its exit code; negative = killed by that signal). No answer in
    ``limit_s``: killed, message ``("error", "PointTimedOut: ...")`` (tasks.profile.limits)."""
    context = multiprocessing.get_context("spawn")  # fork is unsafe with CUDA and threads
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_point_in_child,
        args=(send, spec, str(device), num_layers, point, repeats, warmup, breakdown_steps, trace_dir),
        name=f"infermeter profile {point.label(True)}",
        daemon=True,
    )
    with bare_main():
        child.start()
    send.close()  # the child holds the only write end: its death ends recv() with EOFError
    try:
        message = receive_or_kill(receive, child, limit_s, point.label(True))
    except EOFError:
        message = None
    finally:
        receive.close()
    child.join()
    return message, child.exitcode


def _death_cause(label: str, exitcode: int | None, need: PointMemory, free: int) -> str:
    """The one-line ``error`` of a point whose child ended without a result."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        how = f"was killed by {name} (exit code {exitcode})"
        if -exitcode == signal.SIGKILL:
            how += ", as the kernel's out-of-memory killer does"
    else:
        how = f"exited with code {exitcode} without a result"
    return _describe(
        PointProcessDied(
            f"{label}: the child process running the point {how}; estimated need about "
            f"{format_gib(need.total_bytes)} (weights {format_gib(need.weights_bytes)} + KV cache "
            f"{format_gib(need.kv_cache_bytes)} + activations {format_gib(need.activation_bytes)}), "
            f"{format_gib(free)} available; use a smaller batch or prompt, bfloat16, or a prefill "
            "chunk size"
        )
    )


def run_sweep(
    spec: str,
    points: Sequence[ProfilePoint],
    *,
    max_new_tokens: int | None = None,
    repeats: int,
    warmup: int,
    device: torch.device | str,
    num_layers: int | None = None,
    on_point: Callable[[int, int, ProfilePointResult], None] | None = None,
    available: Callable[[torch.device], int] = available_memory_bytes,
    child_fraction: float = CHILD_PROCESS_FRACTION,
    breakdown_steps: int = 0,
    trace_dir: str | None = None,
    breakdown_first: bool = False,
    load: Callable[..., Any] = load_model,  # a per-process cache on a Dask worker (fanout.py)
) -> list[ProfilePointResult]:
    """Profile every point; returns one result per point, in the order of ``points``.

    ``max_new_tokens``: the decode steps of points whose own ``max_new_tokens`` is None.

    Per dtype, one reading of ``available(device)`` (bytes) decides: if even the smallest point
    (weights + KV + activations, :func:`tasks.memory.formula.estimate_point_memory`) does not fit, every
    point of the dtype fails with ``MemoryNeedError``; points whose need is at most
    ``child_fraction`` x that reading run in this process on one loaded model (each first
    checked against a fresh reading, weights resident); the others then run one by one, each
    in a spawned child process that loads the model itself (each first checked against a fresh
    reading, weights included, after this process has released its model). ``child_fraction``
    0 sends every point to a child, ``float("inf")`` none.

    Each :class:`~tasks.profile.result.ProfilePointResult` has the point (its max_new_tokens
    filled in), the model spec, device and random_weights, ``error`` (None, or
    ``"ExceptionClass: message"``; ``PointProcessDied: ...`` when a child was killed),
    ``memory_estimate_bytes`` (the estimate the check used) and ``child_process`` (whether the
    point ran in a child); a point that ran also has its ``measurement``
    (:func:`tasks.profile.measure.profile_point`) and ``generated_text`` (None for random
    weights). ``breakdown_steps`` > 0: each point that ran also gets its profiled breakdown and
    roofline (``analysis``; Chrome traces under ``trace_dir``); ``breakdown_first``: only the
    first point of the list does. ``on_point(index, total, result)`` is called after each point, in the order they ran
    (index counts finished points), outside any timed region.

    Raises:
        ValueError: a point has no max_new_tokens and none is given here.
        Nothing for a point's failure (memory, a torch error, a killed child): it is recorded.
    """
    device = resolve_device(device)
    source = resolve(spec)
    points = [
        p if p.max_new_tokens is not None else replace(p, max_new_tokens=max_new_tokens) for p in points
    ]
    if any(p.max_new_tokens is None for p in points):
        raise ValueError("max_new_tokens: give it to run_sweep or to every ProfilePoint")
    show_steps = steps_swept(points)
    config = model_config(spec, num_layers=num_layers)
    parameters = parameter_count(config)
    results: dict[int, ProfilePointResult] = {}

    def estimate(point: ProfilePoint) -> PointMemory:
        return estimate_point_memory(
            config,
            parameters=parameters,
            dtype_bytes=dtype_bytes(getattr(torch, point.dtype)),
            batch=point.batch_size,
            prompt_tokens=point.prompt_tokens,
            max_new_tokens=point.max_new_tokens,
            prefill_chunk_size=point.prefill_chunk_size,
        )

    def record(
        index: int,
        point: ProfilePoint,
        ran: tuple[PointMeasurement, str | None, Any] | None,
        error: str | None,
        child: bool,
    ) -> None:
        measurement, text, analysis = ran if ran is not None else (None, None, None)
        row = ProfilePointResult(
            model=spec,
            point=point,
            device=str(device),
            random_weights=source.random_weights,
            error=error,
            memory_estimate_bytes=estimate(point).total_bytes,
            child_process=child,
            measurement=measurement,
            generated_text=text,
            analysis=analysis,
        )
        results[index] = row
        if on_point is not None:
            on_point(len(results) - 1, len(points), row)

    def release() -> None:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand the cached blocks back (after an OOM, or a model)

    by_dtype: dict[str, list[tuple[int, ProfilePoint]]] = {}
    for index, point in enumerate(points):
        by_dtype.setdefault(point.dtype, []).append((index, point))

    for dtype, group in by_dtype.items():
        free = available(device)
        smallest = min((p for _, p in group), key=lambda p: estimate(p).total_bytes)
        try:
            check_memory(f"model {spec} in {dtype}", estimate(smallest), free, weights_resident=False)
        except MemoryNeedError as exc:  # every point of this dtype fails with the same cause
            for index, point in group:
                record(index, point, None, _describe(exc), False)
            continue
        here = [(i, p) for i, p in group if estimate(p).total_bytes <= child_fraction * free]
        apart = [(i, p) for i, p in group if estimate(p).total_bytes > child_fraction * free]

        if here:
            try:
                model, tokenizer = load(spec, dtype, str(device), num_layers=num_layers)
                _touch_weights(model, device)
            except Exception as exc:  # noqa: BLE001 - every in-process point of this dtype fails
                for index, point in here:
                    record(index, point, None, _describe(exc), False)
            else:
                try:
                    for index, point in here:
                        try:
                            check_memory(
                                point.label(show_steps),
                                estimate(point),
                                available(device),
                                weights_resident=True,
                            )
                            ran = _profile_loaded(
                                model,
                                tokenizer,
                                point,
                                source.random_weights,
                                repeats,
                                warmup,
                                device,
                                breakdown_steps if not breakdown_first or index == 0 else 0,
                                trace_dir,
                            )
                        except Exception as exc:  # noqa: BLE001 - recorded; the sweep goes on
                            release()
                            record(index, point, None, _describe(exc), False)
                            continue
                        record(index, point, ran, None, False)
                finally:
                    del model, tokenizer
                    release()

        for index, point in apart:
            need = estimate(point)
            free_now = available(device)
            try:
                check_memory(point.label(show_steps), need, free_now, weights_resident=False)
            except MemoryNeedError as exc:
                record(index, point, None, _describe(exc), False)
                continue
            message, exitcode = _run_in_child(
                spec,
                point,
                limit_s=child_time_limit_s(point, need, repeats, warmup),
                device=device,
                num_layers=num_layers,
                repeats=repeats,
                warmup=warmup,
                breakdown_steps=breakdown_steps if not breakdown_first or index == 0 else 0,
                trace_dir=trace_dir,
            )
            if message is None:
                cause = _death_cause(point.label(show_steps), exitcode, need, free_now)
                record(index, point, None, cause, True)
            elif message[0] == "ok":
                record(index, point, message[1], None, True)
            else:
                record(index, point, None, message[1], True)
    return [results[i] for i in range(len(points))]
