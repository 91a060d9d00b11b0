"""Benchmark: what the reactor's fallback (no asyncio private attribute) costs the stream client.

tasks.wire.reactor waits in the loop's own epoll (the ``wait`` path: asyncio's ``_selector``,
``_ready``, ``_scheduled``) where its probe finds them; ``INFERMETER_REACTOR_FALLBACK=1`` forces
the fallback (``read``: what is ready read each loop turn, public APIs only). This runs
tests/benchmarks/stream_client.py (the instrument, the command a user runs) on both paths,
interleaved round by round (wait, fallback, wait, fallback, ...: the machine's other load falls on
both alike), and prints per level each run's client CPU per chunk (us) and ITL error p99 (ms,
the level's own clock, against the instrument's send stamps), their medians and the flag.

    .venv/bin/python tests/benchmarks/reactor_fallback.py [--streams 256,512] [--rounds 3]
        [--paths cli]

Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FALLBACK_ENV = "INFERMETER_REACTOR_FALLBACK"  # tasks.wire.reactor.FALLBACK_ENV
MODES = {"wait": "0", "fallback": "1"}


def run(mode: str, args) -> list[dict]:
    """One run of stream_client.py on ``mode``'s path: its rows on each level's own clock."""
    command = [sys.executable, str(ROOT / "tests" / "benchmarks" / "stream_client.py"),
               "--paths", args.paths, "--streams", args.streams]  # fmt: skip
    done = subprocess.run(
        command,
        env={**os.environ, FALLBACK_ENV: MODES[mode]},
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [ast.literal_eval(line) for line in done.stderr.splitlines() if line.startswith("{")]
    return [r for r in rows if r["clock"] == r["level_clock"]]


def _fmt(values: list, digits: int) -> str:
    return ", ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="256,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", default="cli", help="stream_client.py's --paths (cli, bare)")
    args = parser.parse_args()
    rows: dict[tuple[str, str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        for mode in MODES:
            for r in run(mode, args):
                rows.setdefault((r["path"], mode, r["streams"]), []).append(r)
                print(round_, mode, r, file=sys.stderr, flush=True)
    print(
        "| path | streams | reactor | CPU us / chunk (each run) | median | ITL err p99 ms (each run) "
        "| median | client-bound | lost |"
    )
    print("| --- | ---: | --- | --- | ---: | --- | ---: | --- | ---: |")
    for (path, mode, streams), runs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        cpu = [r["cpu_us_per_chunk"] for r in runs]
        itl = [r["itl_p99"] for r in runs]
        print(
            f"| {path} | {streams} | {mode} | {_fmt(cpu, 1)} | {statistics.median(c for c in cpu if c is not None):.1f} "
            f"| {_fmt(itl, 2)} | {statistics.median(i for i in itl if i is not None):.2f} "
            f"| {sum(bool(r['bound']) for r in runs)} of {len(runs)} | {sum(r['lost'] for r in runs)} |"
        )


if __name__ == "__main__":
    main()
