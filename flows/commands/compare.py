"""`infermeter compare`: chosen MLflow runs side by side, deltas against the first.

Not a flow: it only reads the tracking store. A search (no run ids) finds the flows' own runs,
not their children (stages, levels, points; ``--children`` includes them), so a filter on a
tag both carry lists each audit once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from flows.shared.common import fail_input, output_path, parse_list, preflight, write_json
from flows.tables.common import console, fmt_value, interval_text, make_table, print_closed_runs, wrap_words
from tasks.report.compare import EXTRA_COLUMNS, comparison_frame, markdown_table, plot_metric, unlike_runs

DEFAULT_FILTER = "tags.flow = 'audit'"


def command(
    run_ids: Annotated[
        Optional[list[str]], typer.Argument(help="Run ids; the first is the reference.")
    ] = None,
    experiment: Annotated[str, typer.Option(help="MLflow experiment to search.")] = "infermeter",
    filter_string: Annotated[
        str, typer.Option("--filter", help="MLflow filter when no run ids are given.")
    ] = DEFAULT_FILTER,
    max_runs: Annotated[int, typer.Option(help="Newest N runs when searching.")] = 10,
    children: Annotated[
        bool,
        typer.Option(
            "--children",
            help="Search child runs too (a flow's stages, levels, points); default: the flows' own runs.",
        ),
    ] = False,
    metrics: Annotated[
        Optional[str], typer.Option(help="Comma-separated metrics (default: headline).")
    ] = None,
    csv: Annotated[Optional[Path], typer.Option(help="Write the table as CSV.", callback=output_path)] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a markdown table.")] = False,
    plot: Annotated[
        Optional[Path], typer.Option(help="PNG of the first metric across runs.", callback=output_path)
    ] = None,
    json_path: Annotated[
        Optional[Path], typer.Option("--json", help="Write the rows as JSON.", callback=output_path)
    ] = None,
) -> None:
    """Compare MLflow runs side by side: their parameters and headline metrics, each with its
    change against the first run."""
    from tasks.tracking import Tracker

    chosen = parse_list("--metrics", metrics, str)
    if max_runs < 1:
        fail_input("--max-runs: must be >= 1")
    preflight(track=True, prefect=False)  # a dead tracking server: one line in seconds, not minutes
    tracker = Tracker(experiment)
    print_closed_runs(tracker.close_abandoned())  # ghosts of SIGKILLed commands: KILLED, not RUNNING
    try:
        if run_ids:
            runs = tracker.runs_by_id(run_ids)
        else:
            found = tracker.find_runs(filter_string, max_results=max_runs, parents_only=not children)
            runs = list(reversed(found))
    except LookupError as exc:
        fail_input(str(exc))
    except Exception as exc:  # a malformed --filter is the usual cause
        fail_input(f"--filter: {str(exc).splitlines()[0]}")
    if not runs:
        fail_input(
            f"no {'' if children else 'parent '}runs in experiment {experiment!r} match "
            f"{filter_string!r}; other flows' runs: --filter \"tags.flow = 'stream'\" (or profile, "
            "sweep, tokenize)" + ("" if children else "; child runs: --children")
        )
    if chosen:
        logged = {name for run in runs for name in run["metrics"]}
        unknown = [name for name in chosen if name not in logged]
        if unknown:
            fail_input(
                f"--metrics: {', '.join(unknown)} not logged by these runs; they have e.g. "
                f"{', '.join(sorted(logged)[:8])}"
            )
    frame = comparison_frame(runs, chosen)
    if csv:
        csv.parent.mkdir(parents=True, exist_ok=True)
        frame.write_csv(csv)
    if plot:
        metric = (chosen or [c for c in frame.columns if c.endswith("_change_pct")][:1] or [""])[0]
        metric = metric.removesuffix("_change_pct")
        try:
            plot_metric(frame, metric, plot)
        except KeyError:
            fail_input("--plot: no metric to plot (give --metrics)")
    unlike = unlike_runs(runs)
    write_json(json_path, {"rows": frame.to_dicts(), "unlike": unlike})
    note = _unlike_note(unlike)
    if markdown:
        typer.echo(markdown_table(frame) + (f"\n{note}" if note else ""))
        return
    console.print(_transposed(frame))
    if note:
        console.print(note, highlight=False)


def _unlike_note(unlike: dict[str, list[str]]) -> str:
    """The line under the table when the runs differ in flow, engine or model
    (``tasks.report.compare.unlike_runs``): their changes compare unlike measurements."""
    if not unlike:
        return ""
    what = ", ".join(f"{label} ({', '.join(values)})" for label, values in unlike.items())
    return (
        f"note: these runs differ in {what}: a change between them measures that difference, "
        "not a regression or a gain of one setup"
    )


def _at(frame, column: str, row: int):
    return frame[column][row] if column in frame.columns else None


#: Text (run names, models, hosts) wraps at this many characters, between words or after a
#: ``-``, ``/``, ``:`` ... (``flows.tables.common.wrap_words``), never inside a piece.
TEXT_WIDTH = 14


def _transposed(frame) -> Table:
    """Metrics as rows, runs as columns: reads in a terminal however many metrics there are.
    A metric whose every value is whole (bytes, counts) is written as an integer, others to
    three decimals; a change goes on its own line under the value, so a column is as wide as
    its longest figure or its longest piece of text (text is shown whole, wrapped at
    :data:`TEXT_WIDTH`; runs that do not fit are left out, and the line after says which)."""
    headers = [
        [*wrap_words(name or "", TEXT_WIDTH), run_id[:8]]
        for name, run_id in zip(frame["name"], frame["run_id"])
    ]
    table = make_table(
        "runs side by side (change against the first run)",
        [("", "left")] + [("\n".join(lines), "right") for lines in headers],
    )
    text_width = [max(len(line) for line in lines) for lines in headers]
    for column in frame.columns:
        if column in ("run_id", "name") or column.endswith(("_change_pct", *EXTRA_COLUMNS)):
            continue
        values = frame[column].to_list()
        whole = all(v is None or float(v).is_integer() for v in values if isinstance(v, float))
        cells = []
        for i, value in enumerate(values):
            if isinstance(value, float):
                change = frame[f"{column}_change_pct"][i] if f"{column}_change_pct" in frame.columns else None
                cell = f"{value:,.0f}" if whole else fmt_value(value, ",.3f")
                low, high = (_at(frame, f"{column}_{end}", i) for end in ("ci_low", "ci_high"))
                if low is not None and high is not None:  # the run's own 95 % interval, on its line
                    cell += "\n" + interval_text(value, low, high, ",.3f").removeprefix(
                        fmt_value(value, ",.3f") + " "
                    )
                if i > 0 and change is not None:
                    cell += f"\n({change:+.1f} %)"
                if _at(frame, f"{column}_verdict", i):  # the class its audit's verdict gave it
                    cell += f"\n{_at(frame, f'{column}_verdict', i)}"
            else:
                lines = wrap_words("" if value is None else str(value), TEXT_WIDTH)
                text_width[i] = max(text_width[i], *map(len, lines), 0)
                cell = "\n".join(lines)
            cells.append(cell)
        table.add_row(column, *cells)
    for column, width in zip(table.columns[1:], text_width):
        column.min_width = width  # the text's longest piece: kept whole when the table is fitted
    return table
