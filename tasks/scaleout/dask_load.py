"""One load level spread over Dask workers, possibly on several hosts (``--task-runner`` of
``infermeter stream``; :func:`tasks.scaleout.levels.run_levels`).

The same level as :func:`tasks.scaleout.multiproc.run_level_processes`, with a Dask worker in
place of each client process: one Dask task per worker (pinned to it) runs
:func:`tasks.stream.load.run_level` on its share (request ``i`` to worker ``i % N``, the
concurrency split as evenly as it goes; the warm-up on worker 0 first) at its places in the one
arrival schedule, started at one instant the orchestrator (this process) picks once every
worker is ready.

The data plane is not Dask's: the orchestrator listens on a TCP port of its own and each task
connects back to it (``tasks.scaleout.dask_wire``: a random token refuses strangers; the API key
travels this way, never through the scheduler). The worker's clock offset to the
orchestrator's is measured by round trips before the level and after it
(:mod:`tasks.scaleout.clocksync`, NTP's way: Linux's ``perf_counter`` is CLOCK_MONOTONIC, since
boot, so two hosts' differ by hours); the start instant goes to each worker on its own clock,
and each record as it finishes comes back with its ``send_ns`` on the worker's clock: the
orchestrator moves it onto its own by the start offset (the end offset is reported beside it),
counts the output tokens where the server gave no usage, and hands it to ``on_record`` (the
journal) at once.

A worker whose connection closes before ``done`` (killed, out of memory, its host gone: TCP
keep-alive notices within ~25 s) is lost, not fatal: the level keeps what it received and
``client["client_workers"]`` names the worker and how many requests of its share never came back
(``requests_lost``; a Dask retry of its task is refused, so nothing is sent twice). The level's
figures are over every record received (``tasks.stream.quality.client_figures``); each worker's
client-bound flag and loop lag p99 are beside its offsets in ``client["client_workers"]``.

The task runs the client on the Dask worker's task thread (``asyncio.run``: that thread has no
loop). A forked client process (``tasks.scaleout.multiproc``) would leave the Dask worker's own
threads off the client's GIL, but cannot start from a daemonic worker (Dask's default) and adds
a fork server per worker. Those threads once cost the client 10-20 % more CPU per chunk (its
loop woke 300-700 times a second); a LocalCluster's workers now run quiet
(``tasks.scaleout.dask_cluster.QUIET_WORKER_CONFIG``; README "Load from several hosts"), and each
worker's loop-lag probe and client-bound flag say when they still cost a figure.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tasks.scaleout.clocksync import Offset
from tasks.scaleout.dask_wire import Link, client_task, sync
from tasks.scaleout.multiproc import START_TIMEOUT_S, _share_of, merge_lags
from tasks.stream.level_result import HistoryTokens, LevelResult, fill_output_tokens
from tasks.stream.quality import client_figures
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings

__all__ = ["pooled_workers", "run_level_dask"]

#: Seconds the tasks get to return once the level is over (or left), before they are cancelled.
FINISH_TIMEOUT_S = 1.0
#: Seconds from the orchestrator's pick of the start instant to the instant: time for the
#: start message to reach every worker (a LAN round trip is well under a millisecond).
START_MARGIN_S = 0.05


class _Hub:
    """The listening socket and a thread per worker connection; every event goes to
    ``events`` as ``(kind, k, payload)``: ``hello`` (link, start offset), ``ready``,
    ``record``, ``done`` (message, end offset or None), ``failed``, ``lost``."""

    def __init__(self, host: str, token: str, api_key: str | None) -> None:
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(0.5)  # its accept looks at `closed` that often
        self.closed = False
        self.token, self.api_key = token, api_key
        self.events: queue.Queue[tuple[str, int, Any]] = queue.Queue()
        self.claimed: set[int] = set()
        self.links: list[Link] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="dask-load-accept").start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed: the level is over
                return
            threading.Thread(target=self._serve, args=(Link(sock),), daemon=True).start()

    def _serve(self, link: Link) -> None:
        with self.lock:
            self.links.append(link)
        k = None
        try:
            hello = link.recv()
            if not hello or hello.get("token") != self.token:
                return
            with self.lock:
                fresh = hello["k"] not in self.claimed
                self.claimed.add(hello["k"])
            if not fresh:
                link.send({"kind": "abandon"})
                return
            k = hello["k"]
            start = sync(link)
            link.send({"kind": "go", "api_key": self.api_key})
            self.events.put(("hello", k, (link, start)))
            while (message := link.recv()) is not None:
                if message["kind"] == "done":
                    end = None
                    with contextlib.suppress(OSError, ConnectionError, ValueError):
                        end = sync(link)
                        link.send({"kind": "bye"})
                    self.events.put(("done", k, (message, end)))
                    return
                self.events.put((message["kind"], k, message))
                if message["kind"] == "failed":
                    return
        except (OSError, ValueError, ConnectionError, KeyError):
            pass
        finally:
            link.close()
            link.reader.close()
        if k is not None:
            self.events.put(("lost", k, None))

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        with self.lock:
            for link in self.links:
                link.close()


@dataclass
class _Worker:
    """What the orchestrator knows of one worker's share."""

    address: str
    streams: int
    requests: list[int]  # the measured indices of its share
    state: str = "waiting"  # -> connected -> ready -> done | lost
    link: Link | None = None
    start: Offset | None = None
    end: Offset | None = None
    done: dict[str, Any] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list)
    cause: str | None = None

    def lose(self, cause: str) -> None:
        self.state, self.cause = "lost", cause


