"""Audits that fail loudly, and flags a new user got wrong (issue 49): an audit whose stream error
rate is over ``regression.max_error_rate`` fails and never becomes a baseline; thresholds merge
with the defaults and keep their sign; ``history --run`` of another experiment; a tracking store
MLflow cannot open; empty items of a comma list; a burstiness that cannot apply. Every bad input
exits 2 with one line naming the field or flag and the fix."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tasks.config import (
    AuditConfig,
    CapacityFlowConfig,
    ConfigError,
    RegressionConfig,
    StreamConfig,
    StreamFlowConfig,
    load_config,
)
from tasks.metrics import DEFAULT_THRESHOLDS_PCT
from tasks.tracking import Tracker
from tasks.wire.errors import error_rate_exceeded

BIN = Path(sys.executable).parent / "infermeter"


def _run(args: list, tmp_path: Path, store: str | None = None, timeout: int = 120, **env: str):
    return subprocess.run(
        [str(BIN), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            **os.environ,
            "MLFLOW_TRACKING_URI": store or f"sqlite:///{tmp_path / 'mlflow.db'}",
            "PREFECT_HOME": os.environ.get("PREFECT_HOME", str(tmp_path / "prefect")),
            "INFERMETER_WORK_DIR": str(tmp_path / "w"),
            **env,
        },
    )


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


# 1. an audit over its error rate -----------------------------------------------------------


def _level(records: list[tuple[bool, str | None, str | None]], concurrency: int = 4, rate=None) -> dict:
    """A level dict as ``Level.to_dict()`` has it: (warmup, error class, message) per request."""
    return {
        "max_concurrency": concurrency,
        "request_rate": rate,
        "metrics": {},
        "requests": [
            {"warmup": warmup, "error": None if kind is None else {"class": kind, "message": message}}
            for warmup, kind, message in records
        ],
    }


def test_error_rate_exceeded_names_the_level_and_its_first_distinct_errors() -> None:
    ok = (False, None, None)
    clean = _level([ok] * 10, concurrency=1)
    assert error_rate_exceeded([clean], 0.05) is None
    # warm-up failures are not measured: 0 of 10
    assert error_rate_exceeded([_level([(True, "server", "x")] * 5 + [ok] * 10)], 0.05) is None
    # at the limit is not over it: 1 of 20 = 0.05
    assert error_rate_exceeded([_level([(False, "timeout", "t")] + [ok] * 19)], 0.05) is None
    errors = [
        (False, "server", "HTTP 500: server error. Server said: boom"),
        (False, "timeout", "timed out\n waiting"),
        (False, "server", "HTTP 500: server error. Server said: boom"),
        (False, "auth", "HTTP 401"),
        (False, "stream_broken", "cut"),
    ] * 2
    bad = _level([*errors, *[ok] * 11, (True, "server", "warm-up only")], concurrency=4, rate=2.0)
    message = error_rate_exceeded([clean, bad], 0.05)
    assert message == (
        "error rate 0.48 (10 of 21 requests) at concurrency 4, 2 requests/s exceeds "
        "regression.max_error_rate 0.05; first errors: server: HTTP 500: server error. Server said: "
        "boom (x 4), timeout: timed out waiting (x 2), auth: HTTP 401 (x 2) and 1 other kinds"
    )
    assert error_rate_exceeded([bad], 0.5) is None  # 0.476 <= 0.5
    assert RegressionConfig().max_error_rate == 0.05


def _audit_config(tmp_path: Path, name: str, base_url: str, prompts: list[str], **regression) -> Path:
    """A stream-only audit of the ground-truth instrument's ``fail_marked`` model: a prompt marked
    ``[fail]`` gets HTTP 500, any other the ``schedule`` answer; 4 measured requests, 2 at once."""
    config = {
        "name": name,
        "tokenize": {"enabled": False},
        "profile": {"enabled": False},
        "sweep": {"enabled": False},
        "endpoint": {"base_url": base_url, "model": "fail_marked"},
        "stream": {
            "prompts": prompts,
            "max_concurrency": [2],
            "num_requests": 4,
            "warmup": 0,
            "max_tokens": 8,
        },
        "tracking": {"experiment": "loud"},
    }
    if regression:
        config["regression"] = regression
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_an_audit_over_its_error_rate_fails_and_never_becomes_a_baseline(tmp_path, instrument) -> None:
    """Half the requests fail: exit 1 naming the rate, the level and the first errors, the run
    FAILED; an audit whose every request failed likewise; the good audit after them has no
    baseline (neither joined one); the next, pinned to it, prints the merged thresholds."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store)

    def audit(name: str, prompts: list[str], *args: str, **regression) -> tuple:
        out = tmp_path / f"{name}.json"
        config = _audit_config(tmp_path, name, instrument.base_url, prompts, **regression)
        proc = _run(["audit", "--config", config, "--json", out, *args], tmp_path, store, timeout=300)
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return proc, json.loads(out.read_text()) if out.exists() else None

    half, data = audit("half-failed", ["a fine question", "[fail] a doomed question"])
    expected = (
        "error rate 0.50 (2 of 4 requests) at concurrency 2 exceeds regression.max_error_rate 0.05; "
        "first errors: server: HTTP 500: server error. Server said: internal failure (x 2)"
    )
    assert half.returncode == 1, half.stderr[-3000:]
    assert f"stage stream failed: {expected}" in half.stderr
    assert data["errors"] == {"stream": expected} and data["regression"] is None
    assert data["headline"]["error_rate"] == 0.5
    failed_run = client.get_run(data["mlflow_run_id"])
    assert failed_run.info.status == "FAILED"
    assert "Regression verdict" not in half.stdout

    every, all_failed = audit("all-failed", ["[fail] one", "[fail] two"])
    assert every.returncode == 1 and "stage stream failed: every request failed" in every.stderr
    assert client.get_run(all_failed["mlflow_run_id"]).info.status == "FAILED"

    good, first = audit("good", ["a fine question", "another fine question"])
    assert good.returncode == 0, good.stderr[-3000:]
    assert first["errors"] == {} and first["regression"] is None
    assert "Regression verdict: no baseline yet" in good.stdout
    assert client.get_run(first["mlflow_run_id"]).data.tags["regression"] == "no_baseline"

    pinned, second = audit(
        "good",
        ["a fine question", "another fine question"],
        "--baseline",
        first["mlflow_run_id"],
        thresholds_pct={"ttft_ms_p50": 10, "output_tokens_per_s": 5},
    )
    assert pinned.returncode == 0, pinned.stderr[-3000:]
    verdict = second["regression"]
    assert verdict["baseline_run_ids"] == [first["mlflow_run_id"]]
    used = {**DEFAULT_THRESHOLDS_PCT, "ttft_ms_p50": 10.0, "output_tokens_per_s": -5.0}
    assert {m: t for m, t in verdict["thresholds_pct"].items() if m in used} == used
    assert "Thresholds: ttft_ms_p50 +10 %, ttft_ms_p90 +15 %," in pinned.stdout
    assert "output_tokens_per_s -5 %" in pinned.stdout
    markdown = Path(client.download_artifacts(second["mlflow_run_id"], "regression.md", str(tmp_path)))
    text = markdown.read_text()
    assert "| ttft_ms_p50 |" in text and "| +10 % |" in text and "| -5 % |" in text


