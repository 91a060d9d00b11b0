"""The ground-truth instrument (``tests/groundtruth_server.py``: every scenario, every stamp)
with the gauges a level's timeline samples added to its ``/metrics``, under vLLM's names and
each of a known law:

- ``vllm:num_requests_running``: the requests in flight at the instrument as the page is
  written (its own count, the one behind ``/stats``' ``max_in_flight``);
- ``vllm:num_requests_waiting``: 0 (the instrument serves every request at once);
- ``vllm:kv_cache_usage_perc``: 1 % per request in flight (a fraction, as vLLM's);
- ``gt_monotonic_seconds``: the instrument's ``time.perf_counter()`` as the page is written:
  CLOCK_MONOTONIC, the client's clock, so a sample's stamp can be checked against it;
- ``gt_step``: ``floor(perf_counter() / 0.5)``, a gauge that steps every 500 ms on that clock.

Run as a separate process (``python tests/gauges_server.py``; it prints ``PORT <n>``); use
:func:`serve` from tests. The instrument's page function is wrapped, nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Iterator

try:
    from tests import groundtruth_server as gt
except ImportError:
    import groundtruth_server as gt

#: Seconds per step of ``gt_step``.
STEP_S = 0.5
_plain_page = gt._metrics_page


def gauges_page(state) -> str:
    """The instrument's page with the gauges of the module docstring first."""
    now = time.perf_counter()
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0"}} {state.in_flight}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0"} 0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0"}} {state.in_flight / 100}\n'
        "# TYPE gt_monotonic_seconds gauge\n"
        f"gt_monotonic_seconds {now!r}\n"
        "# TYPE gt_step gauge\n"
        f"gt_step {math.floor(now / STEP_S)}\n"
    ) + _plain_page(state)


@contextlib.contextmanager
def serve() -> Iterator[gt.GroundTruthServer]:
    """Start the instrument with the gauges on a free port; stop it on exit."""
    with gt.serve(script=__file__) as server:
        yield server


if __name__ == "__main__":
    gt._metrics_page = gauges_page  # the instrument's handler looks the page function up per request
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(gt._main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
