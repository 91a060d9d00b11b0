"""max_new_tokens as a sweep axis: the config field (one value or a list), the grid, the labels,
the context check on the largest value, and each point measured at its own value."""

from __future__ import annotations

import pytest
import yaml

from tasks.config import AuditConfig, ConfigError, ProfileConfig, load_config
from tasks.memory.formula import kv_cache_bytes_formula
from tasks.profile.grid import ProfilePoint, check_request, point_label, profile_points, steps_swept
from tasks.profile.plots import _group
from tasks.profile.runner import run_sweep


def test_config_takes_one_value_or_a_list(tmp_path):
    assert ProfileConfig().max_new_tokens_values == [32]
    assert ProfileConfig(max_new_tokens=8).max_new_tokens_values == [8]
    assert ProfileConfig(max_new_tokens=[8, 32]).max_new_tokens_values == [8, 32]
    for bad in (0, [], [4, 0]):
        with pytest.raises(ValueError, match="max_new_tokens"):
            ProfileConfig(max_new_tokens=bad)
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"profile": {"max_new_tokens": 16}}), encoding="utf-8")
    assert load_config(one, AuditConfig).profile.max_new_tokens == 16  # an int still works
    many = tmp_path / "many.yaml"
    many.write_text(yaml.safe_dump({"profile": {"max_new_tokens": [4, 16]}}), encoding="utf-8")
    assert load_config(many, AuditConfig).profile.max_new_tokens_values == [4, 16]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"profile": {"max_new_tokens": [4, -1]}}), encoding="utf-8")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config(bad, AuditConfig)


def test_grid_and_labels_carry_max_new_tokens():
    points = profile_points([16], [1, 2], ["bfloat16"], [0, 8], [4, 32])
    assert [(p.batch_size, p.prefill_chunk_size, p.max_new_tokens) for p in points] == [
        (1, 0, 4),
        (1, 0, 32),
        (1, 8, 4),
        (1, 8, 32),
        (2, 0, 4),
        (2, 0, 32),
        (2, 8, 4),
        (2, 8, 32),
    ]
    assert steps_swept(points)
    assert points[1].label(steps=True) == "N=16 B=1 bfloat16 T=32"
    assert points[3].label(steps=True) == "N=16 B=1 bfloat16 chunk=8 T=32"
    assert points[1].label() == "N=16 B=1 bfloat16"
    single = profile_points([16], [1], ["bfloat16"], [0], 4)
    assert [p.max_new_tokens for p in single] == [4] and not steps_swept(single)
    assert profile_points([16], [1], ["bfloat16"])[0].max_new_tokens is None  # run_sweep's value
    row = {
        "prompt_tokens": 16,
        "batch_size": 2,
        "dtype": "float32",
        "prefill_chunk_size": 0,
        "max_new_tokens": 8,
    }
    assert point_label(row, steps=True) == "N=16 B=2 float32 T=8"
    assert point_label(row) == "N=16 B=2 float32"
    # plots split their lines by T only when more than one value was swept
    rows = [{**row, "max_new_tokens": t} for t in (8, 32)]
    assert sorted(_group(rows, ("batch_size", "dtype"))) == [
        "batch=2 dtype=float32 T=32",
        "batch=2 dtype=float32 T=8",
    ]
    assert list(_group(rows[:1], ("batch_size", "dtype"))) == ["batch=2 dtype=float32"]


def test_context_check_uses_the_largest_value():
    check_request("arch:llama-2-7b", None, [4000], [8, 96], "cpu")  # 4000 + 96 = 4096 fits
    with pytest.raises(ValueError) as info:
        check_request("arch:llama-2-7b", None, [4000], [8, 97], "cpu")
    message = str(info.value)
    assert "prompt length 4000 + max_new_tokens 97 exceeds the model's context of 4096" in message
    assert "<= 3999 or a smaller max_new_tokens" in message and "\n" not in message
    with pytest.raises(ValueError, match="use max_new_tokens < 4096"):
        check_request("arch:llama-2-7b", None, [1], 5000, "cpu")


def test_each_point_runs_and_is_estimated_at_its_own_max_new_tokens():
    seen = []
    rows = [
        r.to_dict()
        for r in run_sweep(
            "arch:smollm2-135m",
            profile_points([8], [2], ["float32"], [0], [1, 4]),
            repeats=1,
            warmup=0,
            device="cpu",
            num_layers=1,
            on_point=lambda i, n, row: seen.append(row.point.max_new_tokens),
        )
    ]
    assert seen == [1, 4]
    short, long = rows
    for row, steps in ((short, 1), (long, 4)):
        assert not row["failed"], row["error"]
        assert row["max_new_tokens"] == steps and row["child_process"] is False
        assert len(row["decode_ms"]) == steps and len(row["generated_token_ids"]) == steps + 1
        assert row["kv_cache_positions"] == 8 + steps
        assert (
            row["kv_cache_bytes"]
            == row["kv_cache_bytes_formula"]
            == kv_cache_bytes_formula(2, 8 + steps, 1, 3, 64, 4)
        )
    # the estimate differs by exactly the KV cache of the 3 extra positions
    assert long["memory_estimate_bytes"] - short["memory_estimate_bytes"] == kv_cache_bytes_formula(
        2, 3, 1, 3, 64, 4
    )
    # a point's own value wins over run_sweep's; a point without one takes run_sweep's
    [own, default] = [
        r.to_dict()
        for r in run_sweep(
            "arch:smollm2-135m",
            [ProfilePoint(8, 1, "float32", 0, 2), ProfilePoint(8, 1, "float32")],
            max_new_tokens=3,
            repeats=1,
            warmup=0,
            device="cpu",
            num_layers=1,
        )
    ]
    assert (own["max_new_tokens"], len(own["decode_ms"])) == (2, 2)
    assert (default["max_new_tokens"], len(default["decode_ms"])) == (3, 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_sweep(
            "arch:smollm2-135m",
            [ProfilePoint(8, 1, "float32")],
            repeats=1,
            warmup=0,
            device="cpu",
            num_layers=1,
        )