# 2. thresholds ----------------------------------------------------------------------------


def test_thresholds_merge_with_the_defaults_and_take_their_sign(tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "regression:\n  thresholds_pct: {ttft_ms_p50: 10, decode_tokens_per_s: 5, "
        "output_tokens_per_s: -20, requests_per_s: 7, ttft_ms_p95: 30}\n",
        encoding="utf-8",
    )
    thresholds = load_config(path).regression.thresholds_pct
    assert thresholds == {
        **DEFAULT_THRESHOLDS_PCT,
        "ttft_ms_p50": 10.0,
        "decode_tokens_per_s": -5.0,  # a magnitude: the registry says a drop is worse
        "output_tokens_per_s": -20.0,  # the signed form still works
        "requests_per_s": -7.0,  # added
        "ttft_ms_p95": 30.0,  # added
    }
    assert RegressionConfig().thresholds_pct == DEFAULT_THRESHOLDS_PCT
    again = RegressionConfig.model_validate(RegressionConfig(thresholds_pct={"prefill_ms": 20}).model_dump())
    assert again.thresholds_pct == {**DEFAULT_THRESHOLDS_PCT, "prefill_ms": 20.0}  # a round trip keeps it


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("ttft_ms_p50: -15", "threshold for ttft_ms_p50 is -15, but ttft_ms_p50 is worse when it grows: "
         "write ttft_ms_p50: 15"),
        ("tpot_ms_mean: 0", "threshold for tpot_ms_mean must be a non-zero percentage, e.g. tpot_ms_mean: 15"),
        ("decode_tokens_per_s: .inf", "threshold for decode_tokens_per_s must be a non-zero percentage, "
         "e.g. decode_tokens_per_s: -10"),
        ("ttft_p50: 15", "unknown metric 'ttft_p50'"),
        ("decode_tokens_per_s: -150", "threshold for decode_tokens_per_s is -150, but a drop of 150 % or more "
         "cannot happen: give a drop below 100"),
    ],
)  # fmt: skip
def test_a_bad_threshold_is_one_line_naming_the_metric_and_the_fix(tmp_path, entry, said) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"regression:\n  thresholds_pct: {{{entry}}}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="regression.thresholds_pct"):
        load_config(path)
    line = _one_line(_run(["audit", "--config", path], tmp_path))
    assert line.startswith(f"error: {path}: regression.thresholds_pct: {said}"), line


