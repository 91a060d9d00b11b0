"""`infermeter doctor`: what infermeter needs on this machine, checked one by one
(:mod:`tasks.doctor.checks`, plus Prefect's API here), each failure with its fix. Exit 1 when a
check failed, else 0; ``--json PATH`` writes ``{"checks": [{"name", "status", "detail", "fix"}],
"failed"}``."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.shared.common import JsonOption, write_json
from flows.tables.common import console
from tasks.doctor import Check

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def prefect_api_check() -> Check:
    """Prefect's API the commands use (``PREFECT_API_URL``, else infermeter's local server,
    started or reused as a command would): it answers its health check and takes a write (the
    flow ``infermeter-doctor`` registered, idempotent)."""
    import os
    import urllib.error
    import urllib.request

    from prefect.client.orchestration import get_client

    from flows.shared.prefect_api import prefect_api

    given = os.environ.get("PREFECT_API_URL")
    if given:  # one bounded look first: the client's own retries wait minutes on a silent server
        try:
            with urllib.request.urlopen(f"{given.rstrip('/')}/health", timeout=10):
                pass
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            return Check(
                "Prefect API",
                "fail",
                f"PREFECT_API_URL {given}: /health does not answer ({reason})",
                "start that server (prefect server start) or unset PREFECT_API_URL for infermeter's own",
            )
    fix = (
        "start your server (prefect server start) or unset PREFECT_API_URL for infermeter's own"
        if given
        else "infermeter's own server keeps its database in PREFECT_HOME (default ~/.prefect): "
        "set PREFECT_HOME to a writable folder"
    )
    try:
        with prefect_api() as url, get_client(sync_client=True) as client:
            failure = client.api_healthcheck()
            if failure is not None:
                return Check("Prefect API", "fail", f"{url}: health check failed: {failure}", fix)
            client.create_flow_from_name("infermeter-doctor")
    except Exception as exc:  # noqa: BLE001 - a server that did not start, refused a write, ...
        return Check("Prefect API", "fail", f"{type(exc).__name__}: {str(exc)[:400]}", fix)
    return Check("Prefect API", "ok", f"{url}: answers, takes writes")


def command(
    skip_engine: Annotated[
        bool, typer.Option("--skip-engine", help="Leave out the generation through the embedded server.")
    ] = False,
    json_path: JsonOption = None,
) -> None:
    """Check that this machine has what infermeter needs (the engine answers, Prefect, MLflow, CPU,
    ports, disk), each failure with its fix; exits 1 when a check failed."""
    from tasks.doctor import run_checks
    from tasks.doctor.checks import MACHINE_CHECKS

    checks = [
        (name, check) for name, check in MACHINE_CHECKS if not (skip_engine and name == "engine answers")
    ]
    checks.insert(-1, ("Prefect API", prefect_api_check))  # before vLLM's, the slowest

    def show(result: Check) -> None:
        style = _STYLE[result.status]
        console.print(f"[{style}]{result.status:<4}[/] {result.name:<16} {result.detail}", highlight=False)
        if result.fix:
            console.print(f"     {'':<16} [bold]fix:[/] {result.fix}", highlight=False)

    results = run_checks(checks, show)
    counts = {status: sum(r.status == status for r in results) for status in ("ok", "warn", "fail", "skip")}
    console.print(", ".join(f"{n} {status}" for status, n in counts.items() if n), highlight=False)
    write_json(json_path, {"checks": [r.to_dict() for r in results], "failed": counts["fail"]})
    if counts["fail"]:
        raise typer.Exit(1)
