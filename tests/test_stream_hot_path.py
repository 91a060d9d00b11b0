"""The stream client's hot path (issue 30): what a chunk costs, without losing a figure.

Against the ground-truth instrument (tests/groundtruth_server.py): the chunk parser reads what
the standard library reads, a read costs no timer, the read bound still ends a stall (and only
a stall), and every chunk is read in its own read's callback, with that read's times.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from tasks.stream.client import stream_chat
from tasks.stream.load import FINE_WAIT_S, MAX_SEND_LEAD_S, SendLead, make_client, wait_until
from tasks.stream.records import RequestRecord
from tasks.wire.sse import SSEFramer, loads

try:
    from tests import groundtruth_server as gt
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import groundtruth_server as gt


@pytest.fixture(scope="module")
def server(instrument) -> gt.GroundTruthServer:
    return instrument


def test_loads_reads_what_the_standard_library_reads() -> None:
    chunk = b'{"choices": [{"index": 0, "delta": {"content": " w1"}, "finish_reason": null}]}'
    assert loads(chunk) == json.loads(chunk)
    # what orjson refuses and Python servers write (json.dumps' NaN and Infinity, lone surrogates)
    nan = loads(b'{"usage": {"completion_tokens": NaN}}')["usage"]["completion_tokens"]
    assert math.isnan(nan)
    assert loads(b"[Infinity, -Infinity]") == [math.inf, -math.inf]
    assert loads(b'{"t": "\\ud800"}') == {"t": "\ud800"}
    # not JSON: json's own error, with the line, as tasks.wire.errors.classify reads it
    with pytest.raises(json.JSONDecodeError) as caught:
        loads(b'{"choices": [')
    assert caught.value.doc == '{"choices": ['


def _stream(base_url: str, model: str, timeout_s: float, timers: list[float] | None = None) -> RequestRecord:
    """One request on a fresh client (after a warm-up on the same connection); with
    ``timers``, the delay of every timer the loop was asked for during the measured request."""

    async def main() -> RequestRecord:
        client = make_client(base_url, None, timeout_s, 1)
        try:
            await stream_chat(
                client, model="single", prompt="w", max_tokens=4, count_tokens=None, request_id="w"
            )
            loop = asyncio.get_running_loop()
            call_at = loop.call_at
            if timers is not None:

                def counted(when, callback, *args, context=None):
                    timers.append(when - loop.time())
                    return call_at(when, callback, *args, context=context)

                loop.call_at = counted
            try:
                return await stream_chat(
                    client, model=model, prompt="p0", max_tokens=64, count_tokens=None, request_id=model
                )
            finally:
                loop.call_at = call_at
        finally:
            await client.close()

    return asyncio.run(main())


def test_a_read_costs_no_timer(server) -> None:
    """Before: aiohttp's sock_read re-armed a timer on every read (44 for these 40 chunks)."""
    timers: list[float] = []
    r = _stream(server.base_url, "ticks:40:5", 10.0, timers)
    assert r.succeeded and len(r.token_offsets_ms) == 40, r.error_message
    # the head's bound (10 s) and the read bound's first look (5 s): nothing per read or per drain
    assert sorted(timers) == pytest.approx([5.0, 10.0], abs=0.01)


def test_the_read_bound_ends_a_stall_and_only_a_stall(server) -> None:
    # 40 chunks 20 ms apart: 0.8 s in all, four times the bound, never 0.2 s without a byte
    r = _stream(server.base_url, "ticks:40:20", 0.2)
    assert r.succeeded and len(r.token_offsets_ms) == 40, r.error_message
    # a role chunk, then 3 s of nothing: ended 1 to 1.5 bounds after the role chunk
    start = time.perf_counter()
    r = _stream(server.base_url, "slow", 0.4)
    took_s = time.perf_counter() - start
    assert r.error_class == "timeout", r.error_message
    assert 0.4 <= took_s < 0.6 + 0.5, took_s  # 0.5 s for the warm-up request and a loaded machine


