"""What every CLI command shares: one-line input errors (exit 2), list-valued options, configs
with the command's flags applied, pre-flight checks, and running a flow for a command.

DESIGN.md: a list-valued option takes one comma-separated value (`--max-concurrency 1,4,16`,
`--goodput ttft_ms:500,tpot_ms:50`); an option that takes free text is repeated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from flows.shared.inputs import comma_items as comma_items  # re-exported: the commands take them from here
from flows.shared.inputs import fail_input
from flows.shared.inputs import parse_list as parse_list
from flows.shared.inputs import parse_slos as parse_slos
from flows.shared.inputs import rate as rate
from flows.tables.common import console
from tasks.config import ConfigError, describe_validation_error, load_config

T = TypeVar("T")

#: The options every flow command takes, declared once (typer reads the Annotated metadata).


def output_path(param: typer.CallbackParam, path: Path | None) -> Path | None:
    """The callback of an option that names a file to write (``--json``, compare's ``--csv``
    and ``--plot``): :func:`check_output_path` at parse time, before any model load, server
    start, request or tracking-store read."""
    check_output_path(param.opts[0] if param.opts else f"--{param.name}", path)
    return path


JsonOption = Annotated[
    Optional[Path], typer.Option("--json", help="Write the result here.", callback=output_path)
]
NoTrackOption = Annotated[bool, typer.Option("--no-track", help="Do not record in MLflow.")]


def load_or_fail(path: Path | None, model: type[BaseModel]) -> Any:
    """Load a YAML config (None = defaults), exiting 2 with one line on any error."""
    try:
        return load_config(path, model)
    except ConfigError as exc:
        fail_input(str(exc))


def apply_overrides(
    config: BaseModel, section: str | None, overrides: dict[str, Any], flags: dict[str, str] | None = None
) -> BaseModel:
    """Return a validated copy of `config` with CLI values set (None values are left alone).

    `section` names the nested model the overrides go into (e.g. "stream"); None = top level.
    An invalid value exits 2 naming the flag the user typed (``--num-requests``: the field name
    with dashes, or ``flags[field]`` where the flag is spelt otherwise), not the config path.
    """
    data = config.model_dump()
    target = data[section] if section else data
    names: dict[tuple, str] = {}
    for key, value in overrides.items():
        if value is not None:
            target[key] = value
            flag = (flags or {}).get(key, "--" + key.replace("_", "-"))
            names[(section, key) if section else (key,)] = flag
    try:
        return type(config).model_validate(data)
    except ValidationError as exc:
        fail_input(describe_validation_error(exc, "option", type(config), names))


def check_embedded_engine(config: BaseModel) -> None:
    """When the config starts the embedded server (no endpoint.base_url), fail with one line
    (exit 2) if its engine cannot run here, e.g. vllm without ``.venv-vllm`` (names
    ``make vllm``), before any flow starts."""
    from tasks.engines.server import ServerStartError, check_engine

    if config.endpoint.base_url:
        return
    try:
        check_engine(config.server.engine)
    except ServerStartError as exc:
        fail_input(str(exc))


#: How the stream and sweep commands' flags name the endpoint settings.
ENDPOINT_FLAGS = {
    "base_url": "--base-url",
    "model": "--model",
    "api_key_env": "--api-key-env",
    "tokenizer": "--tokenizer",
    "ca_bundle": "--ca-bundle",
}


def check_remote_endpoint(config: BaseModel, flags: dict[str, str] | None = None) -> None:
    """Pre-flight of a configured remote endpoint (``tasks.endpoint.preflight``): one request before
    the first level; a wrong URL path (no ``/v1``), a refused key or a model the server does
    not serve exits 2 with one line naming the setting as ``flags`` spell it (default:
    ``endpoint.<field>``, the config's name) and the fix. The embedded server is not checked
    (this process starts it)."""
    from tasks.endpoint.preflight import PreflightError, check_settings

    try:
        stream = getattr(config, "stream", None)  # a sweep streams chat; a stream may use completions
        check_settings(config.endpoint, api=getattr(stream, "api", "chat"))
    except PreflightError as exc:
        fail_input(exc.line(flags))


def check_hf_model(spec: str, name: str) -> None:
    """An ``hf:`` model spec that is neither a local folder, nor cached, nor reachable on a hub
    exits 2 in seconds with one line naming ``name`` (the flag or config path), instead of
    half a minute of download retries; a cached one is then loaded offline
    (``tasks.endpoint.preflight.check_hf_source``)."""
    from tasks.endpoint.preflight import PreflightError, check_hf_source

    try:
        check_hf_source(spec, name)
    except PreflightError as exc:
        fail_input(f"{name}: {exc.message}")


def check_tokenizer_sources(names: list[str], model_spec: str, setting: str, model_setting: str) -> None:
    """The ``hf:`` tokenizers a tokenize stage would load (and ``model_spec`` for ``model``),
    checked as :func:`check_hf_model` checks a model (``tasks.endpoint.preflight.check_tokenizers``):
    one line naming ``setting`` or ``model_setting``, exit 2, in seconds."""
    from tasks.endpoint.preflight import PreflightError, check_tokenizers

    try:
        check_tokenizers(names, model_spec, setting, model_setting)
    except PreflightError as exc:
        fail_input(exc.line())


def preflight(track: bool, prefect: bool = True) -> None:
    """Fail fast, with one line naming the URL, when a configured server does not answer:
    the MLflow tracking server (when tracking; first, a ``MLFLOW_TRACKING_URI`` MLflow cannot
    open: ``tasks.endpoint.preflight_store.check_tracking_uri``, and a local store it would fail on, a file
    store or a SQLite file that is no database: ``tasks.endpoint.preflight_store.check_local_store``) and the Prefect API (when ``prefect`` and
    PREFECT_API_URL is set; ``compare`` runs no flow). Without this a dead server costs
    minutes of client retries and a stack trace."""
    import urllib.error
    import urllib.request

    from tasks.endpoint.preflight import PreflightError
    from tasks.endpoint.preflight_store import check_local_store, check_tracking_server, check_tracking_uri

    checks = []
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if track and tracking_uri:
        try:
            check_tracking_uri(tracking_uri)
        except PreflightError as exc:
            fail_input(f"MLFLOW_TRACKING_URI: {exc.message}")
    if track:  # a file store, a SQLite file that is no database: one line, not MLflow's traceback
        from tasks.tracking.values import default_tracking_uri

        try:
            check_local_store(tracking_uri or default_tracking_uri())
        except PreflightError as exc:
            fail_input(
                f"{'MLFLOW_TRACKING_URI' if tracking_uri else 'the local MLflow store'}: {exc.message}"
            )
    if track and tracking_uri.startswith("http"):
        checks.append(("MLflow tracking server", tracking_uri.rstrip("/") + "/health", "MLFLOW_TRACKING_URI"))
    prefect_api = os.environ.get("PREFECT_API_URL") if prefect else None
    if prefect and not prefect_api:
        from flows.prefect_server import idle_limit_s

        try:
            idle_limit_s()
        except ValueError as exc:
            fail_input(str(exc))
    if prefect_api:
        checks.append(("Prefect API", prefect_api.rstrip("/") + "/health", "PREFECT_API_URL"))
    for what, url, variable in checks:
        try:
            with urllib.request.urlopen(url, timeout=5):
                pass
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            fail_input(f"{what} at {url} does not answer ({reason}); start it or unset {variable}")
    if track and tracking_uri.startswith("http"):  # it answers: can it reach its database?
        try:
            check_tracking_server(tracking_uri)
        except PreflightError as exc:
            fail_input(f"MLFLOW_TRACKING_URI: {exc.message}")


#: What Prefect's run loggers say when a signal ends a run ("Crash detected! Execution was
#: aborted by an interrupt signal.", "Finished in state Crashed(...)"), at ERROR: the command
#: says it in its own line (:func:`run_flow`), and the run's state still says Crashed.
_SIGNAL_ENDED = ("aborted by an interrupt signal", "aborted by a termination signal")


class _NoSignalCrashLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(said in message for said in _SIGNAL_ENDED)


@contextlib.contextmanager
def _signal_crash_lines_dropped() -> Any:
    quiet, loggers = _NoSignalCrashLines(), [logging.getLogger(f"prefect.{k}_runs") for k in ("flow", "task")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def run_flow(
    name: str,
    flow: Any,
    *args: Any,
    json_path: Path | None = None,
    json_keys: tuple[str, ...] = (),
    **kwargs: Any,
) -> tuple[Any, dict]:
    """Run ``flow`` for the CLI command ``name`` against :func:`flows.shared.prefect_api.prefect_api`;
    write ``--json`` (``json_keys`` of the result plus ``mlflow_run_id``); return the final
    State and the result dict. A flow that failed with a result is reported by the caller.

    Raises:
        typer.Exit: 1 when the flow crashed before producing a result (the cause goes to
            stderr); 128 + the signal after one ended it (130 for a Ctrl-C, 143 for SIGTERM:
            :func:`interrupted_exit_code`), once the runs are marked as interrupted (what
            finished is kept: the message names the records folder).
    """
    from prefect.exceptions import TerminationSignal

    from flows.runs import latest_workdir
    from flows.shared.prefect_api import prefect_api
    from tasks.phases import mark

    mark("preflight")
    # before anything runs: a dead tracking server or Prefect API would cost minutes of retries
    # (the --json path is checked when the option is parsed: JsonOption)
    track = kwargs.get("track", True)
    preflight(track=track)
    try:
        mark("prefect_api")
        with prefect_api(), _signal_crash_lines_dropped():
            mark("flow_call")
            state = flow(*args, return_state=True, **kwargs)
            mark("flow_returned")
    except (KeyboardInterrupt, TerminationSignal) as exc:  # Ctrl-C, or SIGTERM (flows.cli.main)
        code = interrupted_exit_code(getattr(exc, "signal", None))
        if not _SIGNALS:  # Prefect's handler took it and did not pass it on: the exit says which
            note_signal(code - 128)
        workdir = latest_workdir()
        where = f"in {workdir}" if workdir else "(no records folder was made yet)"
        runs = "the MLflow runs are marked KILLED; " if track else ""
        console.print(
            f"[yellow]Interrupted[/]: {runs}the requests and points that finished are kept {where}",
            highlight=False,
        )
        raise typer.Exit(code) from None
    mark("prefect_api_closed")
    result = state.result(raise_on_failure=False)
    report_tracking_journal((result.get("workdir") if isinstance(result, dict) else None) or latest_workdir())
    if not isinstance(result, dict):
        typer.echo(f"{name} failed: {result}", err=True)
        raise typer.Exit(1)
    write_json(json_path, {key: result[key] for key in (*json_keys, "mlflow_run_id")})
    return state, result


#: The signals that interrupted this command, first first (:func:`note_signal`).
_SIGNALS: list[int] = []


def note_signal(signum: int) -> None:
    """Remember a signal that is interrupting the command (``flows.cli.main``'s handlers
    call it before raising KeyboardInterrupt): the exit code will say which."""
    _SIGNALS.append(signum)


def interrupted() -> bool:
    """Whether a signal interrupted this command (:func:`note_signal`)."""
    return bool(_SIGNALS)


def interrupted_exit_code(signum: int | None = None) -> int:
    """The shell's convention for a command a signal ended: 128 + its number (130 for SIGINT,
    143 for SIGTERM). ``signum``: the signal if known (Prefect's TerminationSignal carries it),
    else the first one noted, else SIGINT (Python's own Ctrl-C)."""
    import signal

    return 128 + (signum or (_SIGNALS[0] if _SIGNALS else signal.SIGINT))


#: Lines a command ends with, after its tables (:func:`closing_lines`, called by ``app.main``).
_CLOSING: list[str] = []


def report_tracking_journal(workdir: str | Path | None) -> None:
    """When the tracking server went away during the run (its writes went to the journal in
    the run folder, :mod:`tasks.tracking.journal`), the command ends, after its tables, with
    one line naming the server, why, the folder and the command that uploads the rest; exit 1."""
    from tasks.tracking.journal import offline_note

    note = offline_note(workdir) if workdir else None
    if note is not None:
        _CLOSING.append(
            f"error: MLflow tracking server {note.uri} stopped answering ({note.reason}); the run's "
            f"records are in {workdir}; once the server is back: infermeter sync {workdir}"
        )


def closing_lines(code: Any) -> Any:
    """Print the lines the command saved for its end (stderr); the exit code becomes 1 when
    it was 0 and there were any, and 128 + the signal when one interrupted the command
    (:func:`note_signal`) and it did not end cleanly, wherever it was when the signal came
    (click turns a KeyboardInterrupt outside a flow into "Aborted!" and exit 1; ``infermeter
    server``, which Ctrl-C stops by design, still exits 0)."""
    for line in _CLOSING:
        typer.echo(line, err=True)
    if _SIGNALS and code not in (0, None):
        return interrupted_exit_code()
    return 1 if _CLOSING and code in (0, None) else code


def check_output_path(option: str, path: Path | None) -> None:
    """Exit 2 (one line naming ``option``) when PATH could not be written after the run: PATH
    is a folder, a file stands where one of its folders would be made, or no file can be made
    there (tried: a file is opened for appending, or created and removed, or a folder is made
    and removed where the missing folders would go; so a read-only folder, ``/proc`` or a name
    too long fail here, as root too)."""
    if path is None:
        return
    if path.is_dir():
        example = {"--csv": "table.csv", "--plot": "plot.png"}.get(option, "result.json")
        fail_input(f"{option} {path}: is a folder; give a file path such as {path / example}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                fail_input(f"{option} {path}: {parent} is a file, not a folder; choose another path")
            try:
                if path.exists():
                    with open(path, "a"):
                        pass
                elif parent == path.parent:
                    with open(path, "x"):
                        pass
                    path.unlink()
                else:
                    Path(tempfile.mkdtemp(dir=parent)).rmdir()
            except OSError as exc:
                reason = exc.strerror or type(exc).__name__
                fail_input(f"{option} {path}: cannot write a file there ({reason}); choose another path")
            break


def write_json(path: Path | None, data: dict) -> None:
    """``--json PATH``: ``data`` as indented UTF-8 JSON (parent folders made); None: nothing."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
