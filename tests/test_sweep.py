"""The sampling sweep as an experiment: bad flags refused, temperature 0 deterministic against
the real embedded llama.cpp server, a resumed sweep skipping exactly the finished points, and a
point whose requests fail recorded as failed while the rest finish."""

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.config import SweepFlowConfig
from tasks.stream.records import RequestRecord
from tasks.sweep import (
    PointOutcome,
    SweepPoint,
    distinct_n,
    finish_point,
    grid,
    identical_fraction,
    sweep_headline,
)

try:
    from tests import groundtruth_server as gt
except ImportError:  # run from tests/
    import groundtruth_server as gt

BIN = Path(sys.executable).parent / "infermeter"


def test_grid_points_and_keys():
    points = grid([0.0, 1.2], [1.0], [0, 40], seed=3, max_tokens=4, extra_body={"min_p": 0.05})
    assert len(points) == 4 and points[1].top_k == 40
    assert points[1].sampling(2) == {"temperature": 0.0, "top_p": 1.0, "top_k": 40, "seed": 5, "min_p": 0.05}
    assert points[0].params()["extra_body.min_p"] == 0.05
    ctx = {"endpoint_kind": "llama.cpp", "endpoint_model": "m"}
    assert points[0].key(ctx) == grid([0.0], [1.0], [0], seed=3, max_tokens=4, extra_body={"min_p": 0.05})[
        0
    ].key(ctx)
    assert points[0].key(ctx) != points[0].key({**ctx, "endpoint_model": "other"})
    assert len({p.key(ctx) for p in points}) == 4
    assert SweepPoint(0.0).expects_determinism() and SweepPoint(1.0, top_k=1).expects_determinism()
    assert not SweepPoint(1.0, top_k=0).expects_determinism()
    assert grid([0.7])[0].sampling(0) == {"temperature": 0.7, "seed": 0}  # None is not sent


def test_diversity_figures():
    assert identical_fraction(["a", "a", "b", "a"]) == 0.75
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 1) == 4 / 6
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == 3 / 4
    assert distinct_n([[1]], 2) is None


