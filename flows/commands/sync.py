"""`infermeter sync RUN_FOLDER`: upload what a run could not log while its tracking server was
away (the journal in ``RUN_FOLDER/tracking/``, :mod:`tasks.tracking.journal`).

The run's own end named the folder and this command. Each journal entry is sent once, oldest
first, and marked as sent: a second sync sends nothing, and a sync cut off half way (the server
gone again) resumes where it stopped. Runs created while the server was away get their real ids
here; a run whose creation did reach the server is found again by its key, never duplicated.
Writes ``--json`` (``{"folder", "uri", "sent", "runs_created"}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.shared.common import JsonOption, fail_input, write_json
from flows.tables.common import console


def command(
    run_folder: Annotated[Path, typer.Argument(help="The run's records folder (its output names it).")],
    tracking_uri: Annotated[
        Optional[str],
        typer.Option(help="Send to this tracking URI (default: the server the run lost, from the folder)."),
    ] = None,
    json_path: JsonOption = None,
) -> None:
    """Upload to MLflow what a run could not log while its tracking server was away."""
    from tasks.endpoint.preflight import PreflightError
    from tasks.endpoint.preflight_store import check_tracking_server
    from tasks.tracking.journal import offline_note, pending_entries

    if not run_folder.is_dir():
        fail_input(f"RUN_FOLDER: {run_folder} is not a folder; give the folder the run's output named")
    note = offline_note(run_folder)
    entries, _ = pending_entries(run_folder)
    if note is None and not entries:
        console.print(f"{run_folder}: nothing to sync (its tracking server never went away)", highlight=False)
        write_json(json_path, {"folder": str(run_folder), "uri": None, "sent": 0, "runs_created": 0})
        return
    uri = tracking_uri or note.uri
    setting = (
        "--tracking-uri"
        if tracking_uri
        else f"the run's tracking server ({run_folder}/tracking/offline.json)"
    )
    if uri.startswith("http"):
        try:
            check_tracking_server(uri)
        except PreflightError as exc:
            fail_input(f"{setting}: {exc.message}; start it (or give --tracking-uri), then sync again")
    from tasks.tracking.journal import sync
    from tasks.tracking.sync import journal_replayer

    try:
        result = sync(run_folder, uri, journal_replayer(uri))
    except Exception as exc:  # noqa: BLE001  (the server went away again, or refused an entry)
        left = len(pending_entries(run_folder)[0])
        typer.echo(
            f"error: sync to {uri} stopped ({type(exc).__name__}: {str(exc)[:200]}); {left} entries "
            f"are left in {run_folder}; run `infermeter sync {run_folder}` again",
            err=True,
        )
        raise typer.Exit(1) from None
    console.print(
        f"Sent {result.sent} tracking calls ({result.runs_created} runs) from {run_folder} to {uri}",
        highlight=False,
    )
    write_json(json_path, result.to_dict())
