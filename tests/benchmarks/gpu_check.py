"""The profiler on a GPU: arch: presets (SmolLM2-135M and Llama-2-7B shapes, random weights,
bfloat16), prompt 512 and 4096, batch 1 and 8; prints one table.

Needs only torch and transformers (plus this repository's tasks/ modules, which import nothing
else): no prefect, mlflow or polars, no model download. Each point is checked against the free
GPU memory before it is allocated; a point that does not fit is a FAILED row. When nvidia-ml-py
is installed and finds the GPU (optional: tasks.profile.gpu_metrics imports it guarded), the table also
shows the mean board power (W), mean GPU utilisation (%) and energy (J) over the timed repeats.
A second table gives each point's profiled breakdown (issue 12: step times, the largest part
of prefill and of decode, decode's unattributed "other" share; CUDA kernel time on a GPU) and
its roofline (measured copy bandwidth and matmul rate, arithmetic intensity, achieved decode
bandwidth and its fraction of the copy ceiling, memory- or compute-bound per phase).

    python tests/benchmarks/gpu_check.py                 # the full check, on CUDA
    python tests/benchmarks/gpu_check.py --smoke         # tiny: 2-layer slices, short prompts, CPU ok
    python tests/benchmarks/gpu_check.py --json out.json # also the full points as JSON
    python tests/benchmarks/gpu_check.py --breakdown-steps 0  # without the breakdown / roofline
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.profile.grid import profile_points  # noqa: E402
from tasks.profile.runner import run_sweep  # noqa: E402

PRESETS = ("smollm2-135m", "llama-2-7b")
COLUMNS = (
    ("model", "{}"),
    ("N", "{}"),
    ("B", "{}"),
    ("prefill_ms", "{:.2f}"),
    ("prefill_tok/s", "{:.0f}"),
    ("decode_ms_p50", "{:.2f}"),
    ("decode_tok/s", "{:.1f}"),
    ("weights_GiB", "{:.2f}"),
    ("kv_MiB", "{:.1f}"),
    ("kv_formula_MiB", "{:.1f}"),
    ("peak_GiB", "{:.2f}"),
    ("bw_GB/s", "{:.0f}"),
)
#: Shown when NVML gave any reading (tasks.profile.gpu_metrics): (title, format, the point's key).
POWER_COLUMNS = (
    ("power_W", "{:.0f}", "gpu_power_w_mean"),
    ("util_%", "{:.0f}", "gpu_utilization_pct_mean"),
    ("energy_J", "{:.1f}", "gpu_energy_joules"),
)

#: The breakdown and roofline of each point (``--breakdown-steps`` > 0; tasks/profile/roofline.py
#: analyse_point): profiled step times, the largest part of each phase and the "other" share,
#: the measured ceilings, each phase's arithmetic intensity and how close it came to them.
ANALYSIS_COLUMNS = (
    "model",
    "N",
    "B",
    "clock",
    "prof_pre_ms",
    "prof_dec_ms",
    "pre_top_part",
    "dec_top_part",
    "dec_other_%",
    "copy_GB/s",
    "matmul_TFLOP/s",
    "pre_FLOP/B",
    "dec_FLOP/B",
    "pre_compute_%",
    "dec_GB/s",
    "dec_bw_%",
    "pre_bound",
    "dec_bound",
)


def _top_part(phase: dict) -> str:
    """The phase's largest named part and its share of the step ("mlp 41%")."""
    named = [p for p in phase["parts"] if p["part"] != "other" and p["share"] is not None]
    top = max(named, key=lambda p: p["ms"], default=None)
    return "n/a" if top is None else f"{top['part']} {100 * top['share']:.0f}%"


def _analysis_row(point: dict) -> list[str]:
    """One row of the breakdown / roofline table (a failed part says why, shortened)."""
    head = [point["model"].removeprefix("arch:"), str(point["prompt_tokens"]), str(point["batch_size"])]
    if point["failed"] or "breakdown" not in point:
        return head + ["FAILED: " + (point["error"] or "no breakdown")[:90]]
    bd, roof = point["breakdown"], point["roofline"]
    if bd["failed"]:
        cells = [f"breakdown failed: {bd['error'][:60]}"] + ["n/a"] * 5
    else:
        pre, dec = bd["prefill"], bd["decode"]
        other = next((p["share"] for p in dec["parts"] if p["part"] == "other"), 0.0) or 0.0
        cells = [
            bd["clock"],
            f"{pre['step_ms']:.2f}",
            f"{dec['step_ms']:.2f}",
            _top_part(pre),
            _top_part(dec),
            f"{100 * other:.0f}",
        ]
    if roof["failed"]:
        return head + cells + [f"roofline failed: {roof['error'][:60]}"]
    p, d = roof["prefill"], roof["decode"]
    return (
        head
        + cells
        + [
            f"{roof['copy_bandwidth_gb_per_s']:.0f}",
            f"{roof['matmul_flop_per_s'] / 1e12:.2f}",
            f"{p['arithmetic_intensity_flop_per_byte']:.0f}",
            f"{d['arithmetic_intensity_flop_per_byte']:.1f}",
            f"{100 * p['compute_fraction']:.0f}",
            f"{d['achieved_bandwidth_gb_per_s']:.0f}",
            f"{100 * d['bandwidth_fraction']:.0f}",
            p["bound"].removesuffix("-bound"),
            d["bound"].removesuffix("-bound"),
        ]
    )


