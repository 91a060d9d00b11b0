"""The MLflow UI reads like an experiment tracker: the classic training view (experiment kind),
parent runs named by when and what, compact list params, a level run lasting as long as its
level, per-step series spaced in time, plots with linear concurrency axes from 0; and, in
headless Chromium on a real `mlflow ui`, the runs table the CLI's URL opens, in the classic view,
showing those names. Its screenshot goes to the test's tmp_path; `make docs-images` sets
``INFERMETER_DOCS_IMAGES=docs`` to write the README's docs/mlflow-runs.png instead.

Two tiny real audits (tokenize + stream on the embedded llama.cpp server) make the store.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _free_port, _start, _stop
from mlflow.tracking import MlflowClient

from tasks.config import AuditConfig
from tasks.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker

CHROMIUM = "/usr/bin/chromium"
DOCS = Path(__file__).resolve().parent.parent / "docs"
#: The README's picture of the runs table (written only by `make docs-images`).
SCREENSHOT = "mlflow-runs.png"
EXPERIMENT = "infermeter-ui"
NAME = re.compile(r"^audit \d\d-\d\d \d\d:\d\d:\d\d llama\.cpp SmolLM2-135M-Instruct$")


@pytest.fixture(scope="module")
def two_audits(mlflow_store, prefect_server, workdir):
    from flows.audit import audit

    cfg = AuditConfig.model_validate(
        {
            "name": "audit-ui",
            "tokenize": {"prompts": ["smart", "smarter"], "tokenizers": ["model"]},
            "profile": {"enabled": False},
            "stream": {
                "prompts": ["Say hello."],
                "max_tokens": 4,
                "max_concurrency": [1, 2],
                "num_requests": 2,
                "warmup": 1,
            },
            "sweep": {"enabled": False},
            "tracking": {"experiment": EXPERIMENT},
            "regression": {"min_baseline_audits": 1},  # the second judged against the first
        }
    )
    results = [audit(cfg, return_state=True).result() for _ in range(2)]
    assert all(not r["errors"] for r in results), results
    return results, MlflowClient(tracking_uri=mlflow_store[1])


@pytest.mark.integration
def test_runs_are_named_by_what_and_when_in_a_classic_experiment(two_audits):
    results, client = two_audits
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    first, second = (client.get_run(r["mlflow_run_id"]) for r in results)
    for run in (first, second):
        assert NAME.match(run.info.run_name), run.info.run_name
    # what differs comes first: the runs table's first 30 characters tell the two apart
    assert first.info.run_name[:30] != second.info.run_name[:30]
    for run in (first, second):
        assert run.data.tags["config_name"] == "audit-ui"
        assert run.data.params["stream.max_concurrency"] == "[1, 2]"
    # the second audit is judged against the first: same workload, and it names its baseline
    assert results[1]["regression"]["status"] in ("regressed", "improved", "unchanged", "inconclusive")
    assert results[1]["regression"]["baseline_run_ids"] == [first.info.run_id]


@pytest.mark.integration
def test_a_level_run_lasts_as_long_as_its_level(two_audits):
    results, client = two_audits
    run_id = results[0]["mlflow_run_id"]
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    [stage] = client.search_runs(
        [experiment], f"tags.mlflow.parentRunId = '{run_id}' and tags.stage = 'stream'"
    )
    levels = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{stage.info.run_id}'")
    by_level = {lv["max_concurrency"]: lv for lv in results[0]["stages"]["stream"]["levels"]}
    assert len(levels) == 2
    for level_run in levels:
        duration_ms = level_run.info.end_time - level_run.info.start_time
        requests = by_level[int(level_run.data.params["max_concurrency"])]["requests"]
        first_send = min(r["send_ns"] for r in requests)
        last_end = max(r["send_ns"] + r["e2e_ms"] * 1e6 for r in requests if not r["warmup"])
        span_ms = (last_end - first_send) / 1e6  # warm-up sent first, then the measured requests
        # the level's own span (not the moment it was logged), within the stage's run
        assert span_ms - 5 <= duration_ms <= span_ms + 50, (duration_ms, span_ms)
        assert (
            stage.info.start_time
            <= level_run.info.start_time
            <= level_run.info.end_time
            <= stage.info.end_time
        )


def test_experiments_made_before_get_the_classic_kind_and_series_are_spaced_in_time(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("old")  # as this project made them before: untagged
    tracker = Tracker("old", uri)
    assert client.get_experiment_by_name("old").tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    run = tracker.start_run("p", start_time_ms=1_000_000)
    tracker.log_metric_series(run, "decode_step_ms", [10.0, 20.0, 30.0], durations=True)
    tracker.end_run(run, end_time_ms=1_060_000)
    history = client.get_metric_history(run, "decode_step_ms")
    stamps = [m.timestamp for m in sorted(history, key=lambda m: m.step)]
    assert [b - a for a, b in zip(stamps, stamps[1:])] == [20, 30]  # each step ends its duration later
    info = client.get_run(run).info
    assert (info.start_time, info.end_time) == (1_000_000, 1_060_000)


def test_the_runs_url_names_the_classic_view_of_the_experiment(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker("urls", uri)
    experiment = MlflowClient(tracking_uri=uri).get_experiment_by_name("urls").experiment_id
    # on the `mlflow ui` that ui_command starts (port 5000), in the "Model training" view
    assert tracker.ui_command().endswith(f"--backend-store-uri {uri} --port 5000")
    assert tracker.runs_url() == (
        f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?workflowType=machine_learning"
    )
    assert Tracker("urls", uri, enabled=False).runs_url() is None


def test_load_curves_have_linear_concurrency_axes_from_zero():
    from tasks.report.plots import load_curves_figures

    levels = [
        {
            "max_concurrency": c,
            "request_rate": None,
            "metrics": {"ttft_ms_p50": 10.0 * c, "ttft_ms_p99": 12.0 * c, "output_tokens_per_s": 5.0},
        }
        for c in (1, 4, 16)
    ]
    figures = load_curves_figures(levels)
    assert list(figures) == [
        "load_ttft_ms.png",
        "load_itl_ms.png",
        "load_tpot_ms.png",
        "load_e2e_ms.png",
        "load_output_tokens_per_s.png",
    ]
    for fig in figures.values():
        (ax,) = fig.axes  # one chart per figure
        assert ax.get_xscale() == "linear"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "16"]
        assert ax.get_ylim()[0] == 0


def _chromium(url: str, profile: Path, *extra: str) -> str:
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--virtual-time-budget=12000",
        f"--user-data-dir={profile}",
        *extra,
        url,
    ]
    return subprocess.run(flags, capture_output=True, text=True, timeout=180).stdout


@pytest.mark.integration
@pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs chromium (apt-get install -y chromium; .ci/run does)"
)
def test_the_runs_url_opens_the_classic_runs_table_with_the_named_runs(two_audits, mlflow_store, tmp_path):
    results, client = two_audits
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    url = results[0]["runs_url"]  # what the CLI prints: on the `mlflow ui` of ui_command, port 5000
    assert url == f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?workflowType=machine_learning"
    docs_before = {p.name: p.stat().st_mtime_ns for p in DOCS.iterdir()}
    port = _free_port()
    ui = _start(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "ui",
            "--backend-store-uri",
            mlflow_store[1],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        None,
        f"http://127.0.0.1:{port}/health",
        tmp_path / "ui.log",
    )
    try:
        here = url.replace("127.0.0.1:5000", f"127.0.0.1:{port}")
        dom = _chromium(here, tmp_path / "p1", "--dump-dom", "--window-size=1400,900")
        text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
        # the classic view ("Model training": Runs, Models, Model registry), not GenAI's, whose
        # side bar lists Overview, Traces, "Training runs" and "Evaluation runs"
        assert "Model registry" in text and "matching runs" in text, text[:2000]
        assert "Training runs" not in text and "Evaluation runs" not in text, text[:2000]
        names = [client.get_run(r["mlflow_run_id"]).info.run_name for r in results]
        assert all(name in text for name in names), text[:2000]
        assert "audit-default" not in text
        out = Path(os.environ.get("INFERMETER_DOCS_IMAGES") or tmp_path)
        shot = out / SCREENSHOT
        _chromium(here, tmp_path / "p2", f"--screenshot={shot}", "--window-size=1400,700")
        assert shot.stat().st_size > 20_000
    finally:
        _stop(ui)
    if not os.environ.get("INFERMETER_DOCS_IMAGES"):  # a test run leaves the tree as it found it
        assert {p.name: p.stat().st_mtime_ns for p in DOCS.iterdir()} == docs_before
