"""Benchmark: are the figures of a compressed body (decoded on the fly) as exact as a plain one's?

The raw server of tests/wire_server.py (its own process) streams ``--chunks`` text chunks
``--gap-ms`` apart per request (first at 40 ms), each stamped when written (CLOCK_MONOTONIC,
shared with the client), its body sent as is (``plain``) or compressed per event as a compressing
proxy that flushes writes it (``gzip`` and ``deflate`` with ``Z_SYNC_FLUSH``, ``br`` with its
flush). ``--streams`` concurrent requests on one :class:`tasks.stream.client.SSEClient` per
coding, the codings interleaved over ``--rounds`` rounds. Per coding over all rounds: ITL error
|p50| / p99 / max (ms: measured gap minus the true gap between the same two chunks' write stamps,
on the kernel clock where it is used), arrival error p50 / p99 / max (ms: each chunk's recorded
arrival minus its write stamp: the wire, the read and, for a coding, its decoding), TTFT minus the
schedule's 40 ms (the server's own lateness in it), failures.

    .venv/bin/python tests/benchmarks/wire_bodies.py [--streams 16] [--chunks 60] [--gap-ms 10] [--rounds 3]

Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tasks.stats import percentile  # noqa: E402
from tasks.stream.client import SSEClient, stream_chat  # noqa: E402
from tasks.stream.records import RequestRecord  # noqa: E402

CODINGS = ("plain", "gzip", "deflate", "br")
SCHEDULE_TTFT_MS = 40.0  # tests/wire_server.py's TTFT_MS


async def _level(base_url: str, model: str, streams: int, tag: str) -> list[RequestRecord]:
    client = SSEClient(base_url, None, 30.0)
    try:
        return list(
            await asyncio.gather(
                *(
                    stream_chat(
                        client,
                        model=model,
                        prompt=f"{tag}-{i}",
                        max_tokens=8,
                        count_tokens=None,
                        request_id=f"{tag}-{i}",
                    )
                    for i in range(streams)
                )
            )
        )
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=60)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "wire_server.py")], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline().split()[1])
        base_url = f"http://127.0.0.1:{port}/v1"
        records: dict[str, list[RequestRecord]] = {coding: [] for coding in CODINGS}
        for round_ in range(args.rounds):
            for coding in CODINGS:
                model = f"{coding}:{args.chunks}:{args.gap_ms:g}"
                records[coding] += asyncio.run(_level(base_url, model, args.streams, f"{coding}-{round_}"))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/stamps", timeout=30) as answer:
            stamps = json.loads(answer.read())
    finally:
        server.terminate()
        server.wait(10)
    print(
        f"{args.streams} streams x {args.rounds} rounds, {args.chunks} chunks {args.gap_ms:g} ms apart "
        f"(first at {SCHEDULE_TTFT_MS:g} ms); errors in ms"
    )
    print(
        f"{'coding':8} {'failed':>6} {'clock':>6} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} "
        f"{'arr p50':>8} {'arr p99':>8} {'arr max':>8} {'TTFT-40 p50':>11}"
    )
    for coding, rows in records.items():
        itl_errors, arrival_errors, ttft_late, failed = [], [], [], 0
        for r in rows:
            if not r.succeeded or len(r.token_offsets_ms) != args.chunks:
                failed += 1
                continue
            sent_ms = [(t - r.send_ns) / 1e6 for t in stamps[r.request_id]]
            arrival_errors += [got - sent for got, sent in zip(r.token_offsets_ms, sent_ms)]
            itl_errors += [gap - (b - a) for gap, a, b in zip(r.itl_ms, sent_ms, sent_ms[1:])]
            ttft_late.append(r.ttft_ms - SCHEDULE_TTFT_MS)
        clock = rows[0].arrival_clock if rows else "-"
        if not itl_errors:
            print(f"{coding:8} {failed:>6} {clock:>6}  (no successful request)")
            continue
        itl, arrival_errors, ttft_late = (
            sorted(abs(e) for e in itl_errors),
            sorted(arrival_errors),
            sorted(ttft_late),
        )
        print(
            f"{coding:8} {failed:>6} {clock:>6} {percentile(itl, 50):8.3f} {percentile(itl, 99):8.3f} "
            f"{max(itl):8.3f} {percentile(arrival_errors, 50):8.3f} {percentile(arrival_errors, 99):8.3f} "
            f"{max(arrival_errors):8.3f} {percentile(ttft_late, 50):11.3f}"
        )


if __name__ == "__main__":
    main()
