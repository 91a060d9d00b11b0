"""Every plot is one chart per PNG at a readable size (issue 14): the writers return the paths
they wrote, each a PNG of 640 x 420 px (6.4 x 4.2 in at 100 dpi), and each figure holds
exactly one Axes. Real matplotlib (Agg), real files."""

import struct
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from tasks.profile import plots as profile_plots
from tasks.report import plots

PNG_SIZE_PX = (640, 420)


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk (bytes 16-24, big-endian)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def _level(c: int, rate: float | None) -> dict:
    requests = [
        {"warmup": i == 0, "error": None, "ttft_ms": 10.0 * c + i, "itl_ms": [2.0, 3.0 + i]} for i in range(5)
    ]
    metrics = {
        f"{m}_{q}": (10.0 if q == "p50" else 14.0) * c
        for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
        for q in ("p50", "p99")
    }
    return {
        "max_concurrency": c,
        "request_rate": rate,
        "metrics": {**metrics, "output_tokens_per_s": 30.0 * c},
        "requests": requests,
    }


LEVELS = [_level(c, rate) for c in (1, 4, 16) for rate in (None, 2.0)]
POINTS = [
    {
        "temperature": t,
        "top_p": 1.0,
        "seed": 0,
        "max_tokens": 8,
        "distinct_1": 0.5 + t / 4,
        "distinct_2": 0.6 + t / 4,
        "identical_fraction": 1.0 - t / 2,
        "ttft_ms_mean": 30.0,
        "e2e_ms_mean": 90.0,
    }
    for t in (0.0, 0.7, 1.2)
]


@pytest.fixture(autouse=True)
def _no_open_figures():
    plt.close("all")
    yield
    assert plt.get_fignums() == []  # every writer closes what it drew


@pytest.mark.parametrize(
    ("figures", "names"),
    [
        (lambda: plots.load_curves_figures(LEVELS), [f"load_{m}.png" for m, _ in plots.LOAD_CHARTS]),
        (
            lambda: plots.level_histogram_figures(LEVELS[0], "level0"),
            ["level0_ttft_hist.png", "level0_itl_hist.png"],
        ),
        (
            lambda: plots.sweep_figures(POINTS),
            [f"sweep_{k}_vs_temperature.png" for k, _ in plots.SWEEP_CHARTS],
        ),
    ],
)
def test_each_figure_holds_one_axes_from_zero(figures, names):
    made = figures()
    assert list(made) == names
    for fig in made.values():
        assert len(fig.axes) == 1 and tuple(fig.get_size_inches()) == plots.FIGSIZE_IN
        assert fig.axes[0].get_ylim()[0] == 0
    plt.close("all")


def test_stream_and_sweep_writers_return_one_readable_png_per_chart(tmp_path):
    curves = plots.load_curves(LEVELS, tmp_path / "plots")
    hists = plots.level_histograms(LEVELS[3], tmp_path / "plots", "level3")
    sweep = plots.sweep_vs_temperature(POINTS, tmp_path / "sweep")
    assert [p.name for p in curves] == [
        "load_ttft_ms.png",
        "load_itl_ms.png",
        "load_tpot_ms.png",
        "load_e2e_ms.png",
        "load_output_tokens_per_s.png",
    ]
    assert [p.name for p in hists] == ["level3_ttft_hist.png", "level3_itl_hist.png"]
    assert len(sweep) == 5 and sweep[2].name == "sweep_identical_fraction_vs_temperature.png"
    for path in (*curves, *hists, *sweep):
        assert path.parent.name in ("plots", "sweep") and _png_size(path) == PNG_SIZE_PX


def test_an_empty_sweep_still_draws_labelled_empty_charts(tmp_path):
    paths = plots.sweep_vs_temperature([{"temperature": 0.0, "identical_fraction": None}], tmp_path)
    assert len(paths) == 5 and all(_png_size(p) == PNG_SIZE_PX for p in paths)


def test_profile_plots_are_one_axes_each_at_the_same_size(tmp_path):
    row = {
        "prompt_tokens": 8,
        "batch_size": 1,
        "dtype": "float32",
        "max_new_tokens": 2,
        "prefill_chunk_size": 0,
        "prefill_ms": 5.0,
        "decode_ms": [1.0, 1.1],
        "peak_memory_bytes": 3 * 2**20,
        "kv_cache_positions_after_prefill": 8,
        "kv_cache_positions": 10,
        "kv_cache_bytes_after_prefill": 2**20,
        "kv_cache_bytes": 2**21,
        "kv_cache_bytes_formula_after_prefill": 2**20,
        "kv_cache_bytes_formula": 2**21,
    }
    rows = [row, {**row, "prefill_chunk_size": 4, "prefill_ms": 6.0}]
    writers = (
        profile_plots.prefill_vs_prompt_length,
        profile_plots.decode_vs_context_position,
        profile_plots.memory_vs_sequence_length,
        profile_plots.ttft_vs_chunk_size,
        profile_plots.peak_memory_vs_chunk_size,
    )
    for k, write in enumerate(writers):
        path = write(rows, tmp_path / f"{k}.png")
        assert _png_size(path) == PNG_SIZE_PX