def test_a_stamped_stream_is_framed_in_each_reads_callback_with_its_times(server, monkeypatch) -> None:
    """Before: the reads' bytes were buffered and framed every 50-150 ms (a drain), each event
    stamped by looking up the read that delivered its last byte; now each read's bytes are
    framed in its own callback (one event handed on per chunk: by the framer, or by the compiled
    ``sse_chunks``), with that read's stamps.

    The order of the stamps (sent, then the kernel's, then the read's) holds in every attempt;
    how soon after each other they come is timing, which a client or instrument descheduled on
    2 shared cores can stretch for a few chunks (CI: 1 run in 3): measured up to 3 times."""
    from tasks.wire import transports

    blocks: list[bytes] = []  # every event handed on
    chat_events = transports.chat_events

    def counted(state):
        on_event = chat_events(state)
        return lambda payload, *stamps: blocks.append(payload) or on_event(payload, *stamps)

    monkeypatch.setattr(transports, "chat_events", counted)
    for _ in range(3):
        blocks.clear()
        server.reset()
        r = _stream(server.base_url, "ticks:40:5", 10.0)  # 40 chunks over 0.2 s, after a warm-up
        assert r.succeeded and r.arrival_clock == "kernel", r.error_message
        assert len(blocks) >= 40, len(blocks)  # the warm-up's few and the 40 chunks' own
        true_ns = server.stamps()["p0"]["text_sent_ns"]
        kernel_ns = [r.send_ns + offset * 1e6 for offset in r.token_offsets_ms]
        user_ns = [r.send_ns + offset * 1e6 for offset in r.user_token_offsets_ms]
        assert len(kernel_ns) == len(user_ns) == len(true_ns) == 40
        # each chunk's kernel stamp lies after its send, its user stamp (its read's return)
        # after that (1 us: the records' rounding)
        wire_ns = [k - t for k, t in zip(kernel_ns, true_ns)]
        read_ns = [u - k for u, k in zip(user_ns, kernel_ns)]
        assert min(wire_ns) >= -1e3 and min(read_ns) >= -1e3, (wire_ns, read_ns)
        assert len(set(r.user_token_offsets_ms)) >= 30  # a read's own time, not the loop's few wakes
        if max(wire_ns) < 2e6 and max(read_ns) < 5e6:  # just after: the read's own stamps
            return
    raise AssertionError(f"stamps late in 3 attempts: wire {max(wire_ns)} ns, read {max(read_ns)} ns")


def test_a_stamped_stream_ends_when_its_body_ends(server) -> None:
    """Before (f16a586): after the block that held the body's end the loop still waited out a
    drain (50-150 ms), so every request of a closed loop (``--max-concurrency``) was sent that
    much late: one at a time on ``load:10:20:10:20`` ran 3.2 requests/s instead of 5."""
    for _ in range(3):
        r = _stream(server.base_url, "ticks:10:5", 10.0)
        assert r.succeeded and r.arrival_clock == "kernel", r.error_message
        assert r.stream_close_ms - r.e2e_ms < 25, (r.e2e_ms, r.stream_close_ms)


def test_a_scheduled_instant_is_waited_out_without_a_timer_at_its_end() -> None:
    """Before: a timer to the instant itself, which asyncio fires on epoll's whole milliseconds
    (trace replay at 250 requests/s: sends 0.6-0.9 ms late at the median). Now one timer to
    FINE_WAIT_S before the instant, then yields: never early, and no timer inside the last stretch."""

    async def main() -> tuple[list[float], list[float]]:
        loop = asyncio.get_running_loop()
        timers: list[float] = []
        call_at = loop.call_at

        def counted(when, callback, *args, context=None):
            timers.append(when - loop.time())
            return call_at(when, callback, *args, context=context)

        loop.call_at = counted
        early = []
        for ahead_s in (0.005, 0.0005, 0.0):
            when = time.perf_counter() + ahead_s
            await wait_until(when)
            early.append(when - time.perf_counter())
        loop.call_at = call_at
        return timers, early

    timers, early = asyncio.run(main())
    assert max(early) <= 0, early
    # one timer, for the 5 ms wait, ending FINE_WAIT_S before its instant; none for the others
    assert len(timers) == 1 and 0.005 - FINE_WAIT_S - 0.0005 <= timers[0] <= 0.005 - FINE_WAIT_S, timers


