"""What ``task_runner`` (``sweep.task_runner``, ``profile.task_runner``, ``--task-runner``) may
say, read without Prefect or Dask (the config's field validates with it;
tasks/pipeline/fanout.py runs it): ``threads`` (in this process), ``dask`` (a new LocalCluster,
one worker per core), ``dask:N`` (N workers) or ``dask:ADDRESS`` (the scheduler at ADDRESS).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from typing import Annotated, Any
from urllib.parse import urlparse

from pydantic import AfterValidator, Field

__all__ = [
    "CONNECT_TIMEOUT_S",
    "DASK_TLS_ENV",
    "FORMS",
    "QUIET_DASK_WORKER",
    "TASK_RUNNER_FIELD",
    "DaskChoice",
    "TaskRunner",
    "check_dask_tls",
    "check_task_runner",
    "parse_task_runner",
    "validate",
]

#: How long the reachability check waits for a TCP connection to a Dask scheduler, seconds.
CONNECT_TIMEOUT_S = 3.0

#: Dask settings for the workers of a LocalCluster we start, whose task thread measures: the
#: worker's own event loop otherwise wakes 300-700 times a second (its 20 ms tick, its 500 ms
#: system monitor, its 10 ms profiler) and takes the GIL from the measurement each time (README
#: "Load from several hosts"). The memory monitor keeps its 100 ms where a point may load a
#: model (``tasks.pipeline.fanout``): its pause and terminate must act in time.
QUIET_DASK_WORKER = {
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "1s",
    "distributed.worker.profile.enabled": False,
}


@dataclass(frozen=True)
class DaskChoice:
    """Where points run. ``address`` None: a LocalCluster of ``workers`` processes (None: one
    per core); otherwise the scheduler at that address."""

    address: str | None = None
    workers: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"address": self.address, "workers": self.workers}

    def at_most(self, streams: int) -> DaskChoice:
        """This choice with a LocalCluster of at most ``streams`` workers (None: one per core,
        as many): a worker beyond the streams would have no share. A scheduler's is unchanged."""
        if self.address is not None:
            return self
        return replace(self, workers=max(1, min(self.workers or os.cpu_count() or 1, streams)))


#: The accepted forms, for the messages.
FORMS = (
    "give threads (here), dask (a LocalCluster, a worker per core), dask:N (a LocalCluster of N "
    ">= 1 workers) or dask:tcp://HOST:PORT (a Dask scheduler)"
)


def parse_task_runner(text: str | None) -> DaskChoice | None:
    """``threads``/None -> None (in-process); ``dask`` / ``dask:N`` / ``dask:ADDRESS`` -> a
    :class:`DaskChoice` (an address ``tcp://`` or ``tls://`` with a host and a port; ``tcp://``
    when it names none).

    Raises:
        ValueError: anything else, e.g. ``dask:abc``, ``dask:0``, ``dask:-1`` (one line naming
            the accepted forms: :data:`FORMS`)."""
    if text is None or text == "threads":
        return None
    kind, sep, rest = text.partition(":")
    if kind != "dask" or (sep and not rest):
        raise ValueError(f"{text!r} is not a task runner: {FORMS}")
    if not rest:
        return DaskChoice()
    if rest.lstrip("+-").isdigit():
        if int(rest) < 1:
            raise ValueError(f"{text!r} is not a task runner (N must be at least 1): {FORMS}")
        return DaskChoice(workers=int(rest))
    address = rest if "://" in rest else f"tcp://{rest}"
    parsed = urlparse(address)
    try:
        port = parsed.port
    except ValueError:  # not a number, or out of range
        port = None
    if parsed.scheme not in ("tcp", "tls") or not parsed.hostname or not port:
        raise ValueError(f"{text!r} is not a task runner (a scheduler needs a host and a port): {FORMS}")
    return DaskChoice(address=address)


