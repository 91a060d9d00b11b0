"""`infermeter tune` (issue 20): the grid and its checks, the front, and whole runs.

Whole runs go through the command a user types, against a real MLflow store: a user's own
server (``--serve-cmd``: tests/tune_server.py, the ground-truth instrument behind a command line
whose parameters change its startup or make it crash), and the embedded llama.cpp engine with
two thread counts. The engine's own argument parser judges the parameters (llama.cpp's here;
vLLM's where ``.venv-vllm`` is installed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks.tune import argcheck
from tasks.tune.front import TunePoint, best, pareto
from tasks.tune.grid import (
    TuneInputError,
    check_count,
    configuration_key,
    expand,
    generic_flags,
    parse_server_params,
    scalar,
)
from tasks.tune.serve import command_line

BIN = Path(sys.executable).parent / "infermeter"
TUNE_SERVER = Path(__file__).parent / "tune_server.py"
SERVE_CMD = f"{sys.executable} {TUNE_SERVER} --port {{port}} {{params}}"
#: the instrument's scenario: 4 tokens, gaps 5 ms (no load slope), TTFT 10 ms
MODEL = "load:4:5:0:10"
WORKLOAD = ["--num-requests", "4", "--warmup", "1", "--max-tokens", "4", "--max-concurrency", "1,2"]


# the grid ---------------------------------------------------------------------------------


def test_server_params_read_as_yaml_scalars_and_expand_in_order() -> None:
    grid = parse_server_params(
        ["max_num_seqs=1,4", "enable_chunked_prefill=true,false", "kv_cache_dtype=fp8"]
    )
    assert grid == {
        "max_num_seqs": [1, 4],
        "enable_chunked_prefill": [True, False],
        "kv_cache_dtype": ["fp8"],
    }
    assert [scalar(t) for t in ("0.5", "16", "False", "auto")] == [0.5, 16, False, "auto"]
    sets = expand(grid, None)
    assert sets == [
        {"max_num_seqs": 1, "enable_chunked_prefill": True, "kv_cache_dtype": "fp8"},
        {"max_num_seqs": 1, "enable_chunked_prefill": False, "kv_cache_dtype": "fp8"},
        {"max_num_seqs": 4, "enable_chunked_prefill": True, "kv_cache_dtype": "fp8"},
        {"max_num_seqs": 4, "enable_chunked_prefill": False, "kv_cache_dtype": "fp8"},
    ]
    explicit = [{"max_num_seqs": 1}, {"max_num_seqs": 8, "enable_chunked_prefill": False}]
    assert expand(None, explicit) == explicit


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["max_num_seqs"], "NAME=V1,V2"),
        (["=1,2"], "NAME=V1,V2"),
        (["max_num_seqs="], "no values"),
        (["a=1", "a=2"], "given twice"),
    ],
)
def test_bad_server_params_name_the_parameter(options, words) -> None:
    with pytest.raises(TuneInputError, match=words):
        parse_server_params(options)


def test_empty_both_and_too_many_are_refused() -> None:
    with pytest.raises(TuneInputError, match="grid is empty"):
        expand({}, None)
    with pytest.raises(TuneInputError, match="not both"):
        expand({"a": [1]}, [{"a": 2}])
    with pytest.raises(TuneInputError, match="server_params.a"):
        expand({"a": []}, None)
    with pytest.raises(TuneInputError, match="65 configurations exceed .* --yes"):
        check_count(65, 64, yes=False)
    check_count(65, 64, yes=True)
    check_count(64, 64, yes=False)


def test_llamacpp_parser_spells_and_judges_the_flags() -> None:
    ok, unknown, wrong, switch, reserved = argcheck.check(
        "llamacpp",
        [
            {"n_threads": 2, "flash_attn": True},
            {"n_thread": 2},
            {"n_batch": "many"},
            {"use_mmap": "maybe"},
            {"port": 1},
        ],
    )
    assert ok == {"flags": ["--n_threads", "2", "--flash_attn", "True"], "error": None}
    assert "'n_thread'" in unknown["error"] and "did you mean n_threads" in unknown["error"]
    assert wrong["error"] == "argument --n_batch: invalid int value: 'many'"
    assert "--use_mmap" in switch["error"]
    assert "infermeter sets it itself" in reserved["error"]


def test_a_user_commands_flags_and_template() -> None:
    flags = generic_flags(
        {"max_num_seqs": 4, "enable_chunked_prefill": False, "enforce_eager": True, "x": [1, 2]}
    )
    assert flags == ("--max-num-seqs", "4", "--no-enable-chunked-prefill", "--enforce-eager", "--x", "1", "2")
    assert command_line("vllm serve {model} --port {port} {params}", "my model", 8123, ("--a", "b c")) == [
        "vllm", "serve", "my model", "--port", "8123", "--a", "b c",
    ]  # fmt: skip


def test_the_key_follows_every_setting_that_shapes_the_measurement() -> None:
    base = configuration_key({"max_num_seqs": 4}, {"stream": {"num_requests": 10}})
    assert base == configuration_key({"max_num_seqs": 4}, {"stream": {"num_requests": 10}})
    assert base != configuration_key({"max_num_seqs": 8}, {"stream": {"num_requests": 10}})
    assert base != configuration_key({"max_num_seqs": 4}, {"stream": {"num_requests": 11}})


# the front --------------------------------------------------------------------------------


def _p(conf, tput, user, ttft, good=None, frac=None) -> TunePoint:
    return TunePoint(conf, f"c{conf}", 0, 1, None, tput, user, ttft, good, frac)


def test_pareto_keeps_exactly_the_undominated_points() -> None:
    points = [
        _p(0, 100, 50, 900),
        _p(1, 200, 30, 400),
        _p(2, 150, 20, 1000),
        _p(3, 300, 10, 2000),
        _p(4, None, 99, 1),
    ]
    front = pareto(points)
    assert [p.configuration for p in front] == [0, 1, 3]  # 2 is beaten by 1 on both axes; 4 has no throughput
    assert [p.configuration for p in pareto(points, "ttft_ms_p99")] == [1, 3]  # less TTFT is better
    tie = [_p(0, 100, 50, 1), _p(1, 100, 50, 1)]
    assert len(pareto(tie)) == 2  # neither strictly better


def test_best_is_the_highest_goodput_among_levels_meeting_the_target() -> None:
    points = [
        _p(0, 100, 50, 900, good=4.0, frac=1.0),
        _p(1, 300, 10, 2000, good=6.0, frac=0.9),
        _p(2, 200, 30, 400, good=5.0, frac=0.96),
    ]
    chosen = best(points, {"ttft_ms": 1000}, target=0.95)
    assert chosen.point.configuration == 2 and "ttft_ms <= 1000" in chosen.reason
    assert best(points, {"ttft_ms": 1000}, target=0.99).point.configuration == 0
    none = best(points, {"ttft_ms": 1}, target=1.01)
    assert none.point is None and "no level" in none.reason
    no_slos = best(points, None, 0.95)
    assert no_slos.point.configuration == 1 and "no SLOs" in no_slos.reason


# whole runs through the command ------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "INFERMETER_WORK_DIR": str(tmp_path / "work"),
    }


def _tune(tmp_path: Path, *options: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN), "tune", *options], capture_output=True, text=True, timeout=timeout, env=_env(tmp_path)
    )


@pytest.fixture(scope="module")
def own_server_run(tmp_path_factory):
    """Three configurations of a user's own server (one crashes), run twice: the second resumes."""
    tmp = tmp_path_factory.mktemp("tune-own")
    config = tmp / "tune.yaml"
    config.write_text(
        "tune:\n"
        f"  serve_cmd: '{SERVE_CMD}'\n"
        "  configurations:\n"
        "    - {startup_delay_s: 0}\n"
        "    - {startup_delay_s: 0.6}\n"
        "    - {crash: true}\n"
        "endpoint: {tokenizer: 'gguf:default'}\n"
        "server: {startup_timeout_s: 30}\n",
        encoding="utf-8",
    )
    options = ["--config", str(config), "--model", MODEL, *WORKLOAD, "--goodput", "ttft_ms:5000"]
    first = _tune(tmp, *options, "--json", str(tmp / "first.json"))
    second = _tune(tmp, *options, "--json", str(tmp / "second.json"))
    return tmp, first, second


