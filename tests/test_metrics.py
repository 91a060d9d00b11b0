"""tasks.metrics: the registry answers as the code it replaced did, every name the stages
produce is registered, and DESIGN.md's metric table is the generated one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasks import metrics
from tasks.metrics import (
    DEFAULT_THRESHOLDS_PCT,
    SLO_METRICS,
    STAT_NAMES,
    headline,
    is_known_metric,
    is_registered,
    lookup,
    worse_direction,
)
from tasks.metrics import doc as metrics_doc
from tasks.stats import aggregate_level
from tasks.stream.records import RequestRecord

ROOT = Path(__file__).resolve().parents[1]

# What tasks/report/regression.py accepted before the registry (its own sets, copied here).
_OLD_STAT_METRICS = {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "decode_ms"}
_OLD_SCALARS = {
    "prefill_ms",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "output_tokens_per_s",
    "requests_per_s",
    "goodput_requests_per_s",
    "error_rate",
    "weights_bytes",
    "kv_cache_bytes",
    "peak_memory_bytes",
    "token_count_model_total",
}


def _old_is_known_metric(name: str) -> bool:
    base, _, stat = name.rpartition("_")
    return name in _OLD_SCALARS or (base in _OLD_STAT_METRICS and stat in set(STAT_NAMES))


def test_design_md_table_is_generated_from_the_registry() -> None:
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    assert metrics_doc.TABLE_BEGIN in text and metrics_doc.TABLE_END in text
    assert metrics_doc.replace_table(text) == text, (
        "docs/DESIGN.md's metric table is stale: run `python -m tasks.metrics docs/DESIGN.md`"
    )
    for metric in metrics.REGISTRY:
        assert f"| `{metric.name}` |" in text


def test_is_known_metric_answers_as_before() -> None:
    candidates = {m.name for m in metrics.REGISTRY} | _OLD_SCALARS | {"ttft_p99", "latency", ""}
    for metric in metrics.REGISTRY:
        candidates.update(metric.logged_names())
        candidates.update(f"{metric.name}_{stat}" for stat in (*STAT_NAMES, "std", "p42"))
    candidates.update(
        {
            "token_count_cl100k_base_total",
            "errors_timeout",
            "server_vllm_x_p50",
            "ttft_ms_p99_extra",
            "decode_ms",
        }
    )
    for name in sorted(candidates):
        assert is_known_metric(name) == _old_is_known_metric(name), name
    assert is_known_metric("ttft_ms_p99") and is_known_metric("decode_ms_p50")
    assert not is_known_metric("kv_cache_bytes_formula")  # registered, but not comparable


def test_lookups_resolve_distributions_and_patterns() -> None:
    assert lookup("ttft_ms_p99").name == "ttft_ms"
    assert lookup("ttft_ms").unit == "ms"
    assert lookup("token_count_model_total").comparable  # the exact entry wins over the pattern
    assert lookup("token_count_cl100k_base_total").name == "token_count_<tokenizer>_total"
    assert lookup("errors_rate_limited").name == "errors_<class>"
    assert lookup("server_vllm_time_to_first_token_seconds_p90").name == "server_<series>"
    assert lookup("server_vllm_num_requests_total_delta").name == "server_<series>_delta"
    assert lookup("server_ttft_ms_mean").name == "server_ttft_ms"
    assert lookup("client_loop_lag_ms_p99").stats == ("p50", "p99", "max")
    assert not is_registered("client_loop_lag_ms_p90")  # the probe reports no p90
    assert not is_registered("ttft_ms")  # a distribution is logged only with a stat
    with pytest.raises(KeyError, match="not a registered metric"):
        lookup("ttft_p99")


def test_worse_direction() -> None:
    assert worse_direction("ttft_ms_p50") == "higher"
    assert worse_direction("decode_tokens_per_s") == "lower"
    assert worse_direction("error_rate") == "higher"
    assert worse_direction("errors_timeout") == "higher"
    assert worse_direction("prompt_tokens") is None
    with pytest.raises(KeyError):
        worse_direction("latency")


def test_names_and_orders_the_outputs_depend_on() -> None:
    assert STAT_NAMES == ("mean", "p50", "p90", "p95", "p99", "max")
    assert SLO_METRICS == ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms")
    assert headline("profile") == (
        "prefill_ms",
        "prefill_tokens_per_s",
        "decode_ms_p50",
        "decode_tokens_per_s",
        "weights_bytes",
        "kv_cache_bytes",
        "kv_cache_bytes_formula",
        "peak_memory_bytes",
        "decode_bandwidth_fraction",  # issue 12: the roofline's decode figure (None without it)
    )
    assert headline("stream") == (
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
    )
    assert list(DEFAULT_THRESHOLDS_PCT.items()) == [
        ("ttft_ms_p50", 15.0),
        ("ttft_ms_p90", 15.0),  # issue 21: the tails too, each with its interval
        ("ttft_ms_p99", 15.0),
        ("itl_ms_p90", 15.0),
        ("itl_ms_p99", 15.0),
        ("tpot_ms_mean", 15.0),
        ("e2e_ms_p50", 15.0),
        ("prefill_ms", 15.0),
        ("decode_tokens_per_s", -10.0),
        ("output_tokens_per_s", -10.0),
    ]
    for name, pct in DEFAULT_THRESHOLDS_PCT.items():
        assert is_known_metric(name)
        assert worse_direction(name) == ("higher" if pct > 0 else "lower"), name
    for stage in ("profile", "stream", "sweep"):
        assert headline(stage) and all(is_registered(n) for n in headline(stage))
        assert all(lookup(n).stage == stage for n in headline(stage))
    assert all(metrics.lookup(n).slo for n in SLO_METRICS)
    with pytest.raises(KeyError):
        headline("nope")


def test_consumers_read_the_registry() -> None:
    from tasks import stats
    from tasks.config import RegressionConfig, StreamConfig
    from tasks.report import compare, regression

    assert stats.STAT_NAMES is metrics.STAT_NAMES and stats.SLO_METRICS is metrics.SLO_METRICS
    assert regression.DEFAULT_THRESHOLDS_PCT is DEFAULT_THRESHOLDS_PCT
    assert regression.is_known_metric is is_known_metric
    assert compare.DEFAULT_METRICS == metrics.COMPARE_DEFAULT_METRICS
    assert RegressionConfig().thresholds_pct == DEFAULT_THRESHOLDS_PCT
    assert StreamConfig(goodput={n: 1.0 for n in SLO_METRICS}).goodput
    # the config package no longer reaches into the report package for names
    code = "import sys, tasks.config; sys.exit('tasks.report.regression' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_pipeline_headline_constants_come_from_the_registry() -> None:
    pytest.importorskip("prefect")
    from tasks.pipeline.profile import PROFILE_HEADLINE
    from tasks.pipeline.stream import STREAM_HEADLINE

    assert PROFILE_HEADLINE == headline("profile") and STREAM_HEADLINE == headline("stream")


def _records() -> list[RequestRecord]:
    def ok(rid: str, ttft: float, e2e: float, tokens: int, itl: list[float]) -> RequestRecord:
        return RequestRecord(
            request_id=rid,
            ttft_ms=ttft,
            e2e_ms=e2e,
            output_tokens=tokens,
            tpot_ms=(e2e - ttft) / (tokens - 1),
            itl_ms=itl,
            output_tokens_source="usage",
        )

    return [
        ok("r1", 100, 200, 3, [40, 60]),
        ok("r2", 300, 500, 5, [100, 100]),
        RequestRecord("r3", ttft_ms=50, e2e_ms=50, output_tokens=1, error_class="timeout", error_message="t"),
        RequestRecord("r4", error_class="auth", error_message="401"),
    ]


def test_every_level_figure_is_registered() -> None:
    from tasks.endpoint import prometheus
    from tasks.stream.lag import LoopLagProbe

    level = aggregate_level(_records(), wall_s=2.0, goodput_slos={"ttft_ms": 250, "tpot_ms": 50})
    assert "errors_timeout" in level and "goodput_fraction" in level
    probe = LoopLagProbe()
    probe.lags_ms, probe.stamps_ns = [0.1, 0.5, 2.0], [1, 2, 3]
    level.update(probe.metrics(1.0))
    vllm = (
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} %s\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf"} %s\n'
        "vllm:time_to_first_token_seconds_sum %s\nvllm:time_to_first_token_seconds_count %s\n"
        "vllm:e2e_request_latency_seconds_sum %s\nvllm:e2e_request_latency_seconds_count %s\n"
        'vllm:prompt_tokens_total{model="m"} %s\n'
    )
    before = prometheus.parse(vllm % (0, 0, 0, 0, 0, 0, 0))
    after = prometheus.parse(vllm % (1, 2, 0.3, 2, 0.8, 2, 30))
    level.update(prometheus.level_view(before, after))
    level.update(prometheus.cross_check(level))
    assert "server_ttft_ms_p50" in level and "ttft_ms_mean_client_minus_server" in level
    level["num_short_outputs"] = 0
    unregistered = sorted(name for name in level if not is_registered(name))
    assert not unregistered


def test_sweep_tokenize_and_gpu_figures_are_registered() -> None:
    from tasks.profile.gpu_metrics import GPU_METRIC_KEYS, summarize
    from tasks.sweep import SweepPoint, point_metrics
    from tasks.tokenize.stage import TokenizedText, summary_metrics

    figures = point_metrics(SweepPoint(temperature=0.0), _records(), lambda text: list(text))
    rows = [TokenizedText(t, "ab", [1], ["ab"], 1, 2.0, 2.0) for t in ("model", "cl100k_base")]
    gpu = summarize([1000.0, 2000.0], [50.0], 0.0, 5000.0)
    names = [*figures, *summary_metrics(rows), *gpu, *GPU_METRIC_KEYS, *headline("sweep")]
    assert not [name for name in names if not is_registered(name)]


def test_every_numeric_key_of_a_profile_point_is_registered() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tasks.profile.measure import profile_point

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    ).eval()
    point = profile_point(
        model,
        prompt_ids=torch.randint(0, 64, (1, 4)),
        batch_size=1,
        max_new_tokens=2,
        repeats=1,
        warmup=0,
        device="cpu",
    )
    row = point.to_dict() if hasattr(point, "to_dict") else point
    # what the profile stage logs per point: the numeric values (tasks.pipeline.common._scalars),
    # plus the runner's estimate and the per-step series
    numeric = [k for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert "prefill_ms" in numeric and "decode_ms_p99" in numeric
    names = [*numeric, "memory_estimate_bytes", "decode_step_ms", "profile_points", "profile_failed_points"]
    assert not [name for name in names if not is_registered(name)]