def _routes(addresses: list[str]) -> tuple[str, list[str]]:
    """Where to listen, and the address each worker connects back to: this host's address on
    the route to the worker's host (``distributed.utils.get_ip``: 127.0.0.1 for a local
    cluster); every interface when the workers reach it by several."""
    from urllib.parse import urlparse

    from distributed.utils import get_ip

    ips = [get_ip(urlparse(address).hostname or "127.0.0.1") for address in addresses]
    return (ips[0] if len(set(ips)) == 1 else ""), ips


def run_level_dask(
    client: Any,
    connection: Connection,
    settings: LevelSettings,
    *,
    count_tokens: Callable[[str], int] | None,
    workers: list[str] | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    on_measure_start: Callable[[], None] | None = None,
) -> LevelResult:
    """Run one level over the Dask workers of ``client`` (a ``distributed.Client``; module
    docstring): ``workers`` (addresses; None: all the scheduler has), at most
    ``settings.max_concurrency`` of them. The contract of
    :func:`tasks.scaleout.multiproc.run_level_processes`: the callbacks are called in this
    process, records and request ids are those of one process; their ``send_ns`` on this
    process's ``perf_counter_ns``.

    ``result.client``: the figures over every record received, ``client_processes`` (workers
    used), ``client_workers_lost``, ``requests_lost`` and ``client_workers``: per worker its
    ``worker`` address, ``streams``, ``requests`` (its share), ``records`` (received),
    ``lost`` (requests of its share that never came back; 0 unless it was lost), ``cause``,
    ``clock_offset_ns`` / ``clock_offset_end_ns`` (its clock minus this one's, at the start and
    the end; the end's None when it was lost), ``clock_uncertainty_ns`` (the larger half round
    trip), ``client_bound`` and ``client_loop_lag_ms_p99``.

    Raises:
        ValueError: no worker.
        RuntimeError: a worker cannot import infermeter (before anything is sent), a worker's
            level raised (its message), every worker was lost before the start, or a worker did
            not connect within ``START_TIMEOUT_S`` (records received before are kept: they went
            to ``on_record``).
    """
    addresses = sorted(workers or client.scheduler_info()["workers"])[: settings.max_concurrency]
    if not addresses:
        raise ValueError(
            "the Dask cluster has no worker to run the level: start one (`dask worker SCHEDULER_ADDRESS`)"
        )
    _check_imports(client, addresses)
    n = len(addresses)
    history = HistoryTokens(settings)
    result = LevelResult(settings.level, settings.max_concurrency, settings.request_rate)
    warmup = replace(settings, num_requests=0) if settings.warmup else None
    share = settings.after_warmup()
    ws = [
        _Worker(address, _share_of(settings.max_concurrency, n, k), list(range(k, settings.num_requests, n)))
        for k, address in enumerate(addresses)
    ]
    token = secrets.token_hex(16)
    host, back = _routes(addresses)
    hub = _Hub(host, token, connection.api_key)
    futures = []
    started = False
    try:
        for k, w in enumerate(ws):
            futures.append(
                client.submit(
                    client_task,
                    k,
                    n,
                    (back[k], hub.port),
                    token,
                    replace(connection, api_key=None),  # the key goes over the data plane
                    replace(share, max_concurrency=w.streams),
                    warmup if k == 0 else None,
                    key=f"infermeter-stream-l{settings.level}-{token[:8]}-{k}",
                    workers=[w.address],
                    pure=False,
                    retries=0,
                )
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while any(w.state not in ("done", "lost") for w in ws):
            try:
                kind, k, payload = hub.events.get(timeout=0.5)
            except queue.Empty:
                for w, future in zip(ws, futures):
                    if w.state == "waiting" and future.status in ("error", "cancelled", "finished", "lost"):
                        w.lose(f"its Dask task ended before it connected ({future.status})")
                late = [w.address for w in ws if w.state == "waiting"]
                if late and time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Dask workers did not connect in {START_TIMEOUT_S:g} s: {late} (can they reach "
                        f"{host}:{hub.port}? their own logs say why)"
                    ) from None
            else:
                w = ws[k]
                if kind == "hello":
                    w.state, (w.link, w.start) = "connected", payload
                elif kind == "ready":
                    w.state = "ready"
                elif kind == "record":
                    record = RequestRecord.from_json(payload["record"])
                    if record.send_ns:
                        record.send_ns = w.start.to_local(record.send_ns)
                    fill_output_tokens(record, count_tokens)
                    history.fill(record)
                    if on_record is not None:
                        on_record(record)
                    (result.records if record.warmup else w.records).append(record)
                elif kind == "done":
                    (w.done, w.end), w.state = payload, "done"
                elif kind == "failed":
                    raise RuntimeError(f"Dask worker {w.address}: {payload['error']}")
                elif kind == "lost" and w.state != "done":
                    w.lose("its connection closed before the level's end")
            if not started and all(w.state in ("ready", "lost") for w in ws):
                if all(w.state == "lost" for w in ws):
                    raise RuntimeError(f"every Dask worker was lost before the level started: {addresses}")
                if on_measure_start is not None:
                    on_measure_start()
                at_ns = time.perf_counter_ns() + round(START_MARGIN_S * 1e9)
                for w in ws:
                    if w.state == "ready":
                        with contextlib.suppress(OSError):  # one gone now: its "lost" follows
                            w.link.send({"kind": "start", "at_ns": w.start.to_remote(at_ns)})
                started = True
    finally:
        hub.close()  # each worker's client sees its link end: it cancels its requests and returns
        with contextlib.suppress(Exception):  # a cluster gone meanwhile: nothing to cancel
            _wait(futures, timeout=FINISH_TIMEOUT_S)  # a cancel of a running task: the worker's warning
            client.cancel(futures)
    _finish(result, ws, settings)
    return result


def _check_imports(client: Any, addresses: list[str]) -> None:
    """Raise RuntimeError naming the workers among ``addresses`` that cannot import the level's
    task (:mod:`tasks.scaleout.dask_wire`): a worker started outside infermeter's environment
    otherwise fails only in its own log, and the level waited ``START_TIMEOUT_S`` for it. The
    look is ``importlib.util.find_spec`` on each worker (standard library: it runs where
    infermeter is missing), one round trip."""
    import importlib.util

    found = client.run(
        importlib.util.find_spec, "tasks.scaleout.dask_wire", workers=addresses, on_error="return"
    )
    missing = sorted(
        address for address, spec in found.items() if spec is None or isinstance(spec, Exception)
    )
    if missing:
        raise RuntimeError(
            f"Dask workers cannot import infermeter: {missing}; start them from infermeter's "
            'environment (README "Load from several hosts")'
        )


def _wait(futures: list[Any], timeout: float) -> None:
    """Until ``futures`` are done, at most ``timeout`` seconds."""
    from distributed import wait

    with contextlib.suppress(TimeoutError):
        wait(futures, timeout=timeout)


def _finish(result: LevelResult, ws: list[_Worker], settings: LevelSettings) -> None:
    """The level's result from its workers' (the module docstring; run_level_dask's Returns)."""
    measured = [r for w in ws for r in w.records]
    result.records.extend(sorted(measured, key=lambda r: r.send_ns))
    ends = [w.start.to_local(w.done["last_done_ns"]) for w in ws if w.done.get("last_done_ns")]
    ends += [  # a lost worker's records: each one's own end
        r.send_ns + round((r.e2e_ms or 0.0) * 1e6) for w in ws if w.state == "lost" for r in w.records
    ]
    if measured:
        result.last_done_ns = max(ends)
        result.wall_s = (result.last_done_ns - min(r.send_ns for r in measured)) / 1e9
    done = [w for w in ws if w.done]
    result.lag = merge_lags([w.done["lag"] for w in done])
    result.cpu_s = sum(w.done["cpu_s"] or 0.0 for w in done)
    drifts = [w.done["offset_drift_ns"] for w in done if w.done["offset_drift_ns"] is not None]
    result.offset_drift_ns = max(drifts, key=abs) if drifts else None
    tolerances = {
        "lag_tolerance_ms": settings.lag_tolerance_ms,
        "coalesced_tolerance": settings.coalesced_tolerance,
    }
    entries = []
    for w in ws:
        received = {_request_index(r.request_id) for r in w.records}
        lost = sum(1 for i in w.requests if i not in received) if w.state == "lost" else 0
        lag = w.done.get("lag") or {}
        own = client_figures(w.records, lag, **tolerances) if w.records else {}
        uncertainties = [o.uncertainty_ns for o in (w.start, w.end) if o is not None]
        entries.append(
            {
                "worker": w.address,
                "streams": w.streams,
                "requests": len(w.requests),
                "records": len(w.records),
                "lost": lost,
                "cause": w.cause,
                "clock_offset_ns": w.start.offset_ns if w.start else None,
                "clock_offset_end_ns": w.end.offset_ns if w.end else None,
                "clock_uncertainty_ns": max(uncertainties) if uncertainties else None,
                "client_bound": own.get("client_bound"),
                "client_loop_lag_ms_p99": lag.get("client_loop_lag_ms_p99"),
            }
        )
    figures = client_figures(
        measured, result.lag, cpu_s=result.cpu_s, offset_drift_ns=result.offset_drift_ns, **tolerances
    )
    result.client = {
        **figures,
        "client_processes": len(ws),
        "client_workers_lost": sum(1 for w in ws if w.state == "lost"),
        "requests_lost": sum(e["lost"] for e in entries),
        "client_workers": entries,
    }


def _request_index(request_id: str) -> int:
    """``i`` of a measured request id ``...-r{i}`` or a conversation turn's ``...-r{i}.{turn}``."""
    return int(request_id.rsplit("-r", 1)[1].split(".", 1)[0])


def pooled_workers(clients: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The Dask figures of a level's repeats (their ``LevelResult.client``): the lost workers
    and requests summed, every repeat's ``client_workers`` entries with their ``repeat`` (0-based)."""
    return {
        "client_workers_lost": sum(c.get("client_workers_lost") or 0 for c in clients),
        "requests_lost": sum(c.get("requests_lost") or 0 for c in clients),
        "client_workers": [
            {**entry, "repeat": i} for i, c in enumerate(clients) for entry in c.get("client_workers", [])
        ],
    }
