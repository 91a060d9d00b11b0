"""flows.runs.parent_run: the parent MLflow run ends FINISHED with what the flow said, FAILED
when an exception escapes the flow body, KILLED on a Ctrl-C."""

import pytest
from mlflow.tracking import MlflowClient
from prefect import flow

from flows.runs import parent_run
from tasks.config import TrackingConfig

TRACKING = TrackingConfig(experiment="infermeter-runs-test")


@flow(name="runs-test")
def _flow(outcome: str) -> str | None:
    with parent_run("runs-test", f"runs-{outcome}", {"a": {"b": 1}}, TRACKING, tags={"model": "m"}) as run:
        assert run.workdir.is_dir()
        run.finish({"x_ms": 1.5}, "# summary\n", "stage broke" if outcome == "error" else None)
        if outcome == "raise":
            raise RuntimeError("boom")
        if outcome == "interrupt":
            raise KeyboardInterrupt
    return run.run_id


def _parent(uri: str, outcome: str):
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(TRACKING.experiment)
    [run] = client.search_runs([experiment.experiment_id], f"attributes.run_name = 'runs-{outcome}'")
    return client, run


@pytest.mark.parametrize(
    ("outcome", "status", "error"),
    [
        ("ok", "FINISHED", None),
        ("error", "FAILED", "stage broke"),
        ("raise", "FAILED", "RuntimeError: boom"),
    ],
)
def test_parent_run_ends_with_the_flows_outcome(
    mlflow_store, prefect_server, workdir, outcome, status, error
):
    state = _flow(outcome, return_state=True)
    assert state.is_failed() == (outcome == "raise")
    client, run = _parent(mlflow_store[1], outcome)
    assert run.info.status == status and run.data.tags.get("error") == error
    assert run.data.tags["flow"] == "runs-test" and run.data.tags["model"] == "m"
    assert run.data.params == {"a.b": "1"} and run.data.metrics == {"x_ms": 1.5}
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "summary.md"}


def test_ctrl_c_marks_the_parent_killed(mlflow_store, prefect_server, workdir):
    with pytest.raises(KeyboardInterrupt):
        _flow("interrupt")
    _, run = _parent(mlflow_store[1], "interrupt")
    assert run.info.status == "KILLED" and run.data.tags["error"] == "KeyboardInterrupt"
