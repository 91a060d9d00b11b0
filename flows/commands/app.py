"""The typer app behind the `infermeter` console script: one command per flow, plus the
embedded server, compare and serve (one module each under ``flows.commands``)."""

from __future__ import annotations

import signal

import typer

from flows.commands import audit, capacity, compare, deploy, profile, server, stream, sweep, sync, tokenize

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
app.command("sync")(sync.command)


def _terminate(signum, frame):
    """SIGTERM as Ctrl-C: every ``with`` block unwinds, so the MLflow runs end KILLED and the
    servers the command started are stopped (Prefect swaps in its own handler while a flow
    runs, and re-sends the signal to this one when the flow has been marked crashed)."""
    raise KeyboardInterrupt


def main() -> None:
    from flows.commands.helptext import show_config_defaults

    signal.signal(signal.SIGTERM, _terminate)
    try:
        show_config_defaults(typer.main.get_command(app))(prog_name="infermeter")
    except SystemExit as exc:  # the lines a command keeps for its very end (a lost tracking server)
        from flows.commands.common import closing_lines

        raise SystemExit(closing_lines(exc.code)) from None


if __name__ == "__main__":
    main()