def _print_table(titles: list[str], rows: list[list[str]]) -> None:
    """Right-aligned columns; a shorter row (a failure) is joined as it is."""
    full = [r for r in rows if len(r) == len(titles)]
    widths = [max([len(t)] + [len(r[i]) for r in full]) for i, t in enumerate(titles)]
    print(" | ".join(t.rjust(w) for t, w in zip(titles, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(v.rjust(w) for v, w in zip(r, widths)) if len(r) == len(titles) else " | ".join(r))


def _power_shown(points: list[dict]) -> bool:
    return any(p.get(key) is not None for p in points for _, _, key in POWER_COLUMNS)


def _row(point: dict, power: bool = False) -> list[str]:
    name = point["model"].removeprefix("arch:")
    if point["failed"]:
        return [name, str(point["prompt_tokens"]), str(point["batch_size"]), "FAILED: " + point["error"][:90]]
    gib = 2**30
    values = [
        name,
        point["prompt_tokens"],
        point["batch_size"],
        point["prefill_ms"],
        point["prefill_tokens_per_s"],
        point["decode_ms_p50"],
        point["decode_tokens_per_s"],
        point["weights_bytes"] / gib,
        point["kv_cache_bytes"] / 2**20,
        point["kv_cache_bytes_formula"] / 2**20,
        point["peak_memory_bytes"] / gib,
        point["decode_bandwidth_gb_per_s"],
    ]
    formats = [fmt for _, fmt in COLUMNS]
    if power:
        values += [point.get(key) for _, _, key in POWER_COLUMNS]
        formats += [fmt for _, fmt, _ in POWER_COLUMNS]
    return [("n/a" if v is None else fmt.format(v)) for v, fmt in zip(values, formats)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Profile arch: presets on a GPU; one table.")
    parser.add_argument("--smoke", action="store_true", help="2-layer slices, prompts 32/64, batch 1/2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--breakdown-steps",
        type=int,
        default=4,
        help="Profiled decode steps of each point's breakdown and roofline (0 = off; default 4)",
    )
    args = parser.parse_args(argv)

    prompts, batches = ([32, 64], [1, 2]) if args.smoke else ([512, 4096], [1, 8])
    steps = args.max_new_tokens or (4 if args.smoke else 32)
    repeats = args.repeats or (1 if args.smoke else 3)
    layers = 2 if args.smoke else None
    started = time.time()
    points = []
    for preset in PRESETS:
        result = run_sweep(
            f"arch:{preset}",
            profile_points(prompts, batches, ["bfloat16"]),
            max_new_tokens=steps,
            repeats=repeats,
            warmup=1,
            device=args.device,
            num_layers=layers,
            on_point=lambda i, n, p: print(f"  {p.model} {p.point.label()} done", file=sys.stderr),
            breakdown_steps=args.breakdown_steps,
        )
        points += [r.to_dict() for r in result]  # the rows as --json and MLflow see them

    device = points[0]["device"] if points else args.device
    name = next((p["device_name"] for p in points if not p["failed"]), platform.processor())
    print(
        f"gpu_check {'--smoke ' if args.smoke else ''}on {device} ({name}), torch "
        f"{torch.__version__}, bfloat16, random weights, {steps} decode steps, {repeats} repeats "
        f"+ 1 warm-up{', 2-layer slices' if layers else ''}; {time.strftime('%Y-%m-%d')}; "
        f"{time.time() - started:.0f} s"
    )
    power = _power_shown(points)
    rows = [_row(p, power) for p in points]
    titles = [c[0] for c in COLUMNS] + ([c[0] for c in POWER_COLUMNS] if power else [])
    _print_table(titles, rows)
    if args.breakdown_steps:
        print(
            f"\nbreakdown ({args.breakdown_steps} profiled decode steps, apart from the timed repeats) "
            "and roofline (ceilings measured on this device; phases from the timed repeats)"
        )
        _print_table(list(ANALYSIS_COLUMNS), [_analysis_row(p) for p in points])
    if args.json:
        args.json.write_text(json.dumps(points, indent=1, default=str), encoding="utf-8")
    return 1 if any(p["failed"] for p in points) else 0


if __name__ == "__main__":
    raise SystemExit(main())
