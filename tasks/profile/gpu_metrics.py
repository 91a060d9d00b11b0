"""GPU power, utilisation and energy during a CUDA profile point, read through NVML.

NVML is NVIDIA's management library (``libnvidia-ml.so``, shipped with the driver); its Python
binding is the PyPI package ``nvidia-ml-py`` (``import pynvml``). :class:`NvmlSampler` reads, in
a background thread every ``interval_s`` while its ``with`` block runs:

- ``nvmlDeviceGetPowerUsage``: board power draw in milliwatts. On Ampere GPUs other than the
  GA100 (A100) and on newer ones (H100, H200, ...) NVML reports a one-second average, so a
  block shorter than about a second is smoothed with what came before it; GA100 and older
  report instantaneous power (NVML API reference, nvmlDeviceGetPowerUsage);
- ``nvmlDeviceGetUtilizationRates(...).gpu``: the percent of the driver's last sample period
  (between 1/6 s and 1 s, by GPU) during which one or more kernels ran: a busy fraction, not a
  measure of how much of the GPU's compute was used;

and once at entry and at exit ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since the
driver loaded; Volta and later), whose difference is the energy of the block.

:func:`summarize` turns the samples into the reported figures (units in the names):
``gpu_power_w_mean``, ``gpu_power_w_max``, ``gpu_utilization_pct_mean``,
``gpu_utilization_pct_max``, ``gpu_energy_joules`` and ``gpu_metric_samples``.

Without nvidia-ml-py, without the NVML library (a machine with no NVIDIA driver), or when the
CUDA device cannot be matched to an NVML device, the sampler records nothing and never raises:
:attr:`NvmlSampler.metrics` is then ``{}``; a metric the GPU does not support is left out.

Imports only the standard library at import time (pynvml and torch lazily), so the standalone
profiler runs on a machine with only torch and transformers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["GPU_METRIC_KEYS", "NvmlSampler", "summarize"]

#: The keys :func:`summarize` can return (all of them, in this order).
GPU_METRIC_KEYS = (
    "gpu_power_w_mean",
    "gpu_power_w_max",
    "gpu_utilization_pct_mean",
    "gpu_utilization_pct_max",
    "gpu_energy_joules",
    "gpu_metric_samples",
)


def summarize(
    power_mw: Sequence[float],
    utilization_pct: Sequence[float],
    energy_mj_start: float | None = None,
    energy_mj_end: float | None = None,
) -> dict[str, float | int]:
    """The reported figures from raw NVML readings.

    power_mw: power samples in milliwatts -> ``gpu_power_w_mean`` / ``gpu_power_w_max`` in watts.
    utilization_pct: utilisation samples in percent -> ``gpu_utilization_pct_mean`` / ``_max``.
    energy_mj_start / energy_mj_end: the energy counter (millijoules) at the start and end ->
    ``gpu_energy_joules`` = (end - start) / 1000, only when both are given and end >= start
    (the counter restarts when the driver reloads).
    ``gpu_metric_samples``: the number of sampling rounds (the longer of the two lists).
    Returns only the figures that have data; ``{}`` when none has.
    """
    out: dict[str, float | int] = {}
    if power_mw:
        out["gpu_power_w_mean"] = sum(power_mw) / len(power_mw) / 1000
        out["gpu_power_w_max"] = max(power_mw) / 1000
    if utilization_pct:
        out["gpu_utilization_pct_mean"] = sum(utilization_pct) / len(utilization_pct)
        out["gpu_utilization_pct_max"] = float(max(utilization_pct))
    if energy_mj_start is not None and energy_mj_end is not None and energy_mj_end >= energy_mj_start:
        out["gpu_energy_joules"] = (energy_mj_end - energy_mj_start) / 1000
    if power_mw or utilization_pct:
        out["gpu_metric_samples"] = max(len(power_mw), len(utilization_pct))
    return out


def _nvml_handle(nvml: Any, device: Any) -> Any:
    """The NVML handle of a torch CUDA device: by UUID (right under CUDA_VISIBLE_DEVICES, where
    torch's index 0 can be NVML's index 3), else by index when no device is hidden."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        for candidate in (text, f"GPU-{text}"):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(candidate)
            except nvml.NVMLError:
                continue
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    return None


class NvmlSampler:
    """Power and utilisation of one CUDA device, sampled during a ``with`` block.

    ``device``: a torch CUDA device (``"cuda"``, ``"cuda:1"``, a ``torch.device``).
    ``interval_s``: seconds between samples (default 0.1: the driver's own figures change no
    faster; the thread wakes rarely, so it barely competes with the measured loop for the GIL).
    After the block, :attr:`metrics` holds :func:`summarize`'s figures, or ``{}`` when NVML is
    not available. Never raises for a missing or failing NVML.
    """

    def __init__(self, device: Any = "cuda", interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.device = device
        self.interval_s = interval_s
        self.metrics: dict[str, float | int] = {}
        self.available = False
        self._nvml: Any = None
        self._handle: Any = None
        self._power: list[float] = []
        self._utilization: list[float] = []
        self._energy_start: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _open(self) -> bool:
        try:
            import pynvml
        except ImportError:
            return False
        try:
            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return False
        self._nvml = pynvml
        try:
            self._handle = _nvml_handle(pynvml, self.device)
        except Exception:  # noqa: BLE001 - no such device, torch without CUDA
            self._handle = None
        if self._handle is None:
            self._close()
            return False
        return True

    def _close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass

    def _energy(self) -> float | None:
        try:
            return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # noqa: BLE001 - not supported before Volta
            return None

    def _sample(self) -> None:
        nvml, handle = self._nvml, self._handle
        try:
            self._power.append(float(nvml.nvmlDeviceGetPowerUsage(handle)))
        except Exception:  # noqa: BLE001 - not supported on this board
            pass
        try:
            self._utilization.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        except Exception:  # noqa: BLE001
            pass

    def _loop(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> NvmlSampler:
        self.available = self._open()
        if self.available:
            self._energy_start = self._energy()
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.available:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()  # the state at the end of the block
        energy_end = self._energy()
        self._close()
        self.metrics = summarize(self._power, self._utilization, self._energy_start, energy_end)