def check_task_runner(text: str | None) -> DaskChoice | None:
    """:func:`parse_task_runner`, then for an address a TCP connection to its host and port
    (``CONNECT_TIMEOUT_S``), so that a scheduler where nothing listens is named before any
    measurement; for ``tls://``, Dask's TLS settings too (:func:`check_dask_tls`).

    Raises:
        ValueError: a bad spec, a ``tls://`` address without Dask's TLS settings, or nothing
            accepts connections at the address (one line)."""
    choice = parse_task_runner(text)
    if choice is None or choice.address is None:
        return choice
    parsed = urlparse(choice.address)
    if parsed.scheme == "tls":
        check_dask_tls(choice.address)
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ValueError(
            f"no Dask scheduler answers at {choice.address} ({exc.strerror or exc}); start one "
            f"(`dask scheduler{' --protocol tls' if parsed.scheme == 'tls' else ''}`) or use "
            "--task-runner dask for a local cluster"
        ) from None
    return choice


def validate(text: str) -> str:
    """The config's validator: ``text`` unchanged when :func:`parse_task_runner` reads it.

    Raises:
        ValueError: it does not (pydantic reports it under the field's name)."""
    parse_task_runner(text)
    return text


#: The config field (``sweep.task_runner``, ``profile.task_runner``): validated by :func:`validate`.
TaskRunner = Annotated[str, AfterValidator(validate)]
TASK_RUNNER_FIELD = Field(
    "threads",
    description="Where the points run: threads (this process), dask (a Dask LocalCluster, one "
    "worker per core), dask:N (N workers) or dask:ADDRESS (a scheduler, e.g. "
    "dask:tcp://10.0.0.5:8786), through prefect-dask.",
)


#: The environment variables of Dask's TLS settings a client needs (Dask's configuration,
#: ``distributed.comm.tls``: https://distributed.dask.org/en/stable/tls.html).
DASK_TLS_ENV = (
    "DASK_DISTRIBUTED__COMM__TLS__CA_FILE",
    "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT",
    "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY",
)


def check_dask_tls(address: str) -> None:
    """A ``tls://`` scheduler needs the client's TLS context from Dask's configuration: the CA
    that signed the scheduler's certificate and this client's certificate (its key beside it,
    or in the certificate's file). Without them ``distributed.Client`` fails mid-run with a
    TypeError about an ``ssl_context``; here the missing or unreadable setting is named before
    any measurement.

    Raises:
        ValueError: the CA or the certificate is not set (the message names the variables of
            :data:`DASK_TLS_ENV` that are missing), a file named is not there (the variable and
            the path), or the files are not a CA, certificate and key that go together."""
    import ssl

    from distributed import Security

    security = Security()
    settings = zip(DASK_TLS_ENV, (security.tls_ca_file, security.tls_client_cert, security.tls_client_key))
    named = {env: value for env, value in settings if value}
    missing = [env for env in DASK_TLS_ENV[:2] if env not in named]
    if missing:
        raise ValueError(
            f"{address} is a TLS scheduler but Dask's TLS settings lack {' and '.join(missing)}: set "
            f"{', '.join(DASK_TLS_ENV)} (PEM files: the scheduler's CA, this client's certificate "
            "and its key; the key may be in the certificate's file) or use tcp://"
        )
    for env, value in named.items():
        if "\n" not in value and not os.path.isfile(value):  # a value with lines is the PEM itself
            raise ValueError(f"{env} names {value}, which is not a file (Dask's TLS settings for {address})")
    try:
        security.get_connection_args("client")
    except (OSError, ValueError, ssl.SSLError) as exc:
        keyless = (
            f" (no {DASK_TLS_ENV[2]}: the certificate's file must hold the key)" if len(named) < 3 else ""
        )
        raise ValueError(
            f"Dask's TLS settings for {address} cannot be used ({exc}): {', '.join(named)} must name "
            f"PEM files: the scheduler's CA, this client's certificate and the key that goes with it{keyless}"
        ) from None
