"""The `infermeter` command line: the typer app (``app``) and one module per command, with its
input checks and its rich tables; ``common`` and ``tables`` hold what they share,
``prefect_api`` the Prefect API the commands run their flows against.

Conventions (DESIGN.md): errors in input exit 2 with one line; `--json PATH` writes the
command's result; `mlflow_run_id` is null under `--no-track`. The flows themselves are in
``flows/`` (audit, stream, profile, sweep, tokenize); the commands import them only when they
run one, so `infermeter --help` and input errors stay fast.
"""
