"""Regression verdicts: thresholds with direction, noise inside the baseline's spread, and the
baseline search against a real MLflow store."""

import pytest

from tasks.config import RegressionConfig
from tasks.report.baseline import judge
from tasks.report.regression import is_known_metric, judge_metric, verdict
from tasks.tracking import Tracker


def test_latency_growth_beyond_threshold_is_a_regression():
    row = judge_metric("ttft_ms_p50", current=120.0, baseline=100.0, threshold_pct=15.0)
    assert row.regressed and row.change_pct == pytest.approx(20.0)
    assert not judge_metric("ttft_ms_p50", 114.0, 100.0, 15.0).regressed
    # faster is never a latency regression
    assert not judge_metric("ttft_ms_p50", 50.0, 100.0, 15.0).regressed


def test_throughput_drop_beyond_negative_threshold_is_a_regression():
    assert judge_metric("decode_tokens_per_s", 85.0, 100.0, -10.0).regressed
    assert not judge_metric("decode_tokens_per_s", 91.0, 100.0, -10.0).regressed
    assert not judge_metric("decode_tokens_per_s", 150.0, 100.0, -10.0).regressed


def test_change_inside_the_baseline_spread_is_noise():
    runs = [{"ttft_ms_p50": v} for v in (100.0, 101.0, 140.0)]  # median 101, spread 100..140
    rows = verdict({"ttft_ms_p50": 130.0}, runs, {"ttft_ms_p50": 15.0})
    assert rows[0].baseline == 101.0 and rows[0].change_pct > 15
    assert not rows[0].regressed and "noise" in rows[0].note
    rows = verdict({"ttft_ms_p50": 150.0}, runs, {"ttft_ms_p50": 15.0})
    assert rows[0].regressed


def test_missing_values_are_not_regressions():
    assert not judge_metric("ttft_ms_p50", None, 100.0, 15.0).regressed
    assert not judge_metric("ttft_ms_p50", 100.0, None, 15.0).regressed
    with pytest.raises(ValueError):
        verdict({"a": 1.0}, [], {"ttft_ms_p50": 15.0})


def test_known_metrics():
    assert is_known_metric("ttft_ms_p99") and is_known_metric("decode_tokens_per_s")
    assert not is_known_metric("ttft_p99") and not is_known_metric("latency")


def test_baseline_is_the_median_of_the_same_endpoint_and_model(tmp_path):
    tracker = Tracker("reg", f"sqlite:///{tmp_path / 'mlflow.db'}")
    ident = {"flow": "audit", "endpoint_kind": "llama.cpp", "endpoint_model": "m", "model": "gguf:default"}
    for value in (100.0, 102.0, 104.0):
        run = tracker.start_run("old", tags=ident)
        tracker.log_metrics(run, {"ttft_ms_p50": value})
        tracker.end_run(run)
    other = tracker.start_run("other-model", tags={**ident, "endpoint_model": "x"})
    tracker.log_metrics(other, {"ttft_ms_p50": 1.0})
    tracker.end_run(other)
    current = tracker.start_run("now", tags=ident)
    cfg = RegressionConfig(thresholds_pct={"ttft_ms_p50": 15.0})
    result = judge(tracker, current, {"ttft_ms_p50": 130.0}, ident, cfg)
    assert result.rows[0].baseline == 102.0 and result.regressed
    assert len(result.baseline_run_ids) == 3  # the other model's run is not a baseline
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=tracker.tracking_uri).get_run(current)
    assert run.data.tags["regression"] == "true"
    assert "regression.md" in [
        a.path for a in MlflowClient(tracking_uri=tracker.tracking_uri).list_artifacts(current)
    ]


def test_named_baseline_that_does_not_exist(tmp_path):
    tracker = Tracker("reg", f"sqlite:///{tmp_path / 'mlflow.db'}")
    current = tracker.start_run("now")
    with pytest.raises(LookupError, match="not found"):
        judge(tracker, current, {}, {}, RegressionConfig(baseline_run_id="0" * 32))
