"""Benchmark: a Ctrl-C during a Dask level of ``infermeter stream`` (issue 50, part 6): what the
command prints after it, its exit code and time, and the requests the instrument reads after
the command has exited.

The scenarios of tests/test_stream_dask_interrupt.py (its helpers, the same command: 64
requests at 8/s of ``ticks:20:100``, 2 s each, 8 streams, SIGINT to the command's process group
once the instrument has read 4), each ``--repeats`` times:

- ``outside``: ``dask:tcp://...``, a ``dask scheduler`` and 2 ``dask worker`` started as a user
  starts them in other terminals (their own sessions), one cluster for every run;
- ``local``: ``dask:2``, the LocalCluster the command starts (its workers get the Ctrl-C too);
- ``one-job``: a ``dask scheduler`` and 1 ``dask worker`` started by the same terminal job as
  the command (they get the Ctrl-C too: the scheduler dies of it while the command closes its
  client); also the lines those two wrote to their own output after the signal.

Per run: exit code, lines after the signal (stdout and stderr) and how many were tracebacks,
the instrument's request count at the signal, at the exit and 2 s after, seconds to exit.

    .venv/bin/python tests/benchmarks/dask_interrupt.py [--cases outside,local,one-job] [--repeats 5]

Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import groundtruth_server as gt  # noqa: E402
from dask_cluster import outside_cluster  # noqa: E402
from test_stream_dask_interrupt import _ONE_JOB, _interrupt, _stream  # noqa: E402

from tasks.engines.server import free_port  # noqa: E402


def _row(case: str, i: int, run, extra: str = "") -> str:
    tracebacks = sum("Traceback" in line for line in run.lines)
    return (
        f"{case:8} {i:3} {run.code:5} {len(run.lines):6} {tracebacks:5} {run.at_signal:7} {run.at_exit:6} "
        f"{run.after:6} {run.after - run.at_exit:6} {run.took_s:6.2f}{extra}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="outside,local,one-job")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cases = args.cases.split(",")
    print("case     run  exit  lines  trace  read@sig  @exit  +2 s  after  exit s")
    with tempfile.TemporaryDirectory() as folder, gt.serve() as instrument:
        work = Path(folder)
        if "outside" in cases:
            with outside_cluster(2, work) as address:
                for i in range(args.repeats):
                    run = _interrupt(instrument, _stream(instrument, f"dask:{address}"), work)
                    print(_row("outside", i, run), flush=True)
        if "local" in cases:
            for i in range(args.repeats):
                run = _interrupt(instrument, _stream(instrument, "dask:2"), work)
                print(_row("local", i, run), flush=True)
        if "one-job" in cases:
            dask = str(Path(sys.executable).parent / "dask")
            for i in range(args.repeats):
                port, log = free_port(), work / f"one-job-{i}.log"
                command = [sys.executable, "-c", _ONE_JOB, dask, str(port), str(log)]
                command += _stream(instrument, f"dask:tcp://127.0.0.1:{port}")
                before: list[int] = []

                def size(pid: int, before: list[int] = before, log: Path = log) -> list:
                    before.append(len(log.read_text().splitlines()))
                    return []

                run = _interrupt(instrument, command, work, on_signal=size)
                theirs = len(log.read_text().splitlines()) - before[0]
                print(_row("one-job", i, run, f"  (scheduler and worker: {theirs} lines)"), flush=True)


if __name__ == "__main__":
    main()
