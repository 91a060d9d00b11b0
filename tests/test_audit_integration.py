"""The audit on configs/smoke.yaml, for real: the packaged SmolLM2, the embedded llama.cpp
server, a real MLflow store and a real Prefect server (the session fixtures).

The embedded server's key is random; here it is planted as a known canary so the test can prove
it reaches no MLflow file, no record and no log line.
"""

from pathlib import Path

import polars as pl
import psutil
import pytest
from mlflow.tracking import MlflowClient

from tasks.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CANARY_KEY = "canary-key-7f3a9c1e5b2d4f60a8e1"
STAGES = {"tokenize", "profile", "stream", "sweep"}
# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32.
SMOL_KV_BYTES_PER_POSITION = 30 * 3 * 64 * 2 * 4


def _llama_servers():
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "llama_cpp.server" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def smoke_audit(mlflow_store, prefect_server, workdir):
    from flows.audit import audit

    cfg = load_config(CONFIGS / "smoke.yaml")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tasks.engines.server.secrets.token_urlsafe", lambda n: CANARY_KEY)
        state = audit(cfg, return_state=True)
    result = state.result(raise_on_failure=False)
    client = MlflowClient(tracking_uri=mlflow_store[1])
    return state, result, client


def _children(client, run):
    exp = run.info.experiment_id
    return client.search_runs(
        [exp], filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'", max_results=100
    )


def test_flow_completes_with_all_stages(smoke_audit):
    state, result, _ = smoke_audit
    assert state.is_completed(), result
    assert result["errors"] == {}
    assert set(result["stages"]) == STAGES


def test_mlflow_tree(smoke_audit):
    _, result, client = smoke_audit
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    tags = parent.data.tags
    assert tags["prefect_flow_run_id"] and tags["git_commit"] and tags["torch_version"]
    assert int(tags["torch_num_threads"]) >= 1  # the profile stage ran torch: its facts from torch
    assert tags["endpoint_kind"] == "llama.cpp" and tags["endpoint_model_sha256"]
    assert parent.data.params["stream.max_concurrency"] == "[1, 2]"
    children = {c.data.tags["stage"]: c for c in _children(client, parent)}
    assert set(children) == STAGES
    assert all(c.info.status == "FINISHED" for c in children.values())
    sweep_points = _children(client, children["sweep"])
    assert len(sweep_points) == 2
    assert {p.data.params["temperature"] for p in sweep_points} == {"0.0", "1.2"}
    assert len(_children(client, children["stream"])) == 2  # concurrency 1 and 2
    assert len(_children(client, children["profile"])) == 2  # batch 1 and 2
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"summary.md", "config.yaml"} <= artifacts


def test_headline_metrics_are_sane(smoke_audit):
    _, result, client = smoke_audit
    m = client.get_run(result["mlflow_run_id"]).data.metrics
    assert m["ttft_ms_p50"] > 0 and m["ttft_ms_p99"] >= m["ttft_ms_p50"]
    assert m["itl_ms_p50"] > 0 and m["tpot_ms_mean"] > 0
    assert m["e2e_ms_p50"] > m["ttft_ms_p50"]
    assert m["error_rate"] == 0
    assert m["prefill_ms"] > 0 and m["decode_tokens_per_s"] > 0
    assert m["kv_cache_bytes"] == m["kv_cache_bytes_formula"]
    assert 5.0e8 < m["weights_bytes"] < 5.6e8  # ~134.5M float32 parameters
    assert m["token_count_model_total"] > 0


def test_profile_point_values(smoke_audit):
    _, result, _ = smoke_audit
    first = result["stages"]["profile"]["points"][0]
    assert first["input_ids_shape"] == [1, 16]
    assert first["last_hidden_state_shape"] == [1, 16, 576]
    assert first["embedding_shape"] == [49152, 576]
    assert len(first["decode_ms"]) == 4
    positions = first["kv_cache_bytes"] // SMOL_KV_BYTES_PER_POSITION
    assert first["kv_cache_bytes"] == positions * SMOL_KV_BYTES_PER_POSITION
    assert 16 + 3 <= positions <= 16 + 4
    second = result["stages"]["profile"]["points"][1]
    assert second["batch_size"] == 2 and second["kv_cache_bytes"] == 2 * first["kv_cache_bytes"]
    # the seed's hidden_size form is 3x too large for SmolLM2 (9 heads, 3 KV heads)
    assert first["kv_seed_formula_ratio"] == pytest.approx(3.0)


