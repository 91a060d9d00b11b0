"""The commands' tables piped at 80 columns (rich's width when stdout is not a terminal): a
figure is never cut; text folds; columns that still do not fit are left out, and one line
after the table names them and the width that shows them."""

import io
import re

import pytest
from rich.console import Console

from flows.commands import stream, sweep
from flows.tables import common as tables

LEFT_OUT = re.compile(r"left out to fit (\d+) columns: (.+) \(COLUMNS=(\d+) shows them; so does --json\)")


def _note(text: str):
    """The line(s) after the table that name the columns left out, as one match (or None)."""
    return (
        LEFT_OUT.fullmatch(" ".join(text[text.index("left out") :].split())) if "left out" in text else None
    )


def _printed(monkeypatch, module, width, print_fn, *args) -> str:
    """What ``print_fn`` writes through ``module.console`` on a console ``width`` wide."""
    out = io.StringIO()
    monkeypatch.setattr(module, "console", Console(file=out, width=width, soft_wrap=True))
    print_fn(*args)
    return out.getvalue()


LEVEL_METRICS = {
    "ttft_ms_p50": 1734.56,
    "ttft_ms_p99": 11423.9,
    "itl_ms_p50": 31.2,
    "itl_ms_p99": 1234.5,
    "tpot_ms_mean": 35.9,
    "e2e_ms_p50": 15679.1,
    "output_tokens_per_s": 1140.3,
    "num_errors": 12,
    "client_loop_lag_ms_p99": 250.1,
    "coalesced_event_fraction": 0.0312,
    "client_bound": 1,
    "arrival_clock": "kernel",
}
LEVELS = [
    {"max_concurrency": 256, "request_rate": 12.5, "metrics": LEVEL_METRICS},
    {"max_concurrency": 1, "request_rate": None, "metrics": LEVEL_METRICS},
]
FIGURES = ["1,735", "11,424", "31.2", "1,234", "35.9", "15,679", "1,140", "12", "250"]


def test_stream_levels_at_80_columns_keep_every_figure_and_name_what_was_left_out(monkeypatch):
    text = _printed(monkeypatch, stream, 80, stream.print_levels, LEVELS)
    assert "…" not in text
    body = [line for line in text.splitlines() if line.startswith("  256")]
    assert len(body) == 1 and body[0].split()[2:] == FIGURES, body
    assert all(len(line) <= 80 for line in text.splitlines()[1:])  # the title is one long line
    note = _note(text)
    assert note.group(1) == "80" and note.group(2) == "coalesced, client bound"
    # the width it names shows the whole table, with no note
    wide = _printed(monkeypatch, stream, int(note.group(3)), stream.print_levels, LEVELS)
    assert "left out" not in wide and "…" not in wide
    row = next(line for line in wide.splitlines() if line.startswith("  256"))
    assert row.split()[2:] == [*FIGURES, "0.0", "YES"]


def test_a_table_that_fits_is_printed_whole(monkeypatch):
    text = _printed(monkeypatch, stream, 160, stream.print_levels, LEVELS)
    assert "left out" not in text and "…" not in text
    assert "coalesced" not in text.splitlines()[-1]


@pytest.mark.parametrize("width", [80, 60])
def test_sweep_points_never_cut_a_figure_or_write_large_ones_in_exponent_form(monkeypatch, width):
    point = {
        "temperature": 1.2,
        "top_p": 0.95,
        "top_k": 40,
        "status": "finished",
        "identical_fraction": 0.0,
        "distinct_2": 0.987654,
        "output_tokens_mean": 1140.0,
        "ttft_ms_mean": 11402.7,
        "determinism_violated": False,
    }
    text = _printed(monkeypatch, sweep, width, sweep.print_points, [point])
    assert "…" not in text and "e+0" not in text
    kept = ["1.2", "0.95", "40", "finished", "0", "0.988", "1,140", "11,403", "False"]
    row = next(line for line in text.splitlines() if line.strip().startswith("1.2"))
    note = _note(text)
    shown = row.split()
    assert shown == kept[: len(shown)]  # the first columns, whole; the rest named below
    if len(shown) < len(kept):
        assert note and note.group(2).split(", ")[-1] == "det. violated"
    else:
        assert note is None
    assert width == 80 or note is not None  # 60 columns cannot hold them all


def test_a_skewed_interval_is_shown_by_its_ends_not_a_plus_minus_wider_than_the_value(monkeypatch):
    """Issue 31: the headline read ``prefill_ms 2,932 ± 3,457`` (the half-width of a bootstrap
    interval [1,104, 9,848] of a right-skewed time: the ± claimed negative milliseconds)."""
    headline = {
        "prefill_ms": 2932.0,
        "prefill_ms_ci_low": 1104.0,
        "prefill_ms_ci_high": 9848.0,
        "ttft_ms_p50": 72.1,
        "ttft_ms_p50_ci_low": 68.7,
        "ttft_ms_p50_ci_high": 75.5,
        "weights_bytes": 7372800,
    }
    text = _printed(monkeypatch, tables, 80, tables.print_headline, "headline", headline)
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in text.splitlines() if "│" in line
    }
    assert rows == {
        "prefill_ms": "2,932.000 [1,104.000, 9,848.000]",
        "ttft_ms_p50": "72.100 ± 3.400",
        "weights_bytes": "7,372,800",
    }
    assert tables.interval_text(2932.0, 100.0, 6000.0) == "2,932 [100, 6,000]"  # ± would reach below 0
    assert tables.interval_text(5.0, 6.0, 7.0) == "5.0 [6.0, 7.0]"  # the value outside its interval
    assert tables.fmt_interval({"a": 10.0, "a_ci_low": 9.0, "a_ci_high": 11.2}, "a") == "10.0 ± 1.1"
