"""Live memory readings for the local profile stage: the resident set size and a peak-RSS
sampler running in a separate process (CPU), peak and allocated CUDA memory, and the memory free
for a new allocation.

This module imports only the standard library and torch at import time (psutil is imported
lazily, and only where it is there: /proc is read without it), so it runs on a GPU machine that
has torch and transformers and nothing else. Definitions follow DESIGN.md, "Metric
definitions", "Local:" (``peak_memory_bytes``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NamedTuple

import torch

__all__ = [
    "CudaPeak",
    "RssSampler",
    "available_memory_bytes",
    "cuda_allocated_bytes",
    "cuda_peak_bytes",
    "cuda_reset_peak",
    "rss_bytes",
]


# --------------------------------------------------------------------------------------------
# Resident set size: read it, and sample its peak from another process
# --------------------------------------------------------------------------------------------


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process in bytes (default: this one).

    Uses psutil when installed, else ``/proc/<pid>/statm`` (Linux).

    Raises:
        RuntimeError: neither psutil nor /proc is available.
    """
    pid = os.getpid() if pid is None else pid
    try:
        import psutil
    except ImportError:
        try:
            with open(f"/proc/{pid}/statm", encoding="ascii") as handle:
                return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError as exc:
            raise RuntimeError("reading RSS needs psutil or /proc") from exc
    return int(psutil.Process(pid).memory_info().rss)


# The sampler child: imports only the standard library (and psutil when it is there). It prints
# "ready <rss>" after its first sample, polls until its stdin closes (the parent's stop signal, or
# the parent's death), takes one last sample and prints "peak <bytes> <samples>".
_SAMPLER_CODE = r"""
import os, sys, threading, time
pid = int(sys.argv[1]); interval = float(sys.argv[2])
try:
    import psutil
    _proc = psutil.Process(pid)
    def rss():
        return _proc.memory_info().rss
except ImportError:
    _page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/%d/statm" % pid, "rb") as f:
            return int(f.read().split()[1]) * _page
stop = threading.Event()
def wait_for_eof():
    sys.stdin.buffer.read()
    stop.set()
threading.Thread(target=wait_for_eof, daemon=True).start()
peak = rss(); samples = 1
sys.stdout.write("ready %d\n" % peak); sys.stdout.flush()
while not stop.is_set():
    time.sleep(interval)
    try:
        value = rss()
    except Exception:
        break
    samples += 1
    if value > peak:
        peak = value
sys.stdout.write("peak %d %d\n" % (peak, samples)); sys.stdout.flush()
"""


class RssSampler:
    """Peak resident memory of this process during a ``with`` block, sampled by a child process.

    DESIGN.md, "Local:" ``peak_memory_bytes`` on CPU = peak RSS sampled by a separate process
    during the point, minus the RSS before it. The child (``python -c``, standard library plus
    psutil) polls this process's RSS every ``interval_s`` (default 5 ms); sampling from another
    process keeps the poller off this process's GIL and out of its RSS. ``__enter__`` returns
    only after the child has taken its first sample, so the child's start-up (about 0.1 s) is
    paid before the measured region. On exit the child's stdin is closed, it takes a last sample
    and reports its peak; this process also reads its own RSS once more at exit.

    After the block:
        baseline_bytes: RSS of this process just before the block (bytes).
        peak_bytes: highest RSS seen during the block (bytes, >= baseline_bytes).
        peak_delta_bytes: ``peak_bytes - baseline_bytes``.
        samples: how many samples the child took.

    A sampled peak can miss a spike shorter than the interval. RSS also reflects the allocator:
    memory freed but kept by malloc still counts, so a second run in one process can show a
    smaller delta than the first.

    Raises:
        RuntimeError: the child did not start or did not report (message has its stderr).
    """

    def __init__(self, interval_s: float = 0.005, start_timeout_s: float = 30.0) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self.start_timeout_s = start_timeout_s
        self.baseline_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.peak_delta_bytes: int | None = None
        self.samples: int = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> RssSampler:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER_CODE, str(os.getpid()), repr(self.interval_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self._proc.stdout.readline()  # blocks until the first sample is taken
        if not line.startswith("ready"):
            self._fail("did not start")
        self.baseline_bytes = rss_bytes()
        return self

    def __exit__(self, *exc_info: object) -> None:
        final = rss_bytes()
        proc = self._proc
        assert proc is not None
        try:
            out, _err = proc.communicate(input="", timeout=self.start_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            if exc_info[0] is None:
                raise RuntimeError("RSS sampler did not report its peak in time") from None
            return
        peak_line = [ln for ln in out.splitlines() if ln.startswith("peak")]
        if not peak_line:
            if exc_info[0] is None:
                self._fail("reported no peak")
            return
        _, peak, samples = peak_line[-1].split()
        self.samples = int(samples)
        assert self.baseline_bytes is not None
        self.peak_bytes = max(int(peak), final, self.baseline_bytes)
        self.peak_delta_bytes = self.peak_bytes - self.baseline_bytes

    def _fail(self, what: str) -> None:
        proc = self._proc
        err = ""
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                err = (proc.communicate(timeout=5)[1] or "").strip()
            except (subprocess.TimeoutExpired, ValueError):
                pass
        raise RuntimeError(f"RSS sampler {what}: {err.splitlines()[-1] if err else 'no stderr'}")


# --------------------------------------------------------------------------------------------
# CUDA peak memory (no-ops on other devices)
# --------------------------------------------------------------------------------------------


class CudaPeak(NamedTuple):
    """Peak CUDA memory since the last reset, in bytes."""

    allocated_bytes: int  # torch.cuda.max_memory_allocated: bytes held by live tensors
    reserved_bytes: int  # torch.cuda.max_memory_reserved: bytes the caching allocator held


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def cuda_reset_peak(device: torch.device | str | None) -> None:
    """Synchronise and reset CUDA peak-memory statistics of ``device``; does nothing off CUDA."""
    if _is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device: torch.device | str | None) -> CudaPeak | None:
    """Peak allocated and reserved CUDA bytes on ``device`` since :func:`cuda_reset_peak`.

    Returns None off CUDA. DESIGN.md's ``peak_memory_bytes`` on CUDA is ``allocated_bytes``
    (absolute: weights and everything else live count too, unlike the CPU RSS delta).
    """
    if not _is_cuda(device):
        return None
    torch.cuda.synchronize(device)
    return CudaPeak(
        allocated_bytes=int(torch.cuda.max_memory_allocated(device)),
        reserved_bytes=int(torch.cuda.max_memory_reserved(device)),
    )


def cuda_allocated_bytes(device: torch.device | str | None) -> int | None:
    """Bytes currently allocated by tensors on a CUDA ``device``; None off CUDA."""
    if not _is_cuda(device):
        return None
    return int(torch.cuda.memory_allocated(device))


def available_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Memory free for a new allocation: CPU ``psutil.virtual_memory().available`` (what the
    kernel can give without swapping; ``MemAvailable`` of /proc/meminfo without psutil), CUDA
    ``torch.cuda.mem_get_info()[0]`` plus what torch's caching allocator holds but does not
    use."""
    if _is_cuda(device):
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        import psutil
    except ImportError:  # a machine with only torch and transformers: Linux's own figure
        with open("/proc/meminfo", encoding="ascii") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        return int(fields["MemAvailable"].split()[0]) * 1024
    return int(psutil.virtual_memory().available)