# 3. history --run --------------------------------------------------------------------------


def test_history_of_a_run_in_another_experiment_or_of_none_exits_2(tmp_path) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker("nightly gpu", store)
    run = tracker.start_run("audit", tags={"flow": "audit"})
    tracker.log_metrics(run, {"ttft_ms_p50": 100.0})
    tracker.end_run(run)
    line = _one_line(_run(["history", "--run", run], tmp_path, store))
    assert line == (
        f"error: --run: run {run} is in experiment 'nightly gpu', not 'infermeter'; "
        "pass --experiment 'nightly gpu'"
    )
    proc = _run(["history", "--run", run, "--experiment", "nightly gpu"], tmp_path, store)
    assert proc.returncode == 0, proc.stderr  # the fix it names works
    assert f"1 audit with the workload of run {run}" in proc.stdout
    absent = "0" * 32
    line = _one_line(_run(["history", "--run", absent], tmp_path, store))
    assert line == f"error: --run: MLflow run '{absent}' not found in {store}"


# 4. a store MLflow cannot open --------------------------------------------------------------


def _truncated_store(tmp_path: Path) -> Path:
    """A real MLflow SQLite store (one run), cut to a third: a copy that stopped half way."""
    folder = tmp_path / "cut"
    tracker = Tracker("cut", f"sqlite:///{folder / 'mlflow.db'}")
    tracker.end_run(tracker.start_run("one"))
    db = folder / "mlflow.db"
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 3])
    return db


def test_a_store_mlflow_cannot_open_is_one_line_naming_it(tmp_path, instrument) -> None:
    text = tmp_path / "text" / "mlflow.db"
    text.parent.mkdir()
    text.write_text("these are notes, not a database\n", encoding="utf-8")
    store = f"sqlite:///{text}"
    said = f"error: MLFLOW_TRACKING_URI: the MLflow store {store} cannot be read (SQLite says: file is not a database)"
    stream = ["stream", "--base-url", instrument.base_url, "--model", "schedule", "--num-requests", "1"]
    for command in (["history"], ["compare"], ["audit"], stream):
        line = _one_line(_run(command, tmp_path, store))
        assert line.startswith(said), (command, line)
        assert line.endswith(
            "point MLFLOW_TRACKING_URI at another store (a new sqlite:///PATH/mlflow.db starts empty)"
        )
    assert text.read_text() == "these are notes, not a database\n"  # left as it was

    cut = _truncated_store(tmp_path)
    line = _one_line(_run(["history"], tmp_path, f"sqlite:///{cut}"))
    assert (
        f"the MLflow store sqlite:///{cut} cannot be read (SQLite says: database disk image is malformed)"
        in line
    )

    folder = tmp_path / "runs"
    folder.mkdir()
    for uri in (folder.as_uri(), str(folder)):  # file:///DIR and a plain folder: a file store
        line = _one_line(_run(["history"], tmp_path, uri))
        assert line == (
            f"error: MLFLOW_TRACKING_URI: {uri} is a file store (a folder of runs), which this MLflow "
            "no longer opens; write sqlite:///PATH/mlflow.db (`mlflow migrate-filestore` moves a folder's "
            "runs into one), or set MLFLOW_ALLOW_FILE_STORE=true to use the folder anyway"
        )
    # opted in, MLflow opens it: history reads it (and finds no audit yet)
    line = _one_line(_run(["history"], tmp_path, folder.as_uri(), MLFLOW_ALLOW_FILE_STORE="true"))
    assert line == "error: no finished audits in experiment 'infermeter': run `infermeter audit` first"


def test_a_stores_password_is_never_shown() -> None:
    from tasks.tracking import shown_uri

    assert shown_uri("postgresql://infer:s3cret@db:5432/mlflow") == "postgresql://infer:***@db:5432/mlflow"
    assert shown_uri("sqlite:////data/mlflow.db") == "sqlite:////data/mlflow.db"


