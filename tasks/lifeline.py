"""Make a server child die with the command that started it, however that command ends.

``python -m tasks.lifeline FD COMMAND...`` (what :func:`tasks.server.background_server` runs):
fork a small watcher, then ``exec`` COMMAND in place (so the server keeps this process's pid,
and is the leader of the session the caller started it in). The watcher blocks reading FD, the
read end of a pipe whose only write end the starting command holds. That read returns EOF when
the command's end is closed: on its clean exit (after it stopped the server itself), on
SIGINT/SIGTERM, and on SIGKILL (the kernel closes a dead process's files). On EOF the watcher
sends SIGTERM to the server's process group, waits up to :data:`GRACE_S`, then SIGKILL.

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


def main(argv: list[str]) -> None:
    fd, command = int(argv[0]), argv[1:]
    pgid = os.getpgid(0)
    if os.fork() == 0:
        _watch(fd, pgid)
    os.close(fd)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
