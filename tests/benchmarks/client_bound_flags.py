"""Benchmark: is a level flagged client-bound exactly when its ITL figures are wrong? (issue 50)

Runs the command users run, ``infermeter stream --base-url ... --no-track --json F``, against
the ground-truth instrument (tests/groundtruth_server.py, a separate process on the same
machine: ``ticks:60:GAP`` streams, each chunk stamped with CLOCK_MONOTONIC as it is written),
many times per condition, and compares each level's ``client_bound`` with the truth: its ITL
error p99 on the level's own clock (measured gap minus the gap between the instrument's send
stamps of the same two chunks, absolute, over every gap of the level).

- a *false* flag: flagged while the ITL error p99 is at most the 1 ms tolerance;
- a *missed* flag: not flagged while it is over 1 ms.

Beside each run's flag, the rule it replaced (issue 50): flagged when over 1 % of the ITL gaps
came coalesced (``coalesced_event_fraction`` > 0.01), with its false and missed flags.

Conditions (``STREAMS[:GAP_MS[:HOGS]]``): the streams at a 10 ms gap make levels that are
exact on the kernel clock (the stamps are the kernel's; the instrument may stall and write a
stream's chunks back to back: exact too); HOGS busy-loop processes beside them (on 2 cores) or
a short gap make the client fall behind, so some levels' figures are wrong. The truth is
measured per run, so whatever else shares the machine only moves runs between the two.

    .venv/bin/python tests/benchmarks/client_bound_flags.py
        [--conditions 64,256,512,1024,256:10:2,512:10:1,64:3:3] [--runs 20]
        [--client-processes N] [--instrument-realtime]

``--instrument-realtime`` runs the instrument under SCHED_FIFO (root): it writes on time, as a
server with cores of its own. At normal priority on the client's 2 cores it stalls and then
writes its late chunks back to back, which the client cannot tell from chunks it read late
(``tasks.stream.quality.SAME_HOST_NOTE``): exact levels are then flagged in some runs.

Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import groundtruth_server as gt  # noqa: E402

from tasks.stats import percentile  # noqa: E402

INFERMETER = ROOT / ".venv" / "bin" / "infermeter"
CHUNKS = 60
TOLERANCE_MS = 1.0
#: The replaced rule's threshold on coalesced_event_fraction (the default of its config field).
OLD_FRACTION = 0.01


def one_run(
    server: gt.GroundTruthServer, streams: int, gap_ms: float, hogs: int, processes: int | None = None
) -> dict:
    """One ``infermeter stream`` level of ``streams`` concurrent streams: its flag, its
    coalesced share and its ITL error p99 against the instrument's stamps."""
    server.reset()
    hog = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prompts, out = Path(tmp) / "prompts.txt", Path(tmp) / "out.json"
            prompts.write_text("".join(f"p{i}\n" for i in range(streams)), encoding="utf-8")
            command = [
                str(INFERMETER), "stream", "--base-url", server.base_url,
                "--model", f"ticks:{CHUNKS}:{gap_ms:g}", "--prompts", str(prompts),
                "--max-tokens", str(CHUNKS), "--max-concurrency", str(streams),
                "--num-requests", str(streams), "--warmup", "1", "--no-track", "--json", str(out),
                *(["--client-processes", str(processes)] if processes else []),
            ]  # fmt: skip
            done = subprocess.run(
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "INFERMETER_WORK_DIR": tmp},
            )
            if done.returncode != 0 or not out.exists():  # counted apart, said, not fatal
                return {"failed": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
            level = json.loads(out.read_text(encoding="utf-8"))["levels"][0]
    finally:
        for process in hog:
            process.kill()
            process.wait()
    stamps = server.stamps()
    errors, lost = [], 0
    records = [r for r in level["requests"] if not r["warmup"]]
    for r in records:
        # measured request i used prompt (warm-up + i) % streams; stamps are keyed by prompt
        true = stamps[f"p{(1 + int(r['request_id'].split('-r')[1])) % streams}"]["text_sent_ns"]
        got = r["token_offsets_ms"]
        if len(got) != len(true) or r.get("error_class"):
            lost += 1
            continue
        errors += [abs((got[i] - got[i - 1]) - (true[i] - true[i - 1]) / 1e6) for i in range(1, len(true))]
    errors.sort()
    metrics = level["metrics"]
    return {
        "bound": metrics.get("client_bound"),
        "clock": metrics.get("arrival_clock"),
        "coalesced": metrics.get("coalesced_event_fraction"),
        "itl_p99": percentile(errors, 99.0),
        "lost": lost,
        "processes": metrics.get("client_processes"),
    }


def main() -> None:
    # a SIGTERM ends the run through its finally blocks: the hogs and the instrument die with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conditions", default="64,256,512,1024,256:10:2,512:10:1,64:3:3")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--client-processes", type=int, default=None, help="passed on (default: the command's own)"
    )
    parser.add_argument(
        "--instrument-realtime",
        action="store_true",
        help="the instrument under SCHED_FIFO (root): written on time, as a server on a host of its own",
    )
    args = parser.parse_args()
    table, failed = [], {}
    with gt.serve() as server:
        if args.instrument_realtime:
            os.sched_setscheduler(server.process.pid, os.SCHED_FIFO, os.sched_param(10))
        for condition in args.conditions.split(","):
            streams, gap, hogs = (condition.split(":") + ["10", "0"])[:3] if ":" in condition else (
                condition, "10", "0")  # fmt: skip
            runs = []
            for k in range(args.runs):
                run = one_run(server, int(streams), float(gap), int(hogs), args.client_processes)
                runs.append(run)
                print(condition, k, run, file=sys.stderr, flush=True)
            table.append((int(streams), float(gap), int(hogs), [r for r in runs if "failed" not in r]))
            failed[condition] = sum(1 for r in runs if "failed" in r)
    print(
        f"ITL error tolerance {TOLERANCE_MS} ms; false = flagged with ITL err p99 <= it, missed = not flagged over it"
    )
    print(
        "| streams | gap ms | hogs | runs (failed) | ITL err p99 > 1 ms | ITL err p99 range (ms) | flagged | false "
        "| missed | coalesced range | old rule: flagged | old false | old missed |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for (streams, gap, hogs, runs), key in zip(table, failed):
        if not runs:
            print(f"| {streams} | {gap:g} | {hogs} | 0 ({failed[key]}) | every run failed |")
            continue
        p99s = [r["itl_p99"] for r in runs if r["itl_p99"] is not None]
        coal = [r["coalesced"] for r in runs if r["coalesced"] is not None]
        false = sum(1 for r in runs if r["bound"] and r["itl_p99"] <= TOLERANCE_MS)
        missed = sum(1 for r in runs if not r["bound"] and r["itl_p99"] > TOLERANCE_MS)
        old = [(r["coalesced"] or 0.0) > OLD_FRACTION for r in runs]
        old_false = sum(1 for r, flag in zip(runs, old) if flag and r["itl_p99"] <= TOLERANCE_MS)
        old_missed = sum(1 for r, flag in zip(runs, old) if not flag and r["itl_p99"] > TOLERANCE_MS)
        print(
            f"| {streams} | {gap:g} | {hogs} | {len(runs)} ({failed[key]}) | {sum(1 for p in p99s if p > TOLERANCE_MS)} | "
            f"{min(p99s):.3f}-{max(p99s):.3f} | {sum(1 for r in runs if r['bound'])} | {false} | {missed} | "
            f"{min(coal, default=0):.4f}-{max(coal, default=0):.4f} | {sum(old)} | {old_false} | {old_missed} |"
        )


if __name__ == "__main__":
    main()
