"""The sweep's points on a real Dask LocalCluster (prefect-dask's DaskTaskRunner): a worker
killed with SIGKILL in the middle of a point, the point run again on another worker, every point
logged as without Dask, the local model loaded once per worker; and a Dask address where
nothing listens refused with one line before anything is measured."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.config import SweepFlowConfig
from tasks.engines.server import free_port

try:
    from tests.dask_cluster import dask_cluster
except ImportError:  # run from tests/
    from dask_cluster import dask_cluster

BIN = Path(sys.executable).parent / "infermeter"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["sweep", "--target", "local", "--task-runner", "dask:tcp://127.0.0.1:{port}"], "no Dask scheduler"),
        (["profile", "--task-runner", "dask:127.0.0.1:{port}"], "no Dask scheduler"),
        (["sweep", "--target", "local", "--task-runner", "ray"], "not a task runner"),
        (["sweep", "--target", "local", "--task-runner", "dask:-1"], "(N must be at least 1): give threads"),
        (
            [
                "stream",
                "--base-url",
                "http://127.0.0.1:{port}/v1",
                "--model",
                "m",
                "--task-runner",
                "dask:abc",
            ],
            "'dask:abc' is not a task runner (a scheduler needs a host and a port; did you mean "
            "dask:tcp://abc:8786?): give threads",
        ),
        (
            ["stream", "--base-url", "http://127.0.0.1:{port}/v1", "--model", "m", "--task-runner", "dask:2"]
            + ["--client-processes", "2"],
            "error: client_processes (--client-processes) counts client processes on this machine; "
            "with task_runner dask:2 (--task-runner) each Dask worker runs one client: set the "
            "workers with dask:N, or drop one of them",
        ),
        (["sweep", "--target", "local", "--compare-workers", "1,2"], "--compare-workers"),
    ],
)
def test_bad_task_runner_exits_2_with_one_line(args, needle, tmp_path):
    port = free_port()  # nothing listens there
    out = subprocess.run(
        [str(BIN), *(a.format(port=port) for a in args), "--no-track"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "INFERMETER_WORK_DIR": str(tmp_path)},
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert needle in lines[0] and ("--task-runner" in lines[0] or "--compare-workers" in lines[0])
    assert not list(tmp_path.iterdir())  # no run folder: refused before anything ran


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A LocalCluster of 2 workers in its own process (tests/dask_cluster.py); its address."""
    with dask_cluster(2, tmp_path_factory.mktemp("dask")) as address:
        yield address


def _killer(address: str, killed: dict, times: int = 1) -> None:
    """SIGKILL the first worker seen busy with a point (after it has worked on it 1 s); with
    ``times`` 2, kill again the worker that runs that same point next. ``killed`` gets the
    point's key and the pids killed."""
    from distributed import Client

    with Client(address) as client:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(killed.get("pids", [])) < times:
            busy = {w: keys for w, keys in client.processing().items() if keys}
            if "key" in killed:  # the same point again, wherever it runs now
                busy = {w: keys for w, keys in busy.items() if killed["key"] in map(str, keys)}
            if busy:
                worker, keys = next(iter(busy.items()))
                time.sleep(1.0)  # the point is under way: model load or generate
                if client.processing().get(worker) == keys:  # still that point
                    pid = client.run(os.getpid, workers=[worker])[worker]
                    os.kill(pid, signal.SIGKILL)
                    killed.setdefault("key", str(keys[0]))
                    killed.setdefault("pids", []).append(pid)
                    continue
            time.sleep(0.1)


@pytest.mark.integration
def test_worker_killed_mid_point_is_retried_and_every_point_lands(
    mlflow_store, prefect_server, workdir, cluster
):
    from distributed import Client

    from flows.sweep import sweep
    from tasks.pipeline.fanout import model_loads

    cfg = SweepFlowConfig.model_validate(
        {
            "name": "dask-kill",
            "sweep": {
                "prompt": "Name a fruit.",
                "target": "local",
                "distribution": False,
                "temperature": [0.0, 0.7, 1.0, 1.2],
                "top_p": [1.0],
                "samples": 2,
                "max_tokens": 24,
                "task_runner": f"dask:{cluster}",
            },
            "tracking": {"experiment": "infermeter-dask-test"},
        }
    )
    killed: dict = {}
    killer = threading.Thread(target=_killer, args=(cluster, killed), daemon=True)
    killer.start()
    state = sweep(cfg, return_state=True)
    killer.join(timeout=30)
    result = state.result(raise_on_failure=False)
    with Client(cluster) as client:
        pids = client.run(os.getpid)
        loads = client.run(model_loads)

    assert killed.get("pids"), "no worker was seen busy with a point"
    assert killed["pids"][0] not in pids.values()  # the killed process is gone (its nanny made another)
    assert result["error"] is None, result["error"]
    points = result["points"]
    assert len(points) == 4 and all(p["status"] == "finished" for p in points), points
    assert all(len(p["samples"]) == 2 and p["samples"][0]["output_tokens"] >= 1 for p in points)
    # once per worker process, not once per point: 4 points (5 runs with the retry), <= 3 loads
    counts = [n for per_worker in loads.values() for n in per_worker.values()]
    assert counts and all(n == 1 for n in counts) and sum(counts) <= 3

    client = MlflowClient(tracking_uri=mlflow_store[1])
    for p in points:  # each point's child run exactly as without Dask
        run = client.get_run(p["mlflow_run_id"])
        assert run.info.status == "FINISHED" and run.data.tags["stage"] == "sweep_point"
        assert run.data.metrics["num_samples"] == 2
        assert "samples.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    stage = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert stage.data.metrics["sweep_points"] == 4 and stage.data.metrics["sweep_points_failed"] == 0


