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

import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: The statistics of every full distribution, in report order.
STAT_NAMES: tuple[str, ...] = ("mean", "p50", "p90", "p95", "p99", "max")
#: The stages a metric can come from, in pipeline order.
STAGES: tuple[str, ...] = ("tokenize", "profile", "stream", "sweep", "report")

_PLACEHOLDER = re.compile(r"<[a-z_]+>")
#: What a placeholder matches: MLflow-safe key characters (tokenizers.metric_name, the
#: Prometheus names of tasks.stream.prometheus).
_PLACEHOLDER_VALUE = r"[A-Za-z0-9_.-]+"


@dataclass(frozen=True)
class Metric:
    """One registered metric.

    Attributes:
        name: the logged name, or a pattern with one ``<placeholder>``; for a distribution the
            base of ``<name>_<stat>``.
        unit: ``ms``, ``bytes``, ``tokens/s``, ``count``, ``fraction``, ``0/1`` ...
        stage: the stage that emits it (one of :data:`STAGES`).
        description: what it measures (DESIGN.md "Metric definitions" has the contract).
        worse: ``"higher"`` / ``"lower"``: which change is a regression; None: neutral (a
            setting echoed as a metric, a count that follows the config).
        stats: the statistics it is logged with (``<name>_<stat>``); empty = a scalar.
        slo: a goodput SLO may name it (``metric <= limit``, per request, in ms).
        comparable: a regression threshold may name it (a measured figure of the run itself;
            for a distribution, any of its stats).
    """

    name: str
    unit: str
    stage: str
    description: str
    worse: str | None = None
    stats: tuple[str, ...] = ()
    slo: bool = False
    comparable: bool = False

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"metric {self.name}: unknown stage {self.stage!r}")
        if self.worse not in ("higher", "lower", None):
            raise ValueError(f"metric {self.name}: worse must be 'higher', 'lower' or None")
        if len(_PLACEHOLDER.findall(self.name)) > 1:
            raise ValueError(f"metric {self.name}: at most one <placeholder>")

    @property
    def is_pattern(self) -> bool:
        return bool(_PLACEHOLDER.search(self.name))

    def logged_names(self) -> tuple[str, ...]:
        """The names it is logged under: ``(name,)``, or ``<name>_<stat>`` per stat."""
        if not self.stats:
            return (self.name,)
        return tuple(f"{self.name}_{stat}" for stat in self.stats)

    def matches(self, name: str) -> bool:
        """Whether ``name`` (a base name, without stat) is this metric's name or fits its pattern."""
        if not self.is_pattern:
            return name == self.name
        return _pattern_regex(self.name).fullmatch(name) is not None


@functools.cache
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    prefix, suffix = _PLACEHOLDER.split(pattern)
    return re.compile(re.escape(prefix) + _PLACEHOLDER_VALUE + re.escape(suffix))


_ALL = STAT_NAMES
_LAT, _TPUT, _MEM = "higher", "lower", "higher"  # the usual worse direction of each kind