# 5. empty items ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["audit", "--baseline", ","], "--baseline: no run id in ','; give one or more MLflow run ids, "
         "comma-separated"),
        (["audit", "--baseline", " "], "--baseline: no run id in ' '; give one or more MLflow run ids, "
         "comma-separated"),
        (["audit", "--baseline", "abc,,def"], "--baseline: item 2 of 'abc,,def' is empty; give MLflow run "
         "ids, comma-separated, without empty items (e.g. abc,def)"),
        (["stream", "--max-concurrency", "1,,2", "--no-track"], "--max-concurrency: item 2 of '1,,2' is "
         "empty; give comma-separated values without empty items, e.g. --max-concurrency 1,2"),
        (["stream", "--request-rate", "4,", "--no-track"], "--request-rate: item 2 of '4,' is empty"),
        (["stream", "--max-concurrency", ",", "--no-track"], "--max-concurrency: no value in ','; give one "
         "or more values, comma-separated"),
        (["stream", "--goodput", "ttft_ms:500,,tpot_ms:50", "--no-track"], "--goodput: item 2 of "
         "'ttft_ms:500,,tpot_ms:50' is empty; give comma-separated metric:limit pairs without empty "
         "items, e.g. --goodput ttft_ms:500,tpot_ms:50"),
        (["history", "--metric", ",ttft_ms_p50"], "--metric: item 1 of ',ttft_ms_p50' is empty"),
        (["profile", "--batch-sizes", "1,2,,", "--no-track"], "--batch-sizes: item 3 of '1,2,,' is empty"),
    ],
)  # fmt: skip
def test_an_empty_item_of_a_comma_list_is_refused(tmp_path, args, said) -> None:
    line = _one_line(_run(args, tmp_path))
    assert line.startswith(f"error: {said}"), line


def test_a_configs_baseline_run_id_refuses_empty_items(tmp_path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("regression:\n  baseline_run_id: ','\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}: regression.baseline_run_id: no run id in ','; give one or more MLflow run ids, "
        "comma-separated"
    )
    assert RegressionConfig(baseline_run_id=" a1 , b2 ").baseline_run_id == "a1,b2"
    assert RegressionConfig(baseline_run_id="").baseline_run_id is None  # blank: unset, the history's


# 6. burstiness -----------------------------------------------------------------------------


def test_a_burstiness_that_cannot_apply_is_refused(tmp_path) -> None:
    # the defaults, and a burstiness with a rate to shape, stay valid
    assert AuditConfig().stream.burstiness == 1.0 and StreamFlowConfig().stream.request_rate == [None]
    shaped = StreamFlowConfig(stream=StreamConfig(burstiness=0.5, request_rate=[None, 4.0]))
    assert shaped.stream.burstiness == 0.5
    assert AuditConfig(stream=StreamConfig(enabled=False, burstiness=0.5)).stream.burstiness == 0.5
    # a capacity search sets the rates itself: its burstiness applies to them
    assert CapacityFlowConfig(stream=StreamConfig(burstiness=1000.0)).stream.burstiness == 1000.0

    all_at_once = (
        "stream.burstiness (--burstiness) 0.5 shapes the gaps between arrivals at a request rate, but "
        "every stream.request_rate (--request-rate) is inf (all requests at once): give a rate (e.g. "
        "--request-rate 4) or leave burstiness at 1"
    )
    path = tmp_path / "burst.yaml"
    path.write_text("stream:\n  burstiness: 0.5\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: {all_at_once}"
    assert (
        _one_line(_run(["stream", "--burstiness", "0.5", "--no-track"], tmp_path)) == f"error: {all_at_once}"
    )
    assert _one_line(_run(["audit", "--config", path], tmp_path)) == f"error: {path}: {all_at_once}"

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 4}\n', encoding="utf-8")
    line = _one_line(
        _run(["stream", "--dataset", f"trace:{trace}", "--burstiness", "2", "--no-track"], tmp_path)
    )
    assert line == (
        "error: stream.burstiness (--burstiness) 2 shapes the gaps between arrivals at a request rate, but "
        "a trace (--dataset mooncake:/trace:/azure:PATH) is sent at its recorded times: drop burstiness "
        "(speed the trace with time_scale, --time-scale)"
    )
    assert math.isclose(StreamConfig(dataset=f"trace:{trace}").burstiness, 1.0)  # a trace's default
