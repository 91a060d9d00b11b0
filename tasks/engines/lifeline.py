"""Make a server child die with the command that started it, however that command ends.

``python -m tasks.engines.lifeline FD COMMAND...`` (what :func:`tasks.engines.server.background_server` runs):
fork a small watcher, then ``exec`` COMMAND in place (so the server keeps this process's pid,
and is the leader of the session the caller started it in). The watcher blocks reading FD, the
read end of a pipe whose only write end the starting command holds. That read returns EOF when
the command's end is closed: on its clean exit (after it stopped the server itself), on
SIGINT/SIGTERM, and on SIGKILL (the kernel closes a dead process's files). On EOF the watcher
sends SIGTERM to the server's process group, waits up to :data:`GRACE_S`, then SIGKILL.

``python -m tasks.engines.lifeline --runs FD OWNER TRACKING_URI EXPERIMENT`` (what
:func:`tasks.tracking.run_owner.start_runs_lifeline` runs, for a command that tracks in its own
process): the same pipe, for the command's MLflow runs. The command writes ``done`` once its
parent run is ended; an EOF without it means the command died with its runs open (SIGKILL, the
OOM killer): once the command (``OWNER``, ``tasks.tracking.run_owner.process_identity``) is
certainly gone, the watcher ends KILLED every RUNNING run of the store whose owner is gone
(``tasks.tracking.Tracker.close_abandoned``: an ``error`` tag names the process and the records
folder) and exits. It imports MLflow only then: a command that ended its runs costs it nothing
but this process's start. A command still alive :data:`OWNER_WAIT_S` after the EOF keeps its runs.

Why a pipe and not ``PR_SET_PDEATHSIG``: the death signal fires when the *thread* that forked
the child exits, and Prefect may run the task that starts a server in a worker thread; a
pipe's end belongs to the process. Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: Seconds between the watcher's SIGTERM to the server's group and its SIGKILL.
GRACE_S = 5.0
#: Seconds a runs watcher waits, after the EOF, for the command to be gone (its files close first).
OWNER_WAIT_S = 5.0
#: What the command writes once its runs are ended (``--runs``).
DONE = b"done"


def _watch(fd: int, pgid: int) -> None:
    """The watcher: wait for EOF on ``fd``, then stop the group (ourselves last)."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # our own TERM to the group must not end us
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        os._exit(0)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if not _others_alive(pgid):
            break
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)  # the rest of the group, and this watcher with it
    os._exit(0)


def _others_alive(pgid: int) -> bool:
    """Whether a process of the group besides this one is alive (Linux /proc)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _watch_runs(fd: int, owner: str, tracking_uri: str, experiment: str) -> None:
    """The runs watcher (``--runs``): read ``fd`` to EOF; without :data:`DONE` before it, end
    the gone command's runs KILLED."""
    said = b""
    try:
        while chunk := os.read(fd, 4096):
            said += chunk
    except OSError:
        pass
    if said.endswith(DONE):
        return
    from tasks.tracking.run_owner import owner_gone

    deadline = time.monotonic() + OWNER_WAIT_S
    while not owner_gone(owner):
        if time.monotonic() > deadline:
            return  # alive: its runs are its own to end
        time.sleep(0.02)
    from tasks.tracking import Tracker

    try:
        for gone in Tracker(experiment, tracking_uri).close_abandoned():
            print(
                f"infermeter: MLflow run {gone['run_id']} ({gone['name']}) left RUNNING by a killed "
                f"command: marked KILLED; its records are in {gone['records_folder']}",
                file=sys.stderr,
            )
    except Exception as exc:  # noqa: BLE001  (the store is gone too: the next command closes them)
        print(f"infermeter: could not end a killed command's MLflow runs: {exc}", file=sys.stderr)


def main(argv: list[str]) -> None:
    if argv[0] == "--runs":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the command's
        _watch_runs(int(argv[1]), *argv[2:5])
        sys.stderr.flush()
        os._exit(0)
    fd, command = int(argv[0]), argv[1:]
    pgid = os.getpgid(0)
    if os.fork() == 0:
        _watch(fd, pgid)
    os.close(fd)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
