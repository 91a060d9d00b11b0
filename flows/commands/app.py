"""The typer app behind the `infermeter` console script: one command per flow, plus the
embedded server, compare and serve (one module each under ``flows.commands``)."""

from __future__ import annotations

import typer

from flows.commands import audit, compare, deploy, profile, server, stream, sweep, tokenize

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
app.command("stream")(stream.command)
app.command("profile")(profile.command)
app.command("tokenize")(tokenize.command)
app.command("sweep")(sweep.command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
