"""Benchmark: how long does an interrupted command take to exit, and with which code?

Starts ``infermeter stream`` as a user would (its own session, tracked in a temporary SQLite
MLflow store, Prefect's temporary API server started by the command), sends a signal to it
and times the exit: from ``os.kill`` to the process's end (the MLflow runs marked KILLED, the
temporary Prefect API server and any embedded server stopped, the Prefect flow run reported).
Cases (``--cases``):

- ``groundtruth``: mid-level against the ground-truth instrument (tests/groundtruth_server.py:
  ``ticks:50:20``, 2 streams), once the journal holds 3 requests;
- ``embedded``: mid-level against the embedded llama.cpp server, once 1 request is journaled;
- ``startup``: while the embedded llama.cpp server is starting (as soon as its process exists:
  the command waits on its /health);
- ``vllm-startup``: while the embedded vLLM (``--engine vllm``, ``make vllm``) is starting,
  15 s after its process appeared (it is loading torch and the model then).

Each case runs ``--repeats`` times per signal (``--signals TERM,INT``); prints one line per
run (exit code, seconds) and the median per case and signal.

    .venv/bin/python tests/benchmarks/signal_exit.py [--cases groundtruth,embedded,startup]
        [--signals TERM,INT] [--repeats 3]

Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import groundtruth_server as gt  # noqa: E402

INFERMETER = ROOT / ".venv" / "bin" / "infermeter"


def _journal_lines(folder: Path) -> int:
    found = list((folder / "w").glob("*-stream-*/requests.jsonl"))
    return len(found[0].read_text().splitlines()) if found else 0


def _has_child(pid: int, name: str) -> bool:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return False
    for child in children:
        try:
            if name in " ".join(child.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


def run_once(case: str, signum: int, base_url: str | None) -> tuple[int, float]:
    """One command, one signal: (exit code, seconds from the signal to the exit)."""
    folder = Path(tempfile.mkdtemp(prefix=f"signal-exit-{case}-"))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        PREFECT_HOME=str(folder / "prefect"),
        INFERMETER_WORK_DIR=str(folder / "w"),
        MLFLOW_TRACKING_URI=f"sqlite:///{folder / 'mlflow.db'}",
    )
    args = ["stream", "--num-requests", "400", "--warmup", "0"]
    if case == "groundtruth":
        args += ["--base-url", base_url, "--model", "ticks:50:20", "--max-concurrency", "2"]
        ready = lambda proc: _journal_lines(folder) >= 3  # noqa: E731
    elif case == "embedded":
        args += ["--max-tokens", "16"]
        ready = lambda proc: _journal_lines(folder) >= 1  # noqa: E731
    elif case == "startup":
        args += ["--max-tokens", "16"]
        ready = lambda proc: _has_child(proc.pid, "llama_cpp.server")  # noqa: E731
    else:
        args += ["--max-tokens", "16", "--engine", "vllm"]
        seen: list[float] = []

        def ready(proc) -> bool:
            if not seen and _has_child(proc.pid, "vllm.entrypoints"):
                seen.append(time.monotonic())
            return bool(seen) and time.monotonic() - seen[0] >= 15

    with open(folder / "out.log", "wb") as log:
        proc = subprocess.Popen(
            [str(INFERMETER), *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 600
        while not ready(proc):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{case}: not ready; log {folder / 'out.log'}")
            time.sleep(0.05)
        os.kill(proc.pid, signum)
        began = time.monotonic()
        code = proc.wait(timeout=300)
        return code, time.monotonic() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="groundtruth,embedded,startup")
    parser.add_argument("--signals", default="TERM,INT")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = args.cases.split(",")
    signals = [getattr(signal, f"SIG{name.strip().upper()}") for name in args.signals.split(",")]
    with gt.serve() as server:
        results: dict[tuple[str, str], list[float]] = {}
        for case in cases:
            for signum in signals:
                name = signal.Signals(signum).name
                for i in range(args.repeats):
                    code, seconds = run_once(case, signum, server.base_url)
                    results.setdefault((case, name), []).append(seconds)
                    print(f"{case:12} {name:8} run {i + 1}: exit {code}, {seconds:.1f} s", flush=True)
    print()
    for (case, name), values in results.items():
        print(
            f"{case:12} {name:8} median {statistics.median(values):.1f} s "
            f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"
        )
    print(f"load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
