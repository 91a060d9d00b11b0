"""The tracking module against a real MLflow SQLite store: nesting, batching, canonical params."""

import math

import pytest

from tasks.tracking import PARENT_TAG, Tracker, canonical_param, finite_metrics, flatten_params


def test_canonical_param_forms():
    assert canonical_param(True) == "true"
    assert canonical_param(None) == "null"
    assert canonical_param(7) == "7"
    assert canonical_param(0.7) == "0.7"
    assert canonical_param([1, 4]) == "[1, 4]"


def test_flatten_params_nests_and_leaves_long_lists_to_the_artifact():
    flat = flatten_params({"a": {"b": 1, "c": [1, 2]}, "prompts": ["x" * 300, "y"], "d": None})
    assert flat == {"a.b": "1", "a.c": "[1, 2]", "prompts.count": "2", "d": "null"}


def test_finite_metrics_drops_none_nan_inf_and_strings():
    kept = finite_metrics({"a": 1, "b": None, "c": math.nan, "d": math.inf, "e": "x", "f": True})
    assert kept == {"a": 1.0, "f": 1.0}


@pytest.fixture
def tracker(tmp_path):
    return Tracker("t", f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_nested_runs_metrics_params_artifacts(tracker, tmp_path):
    from mlflow.tracking import MlflowClient

    parent = tracker.start_run("parent", tags={"k": "v"})
    child = tracker.start_run("child", parent)
    tracker.log_params(child, {f"p{i}": str(i) for i in range(250)})  # > one batch of 100
    tracker.log_metrics(child, {f"m{i}": i for i in range(1500)})  # > one batch of 1000
    tracker.log_metric_series(child, "decode_step_ms", [1.0, 2.0, 3.0])
    tracker.log_text(child, "hello", "summary.md")
    tracker.end_run(child)
    tracker.end_run(parent, "FAILED")

    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    run = client.get_run(child)
    assert run.data.tags[PARENT_TAG] == parent
    assert len(run.data.params) == 250 and run.data.params["p249"] == "249"
    assert len(run.data.metrics) == 1501 and run.data.metrics["m1499"] == 1499.0
    history = client.get_metric_history(child, "decode_step_ms")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert client.get_run(parent).info.status == "FAILED"
    assert run.info.status == "FINISHED"
    artifacts = [a.path for a in client.list_artifacts(child)]
    assert artifacts == ["summary.md"]
    # artifacts live beside the SQLite store, not in the working directory
    assert (tmp_path / "artifacts").is_dir()


def test_disabled_tracker_does_nothing():
    off = Tracker("t", enabled=False)
    assert off.start_run("x") is None
    off.log_metrics(None, {"a": 1})
    off.end_run(None)


def test_a_runs_own_url_opens_the_classic_view_like_the_runs_table():
    """Issue 31: a run's page printed without ``workflowType`` opened MLflow 3's GenAI view."""
    from tasks.tracking.values import run_page_url, runs_table_url

    server = "http://mlflow.example:5000/"
    assert run_page_url(server, "7", "abc123") == (
        "http://mlflow.example:5000/#/experiments/7/runs/abc123?workflowType=machine_learning"
    )
    assert runs_table_url(server, "7").endswith("?workflowType=machine_learning")
    assert run_page_url("sqlite:///mlruns/mlflow.db", "7", "abc123") is None  # no server to link to
    assert run_page_url(server, None, "abc123") is None and run_page_url(server, "7", None) is None