def test_each_configuration_is_measured_and_a_crash_is_recorded_and_skipped(own_server_run) -> None:
    tmp, first, _ = own_server_run
    assert first.returncode == 0, first.stderr[-3000:]
    data = json.loads((tmp / "first.json").read_text())
    assert set(data) == {"configurations", "best", "pareto", "mlflow_run_id"}
    confs = data["configurations"]
    assert [c["status"] for c in confs] == ["FINISHED", "FINISHED", "FAILED"]
    assert [c["server_params"] for c in confs] == [
        {"startup_delay_s": 0},
        {"startup_delay_s": 0.6},
        {"crash": True},
    ]
    assert confs[1]["server_startup_s"] - confs[0]["server_startup_s"] > 0.5  # the delay it was given
    assert confs[2]["server_startup_s"] is None
    assert "exited with code 3" in confs[2]["error"] and "crashing before it is healthy" in confs[2]["error"]
    for conf in confs[:2]:
        assert [lv["max_concurrency"] for lv in conf["levels"]] == [1, 2]
        assert all(lv["metrics"]["num_succeeded"] == 4 for lv in conf["levels"])
    assert data["best"]["point"]["configuration"] in (0, 1) and data["best"]["server_params"]
    assert data["pareto"]["per_user_tokens_per_s"]
    assert "configuration 2 (crash=true) FAILED" in first.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    parent = client.get_run(data["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert (
        parent.data.metrics["tune_configurations"] == 3
        and parent.data.metrics["tune_configurations_failed"] == 1
    )
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"tune.csv", "tune.json", "summary.md"} <= artifacts
    assert "plots/tune_pareto.png" in {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    experiment = [parent.info.experiment_id]
    children = client.search_runs(
        experiment,
        f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        order_by=["params.configuration_index"],
    )
    assert [c.info.status for c in children] == ["FINISHED", "FINISHED", "FAILED"]
    assert children[1].data.params["startup_delay_s"] == "0.6"
    assert children[1].data.tags["server_flags"] == "--startup-delay-s 0.6"
    assert children[1].data.metrics["server_startup_s"] == pytest.approx(confs[1]["server_startup_s"])
    assert "server_log_tail.txt" in {a.path for a in client.list_artifacts(children[2].info.run_id)}
    stage = client.search_runs(experiment, f"tags.mlflow.parentRunId = '{children[0].info.run_id}'")
    assert len(stage) == 1  # the stream stage, and its two levels below it
    levels = client.search_runs(experiment, f"tags.mlflow.parentRunId = '{stage[0].info.run_id}'")
    assert len(levels) == 2


def test_a_second_run_resumes_the_finished_configurations(own_server_run) -> None:
    tmp, first, second = own_server_run
    assert second.returncode == 0, second.stderr[-3000:]
    before = json.loads((tmp / "first.json").read_text())["configurations"]
    after = json.loads((tmp / "second.json").read_text())["configurations"]
    assert [c["resumed"] for c in after] == [True, True, False]  # a FAILED one is tried again
    assert [c["mlflow_run_id"] for c in after[:2]] == [c["mlflow_run_id"] for c in before[:2]]
    assert after[0]["levels"] == before[0]["levels"]
    assert second.stdout.count("(resumed)") == 4  # two levels each


def test_a_killed_tune_leaves_no_server_and_resumes(tmp_path: Path) -> None:
    """SIGKILL of the command while the second configuration's server starts: the lifeline
    stops that server; the same command again reads the first configuration back from MLflow
    and measures only the second."""
    command = [str(BIN), "tune", "--serve-cmd", SERVE_CMD, "--model", MODEL, "--tokenizer", "gguf:default",
               "--server-param", "startup_delay_s=0,6", *WORKLOAD[:6], "--json", str(tmp_path / "t.json")]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(tmp_path))
    try:
        server = None
        deadline = time.monotonic() + 180
        while server is None and time.monotonic() < deadline and proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "--startup-delay-s 6" in " ".join(child.cmdline()):
                        server = child
            time.sleep(0.1)
        assert server is not None, "the second configuration's server never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs([server], timeout=15)
        assert not alive, f"server {server.pid} outlived the killed command"
    finally:
        if proc.poll() is None:
            proc.kill()
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    confs = json.loads((tmp_path / "t.json").read_text())["configurations"]
    assert [(c["status"], c["resumed"]) for c in confs] == [("FINISHED", True), ("FINISHED", False)]
    assert confs[1]["server_startup_s"] > 6


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ([], "grid is empty"),
        (["--server-param", "n_thread=1"], "did you mean n_threads"),
        (["--server-param", "n_threads=abc"], "argument --n_threads: invalid int value: 'abc'"),
        (["--server-param", "n_batch=8,16,32", "--max-configurations", "2"], "3 configurations exceed"),
        (["--server-param", "port=1"], "infermeter sets it itself"),
        (["--serve-cmd", "myserver --port 8000", "--server-param", "a=1"], "serve_cmd needs {port}"),
        (["--server-param", "n_threads=1", "--capacity"], "--capacity: the capacity search needs SLOs"),
    ],
)
def test_bad_input_exits_2_before_any_server_starts(tmp_path: Path, options, words) -> None:
    proc = _tune(tmp_path, *options, "--no-track", timeout=120)
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-1000:])
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_the_embedded_llamacpp_engine_with_two_thread_counts(tmp_path: Path) -> None:
    proc = _tune(
        tmp_path, "--server-param", "n_threads=1,2", "--num-requests", "3", "--warmup", "1",
        "--max-tokens", "8", "--json", str(tmp_path / "t.json"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    confs = json.loads((tmp_path / "t.json").read_text())["configurations"]
    assert [c["status"] for c in confs] == ["FINISHED", "FINISHED"]
    assert [c["server_flags"] for c in confs] == [["--n_threads", "1"], ["--n_threads", "2"]]
    assert all(0 < c["server_startup_s"] < 120 for c in confs)
    assert all(c["levels"][0]["metrics"]["num_succeeded"] == 3 for c in confs)
