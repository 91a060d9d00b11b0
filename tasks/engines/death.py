"""A server this command started, dead while the command used it: noticed, named, counted.

A server started by :func:`tasks.engines.server.background_server` (the embedded llama.cpp or vLLM
server, a tune configuration's, Prefect's local API) is watched by a :class:`DeathWatch`
thread from the moment it answers until the command stops it. An exit in between is a
:class:`ServerDeath`: its exit code or signal by name, when, and its log. The command then says
so (:class:`ServerDiedError`, raised when the server's ``with`` block ends, whatever the block
did) instead of blaming the endpoint's address: before, a llama.cpp server that crashed with
SIGSEGV on its first request read as "could not connect ... is the server running and the
base_url right?", 50 of 50 times (issue 48).

The requests are told apart where they are measured (:func:`server_gone`, on the server's pid,
in every client process): a request refused or cut because that server is gone is of the class
``server_died`` (:data:`tasks.wire.errors.SERVER_DIED`), not ``connection`` against the
endpoint; a loopback server we started refuses no connection while it lives, and the request in
flight at its death is cut by it. Standard library and psutil.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

#: Seconds between two looks at the server: how late a death is noticed at most.
POLL_S = 0.1
#: pid -> its death, for the command's own process (where the watch runs): the level loop names
#: the signal and the log without waiting for the server's block to end.
_DEATHS: dict[int, ServerDeath] = {}
#: The pids a :class:`DeathWatch` of this process looks at (or looked at until its block ended).
_WATCHED: set[int] = set()
#: What a signal that kills an engine usually means, for the message.
_SIGNAL_HINTS = {
    signal.SIGSEGV: "a crash inside the engine",
    signal.SIGILL: "an instruction this CPU lacks: an engine built for another CPU",
    signal.SIGBUS: "a crash inside the engine (bad memory access)",
    signal.SIGABRT: "the engine aborted itself (an assertion)",
    signal.SIGKILL: "killed from outside: the kernel's out-of-memory killer, or a person",
    signal.SIGTERM: "stopped from outside",
}


@dataclass(frozen=True)
class ServerDeath:
    """A watched server's exit.

    Attributes:
        name: what it is (``llamacpp server``, ``vllm server``, ``Prefect API server``).
        pid: its process id.
        returncode: ``Popen.returncode``: the exit code, or minus the signal that ended it.
        lived_s: seconds from its start to the moment its exit was noticed (at most
            :data:`POLL_S` late).
        log_path: its combined stdout/stderr.
    """

    name: str
    pid: int
    returncode: int
    lived_s: float
    log_path: Path

    @property
    def signal_name(self) -> str | None:
        """``SIGSEGV`` ... where a signal ended it, else None."""
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def how(self) -> str:
        """``killed by SIGSEGV (a crash inside the engine)`` or ``exited with code 1``."""
        if self.returncode >= 0:
            return f"exited with code {self.returncode}"
        hint = _SIGNAL_HINTS.get(-self.returncode)
        return f"killed by {self.signal_name}" + (f" ({hint})" if hint else "")

    def error(self, cause: BaseException | None = None) -> ServerDiedError:
        """The error the server's block ends with: this death named, with the counts the level
        loop gave where ``cause`` is its :class:`ServerDiedError` (raised in a process that did
        not watch the server)."""
        counts = {k: getattr(cause, k, None) for k in ("answered", "cut", "unsent")}
        return ServerDiedError(death_message(self, **counts), death=self, **counts)


class ServerDiedError(RuntimeError):
    """A server this command started died while the command used it.

    Attributes:
        death: what :class:`DeathWatch` saw (None where only the pid's absence is known: a
            client process, a Dask worker).
        answered: measured requests (warm-ups excluded) that succeeded before it, where counted.
        cut: requests of class ``server_died``, where counted.
        unsent: requests of the run not sent because of it, where counted.
    """

    def __init__(
        self,
        message: str,
        *,
        death: ServerDeath | None = None,
        answered: int | None = None,
        cut: int | None = None,
        unsent: int | None = None,
    ) -> None:
        super().__init__(message)
        self.death, self.answered, self.cut, self.unsent = death, answered, cut, unsent


def _counts(answered: int | None, cut: int | None, unsent: int | None) -> str:
    """``21 requests answered before it, 3 refused or cut by its death (...), 376 not sent``
    (measured requests: warm-ups are in none of the three)."""
    if answered is None:
        return ""
    said = f"{answered} request{'s' if answered != 1 else ''} answered before it"
    if cut:
        said += (
            f", {cut} refused or cut by its death (class server_died, not the endpoint's connection errors)"
        )
    return said + (f", {unsent} not sent" if unsent else "")


def death_message(
    death: ServerDeath,
    answered: int | None = None,
    cut: int | None = None,
    unsent: int | None = None,
    tail: int = 12,
) -> str:
    """What the command says: ``the embedded llama.cpp server (pid 4242) died 15.2 s after it
    started: killed by SIGSEGV (a crash inside the engine); 21 requests answered before it, 3
    refused or cut by its death (class server_died, not the endpoint's connection errors), 376
    not sent`` (the counts where the stage gave them); then the last ``tail`` lines of its log and
    where the whole log is, and for a crash what to do. (A crash's log says nothing of it: the
    last lines show what it was doing.)"""
    counts = _counts(answered, cut, unsent)
    counts = f"; {counts}" if counts else ""
    try:
        last = death.log_path.read_text(errors="replace").splitlines()[-tail:]
    except OSError:
        last = []
    # "llamacpp server" is ours and embedded; "the server command (vllm)" and "Prefect's
    # temporary API server" say what they are themselves
    subject = (
        death.name if death.name.startswith("the ") or "'s " in death.name else f"the embedded {death.name}"
    )
    lines = [
        f"{subject} (pid {death.pid}) died {death.lived_s:.1f} s after it started: {death.how()}{counts}",
        f"its log ends ({death.log_path}):",
        *(f"  {line}" for line in last or ["(empty)"]),
    ]
    if -death.returncode in (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS):
        lines.append(
            "check the engine with `infermeter doctor`; a llama.cpp built for another CPU (or natively, "
            "INFERMETER_LLAMA_BUILD=native, on a CPU with AMX) is rebuilt portable by `make install`"
        )
    return "\n".join(lines)


def server_died_error(
    pid: int | None, answered: int, cut: int, where: str = "", unsent: int | None = None
) -> ServerDiedError:
    """The error that ends a stage once the embedded server ``pid`` died in it (``where``: the
    stream's `` during level 2``, the sweep's `` during the sweep``): its death named where this
    process watched it (:func:`died`), else what is known, the pid; with the measured requests
    answered before it, those it refused or cut, and those not sent because of it."""
    death = died(pid, wait_s=2.0) if pid else None
    counts = {"answered": answered, "cut": cut, "unsent": unsent}
    if death is not None:
        return ServerDiedError(death_message(death, **counts), death=death, **counts)
    said = _counts(answered, cut, unsent)
    return ServerDiedError(f"the server this command started (pid {pid}) died{where}: {said}", **counts)


def died(pid: int, wait_s: float = 0.0) -> ServerDeath | None:
    """The death :class:`DeathWatch` saw of ``pid`` in this process, if any. ``wait_s``: where
    this process watches ``pid``, how long to give its watch to see a death the requests saw
    first (it looks every :data:`POLL_S`)."""
    deadline = time.monotonic() + wait_s
    while pid not in _DEATHS and pid in _WATCHED and time.monotonic() < deadline:
        time.sleep(POLL_S / 4)
    return _DEATHS.get(pid)


def server_gone(pid: int | None) -> bool:
    """Whether the server ``pid`` is no longer running (gone, or a zombie not yet reaped).
    False for None."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # alive, someone else's
        return False


def gone_within(pid: int, seconds: float) -> bool:
    """Whether the server ``pid`` is gone, or goes within ``seconds`` (a dying process's
    sockets close before it is a zombie, a SIGSEGV's core dump first: a client sees the cut a
    moment before the pid shows the death). Blocks; the stream client has an async twin that
    yields to its loop (``tasks.stream.client``)."""
    deadline = time.monotonic() + seconds
    while not server_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


class DeathWatch:
    """A daemon thread that looks at ``proc`` every :data:`POLL_S` s until :meth:`stop`; an exit
    before that is :attr:`death` (also in :func:`died`, for this process)."""

    def __init__(
        self, name: str, proc: subprocess.Popen, log_path: Path, started: float | None = None
    ) -> None:
        self.name, self.proc, self.log_path = name, proc, log_path
        self.started = time.monotonic() if started is None else started
        self.death: ServerDeath | None = None
        _WATCHED.add(proc.pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"death-watch-{proc.pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            code = self.proc.poll()
            if code is not None:
                self.death = ServerDeath(
                    self.name, self.proc.pid, code, time.monotonic() - self.started, self.log_path
                )
                _DEATHS[self.proc.pid] = self.death
                return

    def stop(self) -> ServerDeath | None:
        """Stop watching (before the command stops the server itself); the death seen, if any.
        A server found dead at this last look counts as dead too."""
        self._stop.set()
        self._thread.join()
        if self.death is None:
            code = self.proc.poll()
            if code is not None:
                self.death = ServerDeath(
                    self.name, self.proc.pid, code, time.monotonic() - self.started, self.log_path
                )
                _DEATHS[self.proc.pid] = self.death
        return self.death
