"""The sweep explains what it finds: one warm-up request per point (recorded, outside the
figures), and a deterministic point whose cold warm-up answered otherwise than its agreeing warm
samples says why (``determinism_note``: the server's prompt cache), instead of reporting the
sampler as non-deterministic.

Against the ground-truth server's ``prompt_cache`` scenario (tests/groundtruth_server.py): as
llama.cpp, the first request for a prompt is a slow cold prefill with another greedy text than
every later request (measured on the embedded server: TTFT 163 ms cold, 35 ms warm).
"""

import json

import pytest
from groundtruth_server import PROMPT_CACHE_TEXT, serve
from mlflow.tracking import MlflowClient

from tasks.config import SweepFlowConfig
from tasks.stream.records import RequestRecord
from tasks.sweep import SweepPoint, finish_point
from tasks.sweep.figures import COLD_WARM_NOTE


def _record(text: str, error: str | None = None) -> RequestRecord:
    return RequestRecord("r", output_text=text, output_tokens=2, ttft_ms=1.0, e2e_ms=2.0, error_class=error)


def _tokens(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_note_needs_a_deterministic_point_agreeing_warm_samples_and_another_cold_text():
    greedy, hot = SweepPoint(0.0), SweepPoint(1.0)
    warm = [_record("b"), _record("b")]
    assert finish_point(greedy, warm, _tokens, _record("a")).determinism_note == COLD_WARM_NOTE
    assert finish_point(greedy, warm, _tokens, _record("b")).determinism_note is None  # same text
    assert finish_point(hot, warm, _tokens, _record("a")).determinism_note is None  # sampling
    assert finish_point(greedy, warm, _tokens, None).determinism_note is None  # no warm-up
    assert finish_point(greedy, warm, _tokens, _record("", "timeout")).determinism_note is None
    # warm samples that disagree: a real violation, not the cache
    split = finish_point(greedy, [_record("b"), _record("c")], _tokens, _record("a"))
    assert split.determinism_note is None and split.metrics["determinism_violated"] == 1
    # the warm-up is kept beside the figures, never in them
    result = finish_point(greedy, warm, _tokens, _record("a"))
    assert result.metrics["num_samples"] == 2 and result.warmup_row()["output_text"] == "a"
    assert result.warmup_row()["sample"] is None


@pytest.mark.integration
def test_a_sweep_point_warms_up_and_blames_the_prompt_cache(mlflow_store, prefect_server, workdir, tmp_path):
    from flows.sweep import sweep

    with serve() as server:
        cfg = SweepFlowConfig.model_validate(
            {
                "name": "sweep-warmup",
                "sweep": {
                    "prompt": "Write one sentence about the sea.",
                    "temperature": [0.0],
                    "top_p": [1.0],
                    "samples": 3,
                    "max_tokens": 8,
                },
                "endpoint": {"base_url": server.base_url, "model": "prompt_cache"},
                "tracking": {"experiment": "infermeter-sweep-warmup"},
                "resume": False,
            }
        )
        state = sweep(cfg, return_state=True)
        result = state.result()
        # the flow's pre-flight (a one-token "ping", tasks.endpoint.preflight) is not part of the point
        sent = [b for b in server.stats()["requests"] if b.get("max_tokens") != 1]
    assert state.is_completed(), result
    [point] = result["points"]
    # 1 warm-up + 3 samples reached the server; the warm-up first, with sample 0's seed
    assert len(sent) == 4 and sent[0]["seed"] == 0
    warmup = point["warmup"]
    assert warmup["output_text"] == PROMPT_CACHE_TEXT["cold"] and warmup["ttft_ms"] >= 140
    assert [s["output_text"] for s in point["samples"]] == [PROMPT_CACHE_TEXT["warm"]] * 3
    # the figures are the warm samples': deterministic, fast
    assert point["identical_fraction"] == 1.0 and point["determinism_violated"] == 0
    assert point["num_samples"] == 3 and point["ttft_ms_mean"] < 140
    assert "prompt cache" in point["determinism_note"]

    client = MlflowClient(tracking_uri=mlflow_store[1])
    run = client.get_run(point["mlflow_run_id"])
    assert run.data.tags["determinism_note"] == point["determinism_note"]
    folder = client.download_artifacts(run.info.run_id, "warmup.json", str(tmp_path))
    assert json.load(open(folder))["output_text"] == PROMPT_CACHE_TEXT["cold"]


@pytest.mark.integration
def test_a_resumed_point_keeps_its_note(mlflow_store, prefect_server, workdir):
    from flows.sweep import sweep

    with serve() as server:
        config = {
            "name": "sweep-warmup-resume",
            "sweep": {"prompt": "Name a sea.", "temperature": [0.0], "samples": 2, "top_p": [1.0]},
            "endpoint": {"base_url": server.base_url, "model": "prompt_cache"},
            "tracking": {"experiment": "infermeter-sweep-warmup-resume"},
        }
        first = sweep(SweepFlowConfig.model_validate(config), return_state=True).result()
        second = sweep(SweepFlowConfig.model_validate(config), return_state=True).result()
    assert first["points"][0]["determinism_note"] == COLD_WARM_NOTE
    assert second["points"][0]["status"] == "skipped"
    assert second["points"][0]["determinism_note"] == COLD_WARM_NOTE
