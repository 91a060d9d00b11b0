"""The metric registry: every metric name the project logs, with its unit, meaning, the
direction that counts as worse, and the stage that emits it. The one place names are listed.

A :class:`Metric` is a scalar logged under its name (``prefill_ms``), a distribution logged as
``<name>_<stat>`` for each of its ``stats`` (``ttft_ms_p99``), or a pattern: a family with one
``<placeholder>`` (``errors_<class>``, ``token_count_<tokenizer>_total``), scalar or distribution.
Ordered selections (a stage's headline, the default regression thresholds, compare's and the
summary's columns) are declared here too, since their order is output (JSON keys, table rows);
their names are checked against the registry on import. DESIGN.md's metric table is
:func:`markdown_table` (a test keeps them equal; ``python -m tasks.metrics docs/DESIGN.md``
rewrites it). Pure standard library.
"""

from __future__ import annotations

from tasks.metrics.metric import STAGES, STAT_NAMES, Metric
from tasks.metrics.registry import REGISTRY

__all__ = [
    "COMPARE_DEFAULT_METRICS",
    "DEFAULT_THRESHOLDS_PCT",
    "HEADLINES",
    "REGISTRY",
    "SLO_METRICS",
    "STAGES",
    "STAT_NAMES",
    "SUMMARY_COLUMNS",
    "SWEEP_POINT_METRICS",
    "Metric",
    "headline",
    "is_known_metric",
    "is_registered",
    "lookup",
    "resolve",
    "worse_direction",
]

_BY_NAME: dict[str, Metric] = {m.name: m for m in REGISTRY}
if len(_BY_NAME) != len(REGISTRY):
    raise ValueError("tasks.metrics: a metric is registered twice")
_PATTERNS: tuple[Metric, ...] = tuple(m for m in REGISTRY if m.is_pattern)


def resolve(name: str) -> tuple[Metric, str | None] | None:
    """The metric a logged name belongs to and its stat (None for a scalar); None when the
    name is not registered. Exact names win over patterns (``token_count_model_total``)."""
    base, _, stat = name.rpartition("_")
    metric = _BY_NAME.get(name)
    if metric is not None and not metric.is_pattern:
        return metric, None
    metric = _BY_NAME.get(base)
    if metric is not None and stat in metric.stats:
        return metric, stat
    for metric in _PATTERNS:
        if not metric.stats and metric.matches(name):
            return metric, None
        if stat in metric.stats and metric.matches(base):
            return metric, stat
    return None


def lookup(name: str) -> Metric:
    """The :class:`Metric` of a logged name (``ttft_ms_p99`` -> ``ttft_ms``).

    Raises:
        KeyError: the name is not registered.
    """
    found = resolve(name)
    if found is None:
        raise KeyError(f"{name!r} is not a registered metric (tasks/metrics/registry.py)")
    return found[0]


def is_registered(name: str) -> bool:
    """Whether the project logs this name (a scalar, ``<distribution>_<stat>`` or a pattern's)."""
    found = resolve(name)
    return found is not None and (found[1] is not None or not found[0].stats)


def is_known_metric(name: str) -> bool:
    """A metric a regression threshold may name: a comparable scalar, or ``<latency>_<stat>``
    of a comparable distribution (``ttft_ms_p99``, ``decode_ms_p50``)."""
    return is_registered(name) and lookup(name).comparable


def worse_direction(name: str) -> str | None:
    """``"higher"``, ``"lower"`` or None (neutral) for a logged name or a metric's name.

    Raises:
        KeyError: the name is not registered.
    """
    return lookup(name).worse


#: The per-request metrics a goodput SLO may name (all in milliseconds).
SLO_METRICS: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.slo)


def _checked(names: tuple[str, ...], what: str) -> tuple[str, ...]:
    unknown = [n for n in names if not is_registered(n)]
    if unknown:
        raise ValueError(f"tasks.metrics: {what} names unregistered metrics {unknown}")
    return names


