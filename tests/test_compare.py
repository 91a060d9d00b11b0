"""`infermeter compare` over a real MLflow store: the table, deltas, CSV, markdown, plot."""

import json
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


def _plain_cli(args, uri):
    """The command piped (rich's 80 columns, whatever the terminal running the tests)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [str(BIN), "compare", *args],
        capture_output=True,
        text=True,
        env={**env, "MLFLOW_TRACKING_URI": uri},
        timeout=120,
    )


@pytest.fixture
def sized_store(tmp_path):
    """Eight audits with byte counts and large latencies, each with a stage child run."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker("sized", uri)
    for i in range(8):
        run = tracker.start_run(f"r{i}", tags={"flow": "audit", "endpoint_kind": "llama.cpp"})
        tracker.log_metrics(
            run, {"weights_bytes": 7_372_800.0 + 1024 * i, "ttft_ms_p50": 11_423.9 + 1000.25 * i}
        )
        child = tracker.start_run("stream", parent_run_id=run, tags={"endpoint_kind": "llama.cpp"})
        tracker.log_metrics(child, {"ttft_ms_p50": 1.0})
        tracker.end_run(child)
        tracker.end_run(run)
    return uri


def test_cli_piped_prints_byte_counts_as_integers_and_never_cuts_a_figure(sized_store):
    out = _plain_cli(["--experiment", "sized", "--metrics", "weights_bytes,ttft_ms_p50"], sized_store)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "…" not in out.stdout and all(len(line) <= 80 for line in lines)
    [bytes_row] = [line for line in lines if "weights_bytes" in line]
    shown = bytes_row.strip("│ ").split("│")[1:]
    assert [cell.strip() for cell in shown] == [f"{7_372_800 + 1024 * i:,}" for i in range(len(shown))]
    [ttft_row] = [line for line in lines if "ttft_ms_p50" in line]
    assert [c.strip() for c in ttft_row.strip("│ ").split("│")[1:]] == [
        f"{11_423.9 + 1000.25 * i:,.3f}" for i in range(len(shown))
    ]
    # the runs that did not fit are named, last first left out, with the width that shows them
    note = " ".join(out.stdout[out.stdout.index("left out") :].split())  # wrapped at 80
    assert note.startswith("left out to fit 80 columns: ") and note.endswith("so does --json)")
    assert [label.split()[0] for label in note.split(": ", 1)[1].split(" (COLUMNS=")[0].split(", ")] == [
        f"r{i}" for i in range(len(shown), 8)
    ]
    markdown = _plain_cli(["--experiment", "sized", "--metrics", "weights_bytes", "--markdown"], sized_store)
    assert "| 7,372,800 |" in markdown.stdout and "7,372,800.000" not in markdown.stdout


def test_a_filter_finds_the_flows_own_runs_unless_children_are_asked_for(sized_store, tmp_path):
    flt = "tags.endpoint_kind = 'llama.cpp'"
    args = ["--experiment", "sized", "--filter", flt, "--max-runs", "20", "--metrics", "ttft_ms_p50"]
    out = _plain_cli([*args, "--json", str(tmp_path / "p.json")], sized_store)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["name"] for r in rows] == [f"r{i}" for i in range(8)]  # no stage runs, no blank bars
    out = _plain_cli([*args, "--children", "--json", str(tmp_path / "c.json")], sized_store)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert sorted(r["name"] for r in rows) == sorted([f"r{i}" for i in range(8)] + ["stream"] * 8)


def test_text_is_shown_whole_and_unlike_runs_are_named(tmp_path):
    """Issue 31: a model's name was cut to 20 characters and folded mid-word ("SmolLM2-135M
    -Instruc"), and a change between an audit on llama.cpp and a stream on vLLM was printed
    without a word. Now text wraps between its pieces, whole, and a note under the table (and
    ``unlike`` in --json) names what differs."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker("unlike", uri)
    model = "SmolLM2-135M-Instruct"
    for flow, engine, ttft in (("audit", "llama.cpp", 100.0), ("stream", "vllm", 80.0)):
        tags = {"flow": flow, "endpoint_kind": engine, "endpoint_model": model, "host": "bench-host-01"}
        run = tracker.start_run(f"{flow} 12-02 10:06:42 {engine} {model}", tags=tags)
        tracker.log_metrics(run, {"ttft_ms_p50": ttft})
        tracker.end_run(run)
    args = ["--experiment", "unlike", "--filter", "", "--metrics", "ttft_ms_p50"]
    out = _plain_cli([*args, "--json", str(tmp_path / "u.json")], uri)
    assert out.returncode == 0, out.stderr
    rows = [line.split(line[0])[2:4] for line in out.stdout.splitlines() if line and line[0] in "│┃"]
    for i in (0, 1):  # in the header and the rows, the model's name split after a hyphen, whole
        shown = [row[i].strip() for row in rows]
        assert shown.count("SmolLM2-135M-") == shown.count("Instruct") == 2 and "bench-host-01" in shown
    assert "Instruc " not in out.stdout and "…" not in out.stdout
    note = " ".join(out.stdout[out.stdout.index("note:") :].split())
    assert note == (
        "note: these runs differ in flow (audit, stream), engine (llama.cpp, vllm): a change between "
        "them measures that difference, not a regression or a gain of one setup"
    )
    assert json.loads((tmp_path / "u.json").read_text())["unlike"] == {
        "flow": ["audit", "stream"],
        "engine": ["llama.cpp", "vllm"],
    }
    alike = _plain_cli(["--experiment", "unlike", "--metrics", "ttft_ms_p50"], uri)  # the audit alone
    assert alike.returncode == 0 and "note:" not in alike.stdout, alike.stderr
