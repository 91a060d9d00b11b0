"""Where a command's seconds go: named instants for ``tests/benchmarks/command_phases.py``.

With ``INFERMETER_PHASES=FILE`` in the environment, :func:`mark` appends one line per call,
``<pid> <CLOCK_MONOTONIC ns> <name>``, to FILE (the command, and the client processes it starts,
which inherit the variable). CLOCK_MONOTONIC is one clock for every process of the machine on
Linux, so the benchmark can put the marks of several processes and its own start and end on
one time line. Unset (always, outside the benchmark), a mark costs one dict lookup. Standard
library only: it is imported before anything else is.
"""

from __future__ import annotations

import os
import time

__all__ = ["ENV", "mark"]

#: The environment variable naming the file the marks go to.
ENV = "INFERMETER_PHASES"


def mark(name: str) -> None:
    """Record that the phase ``name`` (no spaces) begins now, when ``INFERMETER_PHASES`` is set."""
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as out:  # O_APPEND: one line per write, any process
            out.write(f"{os.getpid()} {time.clock_gettime_ns(time.CLOCK_MONOTONIC)} {name}\n")
