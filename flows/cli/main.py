"""The `infermeter` console script's entry point (:func:`main`): the signals, the tracked
stream's early tracking writer, the typer app (``flows.cli.app``), the quick exit."""

from __future__ import annotations

import signal
import sys

import flows  # noqa: F401  (the offline defaults, before Prefect or MLflow is imported)
from flows.shared.stream_writer import start_stream_writer, tracked_stream


def _terminate(signum, frame):
    """SIGTERM (and SIGINT) as Ctrl-C: every ``with`` block unwinds, so the MLflow runs end
    KILLED and the servers the command started are stopped (Prefect swaps in its own handler
    while a flow runs, and re-sends the signal to this one when the flow has been marked
    crashed). The signal is noted first: the command exits 128 + its number (143, 130)."""
    from flows.shared.common import note_signal

    note_signal(signum)
    raise KeyboardInterrupt


def main() -> None:
    from tasks.phases import mark

    # the writer's MLflow import (2-3 s here) is the longest path of a tracked stream: it
    # starts before the CLI's own imports (0.3-0.4 s) rather than after its options are read
    # (tests/benchmarks/command_phases.py)
    if tracked_stream(sys.argv[1:]):
        start_stream_writer()
    import typer

    from flows.cli.app import app
    from flows.cli.helptext import show_config_defaults

    mark("cli_imported")

    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
        signal.signal(signal.SIGINT, _terminate)
    try:
        show_config_defaults(typer.main.get_command(app))(prog_name="infermeter")
    except SystemExit as exc:  # click ends every command with one, success included
        from flows.shared.common import closing_lines  # a lost tracking server's last lines

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
