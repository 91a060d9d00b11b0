"""Benchmark: where the seconds of one `infermeter` command go, start to exit (issue 29).

Runs the commands a user types, as subprocesses, with ``INFERMETER_PHASES`` set: the command
and its client processes then write named instants on CLOCK_MONOTONIC (``tasks.phases.mark``),
which this script puts on one time line with its own start (just before ``Popen``) and end
(just after ``wait``). Against the ground-truth instrument (tests/groundtruth_server.py, model
``ticks:10:10``: 10 chunks 10 ms apart, so each request takes about 110 ms):

- ``infermeter --help`` and a bad input (``stream --num-requests 0``): wall time;
- ``infermeter stream --base-url ... --num-requests 4 --no-track`` (the default levels,
  concurrency 1 and 4), ``--repeats`` times;
- the same tracked into a SQLite MLflow store (a temporary one, so the user's ``mlruns/`` is
  untouched), ``--repeats`` times.

The first run of each kind is reported apart: it pays what the next ones do not (a fresh
``PREFECT_HOME``: Prefect's database migrations and the start of its API server; a fresh MLflow
store: its migrations). The rest are "warm", as a user who runs commands in a row lives them:
the table of phases is that of the warm run with the median wall time. Targets (issue 29):
warm ``--no-track`` <= 5 s, tracked <= 7 s, ``--help`` and bad input < 2 s.

    .venv/bin/python tests/benchmarks/command_phases.py [--repeats 3] [--cases tracked]

Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import groundtruth_server as gt  # noqa: E402

INFERMETER = ROOT / ".venv" / "bin" / "infermeter"

#: What each mark begins (tasks.phases.mark's names; see where they are called).
LABELS = {
    "start": "interpreter start, first imports",
    "interpreter_ready": "CLI imports (typer app, commands)",
    "cli_imported": "options, config",
    "preflight": "pre-flight (endpoint request, servers)",
    "prefect_api": "Prefect API: start or reuse a server",
    "flow_call": "Prefect flow run start, flow imports",
    "flow_body": "MLflow parent run, endpoint, tags",
    "stage_start": "stage run (MLflow child run)",
    "tokenizer": "tokenizer, workload, params",
    "levels": "levels: client processes, requests",
    "stage_records": "records: Parquet, plots, artifacts",
    "flow_finish": "summary, parent run end",
    "flow_body_end": "flow run end (Prefect states)",
    "flow_returned": "Prefect API close (logs, events)",
    "prefect_api_closed": "tables, --json",
    "main_end": "interpreter exit",
}
CHILD_MARKS = ("client_process_started", "client_process_ready")
#: The tracking writer process's marks (tasks.tracking.writer_process): when it did what.
WRITER_MARKS = {
    "writer_started": "started",
    "writer_mlflow_imported": "MLflow imported",
    "writer_preloaded": "plots' modules imported",
    "writer_idle": "last call done",
}


def _run(args: list[str], env: dict[str, str], marks: Path) -> tuple[float, list[tuple[int, int, str]], int]:
    """Run ``infermeter ARGS``; return (wall s, the marks on one time line, exit code)."""
    marks.unlink(missing_ok=True)
    start = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    proc = subprocess.run(
        [str(INFERMETER), *args],
        env={**env, "INFERMETER_PHASES": str(marks)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    end = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    found = []
    if marks.exists():
        for line in marks.read_text().splitlines():
            pid, ns, name = line.split(" ", 2)
            found.append((int(pid), int(ns), name))
    timeline = [(proc.returncode, start, "start"), *sorted(found, key=lambda m: m[1]), (0, end, "end")]
    if proc.returncode not in (0, 2):
        print(proc.stderr[-2000:], file=sys.stderr)
    return (end - start) / 1e9, timeline, proc.returncode


def _phases(timeline: list[tuple[int, int, str]]) -> list[tuple[str, float]]:
    """The command's own marks as consecutive phases (s); each level split into its client
    processes' start (spawn to the last one ready) and the rest."""
    main_pid = next((pid for pid, _, name in timeline if name == "interpreter_ready"), None)
    own = [m for m in timeline if m[2] in ("start", "end") or m[0] == main_pid]
    rows = []
    spawns = [ns for _, ns, n in own if n == "client_processes_start"]
    ready = sorted(ns for _, ns, n in timeline if n == "client_process_ready")
    for (_, ns, name), (_, next_ns, _) in zip(own, own[1:]):
        if name == "client_processes_start":  # a level: its processes' start, then its requests
            level = spawns.index(ns) + 1
            up = max((r for r in ready if ns < r < next_ns), default=ns)
            rows.append((f"  level {level}: client processes' spawn to ready", (up - ns) / 1e9))
            rows.append((f"  level {level}: requests, level records", (next_ns - up) / 1e9))
        else:
            rows.append((LABELS.get(name, name), (next_ns - ns) / 1e9))
    return rows


