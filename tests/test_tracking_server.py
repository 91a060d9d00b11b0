"""MLflow past one machine, for real: a tracking server on PostgreSQL (tests/cluster.py).

- Three audits (a tiny config, the embedded llama.cpp server; two of them at the same time)
  against ``mlflow server`` on PostgreSQL with proxied artifacts: every stage's child run and
  its children land with metrics and artifacts (Parquet, PNG, JSON tables), read back through
  ``MlflowClient``; the concurrent ones lose no metric;
  logging is batched (the server's own access log counts the calls); ``infermeter compare``
  and the second audit's regression verdict work against it.
- The server killed in the middle of a sweep (the ground-truth server paces the points): the
  points keep running, the run ends with one line naming the server and the records' folder,
  and ``infermeter sync`` uploads the rest once the server is back on the same port and
  database, without duplicates (a second sync sends nothing).
- Bad input: an unreachable ``MLFLOW_TRACKING_URI``, and a server whose database refuses its
  password, exit 2 with one line before any measurement starts.

Every command runs as the user runs it: the ``infermeter`` console script in a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.engines.server import free_port
from tests.cluster import mlflow_server

try:
    from tests import groundtruth_server as gt
except ImportError:  # pytest's rootdir-relative import
    import groundtruth_server as gt

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent / "infermeter"
STAGES = {"tokenize", "profile", "stream", "sweep"}
TINY_AUDIT = """\
name: audit-pg
tokenize: {prompts: [smart, 大语言模型], tokenizers: [model]}
profile:
  {model: "gguf:default", prompt_lengths: [8], batch_sizes: [1], dtypes: [float32],
   max_new_tokens: 2, repeats: 1, warmup: 0}
stream: {prompts: [Say hello.], max_tokens: 4, max_concurrency: [1], num_requests: 2, warmup: 0}
sweep: {prompt: Name a fruit., temperature: [0.0], top_p: [1.0], samples: 2, max_tokens: 4}
tracking: {experiment: infermeter-pg}
regression: {min_baseline_audits: 2}
"""


def _cli(
    args: list[str], tracking_uri: str, workdir: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "INFERMETER_WORK_DIR": str(workdir)}
    return subprocess.run(
        [str(BIN), *args], capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL
    )


def _children(client: MlflowClient, run) -> list:
    return client.search_runs(
        [run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'", max_results=500
    )


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def _api_calls(log: Path) -> dict[str, int]:
    """Requests per API path in the server's access log (uvicorn: ``"POST /api/... HTTP/1.1"``)."""
    counts: dict[str, int] = {}
    for path in re.findall(r'"[A-Z]+ (/api/2\.0/mlflow/[a-z/-]+)', log.read_text(errors="replace")):
        counts[path] = counts.get(path, 0) + 1
    return counts


@pytest.fixture(scope="module")
def pg_audits(mlflow_pg_server, prefect_api, tmp_path_factory):
    """Three CLI audits of the tiny config against the PostgreSQL-backed server (and a real
    Prefect server): two at the same time (concurrent writers), then one after them (its
    regression verdict has them as the baseline). Returns (uri, folder, [(result, stdout)])."""
    root = tmp_path_factory.mktemp("pg-audits")
    config = root / "audit.yaml"
    config.write_text(TINY_AUDIT, encoding="utf-8")
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": mlflow_pg_server,
        "INFERMETER_WORK_DIR": str(root / "work"),
        "PREFECT_API_URL": prefect_api,
    }

    def start(i: int) -> subprocess.Popen:
        args = [str(BIN), "audit", "--config", str(config), "--json", str(root / f"audit{i}.json")]
        with open(root / f"audit{i}.log", "w") as log:
            return subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
            )

    port = mlflow_pg_server.rsplit(":", 1)[1]
    (log,) = tmp_path_factory.getbasetemp().glob(f"mlflow-pg[0-9]*/mlflow-server-{port}.log")  # conftest's
    before = log.stat().st_size  # the session's server: other tests' calls are not these audits'
    results = []
    for batch in ((1, 2), (3,)):
        procs = {i: start(i) for i in batch}
        for i, proc in procs.items():
            proc.wait(timeout=900)
            output = (root / f"audit{i}.log").read_text(errors="replace")
            assert proc.returncode == 0, output[-4000:]
            results.append((json.loads((root / f"audit{i}.json").read_text()), output))
    with open(log, "rb") as handle:  # the server's access log of these three audits alone
        handle.seek(before)
        (root / "server-calls.log").write_bytes(handle.read())
    return mlflow_pg_server, root, results


