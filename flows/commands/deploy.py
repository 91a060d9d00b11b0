"""`infermeter serve` and `infermeter deploy --pool NAME`: deployments for every flow, served from
this process or registered on a work pool, against the Prefect API.

Each flow takes one pydantic config model (AuditConfig, StreamFlowConfig, ProfileFlowConfig,
SweepFlowConfig, TokenizeFlowConfig, CapacityFlowConfig, TuneFlowConfig), so the Prefect UI renders a typed form with the defaults
and descriptions of tasks/config; a run launched from the UI, from
`prefect deployment run NAME --param ...` or from the REST API lands in MLflow with exactly the
parameters it was given. The audit deployment takes the config's `schedule_cron` (off by
default) and compares each run with its baseline.

Runs execute in subprocesses of this process (Prefect's runner). For other machines,
`infermeter deploy --pool NAME` registers the same deployments on a work pool, whose workers
(`prefect worker start --pool NAME`, any folder) run them (README, "Past one machine").
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.shared.common import fail_input, load_or_fail, preflight
from tasks.config import AuditConfig

#: (module, flow attribute, deployment name): every flow that gets a deployment. Modules that
#: are not there (a stage's flow not written yet) are skipped.
FLOWS = (
    ("flows.audit", "audit", "audit"),
    ("flows.stream", "stream", "stream"),
    ("flows.profile", "profile", "profile"),
    ("flows.sweep", "sweep", "sweep"),
    ("flows.tokenize", "tokenize", "tokenize"),
    ("flows.capacity", "capacity", "capacity"),
    ("flows.tune", "tune", "tune"),
)


def available_flows() -> list[tuple[str, object]]:
    """(deployment name, flow object) for every flow module present."""
    found = []
    for module_name, attribute, name in FLOWS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        flow = getattr(module, attribute, None)
        if flow is not None and hasattr(flow, "to_deployment"):
            found.append((name, flow))
    return found


def machine_timezone() -> str:
    """The machine's IANA time zone name (``TZ``, else the /etc/localtime link, else
    /etc/timezone); ``UTC`` when none says."""
    if os.environ.get("TZ", "").strip(":"):
        return os.environ["TZ"].strip(":")
    try:
        return os.path.realpath("/etc/localtime").split("zoneinfo/", 1)[1]
    except (IndexError, OSError):
        pass
    try:
        return Path("/etc/timezone").read_text(encoding="utf-8").strip() or "UTC"
    except OSError:
        return "UTC"


def build_deployments(audit_config: AuditConfig, cron: str | None, timezone: str = "UTC") -> list:
    """Deployment objects: the audit with the given config as its defaults (and schedule: the
    cron string read in ``timezone``, an IANA name; Prefect would otherwise assume UTC), the
    others with their flows' own defaults."""
    from prefect.schedules import Cron
    from prefect.types.entrypoint import EntrypointType

    deployments = []
    for name, flow in available_flows():
        # A module-path entrypoint (flows.audit.audit), not a file path: loading by file path
        # puts flows/ on sys.path, where flows/profile.py and flows/tokenize.py would shadow
        # the standard library's profile and tokenize modules in the flow-run process.
        kwargs = {"name": name, "tags": ["infermeter"], "entrypoint_type": EntrypointType.MODULE_PATH}
        if name == "audit":
            kwargs["parameters"] = {"config": audit_config.model_dump(mode="json")}
            if cron:
                kwargs["schedule"] = Cron(cron, timezone=timezone)
        deployments.append(flow.to_deployment(**kwargs))
    return deployments


ConfigOption = Annotated[
    Optional[Path], typer.Option(help="Audit config whose values are the form's defaults.")
]
CronOption = Annotated[
    Optional[str], typer.Option(help="Cron schedule for the audit (overrides schedule_cron).")
]
TimezoneOption = Annotated[
    Optional[str],
    typer.Option(help="IANA time zone the --cron schedule is read in. [default: the machine's]"),
]


def _deployments(config: Path | None, cron: str | None, timezone: str | None) -> list:
    """What `serve` and `deploy` share: PREFECT_API_URL set and answering, the audit config
    (with --cron) and the time zone checked (each bad one exits 2 with one line), then
    :func:`build_deployments`."""
    if not os.environ.get("PREFECT_API_URL"):
        fail_input(
            "PREFECT_API_URL is not set: start a server (`.venv/bin/prefect server start`) and "
            "export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    cfg = load_or_fail(config, AuditConfig)
    if cron is not None:
        try:
            cfg = AuditConfig.model_validate({**cfg.model_dump(), "schedule_cron": cron})
        except Exception:
            fail_input(f"--cron: {cron!r} is not a cron string; e.g. '0 3 * * *' for 03:00 daily")
    zone = timezone or machine_timezone()
    try:
        from zoneinfo import ZoneInfo

        ZoneInfo(zone)
    except (ValueError, KeyError, OSError):
        fail_input(f"--timezone: {zone!r} is not an IANA time zone name; e.g. Europe/Paris or UTC")
    preflight(track=True)
    return build_deployments(cfg, cfg.schedule_cron, zone)


def command(
    config: ConfigOption = None,
    cron: CronOption = None,
    limit: Annotated[int, typer.Option(help="Flow runs executed at once.")] = 1,
    timezone: TimezoneOption = None,
) -> None:
    """Serve a Prefect deployment of every flow from this process, so that runs can be launched
    from the Prefect UI, CLI or API (against PREFECT_API_URL; Ctrl-C stops)."""
    from prefect import serve

    serve(*_deployments(config, cron, timezone), limit=limit)


def deploy_command(
    pool: Annotated[
        str, typer.Option(help="The Prefect work pool (`prefect work-pool create NAME --type process`).")
    ],
    config: ConfigOption = None,
    cron: CronOption = None,
    timezone: TimezoneOption = None,
) -> None:
    """Register every flow's deployment on a Prefect work pool, so that workers on other machines
    run them.

    A worker is `prefect worker start --pool NAME`, started from any folder of a machine with this
    repository's .venv."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deployments = _deployments(config, cron, timezone)
    try:
        with get_client(sync_client=True) as client:
            kind = client.read_work_pool(pool).type
    except ObjectNotFound:
        fail_input(
            f"--pool: no work pool {pool!r} at {os.environ['PREFECT_API_URL']}; create it "
            f"(`prefect work-pool create {pool} --type process`) or name another"
        )
    for deployment in deployments:
        deployment_id = deployment.apply(work_pool_name=pool)
        typer.echo(f"{deployment.flow_name}/{deployment.name}: {deployment_id} (pool {pool}, {kind})")
    typer.echo(f"Start a worker on each machine that runs flows: prefect worker start --pool {pool}")
