"""What the commands print: the consoles, one value formatter, the table frame (a table that
fits its width without cutting a figure), the headline table and the MLflow links. Each
command's own table lives in its module."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

console = Console(soft_wrap=True)  # paths and commands stay whole when copied
err_console = Console(stderr=True)


def fmt_value(value: Any, spec: str | None = None, scale: float = 1.0) -> str:
    """One table cell: ``n/a`` for None; bools and text as they are; ints (unscaled) with
    thousands separators; floats divided by ``scale`` (e.g. 2**20 for bytes -> MiB) and written
    with the format ``spec`` (``",.3f"``; a ``g`` spec writes 1,000 and up in whole units, not
    ``1.14e+03``), by default to whole units from 100 up and to one decimal below
    (milliseconds, tokens/s, MiB: finer digits are noise in a terminal)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) and scale == 1.0:
        return f"{value:,}"
    value = value / scale
    if spec is not None and spec.endswith("g") and abs(value) >= 1000:
        return f"{value:,.0f}"  # "1,140", not "1.14e+03"
    if spec is not None:
        return format(value, spec)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def interval_text(value: Any, low: Any, high: Any, spec: str | None = None) -> str:
    """A figure with its 95 % interval, each number as :func:`fmt_value` writes it (``spec``):
    ``72.1 ± 3.4`` (the half-width) when the interval is about even around the value, else
    the ends, ``2,932 [1,104, 9,848]``: one side more than 1.5 times the other, the value
    outside it, or a ± that would reach below zero where the interval does not (a bootstrap
    interval of a right-skewed metric: ``2,932 ± 3,457`` claimed negative milliseconds). The
    value alone without an interval."""
    text = fmt_value(value, spec)
    if low is None or high is None:
        return text
    half = (high - low) / 2
    below, above = (value - low, high - value) if isinstance(value, (int, float)) else (-1, -1)
    skewed = min(below, above) < 0 or max(below, above) > 1.5 * min(below, above)
    if skewed or (value - half < 0 <= low):
        return f"{text} [{fmt_value(low, spec)}, {fmt_value(high, spec)}]"
    return f"{text} ± {fmt_value(half, spec)}"