def test_audit_lands_every_stage_on_the_pg_server(pg_audits):
    uri, _, results = pg_audits
    client = MlflowClient(tracking_uri=uri)
    for result, stdout in results:
        parent = client.get_run(result["mlflow_run_id"])
        assert parent.info.status == "FINISHED" and result["errors"] == {}
        assert {"config.yaml", "summary.md"} <= _artifacts(client, parent.info.run_id)
        assert len(parent.data.metrics) >= 20  # the headline of every stage
        stages = {c.data.tags["stage"]: c for c in _children(client, parent)}
        assert set(stages) == STAGES and all(c.info.status == "FINISHED" for c in stages.values())
        assert all(c.data.metrics for c in stages.values())
        files = {name: _artifacts(client, run.info.run_id) for name, run in stages.items()}
        assert {"requests.parquet", "tokens.parquet", "plots/load_ttft_ms.png"} <= files["stream"]
        assert {"tokenize.json", "tokens_table.json", "token_counts.png"} <= files["tokenize"]
        assert {"profile_points.json", "plots/prefill_ms_vs_prompt_length.png"} <= files["profile"]
        assert "samples.json" in files["sweep"]
        # one run per profile point, load level and sweep point, each with its metrics
        expected = {"profile": "profile_point", "stream": "stream_level", "sweep": "sweep_point"}
        for stage, kind in expected.items():
            (child,) = _children(client, stages[stage])
            assert child.data.tags["stage"] == kind and child.info.status == "FINISHED" and child.data.metrics
        (point,) = _children(client, stages["sweep"])
        assert "samples.json" in _artifacts(client, point.info.run_id)
        # the runs' records were read back through the server: a proxied Parquet artifact
        local = client.download_artifacts(stages["stream"].info.run_id, "requests.parquet")
        import polars as pl

        assert pl.read_parquet(local).height == 2  # num_requests, no warm-up
        assert f"Open the UI: open {uri}" in stdout


def test_logging_is_batched(pg_audits):
    """The server's access log: no per-metric or per-param calls at all, and a few
    ``log-batch`` calls per run (params, metrics, tags), not one per metric."""
    uri, root, _ = pg_audits
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("infermeter-pg").experiment_id], max_results=500)
    metrics = sum(len(r.data.metrics) for r in runs)
    calls = _api_calls(root / "server-calls.log")
    assert (
        "/api/2.0/mlflow/runs/log-metric" not in calls and "/api/2.0/mlflow/runs/log-parameter" not in calls
    )
    print(f"runs {len(runs)}, metrics {metrics}, server calls {calls}")
    created = calls["/api/2.0/mlflow/runs/create"]
    assert created == len(runs) == 3 * 8  # parent, 4 stages, 1 point, 1 level, 1 sweep point
    assert calls["/api/2.0/mlflow/runs/log-batch"] <= 4 * created < metrics