def test_a_send_starts_by_its_learned_dispatch_cost_early_and_never_chases_a_stall() -> None:
    """The lead is the median cost from wake to the kernel over the last sends: none before a
    quarter of the window was seen, a stall's cost (one 30 ms send among 0.3 ms ones) does not
    move it, and a cost above MAX_SEND_LEAD_S is capped there."""
    lead = SendLead()
    for k in range(SendLead.WINDOW // 4 - 1):
        lead.observe(k, k + 0.0003)
    assert lead.s == 0.0
    lead.observe(100.0, 100.03)  # a stalled loop's send
    assert lead.s == pytest.approx(0.0003)
    for k in range(SendLead.WINDOW):  # the window forgets the old sends: now 2 ms each
        lead.observe(k, k + 0.002)
    assert lead.s == MAX_SEND_LEAD_S


@pytest.mark.parametrize(
    ("piece", "payloads"),
    [
        (b'data: {"a": 1}\n\n', [b'{"a": 1}']),  # one whole event: cut without a split
        (b"data:x\n\n", [b"x"]),
        (b"data: x\r\n\n", [b"x"]),
        (b"data: x\r\n\r\n", [b"x"]),
        (b"data: a\ndata: b\n\n", [b"a\nb"]),
        (b": keep-alive\ndata: y\n\n", [b"y"]),
        (b"data: \n\n", [b""]),
        (b"event: ping\n\n", []),
        (b"data: a\n\ndata: b\n\n", [b"a", b"b"]),
    ],
)
def test_a_piece_is_framed_as_the_same_bytes_split_anywhere(piece: bytes, payloads: list[bytes]) -> None:
    for cut in range(len(piece)):  # 0: the piece whole
        got: list[tuple[bytes, int]] = []
        framer = SSEFramer(lambda payload, read_ns, _rx_ns, got=got: got.append((payload, read_ns)))
        framer.sink(piece[:cut], 1, None)
        framer.sink(piece[cut:], 2, None)
        assert [payload for payload, _ in got] == payloads, cut
        # each event is stamped by the read that ended it: the first piece's only if it held its end
        ended_first = len(SSEFramer().feed(piece[:cut]))
        assert [read_ns for _, read_ns in got] == [1] * ended_first + [2] * (len(payloads) - ended_first), cut


_CHUNKS = [  # a stream of every kind the chat reader meets, in one order
    b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}]}',
    b'{"choices":[{"index":0,"delta":{"content":" w1"},"finish_reason":null}]}',
    b'{"choices":[{"index":0,"delta":{"reasoning_content":"hm"},"finish_reason":null}]}',
    b'{"choices":[{"index":0,"delta":{"content":null,"reasoning":"ok"},"finish_reason":null}]}',
    b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{\\"a"}}]}}]}',
    b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\\":1}"}}]}}]}',
    b'{"choices":[{"index":0,"text":" w2","finish_reason":null}]}',  # /completions
    b'{"choices":[{"index":0,"delta":{"content":7}}]}',  # not text: another type, the general path
    b'{"choices":[{"index":0,"delta":{"content":" w3"}}],"usage":{"completion_tokens":3}}',
    b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"timings":{"cache_n":2,"prompt_n":9}}',
    b'{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":4},"timings":{"cache_n":3}}',
    b"[DONE]",
]


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "general"])
def test_a_chunk_read_typed_fills_the_state_the_general_reader_fills(typed, monkeypatch) -> None:
    from tasks.wire import transports

    if not typed:  # every chunk refused by the types: each goes to the general reader

        def refuse(payload: bytes):
            raise transports.msgspec.ValidationError("forced")

        monkeypatch.setattr(transports, "_decode_chunk", refuse)
    general: list[bytes] = []
    read_event = transports._read_event
    monkeypatch.setattr(
        transports,
        "_read_event",
        lambda payload, state: general.append(payload) or read_event(payload, state),
    )
    state = transports.new_state()
    on_event = transports.chat_events(state)
    for n, payload in enumerate(_CHUNKS):
        on_event(payload, 1000 + n, 2000 + n)
    # text chunks: " w1", "hm", "ok", the two tool-call fragments, " w2", " w3" (the role chunk,
    # the non-string content, the finish and the usage-only chunk carry none)
    assert state["arrivals_ns"] == [1001, 1002, 1003, 1004, 1005, 1006, 1008]
    assert state["rx_ns"] == [2001, 2002, 2003, 2004, 2005, 2006, 2008]
    assert state["parts"] == [" w1", "hm", "ok", "", "", " w2", " w3"]
    assert state["tool_calls"] == {0: ["f", '{"a":1}']}
    assert state["chunks"] == 11 and state["done"] and state["finish_reason"] == "stop"
    assert state["usage"] == {"prompt_tokens": 11, "completion_tokens": 4}
    assert state["timings"] == {"cache_n": 3}
    # typed: only the chunk with a non-string content and the one without choices went general
    assert general == ([_CHUNKS[7], _CHUNKS[10]] if typed else _CHUNKS[:-1])


