"""The typer app behind the `infermeter` console script: one command per flow, plus the
embedded server, compare, history and serve (one module each under ``flows.commands``).
``flows.commands.app.main`` runs it."""

from __future__ import annotations

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