def test_concurrent_audits_lose_no_metric(pg_audits):
    """The two audits that wrote at the same time have the same runs, and every run the same
    metric names and params, as the one that wrote alone."""
    uri, _, results = pg_audits
    client = MlflowClient(tracking_uri=uri)

    def tree(run_id: str) -> dict[str, tuple[int, frozenset, frozenset]]:
        run = client.get_run(run_id)
        shape = {"parent": (0, frozenset(run.data.metrics), frozenset(run.data.params))}
        for stage in _children(client, run):
            name = stage.data.tags["stage"]
            shape[name] = (
                len(_children(client, stage)),
                frozenset(stage.data.metrics),
                frozenset(stage.data.params),
            )
            for child in _children(client, stage):
                shape[f"{name}/{child.data.tags['stage']}"] = (0, frozenset(child.data.metrics), frozenset())
        return shape

    for result, _ in results:  # every headline figure the command printed is in MLflow, as printed
        logged = client.get_run(result["mlflow_run_id"]).data.metrics
        for key, value in result["headline"].items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                assert logged[key] == pytest.approx(value), key
    shapes = [tree(result["mlflow_run_id"]) for result, _ in results]
    assert len(shapes[0]) == 8 and sum(len(m) for _, m, _ in shapes[0].values()) > 150
    # the regression rows of the third are on the parent only: compare the stage runs fully
    assert shapes[0] == shapes[1]
    assert {k: v for k, v in shapes[0].items() if k != "parent"} == {
        k: v for k, v in shapes[2].items() if k != "parent"
    }


def test_compare_and_regression_against_the_pg_server(pg_audits):
    uri, root, results = pg_audits
    (first, _), (second, _), (third, stdout) = results
    verdict = third["regression"]
    assert set(verdict["baseline_run_ids"]) == {first["mlflow_run_id"], second["mlflow_run_id"]}
    assert verdict["status"] in ("regressed", "improved", "unchanged", "inconclusive") and verdict["rows"]
    assert "Regression verdict" in stdout
    out = root / "compare.json"
    ids = [first["mlflow_run_id"], second["mlflow_run_id"], third["mlflow_run_id"]]
    proc = _cli(["compare", *ids, "--json", str(out)], uri, root / "work")
    assert proc.returncode == 0, proc.stderr
    text = json.dumps(json.loads(out.read_text()))
    assert all(run_id in text for run_id in ids) and "ttft_ms_p50" in text


def _sweep_points(client: MlflowClient) -> list:
    experiment = client.get_experiment_by_name("infermeter-fault")
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], "tags.stage = 'sweep_point'", max_results=100)


