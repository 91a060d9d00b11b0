"""How long a profile point's child process may run before it is stopped as hung.

A point that runs in a spawned child (:mod:`tasks.profile.runner`) gets a wall-clock limit
derived from its memory estimate (:class:`tasks.memory.formula.PointMemory`, bytes) and its
work, generous enough for a slow CPU, so that only a hang (a deadlock, a stuck driver call,
a child waiting forever on a lock) reaches it:

    limit_s = CHILD_START_S
              + estimate.total_bytes / CHILD_LOAD_BYTES_PER_S
              + (warmup + repeats) x passes x estimate.weights_bytes / CHILD_READ_BYTES_PER_S

with ``passes`` = prefill forwards (1, or ceil(prompt / chunk) with a prefill chunk size) +
``max_new_tokens`` decode steps: every forward reads all weights at least once, so the weights
over a floor bandwidth bound each forward's time. The start term covers the interpreter,
torch and transformers imports; the load term the model's weights, KV cache and activations
allocated at a floor rate. ``INFERMETER_PROFILE_CHILD_LIMIT_S`` (seconds) replaces the rule
(a user's override; the tests set it low).

``INFERMETER_TEST_CHILD_HANG_S=SECONDS:PROMPT_TOKENS`` is a test-only hook: the child of a
point with that prompt length sleeps SECONDS before its work, standing in for a hang
(``tests/test_run_states.py``).
"""

from __future__ import annotations

import math
import os

from tasks.memory.formula import PointMemory
from tasks.profile.grid import ProfilePoint

CHILD_START_S = 300.0  # s: interpreter, torch and transformers imports on a busy machine
CHILD_LOAD_BYTES_PER_S = 20e6  # bytes/s: floor rate of loading and allocating the estimate
CHILD_READ_BYTES_PER_S = 0.5e9  # bytes/s: floor rate of reading the weights in one forward
LIMIT_ENV = "INFERMETER_PROFILE_CHILD_LIMIT_S"
HANG_ENV = "INFERMETER_TEST_CHILD_HANG_S"


def child_time_limit_s(point: ProfilePoint, need: PointMemory, repeats: int, warmup: int) -> float:
    """The point's limit in seconds (module docstring), or ``INFERMETER_PROFILE_CHILD_LIMIT_S``."""
    override = os.environ.get(LIMIT_ENV)
    if override:
        return float(override)
    chunk = point.prefill_chunk_size
    prefill_passes = math.ceil(point.prompt_tokens / chunk) if chunk else 1
    passes = prefill_passes + (point.max_new_tokens or 0)
    work_s = (warmup + repeats) * passes * need.weights_bytes / CHILD_READ_BYTES_PER_S
    return CHILD_START_S + need.total_bytes / CHILD_LOAD_BYTES_PER_S + work_s


def hang_for_test(point: ProfilePoint) -> None:
    """The test-only hook: ``INFERMETER_TEST_CHILD_HANG_S=SECONDS:PROMPT_TOKENS`` makes the
    child of a point with that prompt length sleep SECONDS before its work (unset: return)."""
    seconds, _, prompt_tokens = os.environ.get(HANG_ENV, "").partition(":")
    if seconds and prompt_tokens and int(prompt_tokens) == point.prompt_tokens:
        import time

        time.sleep(float(seconds))


class PointTimedOut(RuntimeError):
    """A point's child process gave no result within its time limit and was killed."""


def receive_or_kill(receive, child, limit_s: float, label: str) -> tuple[str, str] | object:
    """The child's message from the pipe ``receive``; if none comes within ``limit_s``, kill
    ``child`` (a ``multiprocessing`` process) and return ``("error", "PointTimedOut: ...")``,
    recorded like an exception raised in the child.

    Raises:
        EOFError: the child ended without a message (as ``Connection.recv``).
    """
    if receive.poll(limit_s):
        return receive.recv()
    child.kill()
    message = (
        f"PointTimedOut: {label}: the child process gave no result within its limit of "
        f"{limit_s:.0f} s (tasks/profile/limits.py: derived from the point's estimate) and was "
        f"killed; set {LIMIT_ENV} higher if the point is only slow"
    )
    return ("error", message)
