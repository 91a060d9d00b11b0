"""Pre-flight before the first level (issue 14, item 2): a wrong base URL path, a refused key,
a model the server does not serve and an unreachable ``hf:`` tokenizer exit 2 in seconds with
one line naming the setting and the fix. Against the ground-truth server (its ``http_401``
scenario answers 401, an unknown model 404) and the embedded llama.cpp server (real routes:
no ``/chat/completions`` without ``/v1``, a real ``/v1/models`` list, a real key check)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.endpoint.preflight import PreflightError, check_endpoint, check_hf_source

try:
    from tests import groundtruth_server as gt
except ImportError:  # run from tests/
    import groundtruth_server as gt

BIN = Path(sys.executable).parent / "infermeter"


@pytest.fixture(scope="module")
def server() -> Iterator[gt.GroundTruthServer]:
    with gt.serve() as handle:
        yield handle


@pytest.fixture(scope="module")
def llama() -> Iterator:
    from tasks.engines.server import embedded_server

    with embedded_server("gguf:default", api_key="right-key", n_ctx=512) as running:
        yield running


def _cli(
    args: list[str], tmp_path: Path, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    result = subprocess.run(
        [str(BIN), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "INFERMETER_WORK_DIR": str(tmp_path / "w"),
            **(env or {}),
        },
    )
    return result, time.monotonic() - began


def _one_line_exit_2(result: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:] + result.stdout[-2000:]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_refused_key_names_the_key_variable(server) -> None:
    with pytest.raises(PreflightError) as caught:
        check_endpoint(server.base_url, "http_401", "wrong", "MY_KEY")
    assert caught.value.setting == "api_key_env" and "MY_KEY" in caught.value.message
    assert "401" in caught.value.message


def test_unknown_model_names_the_model(server) -> None:
    with pytest.raises(PreflightError) as caught:
        check_endpoint(server.base_url, "no-such-model", None, None)
    assert caught.value.setting == "model" and "404" in caught.value.message


def test_a_good_endpoint_passes(server) -> None:
    check_endpoint(server.base_url, "ticks:3:5", None, None)  # no exception


def test_stream_cli_exits_2_in_seconds_on_a_refused_key(server, tmp_path) -> None:
    result, took_s = _cli(
        [
            "stream",
            "--base-url",
            server.base_url,
            "--model",
            "http_401",
            "--api-key-env",
            "MY_KEY",
            "--no-track",
        ],
        tmp_path,
        {"MY_KEY": "sk-wrong"},
    )
    _one_line_exit_2(result, "--api-key-env", "MY_KEY")
    assert "sk-wrong" not in result.stderr  # the key itself is never printed
    assert took_s < 30  # measured here: about 4 s, mostly the CLI's imports


def test_sweep_cli_exits_2_on_an_unknown_model(server, tmp_path) -> None:
    result, _ = _cli(["sweep", "--base-url", server.base_url, "--model", "nope", "--no-track"], tmp_path)
    _one_line_exit_2(result, "--model", "404")


def test_llama_base_url_without_v1_suggests_v1(llama, tmp_path) -> None:
    root = llama.base_url.removesuffix("/v1")
    with pytest.raises(PreflightError) as caught:
        check_endpoint(root, llama.model, "right-key", "K")
    assert caught.value.setting == "base_url" and f"try {root}/v1" in caught.value.message
    result, took_s = _cli(
        ["stream", "--base-url", root, "--model", llama.model, "--api-key-env", "K", "--no-track"],
        tmp_path,
        {"K": "right-key"},
    )
    _one_line_exit_2(result, "--base-url", "/v1")
    assert took_s < 30
    # with --api completions the probe (and so the 404 it names) is /completions
    with pytest.raises(PreflightError) as caught:
        check_endpoint(root, llama.model, "right-key", "K", api="completions")
    assert f"{root}/completions answered 404" in caught.value.message


def test_llama_wrong_key_and_unserved_model(llama) -> None:
    with pytest.raises(PreflightError) as caught:
        check_endpoint(llama.base_url, llama.model, "wrong-key", "K")
    assert caught.value.setting == "api_key_env"
    with pytest.raises(PreflightError) as caught:
        check_endpoint(llama.base_url, "gpt-9", "right-key", "K")
    assert caught.value.setting == "model" and llama.model in caught.value.message
    check_endpoint(llama.base_url, llama.model, "right-key", "K")


def test_unreachable_hf_tokenizer_exits_2_in_seconds(server, tmp_path) -> None:
    """No hub here (offline) and no cache: one line, exit 2, in seconds (before: 71 s, two
    tracebacks, exit 1). HF_ENDPOINT points at a closed port so the test means the same on a
    machine that does reach the hub."""
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{gt.free_port()}", "HF_HOME": str(tmp_path / "hf")}
    result, took_s = _cli(
        ["stream", "--base-url", server.base_url, "--model", "ticks:3:5", "--tokenizer", "hf:org/not-here"],
        tmp_path,
        env,
    )
    _one_line_exit_2(result, "--tokenizer", "hf:org/not-here", "not in the local Hugging Face cache")
    assert took_s < 30


def test_hf_source_check_passes_local_folders_and_other_kinds(tmp_path) -> None:
    check_hf_source(f"hf:{tmp_path}", "model")
    check_hf_source("gguf:default", "model")


def _offline_hub(tmp_path: Path) -> dict[str, str]:
    """No hub (a closed port) and an empty cache: the same meaning on a machine that does reach
    huggingface.co."""
    return {"HF_ENDPOINT": f"http://127.0.0.1:{gt.free_port()}", "HF_HOME": str(tmp_path / "hf")}


def test_hf_model_that_is_not_local_exits_2_in_seconds(tmp_path) -> None:
    """`profile --model hf:ID` and a local sweep's `sweep.local_model: hf:ID`, neither cached
    nor reachable: one line, exit 2, in seconds (before: 32 s of download retries)."""
    result, took_s = _cli(
        ["profile", "--model", "hf:some-org/absent-model", "--no-track"], tmp_path, _offline_hub(tmp_path)
    )
    _one_line_exit_2(result, "--model", "hf:some-org/absent-model", "not in the local Hugging Face cache")
    assert took_s < 30
    config = tmp_path / "sweep.yaml"
    config.write_text("sweep:\n  target: local\n  local_model: hf:some-org/absent-model\n")
    result, took_s = _cli(["sweep", "--config", str(config), "--no-track"], tmp_path, _offline_hub(tmp_path))
    _one_line_exit_2(result, "sweep.local_model", "hf:some-org/absent-model", "not in the local")
    assert took_s < 30


def test_flows_run_the_preflight_without_the_cli(server, prefect_server, mlflow_store, workdir) -> None:
    """A stream or sweep flow launched from the Prefect UI (the flow function, no CLI) fails at
    once with the one line naming the config path, before any level or MLflow run."""
    from mlflow.tracking import MlflowClient

    from flows.stream import stream
    from flows.sweep import sweep
    from tasks.config import StreamFlowConfig, SweepFlowConfig

    client = MlflowClient()

    def runs() -> int:
        return len(client.search_runs([e.experiment_id for e in client.search_experiments()]))

    runs_before = runs()
    endpoint = {"base_url": server.base_url, "model": "nope"}
    before = len(server.stats()["requests"])
    began = time.monotonic()
    state = stream(StreamFlowConfig(endpoint=endpoint, name="preflight-stream"), return_state=True)
    assert state.is_failed() and time.monotonic() - began < 30
    assert "endpoint.model: the server answered 404 (unknown model 'nope')" in state.message, state.message
    assert len(server.stats()["requests"]) <= before + 1  # the one pre-flight request, no level

    # a refused key: the server's 401 on the one pre-flight request
    refused = {"base_url": server.base_url, "model": "http_401", "api_key_env": "INFERMETER_T14_KEY"}
    os.environ["INFERMETER_T14_KEY"] = "wrong"
    try:
        state = sweep(SweepFlowConfig(endpoint=refused), return_state=True)
    finally:
        os.environ.pop("INFERMETER_T14_KEY")
    assert state.is_failed() and "endpoint.api_key_env: the server answered 401" in state.message, (
        state.message
    )
    local = SweepFlowConfig(sweep={"target": "local", "local_model": "hf:some-org/absent-model"})
    os.environ.update(_offline_hub(workdir))
    try:
        state = sweep(local, return_state=True)
    finally:
        for name in ("HF_ENDPOINT", "HF_HOME"):
            os.environ.pop(name)
    assert state.is_failed() and "sweep.local_model: 'hf:some-org/absent-model' is not" in state.message
    assert runs() == runs_before  # each failed before its MLflow parent run


def test_completions_api_probes_the_completions_path(server) -> None:
    # `--api completions` streams /v1/completions: the pre-flight probes that path, so a server
    # serving only completions is not refused, and a missing /v1 names that path
    check_endpoint(server.base_url, "ticks:3:5", None, None, api="completions")  # no exception
    with pytest.raises(PreflightError) as caught:
        check_endpoint(server.base_url, "http_401", "wrong", "MY_KEY", api="completions")
    assert caught.value.setting == "api_key_env"


def test_a_static_file_server_is_not_an_openai_endpoint(tmp_path) -> None:
    # python's http.server answers GET /models with 404 and POST with 501: one line on base_url
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    web = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        with pytest.raises(PreflightError) as caught:
            check_endpoint(f"http://127.0.0.1:{port}/v1", "m", None, None)
        assert caught.value.setting == "base_url" and "501" in caught.value.message
    finally:
        web.terminate()
        web.wait(timeout=10)


def test_a_refused_key_echoed_by_the_server_never_reaches_the_message() -> None:
    from tasks.endpoint.preflight import _key_error

    body = '{"error": {"message": "invalid api key sk-test-0123456789"}}'
    error = _key_error(401, body, "MY_KEY", "sk-test-0123456789")
    assert "sk-test-0123456789" not in error.message and "***" in error.message
    assert error.setting == "api_key_env" and "MY_KEY" in error.message


# Issue 23, items 13 and 15: a tracking URI that cannot work and an hf: tokenizer that is not
# there fail every command in seconds, by the same check, before any stage starts.


def test_compare_against_a_dead_tracking_server_exits_2_in_seconds(tmp_path) -> None:
    """Before: about 4 minutes of MLflow retries, then a traceback."""
    uri = f"http://127.0.0.1:{gt.free_port()}"
    result, took_s = _cli(["compare"], tmp_path, {"MLFLOW_TRACKING_URI": uri})
    _one_line_exit_2(result, f"MLflow tracking server at {uri}/health does not answer", "MLFLOW_TRACKING_URI")
    assert took_s < 20


@pytest.mark.parametrize(
    "args", [["compare"], ["tokenize", "--text", "hi"], ["stream", "--num-requests", "1"]]
)
def test_a_tracking_uri_mlflow_cannot_open_exits_2_in_seconds(tmp_path, args) -> None:
    """``htp:/oops``: before, a long MLflow exception (after Prefect's start)."""
    result, took_s = _cli(args, tmp_path, {"MLFLOW_TRACKING_URI": "htp:/oops"})
    line = _one_line_exit_2(result, "MLFLOW_TRACKING_URI: 'htp:/oops': 'htp' is not a tracking store scheme")
    assert "sqlite:///" in line and "unset it" in line
    assert took_s < 20
    result, _ = _cli(args, tmp_path, {"MLFLOW_TRACKING_URI": "http:/oops"})
    _one_line_exit_2(result, "MLFLOW_TRACKING_URI: 'http:/oops' names no host; write http://HOST:PORT")


def test_tracking_uris_mlflow_can_open_pass(tmp_path) -> None:
    from tasks.endpoint.preflight_store import check_tracking_uri

    for uri in (
        f"sqlite:///{tmp_path}/mlflow.db",
        "postgresql+psycopg2://u:p@127.0.0.1:5432/mlflow",
        "mysql://h/db",
        "http://127.0.0.1:5000",
        "https://mlflow.example",
        str(tmp_path / "mlruns"),
        f"file://{tmp_path}/mlruns",
        "databricks",
    ):
        check_tracking_uri(uri)
    with pytest.raises(PreflightError) as caught:
        check_tracking_uri("htp:/oops")
    assert caught.value.setting == "tracking_uri"


def test_an_hf_tokenizer_that_is_not_there_exits_2_in_seconds(tmp_path) -> None:
    """`tokenize --tokenizers hf:ID` and an audit config naming it, neither cached nor
    reachable: one line, exit 2, in seconds, the same check as `stream --tokenizer` (before:
    48 s of hub retries; the audit ran every stage before failing)."""
    needle = "'hf:doesnotexist' is not in the local Hugging Face cache"
    result, took_s = _cli(
        ["tokenize", "--tokenizers", "cl100k_base,hf:doesnotexist", "--no-track"],
        tmp_path,
        _offline_hub(tmp_path),
    )
    line = _one_line_exit_2(result, needle)
    assert line.startswith("error: --tokenizers: 'hf:doesnotexist'"), line
    assert took_s < 30
    result, took_s = _cli(
        ["tokenize", "--tokenizers", "model", "--model", "hf:doesnotexist", "--no-track"],
        tmp_path,
        _offline_hub(tmp_path),
    )
    assert _one_line_exit_2(result, needle).startswith("error: --model: 'hf:doesnotexist'")
    config = tmp_path / "audit.yaml"
    config.write_text("tokenize:\n  tokenizers: [model, hf:doesnotexist]\n", encoding="utf-8")
    result, took_s = _cli(["audit", "--config", str(config), "--no-track"], tmp_path, _offline_hub(tmp_path))
    assert _one_line_exit_2(result, needle).startswith("error: tokenize.tokenizers: 'hf:doesnotexist'")
    assert took_s < 30
    config.write_text("profile:\n  model: hf:doesnotexist\n", encoding="utf-8")
    result, took_s = _cli(["audit", "--config", str(config), "--no-track"], tmp_path, _offline_hub(tmp_path))
    assert _one_line_exit_2(result, needle).startswith("error: profile.model: 'hf:doesnotexist'")
    assert took_s < 30


def test_settings_checked_moments_ago_are_not_checked_again() -> None:
    """The CLI checks its settings and then its flow does (it may come from the Prefect UI):
    against a server that takes connections and never answers, each check waited out its
    timeouts. Settings passed moments ago in the process are not checked again; other settings
    (another key) are."""
    import socket
    import threading
    from types import SimpleNamespace

    from tasks.endpoint.preflight import check_settings

    accepted: list[socket.socket] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def accept() -> None:  # takes every connection, answers none
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    endpoint = SimpleNamespace(
        base_url=f"http://127.0.0.1:{listener.getsockname()[1]}/v1",
        model="m",
        api_key_env=None,
        tokenizer=None,
    )
    try:
        check_settings(endpoint, timeout_s=0.3)  # no answer within the bound: left to the run
        first = len(accepted)
        check_settings(endpoint, timeout_s=0.3)
        assert first >= 2 and len(accepted) == first  # the TCP probe and the /models call, not again
        os.environ["PREFLIGHT_TEST_KEY"] = "k"
        check_settings(
            SimpleNamespace(**{**vars(endpoint), "api_key_env": "PREFLIGHT_TEST_KEY"}), timeout_s=0.3
        )
        assert len(accepted) > first  # other settings: checked
    finally:
        os.environ.pop("PREFLIGHT_TEST_KEY", None)
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()
