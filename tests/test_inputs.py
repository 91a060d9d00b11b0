"""Inputs that look valid but are not (issue 14, item 3), and help a user can read (item 7):
an empty config file is an error naming it; CLI errors name the flag typed; a typo in a config
key suggests the closest valid key; ``--help`` shows defaults and units; the client-bound
warning prints enough digits; ``serve --timezone`` reaches Prefect's schedule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config import AuditConfig, ConfigError, StreamFlowConfig, load_config

BIN = Path(sys.executable).parent / "infermeter"


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "INFERMETER_WORK_DIR": str(tmp_path / "w"),
        },
    )


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize("text", ["", "  \n\n\t\n", "# only a comment\n"])
def test_an_empty_config_file_is_an_error_naming_it(tmp_path, text) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="empty") as caught:
        load_config(path, AuditConfig)
    assert str(path) in str(caught.value)
    (tmp_path / "all.yaml").write_text("{}\n", encoding="utf-8")  # explicit: all defaults
    assert load_config(tmp_path / "all.yaml", AuditConfig) == AuditConfig()


def test_the_cli_refuses_an_empty_config(tmp_path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("   \n", encoding="utf-8")
    line = _one_line(_run(["audit", "--config", str(path)], tmp_path))
    assert str(path) in line and "empty" in line


def test_a_typo_in_a_key_suggests_the_closest_valid_key(tmp_path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("stream:\n  num_request: 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="did you mean 'num_requests'") as caught:
        load_config(path, StreamFlowConfig)
    assert "stream.num_request" in str(caught.value)
    path.write_text("strem:\n  num_requests: 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="did you mean 'stream'"):
        load_config(path, AuditConfig)
    path.write_text("stream:\n  zzzz: 3\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path, AuditConfig)
    assert str(caught.value).endswith(
        "stream.zzzz: unknown key (check the spelling; configs/default.yaml has every field)"
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["stream", "--num-requests", "0"], "--num-requests"),
        (["stream", "--max-concurrency", "0,2"], "--max-concurrency"),
        (["sweep", "--samples", "0"], "--samples"),
    ],
)
def test_cli_errors_name_the_flag_typed(tmp_path, args, flag) -> None:
    line = _one_line(_run([*args, "--no-track"], tmp_path))
    assert line.startswith(f"error: {flag}:"), line
    assert "stream.num_requests" not in line and "option:" not in line


def test_help_shows_the_config_defaults(tmp_path) -> None:
    from tasks.config import StreamConfig

    result = subprocess.run(
        [str(BIN), "stream", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0
    line = next(line for line in result.stdout.splitlines() if "--num-requests" in line)
    assert f"[default: ({StreamConfig().num_requests})]" in line
    line = next(line for line in result.stdout.splitlines() if "--request-timeout-s" in line)
    assert "seconds" in line and "[default: (120.0)]" in line
    # a file option is not given the same-named field's value (the prompts' texts), and an empty
    # SLO table reads "none", not a Python dict
    line = next(line for line in result.stdout.splitlines() if "--prompts " in line)
    assert "Prompts file" in line and "default" not in line
    line = next(line for line in result.stdout.splitlines() if "--goodput" in line)
    assert "[default: (none)]" in line


def test_the_client_bound_warning_prints_enough_digits() -> None:
    from tasks.stream.quality import distinct_texts

    assert distinct_texts(1.004, 1.0) == ("1.004", "1.000")
    assert distinct_texts(3.2, 1.0) == ("3.20", "1.00")


def test_total_token_throughput_counts_input_tokens() -> None:
    from tasks.stats import aggregate_level

    records = [
        {"warmup": False, "error": None, "output_tokens": 10, "input_tokens": 30, "ttft_ms": 5.0},
        {"warmup": False, "error": None, "output_tokens": 10, "input_tokens": 50, "ttft_ms": 5.0},
    ]
    out = aggregate_level(records, wall_s=2.0)
    assert out["input_tokens_total"] == 80 and out["total_tokens_per_s"] == pytest.approx(50.0)
    records[0]["input_tokens"] = None
    assert aggregate_level(records, wall_s=2.0)["total_tokens_per_s"] is None


def test_text_prompts_get_their_token_counts() -> None:
    from tasks.config import StreamConfig
    from tasks.models.sources import load_tokenizer
    from tasks.workload.stage import stage_workload

    tokenizer = load_tokenizer("gguf:default")
    counts = list(
        stage_workload(StreamConfig(prompts=["Hello there, world"]), tokenizer, salt=0).prompt_tokens
    )
    assert counts == [len(tokenizer.encode("Hello there, world", add_special_tokens=False))] and counts[0] > 1


def test_serve_cron_takes_a_timezone() -> None:
    from flows.commands.deploy import build_deployments

    (audit,) = [d for d in build_deployments(AuditConfig(), "0 3 * * *", "Europe/Paris") if d.name == "audit"]
    (schedule,) = audit.schedules
    assert schedule.schedule.cron == "0 3 * * *" and schedule.schedule.timezone == "Europe/Paris"


# Issue 23, items 12, 14 and 15: a file that is not UTF-8, an output path that cannot be
# written, a JSONL prompts line that is not JSON: one line, exit 2, before anything runs.

NOT_UTF8 = b"first line\nsecond \xff line\n"  # byte 0xff: offset 18, line 2


def test_read_utf8_names_the_byte_offset_and_line(tmp_path) -> None:
    from tasks.textfile import read_utf8

    path = tmp_path / "p.txt"
    path.write_bytes(NOT_UTF8)
    with pytest.raises(ConfigError) as caught:
        read_utf8(path, ConfigError, "--prompts")
    assert str(caught.value) == (
        f"--prompts: {path}: not UTF-8 text: byte 0xff at offset 18 (line 2); save the file as UTF-8"
    )
    path.write_bytes("caf\u00e9 \u4e2d\n".encode())
    assert read_utf8(path) == "caf\u00e9 \u4e2d\n"


@pytest.mark.parametrize(
    ("name", "args", "option"),
    [
        ("p.txt", ["stream", "--prompts", "{path}", "--no-track"], "--prompts"),
        ("p.jsonl", ["stream", "--prompts", "{path}", "--no-track"], "--prompts"),
        ("p.txt", ["tokenize", "--prompts", "{path}", "--no-track"], "--prompts"),
        ("d.jsonl", ["stream", "--dataset", "jsonl:{path}", "--no-track"], "--dataset"),
        ("d.json", ["stream", "--dataset", "sharegpt:{path}", "--no-track"], "--dataset"),
        ("c.yaml", ["stream", "--config", "{path}", "--no-track"], None),
        ("c.yaml", ["audit", "--config", "{path}", "--no-track"], None),
        ("c.yaml", ["sweep", "--config", "{path}", "--no-track"], None),
    ],
)
def test_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, name, args, option) -> None:
    """Before: a 40-line UnicodeDecodeError traceback (exit 1)."""
    path = tmp_path / name
    path.write_bytes(NOT_UTF8)
    line = _one_line(_run([arg.format(path=path) for arg in args], tmp_path))
    where = f"{option}: {path}" if option else str(path)
    assert line == f"error: {where}: not UTF-8 text: byte 0xff at offset 18 (line 2); save the file as UTF-8"


@pytest.mark.parametrize("command", ["stream", "tokenize"])
def test_a_malformed_jsonl_prompts_line_is_named(tmp_path, command) -> None:
    """Before: ``--prompts: p.jsonl: not valid JSON (...)`` without the line (``tokenize``
    read a .jsonl file as plain lines: the JSON text became the prompts)."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two"\n', encoding="utf-8")
    line = _one_line(_run([command, "--prompts", str(path), "--no-track"], tmp_path))
    assert line.startswith(f"error: --prompts: {path}: line 3: not valid JSON ("), line
    assert 'write one JSON string or {"prompt": ...} object per line' in line


