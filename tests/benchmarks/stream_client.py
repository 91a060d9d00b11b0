"""Benchmark: how exactly does the stream client measure under load?

Drives the ground-truth instrument (tests/groundtruth_server.py, a separate process on the
same machine) at 1, 16, 64 and 256 concurrent streams of 60 chunks 10 ms apart, through the
real load path (tasks.stream.load.run_level), and prints per level:

- ITL error p50 / p99 (ms): measured gap minus the true gap between the instrument's send
  stamps of the same two chunks (CLOCK_MONOTONIC, shared by both processes);
- TTFT error p50 / p99 (ms): measured first-chunk arrival minus its true send time;
- client CPU seconds per 1000 chunks (process CPU time of the client over the level);
- the client's event-loop lag p99, the client-bound flag (tolerance 1 ms), and whether the
  flag agrees with the measured ITL error (flagged exactly where its p99 passes 1 ms).

Targets on a 2-core machine (issue 3): ITL error p99 <= 1 ms at 64 streams, <= 5 ms at 256.

    .venv/bin/python tests/benchmarks/stream_client.py [--transport aiohttp,openai]
        [--streams 1,16,64,256] [--chunks 60] [--gap-ms 10] [--client-processes N]

Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import groundtruth_server as gt  # noqa: E402

from tasks.stats import percentile  # noqa: E402
from tasks.stream.load import make_client, run_level  # noqa: E402
from tasks.stream.multiproc import run_level_processes  # noqa: E402
from tasks.stream.settings import Connection, LevelSettings  # noqa: E402


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (client processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run(
    server: gt.GroundTruthServer, transport: str, streams: int, chunks: int, gap_ms: float, processes: int = 1
):
    model = f"ticks:{chunks}:{gap_ms:g}"
    settings = LevelSettings(
        model=model,
        prompts=[f"p{i}" for i in range(streams)],
        max_tokens=chunks,
        max_concurrency=streams,
        num_requests=streams,
    )

    async def main():
        client = make_client(server.base_url, None, 60.0, streams, transport)
        try:
            return await run_level(client, settings, count_tokens=None)
        finally:
            await client.close()

    server.reset()
    cpu0 = _cpu_s()
    if processes > 1 and streams >= processes:
        result = run_level_processes(
            processes, Connection(server.base_url, None, 60.0, transport), settings, count_tokens=None
        )
    else:
        result = asyncio.run(main())
    cpu_s = _cpu_s() - cpu0
    stamps = server.stamps()
    ttft, itl, lost = [], [], 0
    for r in result.measured:
        true = stamps[f"p{r.request_id.split('-r')[1]}"]["text_sent_ns"]
        measured = [r.send_ns + o * 1e6 for o in r.token_offsets_ms]
        if len(measured) != len(true) or not r.succeeded:
            lost += 1
            continue
        ttft.append((measured[0] - true[0]) / 1e6)
        itl += [
            ((measured[i] - measured[i - 1]) - (true[i] - true[i - 1])) / 1e6 for i in range(1, len(true))
        ]
    ttft.sort()
    itl.sort()
    return {
        "transport": transport if processes == 1 else f"{transport} x{processes} processes",
        "streams": streams,
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "cpu_per_1000": cpu_s / (streams * chunks / 1000),
        "lag_p99": result.client.get("client_loop_lag_ms_p99"),
        "bound": result.client.get("client_bound"),
        "lost": lost,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="aiohttp,openai")
    parser.add_argument("--streams", default="1,16,64,256")
    parser.add_argument("--chunks", type=int, default=60)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--client-processes", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with gt.serve() as server:
        run(server, "aiohttp", 1, 5, args.gap_ms)  # warm imports and the first connection
        for transport in args.transport.split(","):
            for streams in (int(s) for s in args.streams.split(",")):
                rows.append(run(server, transport, streams, args.chunks, args.gap_ms, args.client_processes))
                print(rows[-1], file=sys.stderr, flush=True)
    print(
        "| transport | streams | ITL err p50 | ITL err p99 | TTFT err p50 | TTFT err p99 | "
        "CPU s / 1000 chunks | loop lag p99 | client-bound | flag agrees | lost |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for r in rows:
        print(
            f"| {r['transport']} | {r['streams']} | {r['itl_p50']:.2f} | {r['itl_p99']:.2f} | "
            f"{r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['cpu_per_1000']:.3f} | "
            f"{r['lag_p99']:.2f} | {'yes' if r['bound'] else 'no'} | "
            f"{'yes' if bool(r['bound']) == (r['itl_p99'] > 1.0) else 'NO'} | {r['lost']} |"
        )


if __name__ == "__main__":
    main()
