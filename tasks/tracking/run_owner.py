"""Which process owns an MLflow run, and whether that process is gone.

Every run is created with its owner's host name and identity (:mod:`tasks.tracking` tags it): a
command killed by SIGKILL (the OOM killer, a CI runner's timeout) cannot end its runs, so the
next command against the store closes the RUNNING runs whose owner is certainly gone
(``Tracker.close_abandoned``). "Certainly" is what keeps a live command's runs open, however
many run at once:

- the identity is ``<boot id>/<pid namespace>/<pid>/<start time>`` (Linux: the kernel's boot
  id, ``/proc/<pid>/ns/pid``, and the process's start time in clock ticks since boot, field 22
  of ``/proc/<pid>/stat``), so a pid the kernel handed to another process since is not taken
  for the owner;
- only runs of this host are judged (the caller filters on the host name), and only when the
  pid namespace is ours (a container that shares the host name and the store, but not our
  pids, cannot be seen: never judged);
- a different boot id on the same host means the machine restarted since: the owner is gone.

Where ``/proc`` is missing (not Linux) the identity holds ``-`` for what it cannot read and the
judgement falls back on whether the pid exists. Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "OWNER_HOST_TAG",
    "OWNER_TAG",
    "RECORDS_TAG",
    "close_abandoned_runs",
    "owner_gone",
    "process_identity",
    "start_runs_lifeline",
]

#: Tags every run is created with (``tasks.tracking``): the host and the identity of the process
#: that created it, and the work folder its records are kept in (when it has one). A run left
#: RUNNING by an owner that is gone is closed KILLED by the next command (``close_abandoned_runs``).
OWNER_HOST_TAG = "owner_host"
OWNER_TAG = "owner_process"
RECORDS_TAG = "records_folder"

UNKNOWN = "-"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return None


def _boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id") or UNKNOWN


def _pid_namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")  # e.g. pid:[4026531836]
    except OSError:
        return UNKNOWN


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in ticks) of ``pid`` from ``/proc/<pid>/stat``; None: no such file."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return fields[0], fields[19]


def process_identity(pid: int | None = None) -> str:
    """``<boot id>/<pid namespace>/<pid>/<start time>`` of ``pid`` (default: this process)."""
    pid = pid or os.getpid()
    stat = _stat(pid)
    return "/".join((_boot_id(), _pid_namespace(pid), str(pid), stat[1] if stat else UNKNOWN))


def owner_gone(identity: str) -> bool:
    """Whether the process that ``identity`` (:func:`process_identity`, read on this host)
    names has certainly ended; False when it is alive or cannot be judged from here."""
    try:
        boot, namespace, pid_text, start = identity.split("/")
        pid = int(pid_text)
    except ValueError:
        return False  # not ours to judge
    if boot != UNKNOWN and _boot_id() not in (UNKNOWN, boot):
        return True  # this host restarted since
    if namespace != UNKNOWN and _pid_namespace(os.getpid()) != namespace:
        return False  # another pid namespace: its pids are not ours to look up
    stat = _stat(pid)
    if stat is None:
        if os.path.isdir("/proc/self"):
            return True
        try:  # no /proc: the pid alone
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    state, started = stat
    return state in ("Z", "X") or (start != UNKNOWN and started != start)


def close_abandoned_runs(client: Any, host: str) -> list[dict]:
    """End KILLED every RUNNING run of the store (any experiment) that ``client`` (an
    ``MlflowClient``: only its methods are called, mlflow is not imported here) reaches whose
    owner ran on ``host`` and is certainly gone (:func:`owner_gone`), with an ``error`` tag naming
    the process and the records folder (a run that failed before keeps its own). Returns
    ``{"run_id", "name", "records_folder"}`` per run closed."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    query = f"attributes.status = 'RUNNING' and tags.{OWNER_HOST_TAG} = '{host}'"
    closed, page = [], None
    while experiments:
        runs = client.search_runs(experiments, query, max_results=1000, page_token=page)
        for run in runs:
            tags = run.data.tags
            if not owner_gone(tags.get(OWNER_TAG, "")):
                continue
            pid, folder = tags[OWNER_TAG].split("/")[2], tags.get(RECORDS_TAG)
            if "error" not in tags:  # a run that failed before its owner died says why
                where = f"; its records are in {folder}" if folder else ""
                message = f"killed: process {pid} on {host} ended without ending this run{where}"
                client.set_tag(run.info.run_id, "error", message)
            client.set_terminated(run.info.run_id, status="KILLED")
            closed.append({"run_id": run.info.run_id, "name": run.info.run_name, "records_folder": folder})
        page = runs.token
        if not page:
            break
    return closed


def start_runs_lifeline(owner: str, tracking_uri: str, experiment: str) -> Callable[[], None]:
    """Start the watcher that ends this command's runs KILLED should it die with them open
    (``python -m tasks.engines.lifeline --runs``: it reads a pipe whose write end only this process
    holds; the kernel closes it on SIGKILL too). ``owner``: the runs' owner (this process's
    :func:`process_identity`). Returns ``release``: call it once the runs are ended (it says
    ``done`` and closes the pipe; the watcher then exits without importing MLflow). The watcher
    runs in a session of its own, so a signal to the command's process group leaves it to do
    its work; it lives no longer than the command, plus the few seconds that work takes."""
    watch, hold = os.pipe()  # both close-on-exec: only the watcher is given `watch`
    try:
        subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "tasks.engines.lifeline",
                "--runs",
                str(watch),
                owner,
                tracking_uri,
                experiment,
            ],
            pass_fds=(watch,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # (stderr: the command's, for the runs it ends)
            start_new_session=True,
        )
    except BaseException:
        os.close(hold)
        raise
    finally:
        os.close(watch)

    held = [hold]

    def release() -> None:
        while held:  # once: the fd number may be another file's afterwards
            fd = held.pop()
            try:
                os.write(fd, b"done")
            except OSError:
                pass  # the watcher is gone already
            os.close(fd)

    return release
