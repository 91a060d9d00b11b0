"""`infermeter compare` over a real MLflow store: the table, deltas, CSV, markdown, plot."""

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from tasks.report.compare import comparison_frame
from tasks.tracking import Tracker

BIN = Path(sys.executable).parent / "infermeter"


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker("cmp", uri)
    ids = []
    for name, ttft, tps in (("a", 100.0, 50.0), ("b", 150.0, 40.0), ("c", 80.0, 60.0)):
        run = tracker.start_run(name, tags={"flow": "audit", "model": "gguf:default"})
        tracker.log_metrics(run, {"ttft_ms_p50": ttft, "output_tokens_per_s": tps})
        tracker.end_run(run)
        ids.append(run)
    return uri, tracker, ids


def test_changes_are_against_the_first_run(store):
    _, tracker, ids = store
    frame = comparison_frame(tracker.runs_by_id(ids), ["ttft_ms_p50", "output_tokens_per_s"])
    assert frame["name"].to_list() == ["a", "b", "c"]
    assert frame["ttft_ms_p50_change_pct"].to_list() == pytest.approx([0.0, 50.0, -20.0])
    assert frame["output_tokens_per_s_change_pct"].to_list() == pytest.approx([0.0, -20.0, 20.0])
    assert frame["model"].to_list() == ["gguf:default"] * 3


def _cli(args, uri):
    return subprocess.run(
        [str(BIN), "compare", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
        timeout=120,
    )


def test_cli_writes_csv_markdown_and_plot(store, tmp_path):
    uri, _, ids = store
    out = _cli(
        [
            *ids,
            "--experiment",
            "cmp",
            "--metrics",
            "ttft_ms_p50",
            "--csv",
            str(tmp_path / "t.csv"),
            "--plot",
            str(tmp_path / "p.png"),
            "--markdown",
        ],
        uri,
    )
    assert out.returncode == 0, out.stderr
    assert "| ttft_ms_p50 | ttft_ms_p50_change_pct |" in out.stdout
    table = pl.read_csv(tmp_path / "t.csv")
    assert table["ttft_ms_p50"].to_list() == [100.0, 150.0, 80.0]
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_cli_searches_the_experiment_oldest_first(store):
    uri, _, _ = store
    out = _cli(["--experiment", "cmp", "--markdown", "--metrics", "ttft_ms_p50"], uri)
    assert out.returncode == 0, out.stderr
    body = [
        line
        for line in out.stdout.splitlines()
        if line.startswith("| ") and "run_id" not in line and "---" not in line
    ]
    assert [line.split("|")[2].strip() for line in body] == ["a", "b", "c"]


def test_cli_unknown_metric_exits_2_naming_it(store):
    uri, _, _ = store
    out = _cli(
        [
            "--experiment",
            "cmp",
            "--filter",
            "attributes.status = 'FINISHED'",
            "--metrics",
            "ttft_ms_p50,foo_ms",
        ],
        uri,
    )
    assert out.returncode == 2 and "foo_ms not logged" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_cli_unknown_run_exits_2(store):
    uri, _, _ = store
    out = _cli(["0" * 32], uri)
    assert out.returncode == 2 and "not found" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