@pytest.mark.integration
def test_profile_points_on_dask_land_as_child_runs_with_one_model_load_per_worker(
    mlflow_store, prefect_server, workdir, cluster
):
    from distributed import Client

    from flows.profile import profile
    from tasks.config import ProfileFlowConfig
    from tasks.pipeline.fanout import model_loads

    cfg = ProfileFlowConfig.model_validate(
        {
            "name": "dask-profile",
            "profile": {
                "prompt_lengths": [16],
                "batch_sizes": [1, 2, 3],
                "max_new_tokens": 2,
                "repeats": 1,
                "warmup": 0,
                "task_runner": f"dask:{cluster}",
            },
            "tracking": {"experiment": "infermeter-dask-test"},
        }
    )
    result = profile(cfg, return_state=True).result()
    assert result["error"] is None
    points = result["points"]
    assert [p["batch_size"] for p in points] == [1, 2, 3]  # the grid's order, whatever finished first
    assert all(not p["failed"] and p["prefill_ms"] > 0 and p["torch_num_threads"] == 1 for p in points)
    with Client(cluster) as client:
        loads = client.run(model_loads)
    counts = [n for per_worker in loads.values() for n in per_worker.values()]
    assert counts and all(n == 1 for n in counts)  # 3 points, 2 workers: a load per worker at most

    client = MlflowClient(tracking_uri=mlflow_store[1])
    stage = client.get_run(result["mlflow_run_id"])
    children = client.search_runs(
        [stage.info.experiment_id], f"tags.mlflow.parentRunId = '{result['mlflow_run_id']}'"
    )
    (stage_run,) = children
    points_runs = client.search_runs(
        [stage.info.experiment_id], f"tags.mlflow.parentRunId = '{stage_run.info.run_id}'"
    )
    assert len(points_runs) == 3 and all(r.info.status == "FINISHED" for r in points_runs)
    assert all(r.data.metrics["prefill_ms"] > 0 for r in points_runs)
    assert "profile_points.json" in {a.path for a in client.list_artifacts(stage_run.info.run_id)}


@pytest.mark.integration
def test_a_point_whose_workers_die_twice_is_failed_with_the_cause_and_the_other_finishes(
    mlflow_store, prefect_server, workdir, cluster
):
    from flows.sweep import sweep

    cfg = SweepFlowConfig.model_validate(
        {
            "name": "dask-kill-twice",
            "sweep": {
                "prompt": "Name a fruit.",
                "target": "local",
                "distribution": False,
                "temperature": [0.0, 0.7],
                "top_p": [1.0],
                "samples": 2,
                "max_tokens": 32,
                "task_runner": f"dask:{cluster}",
            },
            "tracking": {"experiment": "infermeter-dask-test"},
        }
    )
    killed: dict = {}
    killer = threading.Thread(target=_killer, args=(cluster, killed, 2), daemon=True)
    killer.start()
    result = sweep(cfg, return_state=True).result(raise_on_failure=False)
    killer.join(timeout=30)
    assert len(killed.get("pids", [])) == 2, killed
    status = sorted(p["status"] for p in result["points"])
    assert status == ["failed", "finished"], result["points"]
    lost = next(p for p in result["points"] if p["status"] == "failed")
    assert lost["error_class"] == "KilledWorker" and lost["samples"] == []
    run = MlflowClient(tracking_uri=mlflow_store[1]).get_run(lost["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith("KilledWorker: ")
    assert result["headline"]["sweep_points_failed"] == 1


def test_the_workers_of_a_cluster_we_start_keep_their_loop_quiet_and_their_memory_watched() -> None:
    """Points measure on a worker's task thread: its own loop is not woken by its tick, system
    monitor and profiler (tasks.config.taskrunner.QUIET_DASK_WORKER), while its memory monitor keeps
    Dask's 100 ms (a point may load a model)."""
    import dask

    from tasks.config.taskrunner import DaskChoice
    from tasks.pipeline.fanout import dask_runner

    names = [
        "distributed.admin.tick.interval",
        "distributed.admin.system-monitor.interval",
        "distributed.worker.profile.enabled",
        "distributed.worker.memory.monitor-interval",
    ]
    with dask_runner(DaskChoice(workers=1)) as runner:
        seen = list(runner.client.run(lambda: [dask.config.get(name) for name in names]).values())
    assert seen == [["1s", "1s", False, "100ms"]]
