"""One module per `infermeter` command (audit, capacity, compare, deploy (``serve`` and
``deploy``), doctor, history, profile, server, stream, sweep, sync, tokenize, tune): its
options, its input checks, the flow it runs and what it prints.

What the commands share is in ``flows.shared`` (input errors, shared options, running a flow
against the Prefect API), what they print in ``flows.tables``; the typer app that gathers them
and the console script are in ``flows.cli``. Arrows point down: cli -> commands -> shared ->
tables.

Conventions (DESIGN.md): errors in input exit 2 with one line; `--json PATH` writes the
command's result; `mlflow_run_id` is null under `--no-track`. The flows themselves are in
``flows/`` (audit, stream, profile, sweep, tokenize, capacity, tune); the commands import them
only when they run one, so `infermeter --help` and input errors stay fast.
"""
