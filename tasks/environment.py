"""What a run ran on: git commit, host, library versions, CPU or GPU name, torch threads.

These become tags on every parent run, so two runs on different machines or commits are told
apart in the MLflow UI.
"""

from __future__ import annotations

import platform
import socket
import subprocess

from tasks.models.sources import REPO_ROOT


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str = "cpu") -> str:
    """The GPU's name for cuda, else the CPU model."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return cpu_model()


def environment_tags(torch_facts: bool = True) -> dict[str, str]:
    """Tags describing this machine and software (no secrets, no environment variables).

    ``torch_facts``: take ``torch_num_threads``, ``cuda_available`` and ``gpu`` from torch
    (importing it: 1.3-3 s on a 2-core machine). False, for a flow that runs no torch (a remote
    stream, a sweep): unless torch is loaded already, the versions come from the installed
    packages' metadata (the same strings), ``cuda_available`` and ``gpu`` from NVML (the GPUs
    the driver sees; none without a driver), and ``torch_num_threads`` is ``n/a`` (no torch
    ran).
    """
    import sys

    tags = {
        "git_commit": git_commit(),
        "host": socket.gethostname(),
        "python_version": platform.python_version(),
        "cpu": cpu_model(),
    }
    if torch_facts or "torch" in sys.modules:
        import torch
        import transformers

        return {
            **tags,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "torch_num_threads": str(torch.get_num_threads()),
            "cuda_available": str(torch.cuda.is_available()).lower(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        }
    gpus = nvml_gpu_names()
    return {
        **tags,
        "torch_version": _version("torch"),
        "transformers_version": _version("transformers"),
        "torch_num_threads": "n/a",
        "cuda_available": str(bool(gpus)).lower(),
        "gpu": gpus[0] if gpus else "none",
    }


def _version(package: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def nvml_gpu_names() -> list[str]:
    """The names of the GPUs NVIDIA's driver sees (nvidia-ml-py); [] without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no device: no GPU to name
        return []
    try:
        names = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return names
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