def test_a_chunk_of_another_shape_is_refused_by_the_general_reader_with_its_reason() -> None:
    from tasks.wire import transports
    from tasks.wire.errors import StreamError

    on_event = transports.chat_events(transports.new_state())
    with pytest.raises(StreamError, match="choices\\[0\\] is not an object"):
        on_event(b'{"choices":["x"]}', 1, None)
    with pytest.raises(StreamError, match="inside the stream: overloaded"):
        on_event(b'{"error":{"message":"overloaded"}}', 1, None)
    with pytest.raises(json.JSONDecodeError):
        on_event(b'{"choices":[', 1, None)


def _chunk(data: bytes, size: bytes | None = None) -> bytes:
    return b"%b\r\n%b\r\n" % (size or b"%x" % len(data), data)


_READS = [  # a body read by read: every framing the compiled short path meets or leaves
    _chunk(b'data: {"n":1}\n\n'),  # the usual: one chunk, one event
    _chunk(b"data: 2\n\n") + _chunk(b"data: 3\n\n") + _chunk(b"data: \n\n"),  # several, an empty one
    _chunk(b"data: 4\n\ndata: 5\n\n"),  # two events in one chunk
    _chunk(b"data:6\n\n") + _chunk(b"data: 7\n\n", b"%X" % 9),  # no space; an upper-case size
    _chunk(b"data: 8\r\n\r\n") + _chunk(b"data: 9\n\n", b"9;e=1"),  # CRLF lines; an extension
    _chunk(b": ping\n\n") + _chunk(b"event: e\ndata: 10\n\n"),  # a comment; an event line
    _chunk(b"data: 1") + _chunk(b"1\n\n"),  # an event across two chunks
    _chunk(b"data: 12\n\n") + b"a\r\ndata: 1",  # a whole chunk, then a part of the next
    b"3\n\n\r\n" + _chunk(b"data: [DONE]\n\n"),  # its rest, then [DONE]
    b"0\r\n\r\n",  # the last chunk
]