def fmt_interval(metrics: Mapping[str, Any], name: str) -> str:
    """A figure with its interval (``name_ci_low`` / ``_ci_high``, ``tasks.stats.interval``)
    as :func:`interval_text` writes it, e.g. ``72.1 ± 3.4``; the value alone without one."""
    return interval_text(metrics.get(name), metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high"))


#: A figure as the tables write it: ``1,234.5``, ``-0.03``, ``1.14e+03``, ``12 %``,
#: ``(+12.3 %)``, ``inf``, ``n/a``, ``72.1 ± 3.4``, ``2,932 [1,104, 9,848]``, an interval alone
#: (``± 3.4``, ``[1,104, 9,848]``). A line of a right-justified column that reads so is never cut.
_NUMBER = r"[-+]?(\d[\d,]*(\.\d*)?(e[-+]?\d+)?|inf|n/a)"
_ENDS = rf"\[{_NUMBER}, {_NUMBER}\]"
_FIGURE = re.compile(rf"[(]?{_NUMBER}( ?%)?[)]?( ± {_NUMBER}| {_ENDS})?|± {_NUMBER}|{_ENDS}")
#: Text columns fold down to this many characters (fewer when their text is shorter) before
#: columns are left out; a header word longer than this folds rather than widening its column.
TEXT_FLOOR = 12


class FittedTable(Table):
    """A rich table that never cuts a figure to fit its width (80 columns when stdout is not a
    terminal): right-justified (figure) columns get the width of their longest figure, text
    folds, and when even that does not fit, the last columns are left out and a line after the
    table names them and the width that shows them."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table, left_out, needed = fit_table(self, console, options.max_width)
        yield from Table.__rich_console__(table, console, options)
        if left_out:  # wrapped here: the commands' console does not wrap (soft_wrap)
            note = Text(
                f"left out to fit {options.max_width} columns: {', '.join(left_out)} "
                f"(COLUMNS={needed} shows them; so does --json)"
            )
            for line in note.wrap(console, options.max_width):
                line.rstrip()
                line.end = "\n"
                yield line


def _lines(console: Console, renderable: Any) -> list[str]:
    text = console.render_str(renderable) if isinstance(renderable, str) else renderable
    return text.plain.splitlines() if isinstance(text, Text) else []


def _rigid_width(console: Console, column: Column) -> int | None:
    """The width a column must keep (None: it may fold): a right-justified column the width of
    its longest figure (other words in it fold; a header word counts up to :data:`TEXT_FLOOR`),
    a ``no_wrap`` column its longest line."""
    if column.no_wrap:
        return _natural_width(console, column)
    if column.justify != "right":
        return None
    lines = [line.strip() for cell in column.cells for line in _lines(console, cell)]
    figures = [len(line) for line in lines if _FIGURE.fullmatch(line)]
    header = max((len(word) for line in _lines(console, column.header) for word in line.split()), default=1)
    return max([*figures, min(header, TEXT_FLOOR), column.min_width or 0])


#: Where :func:`wrap_words` may break a word too long for its line: after one of these.
_WORD_PIECE = re.compile(r"[^\-_/:,.]*[\-_/:,.]*")


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken at spaces, and inside a word
    longer than ``width`` only after ``-``, ``_``, ``/``, ``:``, ``,`` or ``.``
    (``SmolLM2-135M-Instruct`` at 14: ``SmolLM2-135M-``, ``Instruct``); a piece longer than
    ``width`` keeps a line of its own, whole (never cut)."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        pieces = [word] if len(word) <= width else [p for p in _WORD_PIECE.findall(word) if p]
        for n, piece in enumerate(pieces):
            joined = f"{line}{'' if n or not line else ' '}{piece}"
            if line and len(joined) > width:
                lines.append(line)
                line = piece
            else:
                line = joined
    if line:
        lines.append(line)
    return lines


def _natural_width(console: Console, column: Column) -> int:
    return max(Measurement.get(console, console.options, r).maximum for r in [column.header, *column.cells])


def fit_table(table: Table, console: Console, width: int) -> tuple[Table, list[str], int]:
    """A copy of ``table`` that fits ``width`` without cutting a figure, the headers of the
    columns left out (the last ones; never the first), and the width the whole table needs.

    Right-justified and ``no_wrap`` columns get a fixed width (:func:`_rigid_width`; at least
    the column's ``min_width``: text a command wrapped itself, :func:`wrap_words`); the other
    columns fold (``overflow="fold"``) and count :data:`TEXT_FLOOR` characters at most."""
    fitted, budget = [], []
    for column in table.columns:
        rigid = _rigid_width(console, column)
        if rigid is None:
            fitted.append(dataclasses.replace(column, overflow="fold"))
            budget.append(min(_natural_width(console, column), TEXT_FLOOR))
        else:
            fitted.append(dataclasses.replace(column, width=rigid, overflow="fold"))
            budget.append(rigid)

    def width_of(count: int) -> int:  # the table's width with its first `count` columns
        probe = copy.copy(table)
        probe.columns = [dataclasses.replace(c, width=w) for c, w in zip(fitted[:count], budget)]
        return Measurement.get(console, console.options.update_width(10**6), probe).maximum

    needed = width_of(len(fitted))
    keep = len(fitted)
    while keep > 1 and width_of(keep) > width:
        keep -= 1
    result = copy.copy(table)
    result.columns = fitted[:keep]
    return result, [_header_label(console, c) for c in table.columns[keep:]], needed


def _header_label(console: Console, column: Column) -> str:
    """A header on one line: ``"coal-\nesced"`` -> ``coalesced``, ``"TTFT\np99"`` -> ``TTFT p99``."""
    label = ""
    for line in _lines(console, column.header):
        label = label[:-1] + line if label.endswith("-") else f"{label} {line}".strip()
    return label or f"column {column._index + 1}"


def make_table(
    title: str, columns: Iterable[tuple[str, str]], *, compact: bool = False, no_wrap: bool = False
) -> Table:
    """A table with a bold header and ``columns`` as (header, justify) pairs: a
    :class:`FittedTable` (right-justified columns hold figures, which are never cut).
    ``compact``: a rule under the header only and no edge padding, for wide numeric tables
    (stream levels, profile points) that must fit a terminal."""
    extra: dict[str, Any] = (
        dict(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True) if compact else {}
    )
    table = FittedTable(title=title, header_style="bold", **extra)
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=no_wrap)
    return table


def print_headline(title: str, headline: Mapping[str, Any]) -> None:
    """One row per headline metric: name and value (three decimals for floats), with its 95 %
    interval where the headline carries ``_ci_low`` / ``_ci_high`` (:func:`interval_text`:
    ``± x`` when about even, ``[low, high]`` when skewed)."""
    table = make_table(title, (("metric", "left"), ("value", "right")))
    for key, value in headline.items():
        if key.endswith(("_ci_low", "_ci_high")) and key.rpartition("_ci_")[0] in headline:
            continue
        low, high = headline.get(f"{key}_ci_low"), headline.get(f"{key}_ci_high")
        table.add_row(key, interval_text(value, low, high, ",.3f"))
    console.print(table)


def print_run_links(result: Mapping[str, Any]) -> None:
    """The MLflow run id, the command that opens its UI and the URL of the experiment's runs
    table there (the classic view: MLflow 3 opens on GenAI traces otherwise), when tracked."""
    if result.get("mlflow_run_id"):
        console.print(f"MLflow run: {result['mlflow_run_id']}", highlight=False)
        if result.get("ui_command"):
            console.print(f"Open the UI: {result['ui_command']}", highlight=False)
        if result.get("runs_url"):
            console.print(f"Runs table: {result['runs_url']}", highlight=False)


def print_closed_runs(closed: Iterable[Mapping[str, Any]]) -> None:
    """One line on stderr per run a read-only command (compare, history) found RUNNING with
    its owner certainly gone and marked KILLED (``tasks.tracking.Tracker.close_abandoned``):
    ghosts are closed by whatever command reads the store next, not left to the next tracked
    one."""
    for gone in closed:
        err_console.print(
            f"MLflow run {gone['run_id']} ({gone['name']}) was left RUNNING by a process that is "
            f"gone: marked KILLED; its records are in {gone['records_folder'] or '(no records folder)'}",
            highlight=False,
            markup=False,
        )
