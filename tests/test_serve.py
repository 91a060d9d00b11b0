"""`infermeter serve` against a real Prefect server and a real MLflow tracking server: the
deployments' typed parameter forms, and a run launched through the REST API with overridden
parameters landing in MLflow with exactly those parameters."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent / "infermeter"


def _api(base, path, body=None, retries=5):
    """One REST call; 503 is retried with backoff, as Prefect's own client does: the server sends
    it for retryable errors such as a locked SQLite database on a busy machine."""
    data = None if body is None else json.dumps(body).encode()
    for attempt in range(retries + 1):
        request = urllib.request.Request(
            f"{base}{path}",
            data=data,
            method="POST" if data else "GET",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            if error.code != 503 or attempt == retries:
                raise
            time.sleep(2**attempt)


@pytest.fixture(scope="module")
def served(prefect_api, mlflow_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve")
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "MLFLOW_TRACKING_URI": mlflow_server[0],
        "INFERMETER_WORK_DIR": str(logs / "work"),
    }
    log = open(logs / "serve.log", "wb")
    # the session's Prefect server may hold deployments of these names from another test (a work
    # pool's): wait for this process's own, registered from now on
    started = datetime.now(UTC)
    proc = subprocess.Popen(
        [str(BIN), "serve", "--config", "configs/smoke.yaml", "--cron", "0 3 * * *"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, (logs / "serve.log").read_text()[-3000:]
            names = {
                d["name"]
                for d in _api(prefect_api, "/deployments/filter", {})
                if datetime.fromisoformat(d["updated"]) >= started
            }
            if names >= {"audit", "stream", "profile", "sweep", "tokenize", "capacity", "tune"}:
                break
            time.sleep(1)
        else:
            pytest.fail("deployments never appeared: " + (logs / "serve.log").read_text()[-3000:])
        yield prefect_api, mlflow_server[0], logs
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_audit_deployment_renders_a_typed_form(served):
    api, _, _ = served
    deployment = _api(api, "/deployments/name/audit/audit")
    schema = deployment["parameter_openapi_schema"]
    assert "config" in schema["properties"]
    definitions = schema.get("definitions") or schema.get("$defs")
    stream = definitions["StreamConfig"]["properties"]
    assert stream["max_concurrency"]["description"] == "Concurrency levels."
    assert definitions["SweepConfig"]["properties"]["samples"]["description"].startswith("Samples per point")
    # the served config's values are the form's defaults, and the audit runs nightly
    assert deployment["parameters"]["config"]["name"] == "audit-smoke"
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 3 * * *"]
    assert _api(api, "/deployments/name/sweep/sweep")["schedules"] == []


def test_tune_deployment_renders_its_grid_form(served):
    """`infermeter tune` from the Prefect UI (issue 20): the grid, the list, the server command
    and the workload are typed fields of the form, with the config's defaults."""
    api, _, _ = served
    deployment = _api(api, "/deployments/name/tune/tune")
    schema = deployment["parameter_openapi_schema"]
    definitions = schema.get("definitions") or schema.get("$defs")
    tune = definitions["TuneConfig"]["properties"]
    assert {
        "server_params",
        "configurations",
        "serve_cmd",
        "max_configurations",
        "resume",
        "capacity",
    } <= set(tune)
    assert tune["max_configurations"]["default"] == 64 and tune["server_params"]["type"] == "object"
    assert set(definitions["TuneFlowConfig"]["properties"]) >= {"tune", "stream", "server", "capacity"}


