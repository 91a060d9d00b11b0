"""Points that may not fit run in a spawned child process (tasks.profile.runner.run_sweep).

Real children, no mocks: a 1-layer slice of the SmolLM2-135M preset is profiled in a child
and compared with the same point in this process; a child is really killed with SIGKILL (what
the kernel's out-of-memory killer sends) and the sweep must record it and go on; a real loading
error inside a child must be recorded as it is in this process. ``child_fraction`` forces the
routing (the default sends only points over half the available memory to a child).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import psutil

from tasks.memory.formula import estimate_point_memory, kv_cache_bytes_formula
from tasks.models.arch import parameter_count
from tasks.models.sources import model_config
from tasks.profile.grid import profile_points
from tasks.profile.runner import CHILD_PROCESS_FRACTION, run_sweep

SPEC = "arch:smollm2-135m"
GIB = 2**30


class KillFirstSpawnedChild(threading.Thread):
    """Watches this process's children and sends SIGKILL to the first multiprocessing spawn
    child (its command line runs ``spawn_main``) as soon as it appears."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.killed_pid: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            for child in me.children():
                try:
                    if "spawn_main" in " ".join(child.cmdline()):
                        child.send_signal(signal.SIGKILL)
                        self.killed_pid = child.pid
                        return
                except psutil.Error:
                    continue
            time.sleep(0.005)


def test_child_points_match_in_process_ones_and_a_killed_child_is_recorded():
    # N=16 points need a little more than N=8 ones: a threshold between them sends the N=16
    # points to children; they come first in the points but run after the in-process N=8 ones.
    points = profile_points([16, 8], [2], ["float32"], [0], [2, 3])
    config = model_config(SPEC, num_layers=1)
    need = {
        p: estimate_point_memory(
            config,
            parameters=parameter_count(config),
            dtype_bytes=4,
            batch=2,
            prompt_tokens=p.prompt_tokens,
            max_new_tokens=p.max_new_tokens,
        ).total_bytes
        for p in points
    }
    free = 10**12
    threshold = (need[points[3]] + need[points[0]]) / 2 / free
    assert max(need[p] for p in points[2:]) < threshold * free < min(need[p] for p in points[:2])
    [reference] = [
        r.to_dict()
        for r in run_sweep(
            SPEC,
            points[1:2],
            repeats=1,
            warmup=0,
            device="cpu",
            num_layers=1,
        )
    ]
    assert not reference["failed"] and reference["child_process"] is False

    seen: list[tuple[int, int, int]] = []
    killer = KillFirstSpawnedChild()
    killer.start()
    try:
        rows = [
            r.to_dict()
            for r in run_sweep(
                SPEC,
                points,
                repeats=1,
                warmup=0,
                device="cpu",
                num_layers=1,
                available=lambda device: free,
                child_fraction=threshold,
                on_point=lambda i, n, row: seen.append(
                    (i, row.point.prompt_tokens, row.point.max_new_tokens)
                ),
            )
        ]
    finally:
        killer.stop.set()
        killer.join(5)
    assert killer.killed_pid is not None

    # results in the order of the points; run order: in-process first, then the children
    assert [(r["prompt_tokens"], r["max_new_tokens"]) for r in rows] == [(16, 2), (16, 3), (8, 2), (8, 3)]
    assert seen == [(0, 8, 2), (1, 8, 3), (2, 16, 2), (3, 16, 3)]
    assert [r["child_process"] for r in rows] == [True, True, False, False]

    killed, child, *here = rows
    assert killed["failed"] and "prefill_ms" not in killed
    error = killed["error"]
    assert error.startswith(
        "PointProcessDied: N=16 B=2 float32 T=2: the child process running the point was killed "
        "by SIGKILL (exit code -9), as the kernel's out-of-memory killer does; estimated need about "
        f"{killed['memory_estimate_bytes'] / GIB:.1f} GiB"
    ), error
    assert f"{free / GIB:.1f} GiB available" in error and "\n" not in error

    # the sweep went on: the next point ran in its own child, and equals the in-process run
    assert not child["failed"], child["error"]
    assert set(child) == set(reference)
    for key in (
        "input_ids_shape",
        "last_hidden_state_shape",
        "embedding_shape",
        "kv_cache_bytes",
        "kv_cache_bytes_formula",
        "kv_cache_positions",
        "generated_token_ids",
        "weights_bytes",
        "memory_estimate_bytes",
        "num_layers",
        "dtype",
    ):
        assert child[key] == reference[key], key
    assert child["kv_cache_bytes"] == kv_cache_bytes_formula(2, 16 + 3, 1, 3, 64, 4)
    assert child["last_hidden_state_shape"] == [2, 16, 576]
    assert len(child["decode_ms"]) == 3 and child["prefill_ms"] > 0
    assert child["peak_memory_source"] == "rss_sampler_delta" and child["peak_memory_bytes"] >= 0
    assert all(not r["failed"] for r in here)
    assert [r["memory_estimate_bytes"] for r in rows] == [need[p] for p in points]
    json.dumps(rows)


def test_an_exception_in_a_child_is_recorded_like_one_in_process(tmp_path):
    """A folder with a config but no tokenizer: loading fails, in a child as in this process."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 300,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
            }
        ),
        encoding="utf-8",
    )
    spec = f"hf:{tmp_path}"
    args = dict(max_new_tokens=2, repeats=1, warmup=0, device="cpu")
    points = profile_points([8], [1], ["float32"])
    [here] = [r.to_dict() for r in run_sweep(spec, points, child_fraction=float("inf"), **args)]
    [apart] = [r.to_dict() for r in run_sweep(spec, points, child_fraction=0.0, **args)]
    assert here["failed"] and apart["failed"]
    assert (here["child_process"], apart["child_process"]) == (False, True)
    assert apart["error"] == here["error"] and not apart["error"].startswith("PointProcessDied")
    assert "\n" not in apart["error"] and ":" in apart["error"]


def test_a_point_that_cannot_fit_even_alone_fails_before_a_child_starts():
    readings = iter([10**12, 1])  # the dtype's reading routes it to a child; then 1 byte free
    [row] = [
        r.to_dict()
        for r in run_sweep(
            SPEC,
            profile_points([8], [1], ["float32"], [0], 2),
            repeats=1,
            warmup=0,
            device="cpu",
            num_layers=1,
            available=lambda device: next(readings),
            child_fraction=0.0,
        )
    ]
    assert row["failed"] and row["child_process"] is False
    assert row["error"].startswith("MemoryNeedError: N=8 B=1 float32: needs about")
    assert "weights" in row["error"]  # the child would load its own copy: weights count
    assert 0 < CHILD_PROCESS_FRACTION < 1
