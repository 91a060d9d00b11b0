"""What ``task_runner`` (``sweep.task_runner``, ``profile.task_runner``, ``--task-runner``) may
say, read without Prefect or Dask (the config's field validates with it;
tasks/pipeline/fanout.py runs it): ``threads`` (in this process), ``dask`` (a new LocalCluster,
one worker per core), ``dask:N`` (N workers) or ``dask:ADDRESS`` (the scheduler at ADDRESS).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
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

#: How long the reachability check waits for each of its steps (the name resolved, the TCP
#: connection, the scheduler's handshake), seconds: an address that never answers is named
#: within ~3 times this, not waited on (``distributed.Client`` waits for the handshake forever).
CONNECT_TIMEOUT_S = 3.0
#: A Dask server writes its handshake as soon as it accepts a connection (msgpack, with this
#: key: ``distributed.comm.core.Listener.on_connection``, ``Comm.handshake_info``).
DASK_HANDSHAKE_KEY = b"pickle-protocol"

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
    per core); otherwise the scheduler at that address. ``text``: what the user wrote
    (``dask:abc:8786``), which the messages quote; not part of the choice's identity."""

    address: str | None = None
    workers: int | None = None
    text: str | None = field(default=None, compare=False, repr=False)

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
        ValueError: anything else, e.g. ``dask:abc``, ``dask:0``, ``dask:-1`` (one line quoting
            ``text`` and naming the accepted forms, :data:`FORMS`; a host without a port is
            given its likely meaning, ``dask:tcp://abc:8786``, Dask's default port)."""
    if text is None or text.strip() == "threads":
        return None
    kind, sep, rest = text.strip().partition(":")
    rest = rest.strip()  # "dask: 2" (a space after the colon, as YAML writes one): dask:2
    if kind != "dask" or (sep and not rest):
        raise ValueError(f"{text!r} is not a task runner: {FORMS}")
    if not rest:
        return DaskChoice(text=text)
    if rest.lstrip("+-").isdigit():
        if int(rest) < 1:
            raise ValueError(f"{text!r} is not a task runner (N must be at least 1): {FORMS}")
        return DaskChoice(workers=int(rest), text=text)
    address = rest if "://" in rest else f"tcp://{rest}"
    parsed = urlparse(address)
    try:
        port = parsed.port
    except ValueError:  # not a number, or out of range
        port = -1
    if parsed.scheme not in ("tcp", "tls") or not parsed.hostname or not port or port < 0:
        hint = ""
        if parsed.scheme in ("tcp", "tls") and parsed.hostname and port is None:
            hint = f"; did you mean dask:{parsed.scheme}://{parsed.hostname}:8786?"
        raise ValueError(
            f"{text!r} is not a task runner (a scheduler needs a host and a port{hint}): {FORMS}"
        )
    return DaskChoice(address=address, text=text)


def check_task_runner(text: str | None) -> DaskChoice | None:
    """:func:`parse_task_runner`, then for an address: its host resolved, a TCP connection to
    it, and for ``tcp://`` the scheduler's handshake read (each step within
    :data:`CONNECT_TIMEOUT_S`), so that a scheduler where nothing listens, or a port where
    something else does (the dashboard's 8787), is named in seconds before any measurement
    (``distributed.Client`` would wait for that handshake forever); for ``tls://``, Dask's TLS
    settings too (:func:`check_dask_tls`; the handshake is then inside TLS, not read).

    Raises:
        ValueError: a bad spec, a ``tls://`` address without Dask's TLS settings, a host that
            does not resolve, nothing accepts connections at the address, or what does is no
            Dask scheduler (one line quoting ``text``)."""
    choice = parse_task_runner(text)
    if choice is None or choice.address is None:
        return choice
    parsed = urlparse(choice.address)
    if parsed.scheme == "tls":
        check_dask_tls(choice.address)
    start = f"`dask scheduler{' --protocol tls' if parsed.scheme == 'tls' else ''}`"
    fix = f"start one ({start}) or use dask for a local cluster"
    try:
        found = _dask_handshake(parsed.hostname or "", parsed.port or 0, read=parsed.scheme == "tcp")
    except OSError as exc:
        raise ValueError(
            f"{text!r} names no Dask scheduler: nothing answers at {choice.address} "
            f"({exc.strerror or exc}); {fix}"
        ) from None
    if found is not None and DASK_HANDSHAKE_KEY not in found:
        said = f"it said {found[:24]!r}" if found else f"it said nothing in {CONNECT_TIMEOUT_S:g} s"
        raise ValueError(
            f"{text!r} names no Dask scheduler: something accepts connections at {choice.address} "
            f"but it is no Dask scheduler ({said}; a dashboard's port? a scheduler listens on 8786 "
            f"unless told otherwise); {fix}"
        )
    return choice


def _dask_handshake(host: str, port: int, *, read: bool) -> bytes | None:
    """What the server at ``host``:``port`` writes first (up to its Dask handshake; b"" when it
    wrote nothing within :data:`CONNECT_TIMEOUT_S`), None when ``read`` is False (connected
    only). The name is resolved in a thread of its own so that a resolver that hangs is bounded
    too (``socket.create_connection``'s timeout does not cover it).

    Raises:
        OSError: the host does not resolve, or no connection to it (its reason)."""
    infos: list[Any] = []
    failure: list[OSError] = []

    def resolve() -> None:
        try:
            infos.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            failure.append(exc)

    resolver = threading.Thread(target=resolve, daemon=True, name="dask-address-resolve")
    resolver.start()
    resolver.join(CONNECT_TIMEOUT_S)
    if failure:
        raise OSError(f"{host} does not resolve: {failure[0].strerror or failure[0]}")
    if not infos:
        raise OSError(f"{host} did not resolve in {CONNECT_TIMEOUT_S:g} s")
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(address)
        except TimeoutError:
            raise OSError(f"no answer in {CONNECT_TIMEOUT_S:g} s") from None
        if not read:
            return None
        said = b""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while DASK_HANDSHAKE_KEY not in said and len(said) < 4096:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(4096)
            except (TimeoutError, OSError):
                break
            if not chunk:
                break
            said += chunk
        return said


def validate(text: str) -> str:
    """The config's validator: ``text`` without surrounding blanks when :func:`parse_task_runner`
    reads it (``threads `` is ``threads`` wherever it is compared).

    Raises:
        ValueError: it does not (pydantic reports it under the field's name)."""
    parse_task_runner(text)
    return text.strip()


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
