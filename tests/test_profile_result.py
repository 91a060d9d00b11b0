"""The typed profile results: ``to_dict()`` gives the rows the dict-returning code gave, key for
key and in order (``tests/data/profile_point_row.json``, generated once from that code), and the
typed objects are frozen."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tasks.profile.gpu_metrics import GPU_METRIC_KEYS
from tasks.profile.grid import ProfilePoint
from tasks.profile.result import GpuMetrics, PointMeasurement, ProfilePointResult
from tasks.profile.runner import run_sweep

EXAMPLE = json.loads((Path(__file__).parent / "data" / "profile_point_row.json").read_text())
ARGS = dict(max_new_tokens=2, repeats=1, warmup=1, device="cpu", num_layers=1)


def json_type(value) -> str:
    """The JSON type name the example stores: null, bool, int, float, str, list[...]."""
    if value is None:
        return "null"
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if isinstance(value, kind):
            return name
    assert isinstance(value, list), type(value)
    inner = {json_type(v) for v in value}
    assert len(inner) == 1, value
    return f"list[{inner.pop()}]"


@pytest.fixture(scope="module")
def results() -> tuple[ProfilePointResult, ProfilePointResult]:
    point = [ProfilePoint(8, 2, "float32")]
    [ran] = run_sweep("arch:smollm2-135m", point, **ARGS)
    [failed] = run_sweep("arch:smollm2-135m", point, available=lambda device: 1, **ARGS)
    return ran, failed


@pytest.mark.parametrize("which", ["ran", "failed"])
def test_to_dict_is_the_stored_row_key_for_key(results, which):
    result = results[0] if which == "ran" else results[1]
    example = EXAMPLE[which]
    row = result.to_dict()
    assert list(row) == example["keys"]  # names and order
    assert {k: json_type(v) for k, v in row.items()} == example["types"]
    assert {k: row[k] for k in example["values"]} == example["values"]
    assert json.loads(json.dumps(row)) == row  # plain JSON types only


def test_the_typed_fields_carry_the_row(results):
    ran, failed = results
    assert not ran.failed and failed.failed and failed.measurement is None
    assert failed.error.startswith("MemoryNeedError: model arch:smollm2-135m in float32: needs")
    m = ran.measurement
    assert isinstance(m, PointMeasurement) and m.gpu_metrics is None  # CPU: no NVML keys
    row = ran.to_dict()
    assert (m.prefill_ms, m.decode_ms_p50, m.kv_cache_bytes) == (
        row["prefill_ms"],
        row["decode_ms_p50"],
        row["kv_cache_bytes"],
    )
    assert list(m.decode_ms) == row["decode_ms"] and isinstance(m.decode_ms, tuple)
    assert ran.parameters() == {
        k: row[k]
        for k in (
            "model",
            "prompt_tokens",
            "batch_size",
            "dtype",
            "prefill_chunk_size",
            "max_new_tokens",
            "device",
            "random_weights",
        )
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.prefill_ms = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ran.error = "x"


def test_cuda_gpu_keys_sit_between_the_bandwidth_and_the_device(results):
    """On CUDA the dict-returning code spread all six NVML keys (None where unread) right after
    decode_bandwidth_gb_per_s; a typed point with GpuMetrics gives the same row."""
    m = dataclasses.replace(
        results[0].measurement,
        gpu_metrics=GpuMetrics.from_readings({"gpu_power_w_mean": 250.0}),
    )
    keys = list(m.to_dict())
    cpu_keys = list(results[0].measurement.to_dict())
    at = cpu_keys.index("decode_bandwidth_gb_per_s") + 1
    assert keys == cpu_keys[:at] + list(GPU_METRIC_KEYS) + cpu_keys[at:]
    gpu = {k: m.to_dict()[k] for k in GPU_METRIC_KEYS}
    assert gpu == {**dict.fromkeys(GPU_METRIC_KEYS), "gpu_power_w_mean": 250.0}
