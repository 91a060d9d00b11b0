"""The typer app behind the `infermeter` console script: one command per flow, plus the
embedded server, compare, history and serve (one module each under ``flows.commands``)."""

from __future__ import annotations

import signal

import typer

from flows.commands import (
    audit,
    capacity,
    compare,
    deploy,
    history,
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
app.command("history")(history.command)
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
    except SystemExit as exc:  # click ends every command with one, success included
        from flows.commands.common import closing_lines  # a lost tracking server's last lines

        code = closing_lines(exc.code)
        mark("main_end")
        _exit_now(code)


def _exit_now(code: int | str | None) -> None:
    """End the command once its work is safe: its runs are ended or marked and its servers
    stopped (the ``with`` blocks have unwound, on success, failure or a signal alike). So wait
    for the threads that still work (as the interpreter would), run the exit handlers
    (Prefect's log and event workers, MLflow's async logging drain there), flush the output,
    and skip the interpreter's teardown of its modules: 1.4-2.7 s of a 4-request stream's exit
    (tests/benchmarks/command_phases.py), 4-5 s after a signal with torch, transformers, MLflow
    and Prefect loaded (measured with gdb: ``finalize_modules``' garbage collection)."""
    import atexit
    import os
    import sys
    import threading

    if isinstance(code, str):  # SystemExit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    # the interpreter's own first step of an exit: the hooks threads registered for it (Prefect's
    # event-loop threads stop there), then every non-daemon thread joined
    threading._shutdown()
    for output in (sys.stdout, sys.stderr):
        output.flush()
    atexit._run_exitfuncs()
    for output in (sys.stdout, sys.stderr):
        output.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
