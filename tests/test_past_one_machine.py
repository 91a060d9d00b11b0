"""Past one machine, for real (README "Past one machine"): a real Prefect server, a process work
pool with our deployments (`infermeter deploy --pool`), a real `prefect worker` started from
another folder, a Dask LocalCluster of 2 workers, and an `mlflow server` on PostgreSQL.

A sweep deployment run fanned out over the Dask workers lands in the PG-backed server with every
point, sample and artifact; two audit deployment runs at the same time write to it without a
lost metric; the parent runs carry the Prefect flow-run id and the worker's host."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.config import AuditConfig, SweepFlowConfig
from tasks.engines.server import background_server, free_port

try:
    from tests.dask_cluster import dask_cluster
except ImportError:  # run from tests/
    from dask_cluster import dask_cluster

BIN = Path(sys.executable).parent
POOL = "infermeter-test"
pytestmark = pytest.mark.integration


def _run(args, env, cwd=None):
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=180)


def _wait_runs(api: str, flow_run_ids: list, timeout_s: float = 900) -> dict:
    """Poll the Prefect API until every flow run is final; returns id -> state type name."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout_s
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            states = {i: client.read_flow_run(i).state for i in flow_run_ids}
            if all(s is not None and s.is_final() for s in states.values()):
                return {i: (s.type.value, s.message) for i, s in states.items()}
            time.sleep(2)
    raise AssertionError(f"flow runs not final after {timeout_s} s: {states}")


def _start_runs(api: str, name: str, configs: list[dict]) -> list:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(name)
        return [
            client.create_flow_run_from_deployment(deployment.id, parameters={"config": c}).id
            for c in configs
        ]


def _descendants(client: MlflowClient, run) -> list:
    found, todo = [], [run]
    while todo:
        current = todo.pop()
        children = client.search_runs(
            [current.info.experiment_id],
            f"tags.mlflow.parentRunId = '{current.info.run_id}'",
            max_results=500,
        )
        found += children
        todo += children
    return found


def _parent(client: MlflowClient, experiment: str, flow_run_id) -> object:
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.prefect_flow_run_id = '{flow_run_id}'")
    assert len(runs) == 1, runs
    return runs[0]


def test_worker_runs_deployments_fanned_out_over_dask_into_mlflow_on_postgres(
    prefect_api, mlflow_pg_server, tmp_path
):
    elsewhere = tmp_path / "elsewhere"  # the worker's folder: not the repository
    elsewhere.mkdir()
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "MLFLOW_TRACKING_URI": mlflow_pg_server,
        "INFERMETER_WORK_DIR": str(tmp_path / "work"),
    }
    created = _run([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "process"], env)
    assert created.returncode == 0, created.stdout + created.stderr
    missing = _run([str(BIN / "infermeter"), "deploy", "--pool", "no-such-pool"], env)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "--pool" in missing.stderr and "no-such-pool" in missing.stderr
    deployed = _run([str(BIN / "infermeter"), "deploy", "--pool", POOL], env)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "sweep/sweep" in deployed.stdout and "audit/audit" in deployed.stdout

    health = free_port()
    worker_env = {
        **env,
        "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1",
        "PREFECT_WORKER_WEBSERVER_PORT": str(health),
    }
    worker = [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--with-healthcheck"]
    with (
        dask_cluster(2, tmp_path) as address,
        background_server(
            "prefect worker",
            ["/bin/sh", "-c", f'cd "{elsewhere}" && exec "$@"', "worker", *worker],
            worker_env,
            f"http://127.0.0.1:{health}/health",
            startup_timeout_s=120,
            log_path=tmp_path / "worker.log",
        ),
    ):
        sweep_cfg = SweepFlowConfig.model_validate(
            {
                "name": "pom-sweep",
                "sweep": {
                    "prompt": "Name a fruit.",
                    "target": "local",
                    "distribution": False,
                    "temperature": [0.0, 1.2],
                    "top_p": [1.0],
                    "samples": 2,
                    "max_tokens": 8,
                    "task_runner": f"dask:{address}",
                },
                "tracking": {"experiment": "pom"},
            }
        ).model_dump(mode="json")
        audit = AuditConfig.model_validate(
            {
                "name": "pom-audit",
                "tokenize": {"prompts": ["smart", "tokenization"], "tokenizers": ["model"]},
                "profile": {"enabled": False},
                "stream": {
                    "prompts": ["Say hello."],
                    "max_tokens": 4,
                    "max_concurrency": [1],
                    "num_requests": 2,
                },
                "sweep": {
                    "prompt": "Name a fruit.",
                    "temperature": [0.0],
                    "top_p": [1.0],
                    "samples": 1,
                    "max_tokens": 4,
                },
                "tracking": {"experiment": "pom-audits"},
            }
        ).model_dump(mode="json")
        (sweep_id,) = _start_runs(prefect_api, "sweep/sweep", [sweep_cfg])
        audit_ids = _start_runs(prefect_api, "audit/audit", [audit, audit])  # at the same time
        states = _wait_runs(prefect_api, [sweep_id, *audit_ids])
    assert all(kind == "COMPLETED" for kind, _ in states.values()), states

    client = MlflowClient(tracking_uri=mlflow_pg_server)
    parent = _parent(client, "pom", sweep_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["host"] == socket.gethostname()  # the worker's machine
    assert parent.data.params["sweep.task_runner"] == f"dask:{address}"
    stage = _descendants(client, parent)[0]  # the first found: the parent's own child
    assert stage.data.tags["stage"] == "sweep" and stage.data.metrics["sweep_points"] == 2
    stage_files = {a.path for a in client.list_artifacts(stage.info.run_id)}
    assert "samples.json" in stage_files and "plots" in stage_files
    points = [r for r in _descendants(client, parent) if r.data.tags.get("stage") == "sweep_point"]
    assert sorted(p.data.params["temperature"] for p in points) == ["0.0", "1.2"]
    for point in points:
        assert point.info.status == "FINISHED" and point.data.metrics["num_samples"] == 2
        table = json.loads(
            Path(client.download_artifacts(point.info.run_id, "samples.json", str(tmp_path))).read_text()
        )
        tokens = [row[table["columns"].index("output_tokens")] for row in table["data"]]
        assert len(tokens) == 2 and min(tokens) >= 1

    # two audits written at once: the same runs and the same metric counts, none lost
    counts = []
    for flow_run_id in audit_ids:
        run = _parent(client, "pom-audits", flow_run_id)
        assert run.info.status == "FINISHED" and run.data.tags["host"] == socket.gethostname()
        tree = _descendants(client, run)
        histories = sum(
            len(client.get_metric_history(r.info.run_id, key)) for r in [run, *tree] for key in r.data.metrics
        )
        level = [r for r in tree if "num_requests" in r.data.metrics]
        assert len(level) == 1 and level[0].data.metrics["num_requests"] == 2
        counts.append((len(tree), sum(len(r.data.metrics) for r in [run, *tree]), histories))
    assert counts[0] == counts[1] and counts[0][1] > 20, counts
