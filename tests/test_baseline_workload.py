"""A regression verdict compares like with like: a baseline whose workload differs (prompt
lengths, max_tokens, concurrency levels, model file, engine) gives ``incomparable`` with the
differing fields, never a verdict, unless ``force_baseline``. Against a real MLflow store, with
parent runs logged as the audit logs them (the config flattened as params)."""

import json

from mlflow.tracking import MlflowClient
from planted_audits import IDENT

from tasks.config import AuditConfig, RegressionConfig
from tasks.report.baseline import judge, workload_differences
from tasks.tracking import Tracker, flatten_params

THRESHOLDS = {"ttft_ms_p50": 15.0, "tpot_ms_mean": 15.0}


def _audit(tracker: Tracker, config: AuditConfig, metrics: dict, tags=IDENT, finish=True) -> str:
    run = tracker.start_run("audit", tags=tags)
    tracker.log_params(run, flatten_params(config.model_dump(mode="json")))
    tracker.log_metrics(run, metrics)
    if finish:
        tracker.end_run(run)
    return run


def _config(**stream) -> AuditConfig:
    return AuditConfig.model_validate({"stream": {"max_tokens": 8, "max_concurrency": [1, 2], **stream}})


def _store(tmp_path):
    tracker = Tracker("workload", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tracker, MlflowClient(tracking_uri=tracker.tracking_uri)


def test_a_baseline_with_other_max_tokens_and_concurrency_gets_no_verdict(tmp_path):
    tracker, client = _store(tmp_path)
    old = _audit(tracker, _config(), {"ttft_ms_p50": 100.0, "tpot_ms_mean": 10.0})
    # twice the tokens at 4 streams: slower, but that is the workload, not a regression
    config = _config(max_tokens=16, max_concurrency=[1, 4])
    now = _audit(tracker, config, {}, finish=False)
    result = judge(tracker, now, {"ttft_ms_p50": 300.0, "tpot_ms_mean": 30.0}, IDENT, RegressionConfig())
    assert result.status == "incomparable" and not result.regressed and result.rows == []
    fields = {d.field: (d.current, d.baseline) for d in result.differences}
    assert fields == {"stream.max_tokens": ("16", "8"), "stream.max_concurrency": ("[1, 4]", "[1, 2]")}
    assert result.baseline_run_ids == [old]
    run = client.get_run(now)
    assert run.data.tags["regression"] == "incomparable" and run.data.tags["baseline_run_ids"] == old
    folder = client.download_artifacts(now, "", str(tmp_path / "dl"))
    markdown = open(f"{folder}/regression.md").read()
    assert "incomparable" in markdown and "stream.max_tokens 16 vs 8" in markdown and old in markdown
    data = json.load(open(f"{folder}/regression.json"))
    assert data["status"] == "incomparable" and data["baseline_run_ids"] == [old]
    assert {d["field"] for d in data["incomparable"]} == {"stream.max_tokens", "stream.max_concurrency"}

    # --force-baseline: judged all the same, and says so
    forced = judge(
        tracker,
        now,
        {"ttft_ms_p50": 300.0, "tpot_ms_mean": 30.0},
        IDENT,
        RegressionConfig(force_baseline=True),
    )
    assert forced.forced and forced.status == "regressed"
    assert forced.regressed_metrics == ["ttft_ms_p50", "tpot_ms_mean"]
    assert "--force-baseline" in forced.markdown() and old in forced.markdown()


def test_the_median_uses_only_audits_with_the_same_workload(tmp_path):
    tracker, _ = _store(tmp_path)
    alike = [_audit(tracker, _config(), {"ttft_ms_p50": v}) for v in (100.0, 104.0)]
    _audit(tracker, _config(prompts=["a much longer prompt " * 20]), {"ttft_ms_p50": 400.0})
    now = _audit(tracker, _config(), {}, finish=False)
    cfg = RegressionConfig(thresholds_pct={"ttft_ms_p50": 15.0}, min_baseline_audits=2)
    result = judge(tracker, now, {"ttft_ms_p50": 130.0}, IDENT, cfg)
    assert result.status == "regressed" and result.rows[0].baseline == 102.0
    assert sorted(result.baseline_run_ids) == sorted(alike)
    assert result.to_dict()["regressed_metrics"] == ["ttft_ms_p50"]


def test_a_named_baseline_of_another_engine_or_model_file_is_incomparable(tmp_path):
    tracker, _ = _store(tmp_path)
    vllm = {**IDENT, "endpoint_kind": "vllm", "endpoint_model_sha256": "def"}
    other = _audit(tracker, _config(), {"ttft_ms_p50": 100.0}, tags=vllm)
    now = _audit(tracker, _config(), {}, finish=False)
    result = judge(tracker, now, {"ttft_ms_p50": 50.0}, IDENT, RegressionConfig(baseline_run_id=other))
    assert result.status == "incomparable"
    assert {d.field for d in result.differences} == {"endpoint_kind", "endpoint_model_sha256"}


def test_lists_logged_before_compact_spacing_still_compare_equal():
    old = {"stream.max_concurrency": "[1,2]", "stream.max_tokens": "8"}
    new = {"stream.max_concurrency": "[1, 2]", "stream.max_tokens": "8"}
    assert workload_differences(new, old, "r") == []
    assert [d.field for d in workload_differences({**new, "stream.max_tokens": "9"}, old, "r")] == [
        "stream.max_tokens"
    ]


def test_the_cli_names_the_regressed_metrics_and_the_baseline_runs(tmp_path, capsys):
    from flows.commands.audit import print_verdict

    tracker, _ = _store(tmp_path)
    old = _audit(tracker, _config(), {"ttft_ms_p50": 100.0, "tpot_ms_mean": 10.0})
    now = _audit(tracker, _config(), {}, finish=False)
    one = RegressionConfig(min_baseline_audits=1)  # a verdict on one audit (the default wants 3)
    result = judge(tracker, now, {"ttft_ms_p50": 130.0, "tpot_ms_mean": 10.0}, IDENT, one)
    print_verdict(result.to_dict())
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    # (the 8 default thresholds these audits logged nothing for are inconclusive: missing)
    assert first.startswith(
        "Regression verdict: REGRESSED (1 regressed, 0 improved, 1 unchanged, 8 inconclusive)"
    )
    assert "in ttft_ms_p50 (+30.0 %)" in first and "tpot_ms_mean" not in first
    # then every judged metric on a line of its own, with its class
    assert any(
        line.split()[:3] == ["tpot_ms_mean", "+0.0", "%"] and "unchanged" in line for line in out.splitlines()
    )
    assert f"Baseline runs: {old}" in out
    # an improvement is named apart, not among the regressions after "in"
    both = _audit(tracker, _config(), {}, finish=False)
    print_verdict(judge(tracker, both, {"ttft_ms_p50": 130.0, "tpot_ms_mean": 5.0}, IDENT, one).to_dict())
    first = capsys.readouterr().out.splitlines()[0]
    assert " in ttft_ms_p50 (+30.0 %); improved: tpot_ms_mean (-50.0 %); baseline: " in first
    other = _audit(tracker, _config(max_tokens=32), {}, finish=False)
    print_verdict(judge(tracker, other, {"ttft_ms_p50": 1.0}, IDENT, RegressionConfig()).to_dict())
    out = capsys.readouterr().out
    assert "incomparable" in out and "stream.max_tokens 32 vs 8" in out


def test_a_baseline_without_workload_records_is_judged_and_new_fields_default():
    # logged by hand (metrics only): the workload is unknown, not different
    assert workload_differences({"stream.max_tokens": "8", "endpoint_kind": "llama.cpp"}, {}, "r") == []
    # an audit logged before stream.api / dataset / duration_s existed ran with their defaults
    before = {"stream.max_tokens": "8"}
    now = {"stream.max_tokens": "8", "stream.api": "chat", "stream.dataset": "null"}
    assert workload_differences(now, before, "r") == []
    completions = {**now, "stream.api": "completions"}
    assert [d.field for d in workload_differences(completions, before, "r")] == ["stream.api"]