def _writer_marks(timeline: list[tuple[int, int, str]]) -> str:
    """When the tracking writer process (a tracked command's) reached each of its marks, in s
    from the command's start; its last ``writer_idle`` is when it had done every call."""
    start = timeline[0][1]
    seen = {name: ns for _, ns, name in timeline if name in WRITER_MARKS}  # the last of each
    return ", ".join(f"{WRITER_MARKS[name]} {(ns - start) / 1e9:.2f}" for name, ns in seen.items())


def _case(
    name: str, args: list[str], env: dict[str, str], marks: Path, repeats: int, target_s: float
) -> None:
    walls, timelines = [], []
    for _ in range(repeats + 1):
        wall, timeline, code = _run(args, env, marks)
        walls.append(wall)
        timelines.append(timeline)
    first, warm = walls[0], walls[1:]
    median = statistics.median(warm)
    verdict = "met" if median <= target_s else "NOT met"
    print(
        f"\n## {name}: first {first:.2f} s; warm {', '.join(f'{w:.2f}' for w in warm)} s; "
        f"min {min(warm):.2f} s, median {median:.2f} s (target <= {target_s:g} s: {verdict}; exit {code}; "
        f"load average {os.getloadavg()[0]:.2f})"
    )
    index = 1 + min(range(len(warm)), key=lambda i: abs(warm[i] - median))
    for label, seconds in _phases(timelines[index]):
        print(f"  {label:<58} {seconds:6.2f} s")
    writer = _writer_marks(timelines[index])
    if writer:
        print("  tracking writer process (s from the command's start):", writer)
    if len(timelines[0]) > 2:
        print("  first run:", ", ".join(f"{label} {s:.2f}" for label, s in _phases(timelines[0]) if s >= 0.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm runs per case (after the first)")
    parser.add_argument(
        "--cases",
        default="help,bad,no-track,tracked",
        help="comma-separated subset of help, bad, no-track, tracked (default: all)",
    )
    args = parser.parse_args()
    cases = {case.strip() for case in args.cases.split(",")}
    tmp = Path(tempfile.mkdtemp(prefix="infermeter-phases-"))
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env.update(
        PREFECT_HOME=str(tmp / "prefect"),
        INFERMETER_WORK_DIR=str(tmp / "work"),
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}",
    )
    marks = tmp / "marks.txt"
    print(f"# infermeter command phases ({os.cpu_count()} cores; records in {tmp})")
    for case, name, argv in (
        ("help", "infermeter --help", ["--help"]),
        ("bad", "bad input", ["stream", "--num-requests", "0"]),
    ):
        if case not in cases:
            continue
        walls = [_run(argv, env, marks)[0] for _ in range(3)]
        print(f"{name}: {', '.join(f'{w:.2f}' for w in walls)} s (target < 2 s)")
    with gt.serve() as server:
        stream = ["stream", "--base-url", server.base_url, "--model", "ticks:10:10", "--num-requests", "4"]
        if "no-track" in cases:
            _case("stream --no-track, 4 requests", [*stream, "--no-track"], env, marks, args.repeats, 5.0)
        if "tracked" in cases:
            _case("stream tracked (SQLite), 4 requests", stream, env, marks, args.repeats, 7.0)
    try:  # the local Prefect server the runs started (flows.prefect_server), where there is one
        from flows.prefect_server import stop_server

        stop_server(tmp / "prefect")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