#: Every metric the project logs, grouped by stage (order = the doc table's order).
REGISTRY: tuple[Metric, ...] = (
    # tokenize (tasks/tokenize.py summary_metrics); only the model's own count is comparable
    Metric(
        "token_count_model_total",
        "tokens",
        "tokenize",
        "All prompts' tokens under the model's own tokenizer.",
        "higher",
        comparable=True,
    ),
    Metric(
        "token_count_<tokenizer>_total", "tokens", "tokenize", "All prompts' tokens, per tokenizer.", "higher"
    ),
    Metric(
        "chars_per_token_<tokenizer>_mean",
        "chars/token",
        "tokenize",
        "All prompts' characters over their tokens.",
        "lower",
    ),
    # local profile, per point (tasks/profile/measure.py profile_point, runner.run_sweep)
    Metric(
        "prefill_ms",
        "ms",
        "profile",
        "One forward over the prompt (median of the repeats).",
        _LAT,
        comparable=True,
    ),
    Metric("ttft_local_ms", "ms", "profile", "prefill_ms under the stream stage's name.", _LAT),
    Metric(
        "prefill_tokens_per_s",
        "tokens/s",
        "profile",
        "batch x prompt tokens / prefill time.",
        _TPUT,
        comparable=True,
    ),
    Metric(
        "decode_ms",
        "ms",
        "profile",
        "One decode step (the median repeat's steps).",
        _LAT,
        _ALL,
        comparable=True,
    ),
    Metric("decode_step_ms", "ms", "profile", "Each decode step, one MLflow step each (a series).", _LAT),
    Metric("decode_tokens_per_s", "tokens/s", "profile", "batch / decode_ms_p50.", _TPUT, comparable=True),
    Metric("weights_bytes", "bytes", "profile", "The model's parameters and buffers.", _MEM, comparable=True),
    Metric(
        "kv_cache_bytes",
        "bytes",
        "profile",
        "KV-cache tensors after decode (measured).",
        _MEM,
        comparable=True,
    ),
    Metric("kv_cache_bytes_after_prefill", "bytes", "profile", "KV-cache tensors after prefill.", _MEM),
    Metric(
        "kv_cache_bytes_formula",
        "bytes",
        "profile",
        "batch x positions x 2 x layers x kv_heads x head_dim x dtype bytes.",
        _MEM,
    ),
    Metric("kv_cache_bytes_formula_after_prefill", "bytes", "profile", "The formula after prefill.", _MEM),
    Metric(
        "kv_cache_bytes_seed_formula",
        "bytes",
        "profile",
        "The seed's form (hidden_size: too large under GQA).",
        _MEM,
    ),
    Metric("kv_seed_formula_ratio", "ratio", "profile", "Seed formula / formula (> 1 under GQA)."),
    Metric("kv_cache_positions", "positions", "profile", "Positions in the cache after decode."),
    Metric("kv_cache_positions_after_prefill", "positions", "profile", "Positions after prefill."),
    Metric(
        "peak_memory_bytes",
        "bytes",
        "profile",
        "CUDA: max allocated; CPU: peak RSS minus the RSS before.",
        _MEM,
        comparable=True,
    ),
    Metric("peak_memory_baseline_bytes", "bytes", "profile", "Memory in use before the point."),
    Metric("peak_memory_reserved_bytes", "bytes", "profile", "CUDA: max reserved by the allocator.", _MEM),
    Metric("memory_estimate_bytes", "bytes", "profile", "The runner's estimate before the point.", _MEM),
    Metric(
        "decode_bandwidth_gb_per_s",
        "GB/s",
        "profile",
        "CUDA: bytes read per step x steps / decode time.",
        _TPUT,
    ),
    Metric("gpu_power_w", "W", "profile", "NVML board power, timed runs.", "higher", ("mean", "max")),
    Metric("gpu_utilization_pct", "%", "profile", "NVML utilisation, timed runs.", None, ("mean", "max")),
    Metric("gpu_energy_joules", "J", "profile", "NVML energy counter, end - start.", "higher"),
    Metric("gpu_metric_samples", "count", "profile", "NVML sampling rounds."),
    # the point's settings and the model's shape, echoed as metrics (neutral)
    *(
        Metric(name, unit, "profile", text)
        for name, unit, text in (
            ("prompt_tokens", "tokens", "Prompt length of the point."),
            ("batch_size", "sequences", "Batch size of the point."),
            ("max_new_tokens", "tokens", "Decode steps of the point."),
            ("new_tokens_per_sequence", "tokens", "max_new_tokens + 1 (prefill's token)."),
            ("prefill_chunk_size", "tokens", "Chunked prefill size; 0 = the whole prompt at once."),
            ("prefill_chunks", "count", "Forwards the prefill took."),
            ("repeats", "count", "Timed repeats of the point."),
            ("warmup", "count", "Untimed warm-up runs of the point."),
            ("torch_num_threads", "threads", "torch.get_num_threads() during the point."),
            ("num_layers", "count", "Decoder layers of the model."),
            ("num_attention_heads", "count", "Attention heads per layer."),
            ("num_kv_heads", "count", "Key/value heads per layer (< heads under GQA)."),
            ("head_dim", "count", "Dimension of one attention head."),
            ("hidden_size", "count", "Hidden size of the model."),
            ("profile_points", "count", "Points of the profile grid (stage run)."),
        )
    ),
    Metric("profile_failed_points", "count", "profile", "Points that failed (stage run).", "higher"),
    # remote stream, per level (tasks/stats.py aggregate_level, tasks/stream/*); DESIGN.md has
    # the contract of each latency
    Metric(
        "ttft_ms", "ms", "stream", "Send -> first text-carrying chunk.", _LAT, _ALL, slo=True, comparable=True
    ),
    Metric(
        "tpot_ms",
        "ms",
        "stream",
        "(e2e_ms - ttft_ms) / (output_tokens - 1), per request.",
        _LAT,
        _ALL,
        slo=True,
        comparable=True,
    ),
    Metric(
        "e2e_ms", "ms", "stream", "Send -> last text-carrying chunk.", _LAT, _ALL, slo=True, comparable=True
    ),
    Metric(
        "itl_ms",
        "ms",
        "stream",
        "Every gap between text chunks, pooled over requests.",
        _LAT,
        _ALL,
        slo=True,
        comparable=True,
    ),
    Metric("num_requests", "count", "stream", "Measured requests (warm-ups excluded)."),
    Metric("num_succeeded", "count", "stream", "Requests with a token and no error."),
    Metric("num_errors", "count", "stream", "Failed requests.", "higher"),
    Metric("error_rate", "fraction", "stream", "num_errors / num_requests.", "higher", comparable=True),
    Metric("errors_<class>", "count", "stream", "Failed requests of one error class.", "higher"),
    Metric("output_tokens_total", "tokens", "stream", "Output tokens of the successful requests."),
    Metric(
        "output_tokens_per_s", "tokens/s", "stream", "All output tokens / wall time.", _TPUT, comparable=True
    ),
    Metric(
        "requests_per_s", "requests/s", "stream", "Successful requests / wall time.", _TPUT, comparable=True
    ),
    Metric(
        "goodput_requests_per_s",
        "requests/s",
        "stream",
        "Requests within every SLO / wall time.",
        _TPUT,
        comparable=True,
    ),
    Metric("goodput_fraction", "fraction", "stream", "Requests within every SLO / requests.", _TPUT),
    Metric("num_short_outputs", "count", "stream", "Successes with fewer tokens than asked.", "higher"),
    Metric(
        "client_loop_lag_ms",
        "ms",
        "stream",
        "How late the client's event loop read arrived data.",
        _LAT,
        ("p50", "p99", "max"),
    ),
    Metric("client_loop_lag_samples", "count", "stream", "Loop-lag samples kept."),
    Metric("client_bound", "0/1", "stream", "1 when client_loop_lag_ms_p99 passes the tolerance.", "higher"),
    Metric("client_processes", "count", "stream", "Client processes that drove the level."),
    Metric("server_<series>_delta", "as served", "stream", "Prometheus counter increase over the level."),
    Metric(
        "server_<series>",
        "as served",
        "stream",
        "Prometheus histogram mean and quantiles over the level.",
        None,
        ("mean", "p50", "p90", "p99"),
    ),
    *(
        Metric(
            f"server_{m}_ms",
            "ms",
            "stream",
            f"The server's own {m} (vLLM /metrics).",
            _LAT,
            ("mean", "p50", "p90", "p99"),
        )
        for m in ("ttft", "tpot", "e2e", "itl", "queue")
    ),
    *(
        Metric(f"{m}_ms_mean_client_minus_server", "ms", "stream", f"{m}_ms_mean - server_{m}_ms_mean.")
        for m in ("ttft", "tpot", "e2e", "itl")
    ),
    Metric(
        "server_client_disagree", "0/1", "stream", "1 when client and server TTFT/E2E disagree.", "higher"
    ),
    # sampling sweep, per point (tasks/sweep point_metrics) and on the stage run
    Metric("num_samples", "count", "sweep", "Samples of the point."),
    Metric("num_samples_failed", "count", "sweep", "Samples that failed.", "higher"),
    Metric("identical_fraction", "fraction", "sweep", "Share of samples equal to the commonest."),
    Metric("distinct_1", "fraction", "sweep", "Distinct / all unigrams (model tokens)."),
    Metric("distinct_2", "fraction", "sweep", "Distinct / all bigrams (model tokens)."),
    Metric("output_tokens_mean", "tokens", "sweep", "Mean output length of the samples."),
    Metric("output_tokens_std", "tokens", "sweep", "Population std of the output lengths."),
    Metric("determinism_violated", "0/1", "sweep", "1 when a greedy point's outputs differ.", "higher"),
    Metric("sweep_points", "count", "sweep", "Points of the sweep (stage run)."),
    Metric("sweep_points_skipped", "count", "sweep", "Points resumed from earlier runs."),
    Metric("sweep_points_failed", "count", "sweep", "Points with a failed sample.", "higher"),
    Metric("sweep_determinism_violations", "count", "sweep", "Points with determinism_violated.", "higher"),
)

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
        raise KeyError(f"{name!r} is not a registered metric (tasks/metrics.py)")
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
        ),
        "the profile headline",
    ),
    "stream": _checked(
        (
            "ttft_ms_p50",
            "ttft_ms_p99",
            "itl_ms_p50",
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
#: metric's worse direction (+ for "higher", - for "lower").
DEFAULT_THRESHOLDS_PCT: dict[str, float] = {
    "ttft_ms_p50": 15.0,
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


def _logged_as(metric: Metric) -> str:
    if not metric.stats:
        return "scalar"
    return "`_" + "`, `_".join(metric.stats) + "`"


def _roles(metric: Metric) -> str:
    roles = ["SLO"] if metric.slo else []
    stage_headline = HEADLINES[metric.stage]
    mine = [n for n in metric.logged_names() if n in stage_headline]
    if metric.is_pattern and metric.name in stage_headline:
        mine = [metric.name]
    if mine:
        roles.append("headline: " + ", ".join(f"`{n}`" for n in mine))
    for name, pct in DEFAULT_THRESHOLDS_PCT.items():
        if resolve(name) is not None and lookup(name) is metric:
            roles.append(f"threshold `{name}` {pct:+g} %")
    if metric.comparable and not any(r.startswith("threshold") for r in roles):
        roles.append("thresholdable")
    return "; ".join(roles)


TABLE_BEGIN = "<!-- metric table: generated by `python -m tasks.metrics docs/DESIGN.md`; do not edit -->"
TABLE_END = "<!-- end of metric table -->"


def markdown_table() -> str:
    """The registry as a markdown table (DESIGN.md's), one row per metric in registry order."""
    lines = [
        "| metric | unit | stage | worse when | logged as | roles | meaning |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in REGISTRY:
        lines.append(
            f"| `{m.name}` | {m.unit} | {m.stage} | {m.worse or '-'} | {_logged_as(m)} | "
            f"{_roles(m) or '-'} | {m.description} |"
        )
    return "\n".join(lines) + "\n"


def replace_table(text: str) -> str:
    """``text`` with the block between :data:`TABLE_BEGIN` and :data:`TABLE_END` replaced by
    :func:`markdown_table`.

    Raises:
        ValueError: the markers are missing.
    """
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError("the metric-table markers are missing")
    return text[: begin + len(TABLE_BEGIN)] + "\n" + markdown_table() + text[end:]


if __name__ == "__main__":  # python -m tasks.metrics [FILE]: rewrite FILE's table, else print it
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
        path.write_text(replace_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(markdown_table(), end="")