def test_point_outcome_to_dict_is_the_stage_entry():
    point = SweepPoint.make(temperature=0.0, seed=3, max_tokens=4, extra_body={"min_p": 0.05})
    records = [
        RequestRecord("a", output_text="x y", output_tokens=2, ttft_ms=5.0, e2e_ms=9.0),
        RequestRecord("b", error_class="timeout", error_message="slow"),
    ]
    result = finish_point(point, records, encode=lambda text: [ord(c) for c in text if c != " "])
    failed = PointOutcome.measured(result, "k1", "run-1")
    assert failed.to_dict() == {
        "temperature": 0.0,
        "top_p": None,
        "top_k": None,
        "seed": 3,
        "max_tokens": 4,
        "extra_body.min_p": 0.05,
        "point_key": "k1",
        "status": "failed",
        "error_class": "timeout",
        "samples": [
            {
                "sample": 0,
                "seed": 3,
                "output_text": "x y",
                "output_tokens": 2,
                "ttft_ms": 5.0,
                "e2e_ms": 9.0,
                "error_class": None,
                "error_message": None,
            },
            {
                "sample": 1,
                "seed": 4,
                "output_text": "",
                "output_tokens": None,
                "ttft_ms": None,
                "e2e_ms": None,
                "error_class": "timeout",
                "error_message": "slow",
            },
        ],
        "warmup": None,
        "num_samples": 2,
        "num_samples_failed": 1,
        "identical_fraction": 1.0,
        "distinct_1": 1.0,
        "distinct_2": 1.0,
        "output_tokens_mean": 2.0,
        "output_tokens_std": 0.0,
        "ttft_ms_mean": 5.0,
        "e2e_ms_mean": 9.0,
        "determinism_violated": 0,
        "determinism_note": None,
        "mlflow_run_id": "run-1",
    }
    # a resumed point: figures read back from MLflow (floats), counts as ints, missing as None
    skipped = PointOutcome.skipped(
        point, "k1", "run-0", {"num_samples": 2.0, "distinct_1": 0.5}, samples=[{"sample": 0}]
    )
    entry = skipped.to_dict()
    assert (entry["status"], entry["error_class"], entry["mlflow_run_id"]) == ("skipped", None, "run-0")
    assert entry["num_samples"] == 2 and isinstance(entry["num_samples"], int)
    assert entry["distinct_1"] == 0.5 and entry["ttft_ms_mean"] is None
    assert entry["samples"] == [{"sample": 0}]
    assert sweep_headline([failed, skipped]) == {
        "sweep_points": 2,
        "sweep_points_skipped": 1,
        "sweep_points_failed": 1,
        "sweep_determinism_violations": 0,
    }


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--temperature", "0,-0.5", "temperature -0.5"),
        ("--top-p", "0", "top_p 0.0"),
        ("--top-p", "1.5", "top_p 1.5"),
        ("--top-k", "-1", "top_k -1"),
        ("--samples", "0", "samples 0"),
        ("--temperature", "hot", "--temperature"),
        ("--target", "cloud", "--target"),  # the flag typed, not the config path (issue 14)
    ],
)
def test_bad_flag_values_exit_2_with_one_line(flag, value, needle):
    result = subprocess.run(
        [str(BIN), "sweep", flag, value, "--no-track"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def _config(temperatures, name, **endpoint):
    return SweepFlowConfig.model_validate(
        {
            "name": name,
            "sweep": {
                "prompt": "Name a fruit.",
                "temperature": temperatures,
                "top_p": [1.0],
                "samples": 2,
                "max_tokens": 4,
            },
            "endpoint": endpoint,
            "tracking": {"experiment": "infermeter-sweep-test"},
        }
    )


def _point_runs(client, key):
    exp = client.get_experiment_by_name("infermeter-sweep-test")
    return client.search_runs([exp.experiment_id], f"tags.point_key = '{key}'")


@pytest.mark.integration
def test_temperature_zero_is_deterministic_and_resume_skips_exactly_finished_points(
    mlflow_store, prefect_server, workdir
):
    from flows.sweep import sweep

    state = sweep(_config([0.0, 1.2], "sweep-first"), return_state=True)
    first = state.result()
    assert state.is_completed() and first["error"] is None
    points = {p["temperature"]: p for p in first["points"]}
    zero = points[0.0]
    assert zero["status"] == "finished" and len(zero["samples"]) == 2
    assert zero["samples"][0]["output_text"] and zero["samples"][0]["output_tokens"] >= 1
    assert zero["samples"][0]["output_text"] == zero["samples"][1]["output_text"]
    assert zero["identical_fraction"] == 1.0 and zero["determinism_violated"] == 0
    assert [s["seed"] for s in zero["samples"]] == [0, 1]
    assert first["headline"]["sweep_points_skipped"] == 0

    client = MlflowClient(tracking_uri=mlflow_store[1])
    child = client.get_run(zero["mlflow_run_id"])
    assert child.info.status == "FINISHED" and child.data.params["temperature"] == "0.0"
    assert child.data.params["top_k"] == "null" and child.data.metrics["identical_fraction"] == 1.0
    assert "samples.json" in {a.path for a in client.list_artifacts(child.info.run_id)}
    stage = client.get_run(child.data.tags["mlflow.parentRunId"])
    charts = {a.path for a in client.list_artifacts(stage.info.run_id, "plots")}
    assert len(charts) == 5 and "plots/sweep_identical_fraction_vs_temperature.png" in charts

    # rerun with one point more: the two finished points are skipped, only the new one runs
    state = sweep(_config([0.0, 1.2, 0.7], "sweep-second"), return_state=True)
    second = state.result()
    status = {p["temperature"]: p["status"] for p in second["points"]}
    assert status == {0.0: "skipped", 1.2: "skipped", 0.7: "finished"}
    assert second["headline"]["sweep_points_skipped"] == 2
    again = {p["temperature"]: p for p in second["points"]}
    assert again[0.0]["mlflow_run_id"] == zero["mlflow_run_id"]
    assert again[0.0]["identical_fraction"] == 1.0
    assert again[0.0]["samples"] == zero["samples"]  # read back from the finished run
    for p in second["points"]:  # never a duplicated child run
        assert len(_point_runs(client, p["point_key"])) == 1


@pytest.mark.integration
def test_failed_requests_make_failed_points_and_the_sweep_finishes(mlflow_store, prefect_server, workdir):
    from flows.sweep import sweep

    # a server that answers every request with HTTP 500: the pre-flight leaves a 5xx to the run
    # (a refused connection now fails the flow at once: tests/test_preflight.py)
    with gt.serve() as server:
        cfg = _config([0.0, 1.0], "sweep-refused", base_url=server.base_url, model="http_500")
        state = sweep(cfg, return_state=True)
    result = state.result(raise_on_failure=False)
    assert result["error"] is None and len(result["points"]) == 2
    for p in result["points"]:
        assert p["status"] == "failed" and p["error_class"] == "server"
        assert p["num_samples_failed"] == 2
    client = MlflowClient(tracking_uri=mlflow_store[1])
    run = client.get_run(result["points"][0]["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.tags["error_class"] == "server"
    assert result["headline"]["sweep_points_failed"] == 2


@pytest.mark.integration
def test_local_target_is_seeded_per_sample(prefect_server, workdir):
    from flows.sweep import sweep

    cfg = SweepFlowConfig.model_validate(
        {
            "sweep": {
                "prompt": "Name a fruit.",
                "target": "local",
                "samples": 2,
                "max_tokens": 4,
                "points": [
                    {"temperature": 1.0, "top_k": 1},
                    {"temperature": 1.5, "seed": 7},
                    {"temperature": 1.5, "seed": 7},
                ],
            }
        }
    )
    result = sweep(cfg, track=False, return_state=True).result()
    greedy, hot, hot_again = result["points"]
    assert greedy["identical_fraction"] == 1.0 and greedy["determinism_violated"] == 0
    assert all(s["output_tokens"] == 4 and s["ttft_ms"] > 0 for s in greedy["samples"])
    # the same seeds give the same samples: sampling is seeded per sample, not global
    assert [s["output_text"] for s in hot["samples"]] == [s["output_text"] for s in hot_again["samples"]]
    assert [s["seed"] for s in hot["samples"]] == [7, 8]
