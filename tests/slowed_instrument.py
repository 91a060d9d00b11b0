"""The ground-truth instrument (``tests/groundtruth_server.py``) with a slowdown planted: every
``ticks``, ``load`` and ``noisy`` schedule's TTFT and gaps times FACTOR, the scenario's name (the
model, and so the endpoint's identity in the audit history) unchanged. The nightly-audit guide
(docs/guides/nightly-audit.md) restarts the instrument with it on the same port, as a slower
deploy of the same model would be: ``python tests/slowed_instrument.py PORT FACTOR`` prints
``PORT <n>`` like the instrument (PORT 0: a free one; FACTOR default 1.3).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

try:
    from tests import groundtruth_server as gt
except ImportError:  # run as a script: its folder is on sys.path
    import groundtruth_server as gt

_plain_ticks = gt._ticks


def slowed(factor: float):
    """``gt._ticks`` with every time of the schedule (TTFT, gap, slope, a noisy one's drawn gaps)
    multiplied by ``factor``; other scenarios (None) untouched."""

    def ticks(model: str):
        spec = _plain_ticks(model)
        if spec is None:
            return None
        n, gap_s, ttft_s, slope_s, *drawn = spec
        out = (n, gap_s * factor, ttft_s * factor, slope_s * factor)
        if drawn:
            out += (tuple(g * factor for g in drawn[0]),)
        return out

    return ticks


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    factor = float(sys.argv[2]) if len(sys.argv) > 2 else 1.3
    gt._ticks = slowed(factor)  # the handler looks the schedule function up per request
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(gt._main(port))