def test_stream_requests_follow_the_definitions(smoke_audit):
    _, result, _ = smoke_audit
    level = result["stages"]["stream"]["levels"][0]
    assert level["max_concurrency"] == 1
    requests = level["requests"]
    assert sum(r["warmup"] for r in requests) == 1 and len(requests) == 4
    for r in requests:
        assert r["error"] is None
        assert r["output_tokens_source"] == "tokenizer"  # llama.cpp sends no usage chunk
        assert len(r["itl_ms"]) >= 1 and all(gap >= 0 for gap in r["itl_ms"])
        assert r["ttft_ms"] + sum(r["itl_ms"]) == pytest.approx(r["e2e_ms"], abs=0.01)
        assert r["stream_close_ms"] >= r["e2e_ms"]
        if r["output_tokens"] >= 2:
            expected = (r["e2e_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1)
            assert r["tpot_ms"] == pytest.approx(expected)


def test_identical_outputs_at_temperature_zero(smoke_audit):
    _, result, _ = smoke_audit
    points = {p["temperature"]: p for p in result["stages"]["sweep"]["points"]}
    assert points[0.0]["identical_fraction"] == 1.0
    assert points[0.0]["determinism_violated"] == 0
    assert len(points[0.0]["samples"]) == 2 and points[0.0]["samples"][0]


def test_parquet_artifacts_readable(smoke_audit, tmp_path):
    _, result, client = smoke_audit
    stream_run = result["stages"]["stream"]["mlflow_run_id"]
    requests = pl.read_parquet(client.download_artifacts(stream_run, "requests.parquet", str(tmp_path)))
    tokens = pl.read_parquet(client.download_artifacts(stream_run, "tokens.parquet", str(tmp_path)))
    assert requests.height == 8  # 2 levels x (1 warm-up + 3 measured)
    assert {"ttft_ms", "e2e_ms", "output_tokens", "warmup", "itl_ms"} <= set(requests.columns)
    chunks = sum(len(r["itl_ms"]) + 1 for lv in result["stages"]["stream"]["levels"] for r in lv["requests"])
    assert tokens.height == chunks


def test_api_key_reaches_no_store_record_or_log(smoke_audit, mlflow_store, workdir, capfd):
    root, _ = mlflow_store
    needle = CANARY_KEY.encode()
    for base in (root, workdir):
        for path in Path(base).rglob("*"):
            if path.is_file():
                assert needle not in path.read_bytes(), f"API key leaked into {path}"
    out, err = capfd.readouterr()
    assert CANARY_KEY not in out + err


def test_server_is_gone_afterwards(smoke_audit):
    assert _llama_servers() == []


def test_failed_server_start_fails_the_flow_but_keeps_finished_stages(mlflow_store, prefect_server, workdir):
    from flows.audit import audit

    cfg = load_config(CONFIGS / "smoke.yaml")
    cfg.profile.enabled = False
    cfg.server.startup_timeout_s = 0.01  # cannot be healthy that fast
    cfg.name = "audit-broken-server"
    state = audit(cfg, return_state=True)
    result = state.result(raise_on_failure=False)
    assert state.is_failed()
    assert "endpoint" in result["errors"] and "startup_timeout_s" in result["errors"]["endpoint"]
    client = MlflowClient(tracking_uri=mlflow_store[1])
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.info.status == "FAILED" and "endpoint" in parent.data.tags["error"]
    assert parent.data.metrics["token_count_model_total"] > 0  # the finished stage is kept
    assert _llama_servers() == []


def test_planted_regression_fails_the_audit_with_a_verdict(mlflow_store, prefect_server, workdir):
    from flows.audit import audit
    from tasks.tracking import Tracker

    cfg = load_config(CONFIGS / "smoke.yaml")
    cfg.name = "audit-regression"
    cfg.tokenize.enabled = False
    cfg.profile.enabled = False
    cfg.sweep.enabled = False
    cfg.stream.max_concurrency = [1]
    cfg.stream.num_requests = 2
    tracker = Tracker(cfg.tracking.experiment)
    planted = tracker.start_run("planted-baseline", tags={"flow": "audit"})
    tracker.log_metrics(planted, {"ttft_ms_p50": 0.5, "output_tokens_per_s": 1.0e6})
    tracker.end_run(planted)
    cfg.regression.baseline_run_id = planted
    cfg.regression.thresholds_pct = {"ttft_ms_p50": 15.0, "output_tokens_per_s": -10.0}
    cfg.regression.fail_on_regression = True

    state = audit(cfg, return_state=True)
    result = state.result(raise_on_failure=False)
    assert state.is_failed() and "regression" in state.message
    assert result["errors"] == {}
    rows = {row["metric"]: row for row in result["regression"]["rows"]}
    assert rows["ttft_ms_p50"]["regressed"] and rows["ttft_ms_p50"]["baseline"] == 0.5
    assert rows["output_tokens_per_s"]["regressed"]
    # a planted baseline kept no samples: the legacy rule, said on every row (issue 21)
    assert {row["rule"] for row in rows.values()} == {"legacy"} and "legacy rule" in rows["ttft_ms_p50"][
        "note"
    ]
    client = MlflowClient(tracking_uri=mlflow_store[1])
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["regression"] == "true"
    assert run.data.tags["baseline_run_ids"] == planted
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"regression.md", "regression.json", "summary.md", "samples.parquet"} <= artifacts
