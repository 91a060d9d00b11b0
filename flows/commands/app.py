"""The typer app behind the `infermeter` console script: one command per flow, plus the
embedded server, compare and serve (one module each under ``flows.commands``)."""

from __future__ import annotations

import signal

import typer

from flows.commands import (
    audit,
    capacity,
    compare,
    deploy,
    profile,
    server,
    stream,
    sweep,
    sync,
    tokenize,
    tune,
)

app = typer.Typer(
    name="infermeter",
    no_args_is_help=True,
    add_completion=False,
    help="Measure LLM inference: tokenize, profile, stream, sweep; tracked in MLflow.",
)

# in the order `infermeter --help` lists them
app.command("audit")(audit.command)
app.command("server")(server.command)
app.command("compare")(compare.command)
app.command("serve")(deploy.command)
app.command("deploy")(deploy.deploy_command)
app.command("stream")(stream.command)
app.command("profile")(profile.command)
app.command("tokenize")(tokenize.command)
app.command("sweep")(sweep.command)
app.command("capacity")(capacity.command)
app.command("tune")(tune.command)
app.command("sync")(sync.command)


def _terminate(signum, frame):
    """SIGTERM (and SIGINT) as Ctrl-C: every ``with`` block unwinds, so the MLflow runs end
    KILLED and the servers the command started are stopped (Prefect swaps in its own handler
    while a flow runs, and re-sends the signal to this one when the flow has been marked
    crashed). The signal is noted first: the command exits 128 + its number (143, 130)."""
    from flows.commands.common import note_signal

    note_signal(signum)
    raise KeyboardInterrupt


def main() -> None:
    from flows.commands.helptext import show_config_defaults
    from tasks.phases import mark

    mark("cli_imported")

    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
        signal.signal(signal.SIGINT, _terminate)
    try:
        show_config_defaults(typer.main.get_command(app))(prog_name="infermeter")
    except SystemExit as exc:  # the lines a command keeps for its very end (a lost tracking server)
        from flows.commands.common import closing_lines, interrupted

        code = closing_lines(exc.code)
        mark("main_end")
        if interrupted() and code not in (0, None):
            _exit_now(code)
        raise SystemExit(code) from None


def _exit_now(code: int) -> None:
    """End an interrupted command at once: its runs are marked and its servers stopped (the
    ``with`` blocks have unwound), so flush the output, run the exit handlers (Prefect's log
    and event workers drain there), and skip the interpreter's teardown of its modules, which
    took 4-5 s of the exit after a signal here (torch, transformers, MLflow and Prefect
    loaded; measured with gdb: ``finalize_modules``' garbage collection)."""
    import atexit
    import os
    import sys

    for output in (sys.stdout, sys.stderr):
        output.flush()
    atexit._run_exitfuncs()
    for output in (sys.stdout, sys.stderr):
        output.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
