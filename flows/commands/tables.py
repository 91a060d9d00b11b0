"""What the commands print: the consoles, one value formatter, the table frame, the headline
table and the MLflow links. Each command's own table lives in its module."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

console = Console(soft_wrap=True)  # paths and commands stay whole when copied
err_console = Console(stderr=True)


def fmt_value(value: Any, spec: str | None = None, scale: float = 1.0) -> str:
    """One table cell: ``n/a`` for None; bools and text as they are; ints (unscaled) with
    thousands separators; floats divided by ``scale`` (e.g. 2**20 for bytes -> MiB) and written
    with the format ``spec`` (``",.3f"``), by default to whole units from 100 up and to one
    decimal below (milliseconds, tokens/s, MiB: finer digits are noise in a terminal)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) and scale == 1.0:
        return f"{value:,}"
    value = value / scale
    if spec is not None:
        return format(value, spec)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def make_table(
    title: str, columns: Iterable[tuple[str, str]], *, compact: bool = False, no_wrap: bool = False
) -> Table:
    """A table with a bold header and ``columns`` as (header, justify) pairs. ``compact``:
    a rule under the header only and no edge padding, for wide numeric tables (stream levels,
    profile points) that must fit a terminal."""
    extra: dict[str, Any] = (
        dict(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True) if compact else {}
    )
    table = Table(title=title, header_style="bold", **extra)
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=no_wrap)
    return table


def print_headline(title: str, headline: Mapping[str, Any]) -> None:
    """One row per headline metric: name and value (three decimals for floats)."""
    table = make_table(title, (("metric", "left"), ("value", "right")))
    for key, value in headline.items():
        table.add_row(key, fmt_value(value, ",.3f"))
    console.print(table)


def print_run_links(result: Mapping[str, Any]) -> None:
    """The MLflow run id and the command that opens its UI, when the run was tracked."""
    if result.get("mlflow_run_id"):
        console.print(f"MLflow run: {result['mlflow_run_id']}")
        if result.get("ui_command"):
            console.print(f"Open the UI: {result['ui_command']}")
