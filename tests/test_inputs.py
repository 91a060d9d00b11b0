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
    with pytest.raises(ConfigError, match="check the spelling"):
        load_config(path, AuditConfig)


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


def test_the_client_bound_warning_prints_enough_digits() -> None:
    from tasks.stream.levels import distinct_texts

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
    from tasks.models import load_tokenizer
    from tasks.stream.prompts import stage_prompts

    tokenizer = load_tokenizer("gguf:default")
    prompts, counts = stage_prompts(StreamConfig(prompts=["Hello there, world"]), tokenizer)
    assert counts == [len(tokenizer.encode("Hello there, world", add_special_tokens=False))] and counts[0] > 1


def test_serve_cron_takes_a_timezone() -> None:
    from flows.commands.deploy import build_deployments

    (audit,) = [d for d in build_deployments(AuditConfig(), "0 3 * * *", "Europe/Paris") if d.name == "audit"]
    (schedule,) = audit.schedules
    assert schedule.schedule.cron == "0 3 * * *" and schedule.schedule.timezone == "Europe/Paris"
