"""Config validation: unknown keys and bad values name the field; shipped configs load."""

from pathlib import Path

import pytest

from tasks.config import AuditConfig, ConfigError, load_config
from tasks.metrics import DEFAULT_THRESHOLDS_PCT

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["default.yaml", "smoke.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS / name)
    assert isinstance(cfg, AuditConfig)
    assert cfg.profile.model == "gguf:default"


def test_default_yaml_matches_builtin_defaults_where_it_should():
    cfg = load_config(CONFIGS / "default.yaml")
    assert cfg.stream.max_concurrency == [1, 4]
    assert cfg.sweep.temperature == [0.0, 0.7, 1.2] and cfg.sweep.top_p == [0.9, 1.0]
    assert cfg.sweep.samples == 3
    assert {"smart", "smarter", "token", "tokenization"} <= set(cfg.tokenize.prompts)


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_unknown_key_names_the_field(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "stream:\n  max_concurency: [1]\n"))
    message = str(err.value)
    assert "stream.max_concurency" in message and "unknown key" in message
    assert "\n" not in message


def test_bad_value_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"sweep\.top_p"):
        load_config(_write(tmp_path, "sweep:\n  top_p: [1.5]\n"))
    with pytest.raises(ConfigError, match=r"stream\.max_concurrency"):
        load_config(_write(tmp_path, "stream:\n  max_concurrency: [0]\n"))
    with pytest.raises(ConfigError, match=r"profile\.dtypes"):
        load_config(_write(tmp_path, "profile:\n  dtypes: [float8]\n"))
    with pytest.raises(ConfigError, match=r"profile\.prefill_chunk_sizes"):
        load_config(_write(tmp_path, "profile:\n  prefill_chunk_sizes: [-1]\n"))
    with pytest.raises(ConfigError, match=r"stream\.goodput"):
        load_config(_write(tmp_path, "stream:\n  goodput: {latency: 5}\n"))


def test_api_key_env_must_be_a_variable_name_not_a_key(tmp_path):
    with pytest.raises(ConfigError, match=r"endpoint\.api_key_env"):
        load_config(_write(tmp_path, "endpoint:\n  api_key_env: sk-abc/def+ghi\n"))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "stream: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))


def test_regression_threshold_for_an_unknown_metric(tmp_path):
    with pytest.raises(ConfigError, match=r"regression\.thresholds_pct.*unknown metric 'ttft_p50'"):
        load_config(_write(tmp_path, "regression:\n  thresholds_pct: {ttft_p50: 15}\n"))
    cfg = load_config(
        _write(tmp_path, "regression:\n  thresholds_pct: {ttft_ms_p99: 20, decode_tokens_per_s: -5}\n")
    )
    # merged with the defaults (issue 49): the entries override them
    assert cfg.regression.thresholds_pct == {
        **DEFAULT_THRESHOLDS_PCT,
        "ttft_ms_p99": 20.0,
        "decode_tokens_per_s": -5.0,
    }


def test_schedule_cron_must_parse(tmp_path):
    with pytest.raises(ConfigError, match=r"schedule_cron.*not a cron string"):
        load_config(_write(tmp_path, "schedule_cron: '0 25 * * *'\n"))
    assert load_config(_write(tmp_path, "schedule_cron: '0 3 * * *'\n")).schedule_cron == "0 3 * * *"
