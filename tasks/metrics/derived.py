"""Registry entries derived from a level's own figures: the repeats' range, the 95 % intervals,
the figures by conversation turn, a level's timeline (``tasks.metrics.timeline``). Spliced into
:data:`tasks.metrics.registry.REGISTRY` (the one registry) where the stream stage's entries are.
"""

from __future__ import annotations

from tasks.metrics.metric import Metric
from tasks.metrics.timeline import TIMELINE

#: The level figures with an interval (tasks.stats.interval.LEVEL_INTERVAL_FIGURES, which the
#: registry cannot import: tasks.stats imports the registry).
_CI_STREAM = tuple(
    f"{m}_{s}" for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms") for s in ("mean", "p50", "p90", "p99")
)

LEVEL_DERIVED: tuple[Metric, ...] = (
    # repeats (StreamConfig.repeats > 1, tasks.scaleout.levels): the figures pool them; each one's range
    Metric("num_repeats", "count", "stream", "Runs of the level in a row, each a fresh start."),
    *(
        Metric(f"{m}_repeat", "as the figure", "stream", f"{m} of each repeat alone.", None, ("min", "max"))
        for m in "ttft_ms_p50 ttft_ms_p99 itl_ms_p50 tpot_ms_mean e2e_ms_p50 output_tokens_per_s".split()
    ),
    # 95 % intervals (tasks.stats.interval: percentile bootstrap over requests / repeats)
    *(
        Metric(
            f"{name}_ci",
            "as the figure",
            stage,
            f"95 % interval of {name} (bootstrap).",
            None,
            ("low", "high"),
        )
        for stage, names in (("stream", _CI_STREAM), ("profile", ("prefill_ms", "decode_ms_p50")))
        for name in names
    ),
    # conversations (tasks.stats.by_turn): one figure per turn index
    Metric("num_sessions", "count", "stream", "Conversations of the level (multi-turn workloads)."),
    Metric("num_requests_turn<turn>", "count", "stream", "Turns sent at this turn index."),
    Metric(
        "ttft_ms_p50_turn<turn>", "ms", "stream", "TTFT p50 of the successful turns at this index.", "higher"
    ),
    Metric(
        "e2e_ms_p50_turn<turn>",
        "ms",
        "stream",
        "E2E latency p50 of the successful turns at this index.",
        "higher",
    ),
    Metric(
        "input_tokens_mean_turn<turn>",
        "tokens",
        "stream",
        "Mean prompt tokens at this turn (history included).",
    ),
    Metric(
        "cached_tokens_mean_turn<turn>", "tokens", "stream", "Mean usage cached_tokens at this turn index."
    ),
    *TIMELINE,  # a level's windows and the server's gauges (tasks.stream.timeline)
)
