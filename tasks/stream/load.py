"""Load levels: warm-up, then N measured requests, arriving at a rate, at most C in flight.

A level (vLLM ``benchmark_serving.py``: ``--max-concurrency`` x ``--request-rate``): warm-up
requests go first, one at a time, recorded with ``warmup=True`` and left out of the statistics;
then ``num_requests`` measured requests arrive at ``request_rate`` requests/s and are sent as
soon as an ``asyncio.Semaphore(max_concurrency)`` lets them. Rate None (``inf``): all arrive at
once, so the level is a closed loop of ``max_concurrency`` streams. A finite rate draws the
inter-arrival times from a gamma distribution with shape ``burstiness`` and mean ``1 / rate``
(vLLM's ``get_request``: ``theta = 1 / (rate * burstiness)``; burstiness 1 = a Poisson
process), from ``random.Random(seed)``, so a seed replays the same arrivals. Prompts are used
round-robin, the measured requests continuing after the warm-up's. Each scheduled send (a
rate's arrival, a trace's row, a session's think time) leaves at its instant to well under a
millisecond (:func:`wait_until`), started by its learned dispatch cost early (:class:`SendLead`);
its lateness counts to the request's bytes handed to the kernel (:func:`sent_lateness_ms`).

``wall_s`` runs from the first measured send to the last measured completion; it is the
denominator of the level's throughput figures (``tasks.stats.aggregate_level``). During the
measured part a :class:`tasks.stream.lag.LoopLagProbe` measures the client's own event-loop lag
(``LevelResult.client``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence

import httpx2
import openai

from tasks.stream.client import SSEClient, stream_chat
from tasks.stream.lag import LoopLagProbe
from tasks.stream.level_result import LevelResult
from tasks.stream.quality import client_figures
from tasks.stream.records import RequestRecord
from tasks.stream.settings import Connection, LevelSettings, level_grid, session_max_tokens
from tasks.wire import proxy as proxies
from tasks.wire import rxclock
from tasks.wire.errors import SERVER_DIED

__all__ = ["arrival_offsets_s", "connect", "level_grid", "make_client", "open_connections", "run_level"]


def arrival_offsets_s(
    count: int, request_rate: float | None, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """When each of ``count`` requests arrives, in seconds since the first (which is at 0).

    Gaps are gamma(shape=burstiness, scale=1/(request_rate*burstiness)): mean ``1/rate``,
    coefficient of variation ``1/sqrt(burstiness)``. ``request_rate`` None: all at 0.

    Raises:
        ValueError: a rate or burstiness that is not > 0.
    """
    if request_rate is None:
        return [0.0] * count
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    offsets, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.gammavariate(burstiness, theta)
        offsets.append(t)
    return offsets


#: The last stretch before a scheduled send that the loop waits out by yielding instead of by a
#: timer: asyncio's timers fire on epoll's whole milliseconds, rounded up, so a timer alone is up
#: to 1 ms late (issue 30 measured 0.6-0.9 ms at the median of a trace replay; 0.3-0.4 ms to the
#: send call on 2026-12-03, tests/benchmarks/send_lateness.py). Yielding keeps the other streams
#: read meanwhile.
FINE_WAIT_S = 0.0012


async def wait_until(when_s: float) -> None:
    """Return at ``when_s`` (``time.perf_counter()`` seconds), or at once when it has passed: a
    timer to :data:`FINE_WAIT_S` before it, then yields to the event loop until it comes (the
    loop's other work runs between the looks; it costs at most that much CPU per send)."""
    delay = when_s - time.perf_counter() - FINE_WAIT_S
    if delay > 0:
        await asyncio.sleep(delay)
    while time.perf_counter() < when_s:
        await asyncio.sleep(0)


#: The most a scheduled send starts before its instant (:class:`SendLead`): the dispatch cost it
#: learns is 0.3-0.4 ms here (a task to run, the semaphore, the request written to the kernel); a
#: larger figure is a stalled loop, which no lead should chase.
MAX_SEND_LEAD_S = 0.0006


class SendLead:
    """How long before its instant a scheduled send starts, so that its bytes reach the kernel
    at the instant rather than a dispatch later: the lowest decile of the last :attr:`WINDOW`
    sends' cost from the wake to the bytes handed to the kernel (a send on a new connection
    costs its connect too: a median overshot, 0.4 ms early at the median), at most
    :data:`MAX_SEND_LEAD_S`, 0 until :attr:`WINDOW` // 4 sends were seen. A send lands early
    by less than the lead, never more (its wake is at most the lead early); the lateness is
    still measured to the kernel, so an early send shows as negative lateness, never hidden."""

    WINDOW = 64

    def __init__(self) -> None:
        self._costs: list[float] = []
        self.s = 0.0

    def observe(self, woke_s: float, sent_s: float) -> None:
        """One send: woken at ``woke_s``, its bytes with the kernel at ``sent_s`` (both
        ``perf_counter`` seconds)."""
        self._costs.append(sent_s - woke_s)
        if len(self._costs) > self.WINDOW:
            del self._costs[0]
        if len(self._costs) >= self.WINDOW // 4:
            low = sorted(self._costs)[len(self._costs) // 10]
            self.s = min(MAX_SEND_LEAD_S, max(0.0, low))


def sent_lateness_ms(record: RequestRecord, scheduled_s: float) -> float:
    """How late ``record``'s request left against its scheduled instant (``perf_counter``
    seconds): to its bytes handed to the kernel where the socket says when
    (``request_sent_ms``), else to the client's send call; ms."""
    sent_ns = record.send_ns + (record.request_sent_ms or 0.0) * 1e6
    return (sent_ns - scheduled_s * 1e9) / 1e6


def _input_tokens(counts: Sequence[int | None] | None, index: int) -> int | None:
    return counts[index % len(counts)] if counts else None


async def run_level(
    client: SSEClient | openai.AsyncOpenAI,
    settings: LevelSettings,
    *,
    count_tokens: Callable[[str], int] | None,
    on_record: Callable[[RequestRecord], None] | None = None,
    on_measure_start: Callable[[], None] | None = None,
    share: tuple[int, int] = (0, 1),
    start_at: float | None = None,
) -> LevelResult:
    """Run one load level against ``client`` and return its records and wall time.

    Args:
        settings: the level (:class:`tasks.stream.settings.LevelSettings`); at most
            ``settings.max_concurrency`` measured requests are in flight (the semaphore).
        count_tokens: the output-token fallback when the server sends no usage.
        on_record: called with every finished record (warm-up too), e.g. a ``RecordWriter``.
        on_measure_start: called after the warm-up, just before the first measured request
            (e.g. a scrape of the server's /metrics); it may block, nothing is in flight.
        share, start_at: for one of several client processes (``tasks.scaleout.multiproc``):
            ``(k, n)`` sends only the measured requests ``i`` with ``i % n == k``, at their
            places in the one arrival schedule that starts at ``start_at`` (a
            ``time.perf_counter()`` value: CLOCK_MONOTONIC, the same in every process).

    Request ids are ``l{level}-w{i}`` (warm-up) and ``l{level}-r{i}`` (measured), with
    ``-k{repeat}`` after the level when it is repeated (``settings.id_prefix``);
    ``settings.sessions``: measured ``i`` is a conversation (``converse``), its turns
    ``l{level}-r{i}.{turn}``, the semaphore held by its user from the first turn to the last
    reply (think times included), a rate scheduling the first turns (a turn's ``input_tokens``
    is the client's count, set where its tokenizer is: :class:`tasks.stream.level_result.HistoryTokens`).

    ``settings.duration_s`` bounds the sending: a measured request whose arrival, or whose turn
    at the semaphore, comes ``duration_s`` or more after the first measured arrival is not sent
    (vLLM and guidellm bound a level the same way: requests in flight finish and count). The
    level's ``wall_s`` still runs to the last completion.

    ``settings.schedule_s``: the measured requests are sent at those recorded times instead of a
    rate's draws (a trace replay); ``send_lateness_ms`` is then measured against them.

    Raises:
        ValueError: max_concurrency < 1, no prompts, a rate / burstiness not > 0, or a schedule
            shorter than ``num_requests``.
    """
    s = settings
    if s.max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    if not s.prompts:
        raise ValueError("prompts must not be empty")
    if s.schedule_s is not None:  # a recorded schedule (a trace): its times, not a rate's
        if len(s.schedule_s) < s.num_requests:
            raise ValueError("schedule_s must hold a time for every measured request")
        offsets = list(s.schedule_s)
    else:
        offsets = arrival_offsets_s(s.num_requests, s.request_rate, s.burstiness, s.seed)
    scheduled = s.request_rate is not None or s.schedule_s is not None
    mine = range(share[0], s.num_requests, share[1])
    result = LevelResult(level=s.level, max_concurrency=s.max_concurrency, request_rate=s.request_rate)
    common = {
        "model": s.model,
        "count_tokens": count_tokens,
        "sampling": s.sampling,
        "level": s.level,
        "max_concurrency": s.max_concurrency,
        "extra_body": s.extra_body,
        "api_key_env": s.api_key_env,
        "api": s.api,
        "server_pid": s.server_pid,
    }
    died: list[bool] = []  # the embedded server died: nothing more is sent (tasks.engines.death)

    def keep(record: RequestRecord) -> RequestRecord:
        record.request_rate, record.repeat = s.request_rate, s.repeat
        if s.prompt_groups:
            record.prefix_group = s.prompt_groups[s.prompt_index(record.request_id) % len(s.prompt_groups)]
        if on_record is not None:
            on_record(record)
        if record.error_class == SERVER_DIED:
            died.append(True)
        return record

    for i in range(s.warmup):
        record = await stream_chat(
            client,
            prompt=s.prompts[i % len(s.prompts)],
            request_id=f"{s.id_prefix}-w{i}",
            warmup=True,
            input_tokens=_input_tokens(s.prompt_tokens, i),
            max_tokens=s.max_tokens_at(i),
            **common,
        )
        result.records.append(keep(record))

    if start_at is None:  # one client: its streams' connections now (several: each did, before its start)
        await open_connections(client, s, share)
    if on_measure_start is not None:
        on_measure_start()
    gate = asyncio.Semaphore(s.max_concurrency)
    done_ns: list[int] = []
    measured: list[RequestRecord] = []

    deadline = None  # perf_counter() after which no measured request is sent (duration_s)
    lead = SendLead()  # scheduled sends start by their dispatch cost early

    async def one(i: int, woke_s: float = 0.0) -> None:
        async with gate:
            if deadline is not None and time.perf_counter() >= deadline:
                return  # queued behind the semaphore past the level's time: not sent
            if died:
                return  # the server is dead: not sent (the level loop says so)
            if s.sessions:
                await converse(i)
                return
            record = await stream_chat(
                client,
                prompt=s.prompts[(s.warmup + i) % len(s.prompts)],
                request_id=f"{s.id_prefix}-r{i}",
                input_tokens=_input_tokens(s.prompt_tokens, s.warmup + i),
                max_tokens=s.max_tokens_at(s.warmup + i),
                **common,
            )
            done_ns.append(time.perf_counter_ns())
        if scheduled:  # the schedule's arrival of request i vs its bytes leaving
            record.send_lateness_ms = sent_lateness_ms(record, start + offsets[i])
            if record.request_sent_ms is not None:
                lead.observe(woke_s, (record.send_ns + record.request_sent_ms * 1e6) / 1e9)
        measured.append(keep(record))

    async def converse(i: int) -> None:
        """Session ``i`` of one user, closed loop: each turn sent after the previous reply has
        finished and its think time, with the earlier turns and the server's own replies as
        history. A failed turn ends the session (there is no reply to go on from)."""
        session = s.sessions[i % len(s.sessions)]
        history: list[dict[str, str]] = []
        for k, text in enumerate(session.turns):
            if k and deadline is not None and time.perf_counter() >= deadline:
                return  # the level's time is up: no new turn
            record = await stream_chat(
                client,
                prompt=text,
                request_id=f"{s.id_prefix}-r{i}.{k + 1}",
                max_tokens=session_max_tokens(session, k, s.max_tokens),
                history=list(history),
                **common,
            )
            done_ns.append(time.perf_counter_ns())
            record.session_id, record.turn = f"{s.id_prefix}-s{i}", k + 1
            if scheduled and k == 0:  # a rate schedules the sessions' first turns
                record.send_lateness_ms = sent_lateness_ms(record, start + offsets[i])
            measured.append(keep(record))
            if not record.succeeded:
                return
            history += [
                {"role": "user", "content": text},
                {"role": "assistant", "content": record.output_text},
            ]
            if k < len(session.think_s):
                await wait_until(time.perf_counter() + session.think_s[k])

    offset_start_ns, cpu_start_s = rxclock.realtime_offset_ns(), time.process_time()
    async with LoopLagProbe() as probe:
        start = time.perf_counter() if start_at is None else start_at
        if s.duration_s is not None:
            deadline = start + s.duration_s
        tasks = []
        for i in mine:
            if deadline is not None and start + offsets[i] >= deadline:
                break  # arrivals are in time order: every later one is past the deadline too
            if died:
                break
            await wait_until(start + offsets[i] - lead.s)
            tasks.append(asyncio.ensure_future(one(i, time.perf_counter())))
        await asyncio.gather(*tasks)
    result.cpu_s = time.process_time() - cpu_start_s
    result.offset_drift_ns = rxclock.realtime_offset_ns() - offset_start_ns
    # the probe's lags that can reach a measurement: when the loop read them (user clock)
    arrivals_ns = sorted(
        r.send_ns + round(offset * 1e6)
        for r in measured
        for offset in (r.user_token_offsets_ms or r.token_offsets_ms)
    )
    result.lag = probe.metrics(s.lag_tolerance_ms, arrivals_ns)
    result.client = client_figures(
        measured,
        result.lag,
        lag_tolerance_ms=s.lag_tolerance_ms,
        coalesced_tolerance=s.coalesced_tolerance,
        cpu_s=result.cpu_s,
        offset_drift_ns=result.offset_drift_ns,
    )
    result.records.extend(sorted(measured, key=lambda r: r.send_ns))
    if measured:
        first_send_ns = min(r.send_ns for r in measured)
        result.last_done_ns = max(done_ns)
        result.wall_s = (result.last_done_ns - first_send_ns) / 1e9
    return result


#: The longest a client opens its connections for before a level (:func:`open_connections`):
#: those not open by then are opened by their requests.
OPEN_CONNECTIONS_S = 10.0


async def open_connections(
    client: SSEClient | openai.AsyncOpenAI, settings: LevelSettings, share: tuple[int, int] = (0, 1)
) -> int:
    """Open the connections a level's streams will use before its measured part: one per
    stream of ``share`` (:func:`run_level`'s; at most ``max_concurrency``, at most the share's
    requests), kept idle in the client's pool. A measured request then never waits for a TCP
    (or TLS) handshake, nor a closed loop's first wave behind hundreds of them: at 512 streams
    on this 2-core machine those requests left 86-92 ms after their instant (README "A level's
    connections are opened before its start"). A connection the server closes meanwhile, or
    one idle past the pool's expiry, costs its request a new one (its ``connect_ms``). They are
    opened within the request timeout and at most :data:`OPEN_CONNECTIONS_S`, all together.
    Returns how many were opened: 0 with the ``openai`` transport (httpx's pool opens on
    demand)."""
    if not isinstance(client, SSEClient):
        return 0
    streams = min(settings.max_concurrency, len(range(share[0], settings.num_requests, share[1])))
    return await client.pool.open_idle(streams, min(client.request_timeout_s, OPEN_CONNECTIONS_S))


def make_client(
    base_url: str,
    api_key: str | None,
    request_timeout_s: float,
    max_concurrency: int,
    transport: str = "sse",
    arrival_clock: str = "kernel",
    ca_bundle: str | None = None,
) -> SSEClient | openai.AsyncOpenAI:
    """A streaming client with no retries, the given timeout, and room for the concurrency.

    ``transport``: ``"sse"`` (default; :class:`tasks.stream.client.SSEClient`: our HTTP/1.1 and
    SSE parser, chosen on the benchmark's numbers) or ``"openai"`` (``AsyncOpenAI`` over httpx2). Both give the same
    records. No retries: a retried request would hide an error and stretch its latency. The
    timeout applies to connecting and to each read (the wait for the next chunk). With no key a
    placeholder is sent (servers without auth ignore it). ``arrival_clock``: ``"kernel"``
    (default) stamps arrivals with the kernel's receive times where it can (``sse`` on Linux;
    ``tasks.wire.rxclock``), ``"user"`` with the event loop's reads; the openai transport has
    only the user clock. ``ca_bundle``: a PEM file of the CAs that sign the endpoint's
    certificate (else the system store, or ``SSL_CERT_FILE``). Both transports take the proxy
    :func:`tasks.wire.proxy.proxy_for` names (never for loopback), or none.

    Raises:
        ValueError: an unknown transport.
        tasks.wire.proxy.ProxyError: a proxy variable names a proxy the sse transport cannot use.
        OSError: ``ca_bundle`` cannot be read.
    """
    if transport == "sse":  # its connections are the level's: the level's gate bounds them
        return SSEClient(
            base_url, api_key or "no-key", request_timeout_s, arrival_clock == "kernel", ca_bundle
        )
    if transport != "openai":
        raise ValueError(f"transport must be 'sse' or 'openai', got {transport!r}")
    room = max(max_concurrency, 1) + 8
    http_client = openai.DefaultAsyncHttpx2Client(
        timeout=httpx2.Timeout(request_timeout_s),
        limits=httpx2.Limits(max_connections=room, max_keepalive_connections=room),
        # a 3xx is an error naming its Location (tasks.wire.errors), as on the own client: a
        # followed redirect would charge the second request's time to the first
        follow_redirects=False,
        **({"verify": proxies.tls_context(ca_bundle)} if ca_bundle else {}),
        **proxies.httpx_routing(base_url),
    )
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key or "no-key",
        max_retries=0,
        timeout=request_timeout_s,
        http_client=http_client,
    )


def connect(connection: Connection, max_concurrency: int) -> SSEClient | openai.AsyncOpenAI:
    """:func:`make_client` for a :class:`tasks.stream.settings.Connection`."""
    return make_client(
        connection.base_url,
        connection.api_key,
        connection.request_timeout_s,
        max_concurrency,
        connection.transport,
        connection.arrival_clock,
        connection.ca_bundle,
    )
