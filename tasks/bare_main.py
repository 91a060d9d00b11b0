"""Start ``multiprocessing`` children without re-running the parent's main module.

A ``spawn`` or ``forkserver`` child re-runs the parent's main module (as ``__mp_main__``) so
that targets defined there can be found. infermeter's targets live in its packages, so that re-run
buys nothing and costs much: under the ``infermeter`` script it imports prefect and the CLI
(0.2-0.3 s for a stream's client process, more for a profile point's child, which may also be
short of memory), and a script without an ``if __name__ == "__main__":`` guard would start its
work again in the child. Standard library only.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

__all__ = ["bare_main"]


@contextlib.contextmanager
def bare_main() -> Iterator[None]:
    """Hide the main module while the block starts children (``Process.start()``): an empty
    ``__main__`` (no ``__file__``, no ``__spec__``) while ``start()`` gathers the child's
    preparation data makes the child skip it."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main
