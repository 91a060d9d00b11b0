"""Registry entries of a level's timeline (``tasks.stream.timeline``, ``tasks.endpoint.gauges``):
the step series on each level's run, one MLflow step per window, and the few scalars beside
them. Spliced into :data:`tasks.metrics.registry.REGISTRY` through
:data:`tasks.metrics.derived.LEVEL_DERIVED` (figures derived from a level's records).
"""

from __future__ import annotations

from tasks.metrics.metric import Metric

_SERIES = "one MLflow step per window, stamped with the window's start in wall time"

TIMELINE: tuple[Metric, ...] = (
    Metric(
        "timeline_window_start_s",
        "s",
        "stream",
        f"A timeline window's start, s since the level's first measured send ({_SERIES}).",
    ),
    Metric(
        "timeline_window_end_s", "s", "stream", "A timeline window's end, s since the first measured send."
    ),
    Metric("timeline_window_s", "s", "stream", "A window's length: slice_s; the last one shorter when cut."),
    Metric(
        "timeline_window_partial",
        "0/1",
        "stream",
        "1: the first (ramp-up) or last (cut, drain) window of a measured part.",
    ),
    Metric("timeline_repeat_index", "index", "stream", "The repeat a window belongs to (0 without repeats)."),
    Metric(
        "timeline_requests_in_flight",
        "requests",
        "stream",
        "Requests between send and end, time-weighted mean over the window (client).",
    ),
    Metric("timeline_requests_in_flight_max", "requests", "stream", "Most requests in flight in the window."),
    Metric("timeline_requests_sent", "count", "stream", "Measured sends in the window."),
    Metric("timeline_requests_finished", "count", "stream", "Measured requests that ended in the window."),
    Metric(
        "timeline_requests_failed", "count", "stream", "Failed requests that ended in the window.", "higher"
    ),
    Metric(
        "timeline_ttft_ms_p50",
        "ms",
        "stream",
        "TTFT p50 of the successes whose first text chunk arrived in the window.",
        "higher",
    ),
    Metric("timeline_ttft_count", "count", "stream", "First text chunks that arrived in the window."),
    Metric(
        "timeline_itl_ms",
        "ms",
        "stream",
        "ITL gaps that ended in the window (successes with a visible decode).",
        "higher",
        ("mean", "p50"),
    ),
    Metric("timeline_itl_count", "count", "stream", "ITL gaps that ended in the window."),
    Metric("timeline_output_tokens", "tokens", "stream", "Output tokens whose chunk arrived in the window."),
    Metric(
        "timeline_output_tokens_per_s",
        "tokens/s",
        "stream",
        "timeline_output_tokens / the window's length.",
        "lower",
    ),
    Metric(
        "timeline_server_<series>",
        "as served",
        "stream",
        "A server gauge sampled every 250 ms (vLLM num_requests_running, num_requests_waiting, "
        "kv_cache_usage_perc ...): mean of the window's samples, _max their max; a counter's "
        "(num_preemptions_total) _delta its increase over the window.",
    ),
    # scalars on the level's run
    Metric("timeline_windows", "count", "stream", "Windows of the level's timeline (level run)."),
    Metric("timeline_slice_s", "s", "stream", "The timeline's window length asked for (--slice-s)."),
    Metric("timeline_gauge_samples", "count", "stream", "Server gauge samples taken during the level."),
    Metric(
        "timeline_gauge_interval_ms_p50",
        "ms",
        "stream",
        "Median time between two gauge samples (250 ms asked).",
    ),
)