@pytest.mark.parametrize("cut", [None, 7, 23])
def test_the_compiled_short_path_hands_on_what_the_framing_does(cut, monkeypatch) -> None:
    """``tasks/wire/_rx.c``'s ``sse_chunks`` (whole chunks of one one-line ``data:`` event each,
    straight to the reader) against the Python framing alone, read by read: the same events, with
    the same reads' stamps, the same body bytes counted, the same end. ``cut``: every read also
    split there (parts of chunks, of size lines)."""
    from tasks.wire import h1, reactor

    if not reactor.COMPILED:
        pytest.skip("the compiled read was not built here (tests/test_h1.py says why)")
    reads = _READS if cut is None else [piece for r in _READS for piece in (r[:cut], r[cut:]) if piece]

    framed: list[bool] = []  # a piece handed to the framer (not taken by the short path)

    def read(compiled: bool) -> tuple[list[tuple], int, bool]:
        monkeypatch.setattr(h1, "_rx", reactor._rx if compiled else None)
        got: list[tuple] = []

        def on_event(payload: bytes, read_ns: int, rx_ns: int | None) -> None:
            got.append((payload, read_ns, rx_ns))

        class Sock:  # the stamped socket's two stamps, set per read as its read sets them
            read_ns = rx_ns = 0

        response, framer = h1.Response(Sock), SSEFramer(on_event)  # type: ignore[arg-type]
        response._state = h1._SIZE
        response._sink = response._fast = lambda *piece: framed.append(compiled) or framer.sink(*piece)
        response._events = (framer, on_event) if compiled else None
        for k, data in enumerate(reads):
            Sock.read_ns, Sock.rx_ns = 1000 + k, 2000 + k
            response.data_received(data)
        return got, response._total, response._ended

    compiled, python = read(True), read(False)
    assert compiled == python
    if cut is None:  # whole reads: the compiled path took its share (cut ones are parts)
        assert framed.count(True) < framed.count(False)
    assert [payload for payload, _, _ in python[0]] == [
        b'{"n":1}',
        b"2",
        b"3",
        b"",
        b"4",
        b"5",
        b"6",
        b"7",
        b"8",
        b"9",
        b"10",
        b"11",
        b"12",
        b"13",
        b"[DONE]",
    ]
    assert python[2]  # the body ended


def test_the_compiled_read_waits_only_while_nothing_else_is_due() -> None:
    """``_rx.drain`` with the loop's epoll (``tasks.wire.reactor.Reactor._turn``): while only the
    reactor's connections become ready it goes on reading them as their bytes come, up to its
    deadline; a queued callback or another of the loop's readers ready ends the wait at once."""
    import collections
    import select
    import socket
    import threading

    from tasks.wire import reactor

    if not reactor.COMPILED:
        pytest.skip("the compiled read was not built here (tests/test_h1.py says why)")
    loop_epoll, reactor_epoll = select.epoll(), select.epoll()
    loop_epoll.register(reactor_epoll.fileno(), select.EPOLLIN)
    ours, server = socket.socketpair()
    ours.setblocking(False)
    reactor_epoll.register(ours.fileno(), select.EPOLLIN)
    other_r, other_w = socket.socketpair()  # another reader of the loop (the lag probe's pipe)
    loop_epoll.register(other_r.fileno(), select.EPOLLIN)
    reads: list[bytes] = []

    class Protocol:
        def data_received(self, data: bytes) -> None:
            reads.append(data)

    handlers = {ours.fileno(): (None, Protocol(), None)}

    def drain(ready: collections.deque, within_s: float) -> float:
        start = time.monotonic()
        deadline_ns = time.monotonic_ns() + round(within_s * 1e9)
        reactor._rx.drain(reactor_epoll.fileno(), handlers, loop_epoll.fileno(), ready, deadline_ns)
        return time.monotonic() - start

    def write_every(gap_s: float, times: int) -> threading.Thread:
        def run() -> None:
            for _ in range(times):
                server.send(b"x")
                time.sleep(gap_s)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    try:
        # only its connection: bytes every 5 ms are read as they come until the deadline
        writer = write_every(0.005, 20)
        took_s = drain(collections.deque(), 0.06)
        writer.join()
        assert 0.055 <= took_s < 1.0 and len(reads) >= 6, (took_s, len(reads))
        # a callback queued on the loop: one pass, no wait (the deadline is 10 s away)
        reads.clear()
        server.send(b"y")
        time.sleep(0.01)
        assert (
            drain(collections.deque([object()]), 10.0) < 1.0 and len(reads) == 1 and reads[0].endswith(b"y")
        )
        # another reader ready: back to the loop at once
        other_w.send(b"!")
        assert drain(collections.deque(), 10.0) < 1.0
        other_r.recv(1)
        # nothing at all: back at the deadline
        assert 0.02 <= drain(collections.deque(), 0.02) < 1.0
    finally:
        for sock in (ours, server, other_r, other_w):
            sock.close()
        loop_epoll.close()
        reactor_epoll.close()