def test_tokenize_reads_jsonl_prompts_as_stream_does(tmp_path) -> None:
    from tasks.workload.prompts import read_prompts_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one"}\n"two"\n', encoding="utf-8")
    assert read_prompts_file(path) == ["one", "two"]
    path = tmp_path / "p.yaml"
    path.write_text("- one\n- 'two: 2'\n", encoding="utf-8")
    assert read_prompts_file(path) == ["one", "two: 2"]


needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")


@needs_proc
@pytest.mark.parametrize(
    "args",
    [
        ["compare", "--csv", "/proc/x.csv"],
        ["compare", "--plot", "/proc/x.png"],
        ["compare", "--json", "/proc/x.json"],
        ["stream", "--json", "/proc/x.json", "--no-track"],
        ["sweep", "--json", "/proc/x.json", "--no-track"],
        ["profile", "--json", "/proc/x.json", "--no-track"],
        ["tokenize", "--json", "/proc/x.json", "--no-track"],
        ["audit", "--json", "/proc/x.json", "--no-track"],
        ["capacity", "--json", "/proc/x.json", "--no-track"],
    ],
)
def test_an_output_path_that_cannot_be_created_fails_at_parse_time(tmp_path, args) -> None:
    """/proc takes no new file, for root too (``os.access`` says it is writable). Before: a
    traceback after the whole run (compare: also for a read-only folder). The tracking store
    is empty: compare would otherwise say 'no runs'."""
    env_store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    option, path = args[1], args[2]
    result = subprocess.run(
        [str(BIN), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MLFLOW_TRACKING_URI": env_store, "PREFECT_HOME": str(tmp_path / "prefect")},
    )
    line = _one_line(result)
    assert line.startswith(f"error: {option} {path}: cannot write a file there ("), line
    assert line.endswith("; choose another path")
    assert not (tmp_path / "mlflow.db").exists()  # nothing was read or written before


def test_compare_output_paths_under_a_file_or_at_a_folder(tmp_path) -> None:
    (tmp_path / "file").write_text("x", encoding="utf-8")
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    for option in ("--csv", "--plot", "--json"):
        result = subprocess.run(
            [str(BIN), "compare", option, str(tmp_path / "file" / "out")],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **store},
        )
        line = _one_line(result)
        where = f"{option} {tmp_path / 'file' / 'out'}"
        assert line == f"error: {where}: {tmp_path / 'file'} is a file, not a folder; choose another path"
        result = subprocess.run(
            [str(BIN), "compare", option, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **store},
        )
        assert _one_line(result).startswith(f"error: {option} {tmp_path}: is a folder; give a file path")
