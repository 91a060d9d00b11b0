"""tasks.profile.gpu_metrics: NVML power / utilisation figures, and their absence without a GPU.

The arithmetic of :func:`summarize` is checked on a fixed feed of readings (pure arithmetic, no
NVML involved). The sampler itself is checked for what this machine can show: with no NVIDIA
driver (or no nvidia-ml-py) it records nothing and never raises, and a CPU point carries no
gpu_* keys. On a CUDA machine the last test checks that a CUDA point carries them.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.profile.gpu_metrics import GPU_METRIC_KEYS, NvmlSampler, summarize
from tasks.profile.measure import profile_point


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001
        return False


def test_summarize_turns_readings_into_watts_percent_and_joules():
    figures = summarize([200_000, 300_000, 250_000], [50, 100, 0], 1_000_000, 1_012_500)
    assert figures == {
        "gpu_power_w_mean": 250.0,
        "gpu_power_w_max": 300.0,
        "gpu_utilization_pct_mean": 50.0,
        "gpu_utilization_pct_max": 100.0,
        "gpu_energy_joules": 12.5,
        "gpu_metric_samples": 3,
    }
    assert list(figures) == list(GPU_METRIC_KEYS)
    # a board without power readings: utilisation only; an energy counter that restarted: none
    assert summarize([], [10, 30], 5_000, 1_000) == {
        "gpu_utilization_pct_mean": 20.0,
        "gpu_utilization_pct_max": 30.0,
        "gpu_metric_samples": 2,
    }
    assert summarize([], [], None, None) == {}
    assert summarize([], [], 0, 2_000) == {"gpu_energy_joules": 2.0}


@pytest.mark.skipif(_nvml_works(), reason="NVML works here: the no-GPU path cannot be shown")
@pytest.mark.parametrize("hide_binding", [False, True])
def test_without_nvml_the_sampler_records_nothing_and_never_raises(monkeypatch, hide_binding):
    if hide_binding:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    else:
        pytest.importorskip("pynvml")  # installed: its nvmlInit finds no driver library here
    for device in ("cuda", "cuda:0", torch.device("cpu")):
        with NvmlSampler(device, interval_s=0.01) as sampler:
            pass
        assert sampler.available is False and sampler.metrics == {}
    with pytest.raises(ValueError):
        NvmlSampler(interval_s=0)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).eval()


def test_a_cpu_point_has_no_gpu_keys(tiny):
    point = profile_point(
        tiny,
        prompt_ids=torch.arange(6).unsqueeze(0),
        batch_size=1,
        max_new_tokens=2,
        repeats=1,
        warmup=0,
        device="cpu",
    ).to_dict()
    assert point["device"] == "cpu" and not [k for k in point if k.startswith("gpu_")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_point_has_the_gpu_keys(tiny):
    point = profile_point(
        tiny.to("cuda"),
        prompt_ids=torch.arange(6).unsqueeze(0),
        batch_size=1,
        max_new_tokens=2,
        repeats=2,
        warmup=1,
        device="cuda",
    ).to_dict()
    assert set(GPU_METRIC_KEYS) <= set(point)
    if _nvml_works():
        assert point["gpu_metric_samples"] >= 1 and point["gpu_power_w_mean"] > 0
        assert 0 <= point["gpu_utilization_pct_mean"] <= 100