def _wait_for(api, flow_run_id, logs, timeout_s=420):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _api(api, f"/flow_runs/{flow_run_id}")["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(2)
    return "TIMEOUT: " + (logs / "serve.log").read_text()[-4000:]


def test_sweep_run_with_overridden_parameters_lands_in_mlflow(served):
    from mlflow.tracking import MlflowClient

    api, tracking_uri, logs = served
    deployment = _api(api, "/deployments/name/sweep/sweep")
    assert "config" in deployment["parameter_openapi_schema"]["properties"]
    config = {
        "name": "served-sweep",
        "sweep": {
            "prompt": "Name a colour.",
            "temperature": [0.0],
            "top_p": [1.0, 0.5],
            "samples": 2,
            "max_tokens": 4,
            "seed": 7,
        },
        "tracking": {"experiment": "served"},
    }
    flow_run = _api(
        api, f"/deployments/{deployment['id']}/create_flow_run", {"parameters": {"config": config}}
    )
    state = _wait_for(api, flow_run["id"], logs)
    assert state == "COMPLETED", (
        state if state.startswith("TIMEOUT") else (logs / "serve.log").read_text()[-4000:]
    )
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("served")
    parents = client.search_runs([experiment.experiment_id], filter_string="tags.flow = 'sweep'")
    assert len(parents) == 1
    parent = parents[0]
    assert parent.data.tags["config_name"] == "served-sweep"
    assert re.fullmatch(
        r"sweep \d\d-\d\d \d\d:\d\d:\d\d llama\.cpp SmolLM2-135M-Instruct", parent.info.run_name
    )
    assert parent.data.tags["prefect_flow_run_id"] == flow_run["id"]
    assert parent.data.params["sweep.samples"] == "2" and parent.data.params["sweep.seed"] == "7"
    assert parent.data.params["sweep.top_p"] == "[1.0, 0.5]"
    points = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'sweep_point'")
    assert sorted(p.data.params["top_p"] for p in points) == ["0.5", "1.0"]
    assert all(p.data.params["temperature"] == "0.0" for p in points)


CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parent.parent / "out" / "screenshots"


def _browse(url: str, tmp_path: Path, screenshot: Path | None = None) -> str:
    """Headless Chromium: the DOM of `url` after 8 s of virtual time (and a screenshot)."""
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--virtual-time-budget=8000",
        "--window-size=1400,1000",
    ]
    profile = tmp_path / f"chrome-{len(list(tmp_path.iterdir()))}"
    dom = subprocess.run(
        [*flags, f"--user-data-dir={profile}", "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [*flags, f"--user-data-dir={profile}-shot", f"--screenshot={screenshot}", url],
            capture_output=True,
            timeout=120,
        )
    return dom


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs Debian's chromium: apt-get install -y chromium (.ci/run does)"
)
def test_browser_sees_runs_in_mlflow_and_the_form_in_prefect(served, tmp_path):
    from mlflow.tracking import MlflowClient

    api, tracking_uri, _ = served
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("served")
    if experiment is None:  # this test run alone: make a run to look at
        from tasks.tracking import Tracker

        tracker = Tracker("served", tracking_uri)
        tracker.end_run(tracker.start_run("served-sweep"))
        experiment = client.get_experiment_by_name("served")
    dom = _browse(
        f"{tracking_uri}/#/experiments/{experiment.experiment_id}/runs",
        tmp_path,
        SCREENSHOTS / "mlflow_experiment.png",
    )
    names = [r.info.run_name for r in client.search_runs([experiment.experiment_id], max_results=5)]
    assert any(name in dom for name in names), names  # "sweep <mm-dd hh:mm:ss> llama.cpp SmolLM2-..."

    deployment = _api(api, "/deployments/name/sweep/sweep")
    ui = api.removesuffix("/api")
    dom = _browse(
        f"{ui}/deployments/deployment/{deployment['id']}/run",
        tmp_path,
        SCREENSHOTS / "prefect_deployment_form.png",
    )
    for field in ("temperature", "top p", "samples", "seed", "max tokens"):
        assert field in dom.lower(), f"form field {field} not rendered"
    assert (SCREENSHOTS / "prefect_deployment_form.png").stat().st_size > 10_000


def test_the_docs_prefect_ui_on_another_port_calls_that_port(tmp_path):
    """The serve page's line (docs/commands/serve.md; the README's until issue 51) for a Prefect UI on a port other than 4200, run as written (on a free
    port): the UI's settings name that port's API; without PREFECT_UI_API_URL they name 4200."""
    from conftest import _free_port, _start, _stop

    page = Path(__file__).resolve().parent.parent / "docs" / "commands" / "serve.md"
    [line] = re.findall(
        r"`(PREFECT_UI_API_URL=\S+ \.venv/bin/prefect server start --port \d+)`",
        page.read_text(encoding="utf-8"),
    )
    setting, command = line.split(" ", 1)
    readme_port = command.rsplit(" ", 1)[1]
    port = str(_free_port())
    api = setting.split("=", 1)[1].replace(readme_port, port)
    assert api == f"http://127.0.0.1:{port}/api"
    prefect = [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    base.update({"PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    for env, expected in (({**base, "PREFECT_UI_API_URL": api}, api), (base, "http://127.0.0.1:4200/api")):
        proc = _start(
            [*prefect, "--port", port], env, f"http://127.0.0.1:{port}/api/health", tmp_path / "s.log"
        )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=30) as response:
                assert json.load(response)["api_url"] == expected
        finally:
            _stop(proc)