#: Each stage's headline, in output order: the figures the stage returns as ``headline`` and
#: the audit's parent run carries (stream: the first level's; profile: the first point's).
#: The tokenize and sweep stages' headlines are what their tasks log on the stage run.
HEADLINES: dict[str, tuple[str, ...]] = {
    "tokenize": ("token_count_<tokenizer>_total", "chars_per_token_<tokenizer>_mean"),
    "profile": _checked(
        (
            "prefill_ms",
            "prefill_tokens_per_s",
            "decode_ms_p50",
            "decode_tokens_per_s",
            "weights_bytes",
            "kv_cache_bytes",
            "kv_cache_bytes_formula",
            "peak_memory_bytes",
            "decode_bandwidth_fraction",  # under --breakdown (the audit's first point), else None
        ),
        "the profile headline",
    ),
    "stream": _checked(
        (
            "ttft_ms_p50",
            "ttft_ms_p90",
            "ttft_ms_p99",
            "itl_ms_p50",
            "itl_ms_p90",
            "itl_ms_p99",
            "tpot_ms_mean",
            "e2e_ms_p50",
            "output_tokens_per_s",
            "requests_per_s",
            "error_rate",
        ),
        "the stream headline",
    ),
    "sweep": _checked(
        (
            "sweep_points",
            "sweep_points_skipped",
            "sweep_points_failed",
            "sweep_determinism_violations",
        ),
        "the sweep headline",
    ),
    "tune": _checked(
        (
            "tune_configurations",
            "tune_configurations_failed",
            "tune_configurations_resumed",
            "tune_pareto_points",
            "tune_best_output_tokens_per_s",
            "tune_best_goodput_requests_per_s",
            "tune_best_capacity_requests_per_s",
        ),
        "the tune headline",
    ),
    "report": (),
}


def headline(stage: str) -> tuple[str, ...]:
    """The stage's headline names, in output order (tokenize: patterns, one per tokenizer).

    Raises:
        KeyError: not a stage.
    """
    return HEADLINES[stage]


#: Default regression thresholds (tasks/report/regression.py has the rule): latencies may not
#: grow by more than 15 %, throughputs not drop by more than 10 %. The sign agrees with the
#: metric's worse direction (+ for "higher", - for "lower"). The tails are judged too (a release
#: after which one request in seven waits four times longer leaves the median where it was);
#: each carries its interval, and one with too few samples beyond it is inconclusive.
DEFAULT_THRESHOLDS_PCT: dict[str, float] = {
    "ttft_ms_p50": 15.0,
    "ttft_ms_p90": 15.0,
    "ttft_ms_p99": 15.0,
    "itl_ms_p90": 15.0,
    "itl_ms_p99": 15.0,
    "tpot_ms_mean": 15.0,
    "e2e_ms_p50": 15.0,
    "prefill_ms": 15.0,
    "decode_tokens_per_s": -10.0,
    "output_tokens_per_s": -10.0,
}
_checked(tuple(DEFAULT_THRESHOLDS_PCT), "DEFAULT_THRESHOLDS_PCT")

#: The columns ``infermeter compare`` shows when none are asked for: the audit's headline.
COMPARE_DEFAULT_METRICS: tuple[str, ...] = _checked(
    (
        "ttft_ms_p50",
        "ttft_ms_p99",
        "itl_ms_p50",
        "tpot_ms_mean",
        "e2e_ms_p50",
        "output_tokens_per_s",
        "prefill_ms",
        "decode_tokens_per_s",
        "kv_cache_bytes",
        "error_rate",
    ),
    "COMPARE_DEFAULT_METRICS",
)

#: The figures each sampling-sweep point carries in its result (tasks.sweep.results), in order.
SWEEP_POINT_METRICS: tuple[str, ...] = _checked(
    (
        "num_samples",
        "num_samples_failed",
        "identical_fraction",
        "distinct_1",
        "distinct_2",
        "output_tokens_mean",
        "output_tokens_std",
        "ttft_ms_mean",
        "e2e_ms_mean",
        "determinism_violated",
    ),
    "the sweep point's figures",
)

#: The metric columns of summary.md's tables: one row per stream level, one per sweep point.
SUMMARY_COLUMNS: dict[str, tuple[str, ...]] = {
    "stream": _checked(
        ("ttft_ms_p50", "itl_ms_p50", "tpot_ms_mean", "e2e_ms_p50", "output_tokens_per_s", "error_rate"),
        "the summary's level table",
    ),
    "sweep": _checked(
        ("identical_fraction", "distinct_2", "output_tokens_mean", "determinism_violated"),
        "the summary's sweep table",
    ),
}
