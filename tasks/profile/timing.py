"""The device and its clock: which device a point runs on, span timing on that device's own
clock, and the order statistics the profile reports. Standard library and torch only."""

from __future__ import annotations

import time
from typing import Any

import torch

from tasks import stats

__all__ = ["Timer", "median_index", "percentile", "resolve_device", "synchronize"]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> cuda when available else cpu; ``"cpu"`` / ``"cuda"`` / ``"cuda:1"`` as given.

    Raises:
        ValueError: an unknown device name.
        RuntimeError: cuda asked for but not available.
    """
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {resolved}; use auto, cpu or cuda")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda asked for, but torch sees no CUDA device")
    return resolved


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); nothing on CPU, whose kernels are
    synchronous."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Times spans on the device's own clock.

    CPU: ``time.perf_counter_ns()`` at ``start()`` / ``stop()`` (CPU kernels run synchronously).
    CUDA: a ``torch.cuda.Event(enable_timing=True)`` pair recorded on the current stream, so a
    span is GPU time between the two events; :meth:`elapsed_ms` synchronises once and reads them
    all, so timing adds no synchronisation between steps.

    Usage: ``timer.start(); ...; timer.stop()`` any number of times, then ``timer.elapsed_ms()``
    -> list of span lengths in milliseconds, in order.

    Raises:
        RuntimeError: ``stop()`` without a ``start()`` before it.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._spans: list[tuple[Any, Any]] = []
        self._open: Any = None

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def start(self) -> None:
        self._open = self._mark()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("Timer.stop() without start()")
        self._spans.append((self._open, self._mark()))
        self._open = None

    def elapsed_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [float(a.elapsed_time(b)) for a, b in self._spans]
        return [(b - a) / 1e6 for a, b in self._spans]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of unsorted values: :func:`tasks.stats.percentile`
    (linear interpolation).

    Raises:
        ValueError: empty ``values`` or q outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    return stats.percentile(sorted(values), q)


def median_index(values: list[float]) -> int:
    """Index of the (lower) median element of ``values`` (for an even count, the lower of the
    two middle ones)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]