def test_server_killed_mid_sweep_then_sync(postgres, tmp_path):
    """Kill the tracking server after the first sweep point landed; the sweep finishes on
    disk, ends with one line, and ``infermeter sync`` fills MLflow in once it is back."""
    backend = postgres.create_database("mlflow_fault")
    port, artifacts = free_port(), tmp_path / "artifacts"
    uri = f"http://127.0.0.1:{port}"
    config, log = tmp_path / "sweep.yaml", tmp_path / "sweep.log"
    with gt.serve() as endpoint, open(log, "w") as out:
        config.write_text(
            f"sweep: {{prompt: Name a fruit., temperature: [0, 0.5, 1.0, 1.5], top_p: [1.0],"
            f" samples: 2,"
            f" max_tokens: 6, max_concurrency: 1}}\n"
            f"endpoint: {{base_url: '{endpoint.base_url}', model: 'ticks:6:150'}}\n"
            "tracking: {experiment: infermeter-fault}\n",
            encoding="utf-8",
        )
        with mlflow_server(backend, artifacts, port=port):
            env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "INFERMETER_WORK_DIR": str(tmp_path / "work")}
            sweep = subprocess.Popen(
                [str(BIN), "sweep", "--config", str(config), "--json", str(tmp_path / "sweep.json")],
                stdout=out, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            client = MlflowClient(tracking_uri=uri)
            deadline = time.monotonic() + 300
            while not _sweep_points(client) and sweep.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        # the server is gone (its process group stopped); the sweep goes on
        _, stderr = sweep.communicate(timeout=600)
    assert sweep.returncode == 1, stderr[-3000:]
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert len(result["points"]) == 4 and all(p["status"] == "finished" for p in result["points"])
    assert all(len(p["samples"]) == 2 for p in result["points"])
    lines = [line for line in stderr.splitlines() if "stopped answering" in line]
    assert len(lines) == 1 and stderr.rstrip().endswith(lines[0]), stderr[-3000:]
    folder = Path(re.search(r"records are in (\S+);", lines[0]).group(1))
    assert uri in lines[0] and f"infermeter sync {folder}" in lines[0]
    assert (folder / "samples.json").is_file() and (folder / "tracking" / "offline.json").is_file()

    with mlflow_server(backend, artifacts, port=port):  # back, same port, same database
        client = MlflowClient(tracking_uri=uri)
        landed = len(_sweep_points(client))
        assert 1 <= landed < 4, stderr[-2000:]  # the rest is in the journal
        sync = _cli(["sync", str(folder), "--json", str(tmp_path / "sync1.json")], uri, tmp_path / "work")
        assert sync.returncode == 0, sync.stdout + sync.stderr
        first = json.loads((tmp_path / "sync1.json").read_text())
        # a run whose create reached the server before it fell is found again: counted, not made
        assert first["sent"] > 0 and first["runs_created"] >= 4 - landed
        points = _sweep_points(client)
        assert len(points) == 4 and len({p.data.tags["point_key"] for p in points}) == 4
        assert {p.data.params["temperature"] for p in points} == {"0.0", "0.5", "1.0", "1.5"}
        for p in points:
            assert p.info.status == "FINISHED" and p.data.metrics["num_samples"] == 2
            assert {"samples.json", "warmup.json"} <= _artifacts(client, p.info.run_id)
        stage = client.get_run(points[0].data.tags["mlflow.parentRunId"])
        assert stage.info.status == "FINISHED" and stage.data.metrics["sweep_points"] == 4
        assert "samples.json" in _artifacts(client, stage.info.run_id)
        parent = client.get_run(result["mlflow_run_id"])
        assert parent.info.status == "FINISHED" and "summary.md" in _artifacts(client, parent.info.run_id)
        # again: nothing left to send, nothing duplicated
        again = _cli(["sync", str(folder), "--json", str(tmp_path / "sync2.json")], uri, tmp_path / "work")
        assert again.returncode == 0 and json.loads((tmp_path / "sync2.json").read_text())["sent"] == 0
        assert len(_sweep_points(client)) == 4


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    print(lines[0])
    return lines[0]


def test_unreachable_tracking_uri_exits_2_before_measuring(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = _cli(["sweep", "--temperature", "0", "--samples", "1"], uri, tmp_path / "work", timeout=120)
    line = _one_error_line(proc)
    assert "MLFLOW_TRACKING_URI" in line and uri in line and "Connection refused" in line
    assert not (tmp_path / "work").exists()  # no run started


def test_wrong_database_password_exits_2_before_measuring(postgres, tmp_path):
    """The server started with the right password; the password was then changed: every call
    it makes to its database (a new connection per request) is refused."""
    backend = postgres.create_database("mlflow_rotated", owner="rotated", password="first-pw")
    env = {"MLFLOW_SQLALCHEMYSTORE_POOLCLASS": "NullPool"}
    with mlflow_server(backend, tmp_path / "artifacts", env=env) as uri:
        MlflowClient(tracking_uri=uri).search_experiments()  # its worker's store is up
        postgres.execute("ALTER ROLE rotated PASSWORD 'second-pw'")
        config = tmp_path / "audit.yaml"
        config.write_text(TINY_AUDIT, encoding="utf-8")
        proc = _cli(["audit", "--config", str(config)], uri, tmp_path / "work", timeout=180)
    line = _one_error_line(proc)
    assert "MLFLOW_TRACKING_URI" in line and uri in line
    assert 'password authentication failed for user "rotated"' in line and "--backend-store-uri" in line
    assert not (tmp_path / "work").exists()
