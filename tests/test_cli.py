"""The console script as a user runs it: exit codes, one-line errors, --json, the server."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent / "infermeter"


def _run(args, env=None, timeout=300):
    return subprocess.run(
        [str(BIN), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_config_error_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stream:\n  max_concurrency: [0]\n", encoding="utf-8")
    result = _run(["audit", "--config", str(bad)])
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "stream.max_concurrency" in lines[0]
    assert "Traceback" not in result.stderr


def test_missing_config_file_exits_2(tmp_path):
    result = _run(["audit", "--config", str(tmp_path / "absent.yaml")])
    assert result.returncode == 2 and "file not found" in result.stderr


def test_no_track_json_has_null_run_id(tmp_path):
    cfg = tmp_path / "tok.yaml"
    cfg.write_text(
        "tokenize: {prompts: [smart, smarter, token, tokenization]}\nprofile: {enabled: false}\n"
        "stream: {enabled: false}\nsweep: {enabled: false}\n",
        encoding="utf-8",
    )
    out = tmp_path / "out.json"
    result = _run(
        ["audit", "--config", str(cfg), "--no-track", "--json", str(out)],
        env={"PREFECT_HOME": str(tmp_path / "prefect"), "INFERMETER_WORK_DIR": str(tmp_path / "w")},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["mlflow_run_id"] is None
    rows = data["stages"]["tokenize"]["rows"]
    assert [r["text"] for r in rows] == ["smart", "smarter", "token", "tokenization"]
    # the seed's probes under SmolLM2: 'smart' and 'smarter' share no token ...
    assert rows[0]["pieces"] == ["smart"] and rows[1]["pieces"] == ["s", "mar", "ter"]
    assert not set(rows[0]["ids"]) & set(rows[1]["ids"])
    # ... while 'tokenization' is 'token' + 'ization'
    assert rows[3]["pieces"] == ["token", "ization"] and rows[3]["ids"][0] == rows[2]["ids"][0]
    assert rows[3]["chars_per_token"] == 6.0
    assert set(data) == {"stages", "headline", "errors", "regression", "mlflow_run_id"}


def test_server_prints_base_url_serves_and_stops_on_sigterm():
    proc = subprocess.Popen([str(BIN), "server"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base_url = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and base_url is None:
            line = proc.stdout.readline()
            if line.startswith("base_url:"):
                base_url = line.split(":", 1)[1].strip()
            elif not line and proc.poll() is not None:
                break
        assert base_url and base_url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{base_url}/models", timeout=10) as response:
            models = json.load(response)
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the llama.cpp server should run as a child"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when the block ends


def test_tracking_server_down_is_one_line_naming_the_url():
    url = f"http://127.0.0.1:{_closed_port()}"
    result = _run(["audit", "--config", "configs/smoke.yaml"], env={"MLFLOW_TRACKING_URI": url})
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and url in result.stderr
    assert "Traceback" not in result.stderr


def test_prefect_api_down_is_one_line_naming_the_url():
    url = f"http://127.0.0.1:{_closed_port()}/api"
    result = _run(["serve"], env={"PREFECT_API_URL": url})
    assert result.returncode == 2 and url in result.stderr and "Traceback" not in result.stderr


def test_an_unwritable_json_path_exits_2_before_the_run(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x", encoding="utf-8")
    for path, needle in ((tmp_path, "is a folder"), (a_file / "out.json", "is a file")):
        started = time.monotonic()
        result = _run(["tokenize", "--text", "hi", "--no-track", "--json", str(path)])
        assert result.returncode == 2 and needle in result.stderr, result.stderr[-2000:]
        assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
        assert time.monotonic() - started < 60  # before the run: no model load, no Prefect start


def test_tracking_server_down_is_one_line_for_every_command():
    url = f"http://127.0.0.1:{_closed_port()}"
    result = _run(["tokenize", "--text", "hi"], env={"MLFLOW_TRACKING_URI": url}, timeout=120)
    assert result.returncode == 2 and url in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr


def test_a_tracked_command_prints_the_runs_table_url_and_names_its_run_by_when_first(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        "MLFLOW_TRACKING_URI": uri,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "INFERMETER_WORK_DIR": str(tmp_path / "w"),
    }
    out = tmp_path / "out.json"
    result = _run(["tokenize", "--text", "hi", "--tokenizers", "model", "--json", str(out)], env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("infermeter").experiment_id
    lines = result.stdout.splitlines()
    assert f"Open the UI: .venv/bin/mlflow ui --backend-store-uri {uri} --port 5000" in lines
    # MLflow 3 opens an experiment on GenAI's traces; this URL opens its runs table, classic view
    url = f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?workflowType=machine_learning"
    assert f"Runs table: {url}" in lines, result.stdout
    run = client.get_run(json.loads(out.read_text())["mlflow_run_id"])
    # what differs between runs first: "tokenize 12-01 10:41:07 SmolLM2-135M-Instruct"
    assert re.fullmatch(r"tokenize \d\d-\d\d \d\d:\d\d:\d\d SmolLM2-135M-Instruct", run.info.run_name)
    assert run.data.tags["config_name"] == "tokenize"


def test_a_failed_stream_says_how_many_requests_finished_before_it_and_where(tmp_path):
    from flows.commands.stream import failure_message

    error = "RuntimeError: client process 0 died"
    assert failure_message(error, tmp_path) == f"stream failed: {error}; no request finished before it"
    (tmp_path / "requests.jsonl").write_text("", encoding="utf-8")  # opened, nothing written
    assert failure_message(error, tmp_path).endswith("; no request finished before it")
    (tmp_path / "requests.jsonl").write_text('{"request_id": "a"}\n{"request_id": "b"}\n', encoding="utf-8")
    assert failure_message(error, tmp_path) == (
        f"stream failed: {error}; 2 requests finished before it, kept in {tmp_path / 'requests.jsonl'}"
    )
