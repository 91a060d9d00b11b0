"""What a run ran on: git commit, host, library versions, CPU or GPU name, torch threads.

These become tags on every parent run, so two runs on different machines or commits are told
apart in the MLflow UI.
"""

from __future__ import annotations

import platform
import socket
import subprocess

from tasks.models import REPO_ROOT


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


def environment_tags() -> dict[str, str]:
    """Tags describing this machine and software (no secrets, no environment variables)."""
    import torch
    import transformers

    return {
        "git_commit": git_commit(),
        "host": socket.gethostname(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torch_num_threads": str(torch.get_num_threads()),
        "cpu": cpu_model(),
        "cuda_available": str(torch.cuda.is_available()).lower(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }
