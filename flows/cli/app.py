"""The typer app behind the `infermeter` console script: one command per flow, plus the
embedded server, compare, history and serve (one module each under ``flows.commands``).
``flows.cli.main.main`` runs it."""

from __future__ import annotations

import typer

from flows.cli.helptext import prose
from flows.commands import (
    audit,
    capacity,
    compare,
    deploy,
    doctor,
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
    help="Measure LLM inference, on this machine and against endpoints under load, with every run tracked in MLflow.",
)

# (name, callback), in the order `infermeter --help` lists them
COMMANDS = (
    ("audit", audit.command),
    ("server", server.command),
    ("compare", compare.command),
    ("history", history.command),
    ("serve", deploy.command),
    ("deploy", deploy.deploy_command),
    ("stream", stream.command),
    ("profile", profile.command),
    ("tokenize", tokenize.command),
    ("sweep", sweep.command),
    ("capacity", capacity.command),
    ("tune", tune.command),
    ("sync", sync.command),
    ("doctor", doctor.command),
)
for _name, _callback in COMMANDS:
    # the docstring as prose: its source lines are wrapped at 100 columns, and typer's rich help
    # would keep those breaks inside sentences (flows.cli.helptext.prose)
    app.command(_name, help=prose(_callback.__doc__))(_callback)
