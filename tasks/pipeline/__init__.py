"""The stages as Prefect tasks: thin orchestration and tracking around the plain measurement
code of each stage package (one wrapper module per stage; shared parts in ``common``).

``from tasks.pipeline import stream_stage`` imports only that stage's module (PEP 562
``__getattr__``): a command runs one stage, and the others' imports (numpy statistics, the
sweep's plots, the profile's runner) cost a stream command 0.3-0.5 s on a 2-core machine.
"""

from __future__ import annotations

import importlib
from typing import Any

#: name -> the module that defines it
_HOMES = {
    "ProfileSweepFailed": "tasks.pipeline.profile",
    "profile_stage": "tasks.pipeline.profile",
    "stream_stage": "tasks.pipeline.stream",
    "sweep_stage": "tasks.pipeline.sweep",
    "tokenize_stage": "tasks.pipeline.tokenize",
}

__all__ = ["ProfileSweepFailed", "profile_stage", "stream_stage", "sweep_stage", "tokenize_stage"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
