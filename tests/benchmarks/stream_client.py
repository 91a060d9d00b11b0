"""Benchmark: how exactly does the stream client measure under load, on the path users run?

Drives the ground-truth instrument (tests/groundtruth_server.py, a separate process on the
same machine) at 1, 16, 64 and 256 concurrent streams of 60 chunks 10 ms apart, two ways:

- ``cli``: the command a user runs, ``infermeter stream --base-url ... --no-track --json F``
  (Prefect flow, pre-flight, journal, client process: everything), read back from its JSON;
- ``bare``: ``tasks.stream.load.run_level`` in this process (no flow, no journal);
- ``vllm``: vLLM's own benchmark client (``vllm bench serve``'s request function, in
  ``.venv-vllm``: ``make vllm``), through tests/benchmarks/vllm_client.py.

Per level and path it prints, for both clocks of the same run (``kernel``: each chunk's kernel
receive stamp, ``tasks.wire.rxclock``; ``user``: when the event loop read it):

- ITL error p50 / p99 / max (ms): measured gap minus the true gap between the instrument's send
  stamps of the same two chunks (CLOCK_MONOTONIC, shared by both processes);
- TTFT error p50 / p99 (ms): measured first text-chunk arrival minus its true send time;
- the fraction of text chunks coalesced (they came in one read with the one before);
- client CPU per chunk and per request in us (user + system; ``bare``: this process's CPU time
  over the level; ``cli``: the level's own ``client_cpu_us_per_chunk``, its client processes
  over the measured part; ``vllm``: its whole process, imports included);
- the level's client-bound flag, and whether it agrees with the error (flagged exactly where
  the ITL error p99 on the level's own clock passes 1 ms).

Targets (issue 11, 2-core machine, instrument on the same cores): through ``cli``, ITL error
p99 <= 0.5 ms at 1 and 16 streams, <= 1 ms at 64, <= 5 ms at 256. Issue 30: ``--streams
64,256,512,1024``, the CPU per chunk halved; ITL error p99 <= 1 ms unflagged at 256, <= 2 ms at
512, flagged or <= 5 ms at 1,024; two Dask workers (``--task-runner dask:2``) at 512 streams no
worse than one client process (``--client-processes 1``) at 256.

    .venv/bin/python tests/benchmarks/stream_client.py [--paths cli,bare,vllm]
        [--streams 1,16,64,256] [--chunks 60] [--gap-ms 10] [--client-processes N | --task-runner dask:N]
        [--transport aiohttp|openai] [--loop asyncio|uvloop]

Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import groundtruth_server as gt  # noqa: E402

from tasks.stats import percentile  # noqa: E402
from tasks.stream.load import make_client, run_level  # noqa: E402
from tasks.stream.records import RequestRecord  # noqa: E402
from tasks.stream.settings import LevelSettings  # noqa: E402

INFERMETER = ROOT / ".venv" / "bin" / "infermeter"


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _bare(server: gt.GroundTruthServer, args, streams: int) -> tuple[list[RequestRecord], dict, float]:
    settings = LevelSettings(
        model=f"ticks:{args.chunks}:{args.gap_ms:g}",
        prompts=[f"p{i}" for i in range(streams)],
        max_tokens=args.chunks,
        max_concurrency=streams,
        num_requests=streams,
        warmup=1,
    )

    async def main():
        client = make_client(server.base_url, None, 60.0, streams, args.transport)
        try:
            return await run_level(client, settings, count_tokens=None)
        finally:
            await client.close()

    if args.loop == "uvloop":
        import uvloop

        uvloop.install()
    cpu0 = _cpu_s(resource.RUSAGE_SELF)
    result = asyncio.run(main())
    return result.measured, result.client, _cpu_s(resource.RUSAGE_SELF) - cpu0


def _cli(server: gt.GroundTruthServer, args, streams: int) -> tuple[list[RequestRecord], dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        prompts, out = Path(tmp) / "prompts.txt", Path(tmp) / "out.json"
        prompts.write_text("".join(f"p{i}\n" for i in range(streams)), encoding="utf-8")
        command = [
            str(INFERMETER), "stream", "--base-url", server.base_url,
            "--model", f"ticks:{args.chunks}:{args.gap_ms:g}", "--prompts", str(prompts),
            "--max-tokens", str(args.chunks), "--max-concurrency", str(streams),
            "--num-requests", str(streams), "--warmup", "1", "--no-track", "--json", str(out),
        ]  # fmt: skip
        if args.client_processes:  # else the command's own choice (one per 128 streams)
            command += ["--client-processes", str(min(args.client_processes, streams))]
        if args.task_runner:  # the level's client on Dask workers (tasks.scaleout.dask_load)
            command += ["--task-runner", args.task_runner]
        subprocess.run(
            command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "INFERMETER_WORK_DIR": tmp}
        )
        level = json.loads(out.read_text(encoding="utf-8"))["levels"][0]
    records = [RequestRecord.from_json(r) for r in level["requests"] if not r["warmup"]]
    # the level's own figure: its client processes' CPU over the measured part
    chunks = sum(len(r.token_offsets_ms) for r in records)
    cpu_s = (level["metrics"].get("client_cpu_us_per_chunk") or 0.0) * chunks / 1e6
    return records, level["metrics"], cpu_s


def _vllm(server: gt.GroundTruthServer, args, streams: int) -> dict:
    """vLLM's benchmark client (tests/benchmarks/vllm_client.py in .venv-vllm) on the same
    instrument: its own TTFT / ITL against the true send stamps."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    command = [str(python), str(ROOT / "tests" / "benchmarks" / "vllm_client.py"), server.base_url,
               f"ticks:{args.chunks}:{args.gap_ms:g}", str(streams), str(args.chunks)]  # fmt: skip
    cpu0 = _cpu_s(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    cpu_s = _cpu_s(resource.RUSAGE_CHILDREN) - cpu0  # the whole process: imports included
    outputs = json.loads(done.stdout.strip().splitlines()[-1])
    stamps = server.stamps()
    ttft, itl, lost, chunks = [], [], 0, 0
    for prompt, out in outputs.items():
        true = stamps[prompt]["text_sent_ns"]
        # its arrivals: start + ttft, then each ITL gap. It counts the instrument's role-only
        # first chunk (content "") as the first token, so its last len(true) arrivals are the
        # text chunks' (its own TTFT figure is that role chunk's: not compared)
        times = [out["start_time"] + out["ttft"]]
        for gap in out["itl"]:
            times.append(times[-1] + gap)
        if not out["ok"] or len(times) < len(true):
            lost += 1
            continue
        got = [t * 1e9 for t in times[-len(true) :]]
        chunks += len(true)
        ttft.append((got[0] - true[0]) / 1e6)
        itl += [((got[i] - got[i - 1]) - (true[i] - true[i - 1])) / 1e6 for i in range(1, len(true))]
    ttft.sort()
    itl.sort()
    return {
        "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99), "itl_max": itl[-1] if itl else None,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "coalesced": None,
        "chunks": chunks, "lost": lost, "path": "vllm", "streams": streams, "clock": "user",
        "level_clock": "user", "cpu_us_per_chunk": cpu_s * 1e6 / chunks if chunks else None,
        "cpu_us_per_request": cpu_s * 1e6 / len(outputs) if outputs else None, "bound": None,
    }  # fmt: skip


def _errors(records: list[RequestRecord], stamps: dict, streams: int, clock: str) -> dict:
    """ITL and TTFT errors on one clock against the instrument's send stamps."""
    ttft, itl, lost, chunks, coalesced = [], [], 0, 0, 0
    over_server, sent, connect = [], [], []  # where TTFT's milliseconds go before the server
    for r in records:
        # measured request i used prompt (warm-up + i) % streams; stamps are keyed by prompt
        stamp = stamps[f"p{(1 + int(r.request_id.split('-r')[1])) % streams}"]
        true = stamp["text_sent_ns"]
        offsets = (
            r.user_token_offsets_ms if clock == "user" and r.user_token_offsets_ms else r.token_offsets_ms
        )
        measured = [r.send_ns + o * 1e6 for o in offsets]
        if len(measured) != len(true) or not r.succeeded:
            lost += 1
            continue
        chunks += len(measured)
        coalesced += r.coalesced_events
        ttft.append((measured[0] - true[0]) / 1e6)
        # the client's TTFT minus the server's own (request read -> first text written)
        over_server.append(r.ttft_ms - (true[0] - stamp["recv_ns"]) / 1e6)
        if r.request_sent_ms is not None:
            sent.append(r.request_sent_ms)
        if r.connect_ms is not None:
            connect.append(r.connect_ms)
        itl += [
            ((measured[i] - measured[i - 1]) - (true[i] - true[i - 1])) / 1e6 for i in range(1, len(true))
        ]
    ttft.sort()
    itl.sort()
    return {
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "itl_max": itl[-1] if itl else None,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "coalesced": coalesced / chunks if chunks else None,
        "chunks": chunks,
        "lost": lost,
        "over_server_p50": percentile(sorted(over_server), 50),
        "over_server_p99": percentile(sorted(over_server), 99),
        "sent_p50": percentile(sorted(sent), 50),
        "connect_p50": percentile(sorted(connect), 50),
        "new_connections": len(connect),
    }


def measure(server: gt.GroundTruthServer, args, path: str, streams: int) -> list[dict]:
    server.reset()
    if path == "vllm":
        return [_vllm(server, args, streams)]
    records, metrics, cpu_s = (_cli if path == "cli" else _bare)(server, args, streams)
    stamps = server.stamps()
    level_clock = metrics.get("arrival_clock") or (records[0].arrival_clock if records else "user")
    rows = []
    for clock in ("kernel", "user") if level_clock == "kernel" else ("user",):
        row = _errors(records, stamps, streams, clock)
        row.update(
            path=path,
            streams=streams,
            clock=clock,
            level_clock=level_clock,
            cpu_us_per_chunk=cpu_s * 1e6 / row["chunks"] if row["chunks"] else None,
            cpu_us_per_request=cpu_s * 1e6 / len(records) if records else None,
            bound=metrics.get("client_bound"),
        )
        rows.append(row)
    return rows


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="cli,bare")
    parser.add_argument("--streams", default="1,16,64,256")
    parser.add_argument("--chunks", type=int, default=60)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--client-processes", type=int, default=None, help="cli path; default: its own")
    parser.add_argument(
        "--task-runner", default=None, help="cli path: e.g. dask:2 (one client per Dask worker)"
    )
    parser.add_argument("--transport", default="sse")
    parser.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop"))
    args = parser.parse_args()
    rows = []
    with gt.serve() as server:
        for streams in (int(s) for s in args.streams.split(",")):
            for path in args.paths.split(","):
                for row in measure(server, args, path, streams):
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    print(
        "| path | streams | clock | ITL err p50 | ITL err p99 | ITL err max | TTFT err p50 | TTFT err p99 "
        "| coalesced | CPU us / chunk | CPU us / request | client-bound | flag agrees | lost |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for r in rows:
        own = r["clock"] == r["level_clock"] and r["path"] != "vllm"  # vLLM has no flag
        agrees = "yes" if bool(r["bound"]) == ((r["itl_p99"] or 0) > 1.0) else "NO"
        print(
            f"| {r['path']} | {r['streams']} | {r['clock']} | {_fmt(r['itl_p50'])} | {_fmt(r['itl_p99'])} | "
            f"{_fmt(r['itl_max'])} | {_fmt(r['ttft_p50'])} | {_fmt(r['ttft_p99'])} | "
            f"{_fmt(r['coalesced'], 3)} | {_fmt(r['cpu_us_per_chunk'], 1)} | {_fmt(r['cpu_us_per_request'], 0)} | "
            f"{'yes' if r['bound'] else 'no' if own else ''} | {agrees if own else ''} | {r['lost']} |"
        )

    print()
    print("Where TTFT goes before the server (ms; kernel-clock rows): the client's TTFT minus the")
    print("instrument's own (request read -> first text written), the request written, a new connection.")
    print()
    print(
        "| path | streams | TTFT - server's p50 | p99 | request_sent_ms p50 | connect_ms p50 (new connections) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["clock"] == "kernel":
            print(
                f"| {r['path']} | {r['streams']} | {_fmt(r['over_server_p50'])} | {_fmt(r['over_server_p99'])} | "
                f"{_fmt(r['sent_p50'])} | {_fmt(r['connect_p50'])} ({r['new_connections']}) |"
            )


if __name__ == "__main__":
    main()
