"""tasks.wire.h1: the stream client's HTTP/1.1 (RFC 9112) against scripted servers on 127.0.0.1.

Each server writes exact bytes (split as the test says) so every framing the client meets is known:
chunked with extensions and trailers, Content-Length, close-delimited, interim 1xx heads,
connections kept alive or closed, bodies cut or stalled, heads that are not HTTP.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

import pytest

from tasks.wire import h1, reactor, rxclock
from tasks.wire.pool import Pool

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
CHUNKED_BODY = b"".join(b"%x;ext=1\r\n%b\r\n" % (len(e), e) for e in EVENTS) + b"0\r\nX-Trailer: t\r\n\r\n"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def _serve(script: Script, body: Callable[[Pool], Awaitable[object]]) -> tuple[object, int]:
    """Run ``body`` against a server that runs ``script`` per connection; the result and how
    many connections the server saw."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool(f"http://127.0.0.1:{port}/v1", kernel_clock=True)
    async with server:
        try:
            return await body(pool), connections
        finally:
            # before the server's exit: from Python 3.12.1 it waits for every connection to
            # close (asyncio.Server.wait_closed, CPython gh-79033), the pool's kept ones too
            await pool.close()


async def _post_and_read(pool: Pool, timeout_s: float = 5.0) -> tuple[int, bytes, h1.Response]:
    """One POST read whole: its status, body and response (``kept``: whether the connection
    went back to the pool; ``pieces``: what the sink was handed, ``(piece, read_ns, rx_ns)``)."""
    state: dict = {}
    response = await pool.post(pool_url(pool), {"Content-Type": "application/json"}, b'{"a": 1}', state)
    pieces: list[tuple[bytes, int, int | None]] = []
    try:
        await response.consume(lambda *piece: pieces.append(piece), timeout_s)
    finally:
        pool.release(response)
    response.kept, response.pieces = any(kept is response for kept, _ in pool._idle), pieces
    return response.status, b"".join(piece for piece, _, _ in pieces), response


async def _refuse_the_second_piece(pool: Pool) -> tuple[list[bytes], BaseException | None]:
    """One POST whose reader takes the body's first piece and raises on the second: the pieces
    it took and what ``consume`` raised."""
    response = await pool.post(pool_url(pool), {}, b"{}", {})
    got: list[bytes] = []

    def sink(piece: bytes, _read_ns: int, _rx_ns: int | None) -> None:
        if got:
            raise ValueError("not a chunk this reader takes")
        got.append(piece)

    error = None
    try:
        await response.consume(sink, 5.0)
    except ValueError as exc:
        error = exc
    finally:
        pool.release(response)
    return got, error


@pytest.fixture(autouse=True, params=["compiled", "python"])
def read_path(request, monkeypatch) -> str:
    """Every test on both reads of a plain connection: the compiled one (tasks/wire/_rx.c) and
    the reactor's Python one, which runs where it could not be built."""
    if request.param == "python":
        monkeypatch.setattr(reactor, "_rx", None)
        monkeypatch.setattr(h1, "_rx", None)
    elif not reactor.COMPILED:
        pytest.skip("the compiled read was not built here (test_the_read_is_compiled_on_linux says why)")
    return request.param


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the compiled read is Linux's")
def test_the_read_is_compiled_on_linux(read_path) -> None:
    # pip install -e builds it (pyproject.toml: optional, so an install without a C compiler
    # still succeeds): on this project's machines a failed build must not pass unseen
    assert reactor.COMPILED


def pool_url(pool: Pool) -> str:
    return f"http://{pool._authority}:{pool._port}/v1/chat/completions"


def test_a_chunked_body_split_at_every_byte_is_read_whole_with_each_reads_stamps() -> None:
    requests: list[bytes] = []

    async def script(reader, writer) -> None:
        requests.append(await _read_request(reader))
        for i in range(len(CHUNKED_HEAD + CHUNKED_BODY)):  # one byte per write, each its own read
            writer.write((CHUNKED_HEAD + CHUNKED_BODY)[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0.0005)
        await reader.read()  # keep the connection until the client closes it

    (status, body, response), _ = asyncio.run(_serve(script, _post_and_read))
    assert status == 200 and body == b"".join(EVENTS)
    assert response.headers["content-type"] == "text/event-stream"
    request = requests[0]
    assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Length: 8\r\n\r\n" in request and request.endswith(b'{"a": 1}')
    if rxclock.SUPPORTED:
        # every body byte came in a read of its own, handed on with that read's stamps, in order
        assert [piece for piece, _, _ in response.pieces] == [bytes([b]) for b in body]
        reads_ns = [read_ns for _, read_ns, _ in response.pieces]
        kernel_ns = [rx_ns for _, _, rx_ns in response.pieces]
        assert reads_ns == sorted(reads_ns) and len(set(reads_ns)) == len(body)
        assert all(kernel_ns) and kernel_ns == sorted(kernel_ns)


def test_content_length_close_delimited_and_interim_heads() -> None:
    def answer(raw: bytes) -> Script:
        async def script(reader, writer) -> None:
            await _read_request(reader)
            writer.write(raw)
            await writer.drain()
            if b"Content-Length" in raw:
                await reader.read()
            # else: close-delimited, the handler's close ends the body

        return script

    with_length = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    (status, body, response), _ = asyncio.run(_serve(answer(with_length), _post_and_read))
    assert (status, body, response.kept) == (200, b"hello", True)

    until_close = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + EVENTS[0]
    (status, body, response), _ = asyncio.run(_serve(answer(until_close), _post_and_read))
    assert (status, body, response.kept) == (200, EVENTS[0], False)

    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + CHUNKED_HEAD + CHUNKED_BODY
    (status, body, _), _ = asyncio.run(_serve(answer(interim), _post_and_read))
    assert (status, body) == (200, b"".join(EVENTS))

    error = b'HTTP/1.1 429 Too Many Requests\r\nContent-Length: 11\r\n\r\n{"error":1}'
    (status, body, _), _ = asyncio.run(_serve(answer(error), _post_and_read))
    assert (status, body) == (429, b'{"error":1}')


@pytest.mark.parametrize(("close", "connections"), [(False, 1), (True, 2)])
def test_a_connection_is_kept_only_when_the_body_ended_and_the_server_keeps_it(close, connections) -> None:
    head = CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") if close else CHUNKED_HEAD

    async def script(reader, writer) -> None:
        while True:
            await _read_request(reader)
            writer.write(head + CHUNKED_BODY)
            await writer.drain()
            if close:
                return

    async def twice(pool: Pool) -> list[bytes]:
        return [(await _post_and_read(pool))[1] for _ in range(2)]

    bodies, seen = asyncio.run(_serve(script, twice))
    assert bodies == [b"".join(EVENTS)] * 2
    assert seen == connections


def test_a_connection_idle_past_its_expiry_is_closed_and_a_new_one_opened() -> None:
    """Servers close idle connections after 5 s: a request sent as that close crosses it would
    fail without a response, so an older idle connection is not used again."""

    async def script(reader, writer) -> None:
        while True:
            await _read_request(reader)
            writer.write(CHUNKED_HEAD + CHUNKED_BODY)
            await writer.drain()

    async def aged(pool: Pool) -> tuple[int, bool, bool, bool]:
        pool._expiry_s = 0.2
        opened = await pool.open_idle(1, 5.0)
        (first, _), state = pool._idle[0], {}
        await asyncio.sleep(0.3)
        response = await pool.post(pool_url(pool), {}, b"{}", state)
        await response.consume(lambda *_: None, 5.0)
        pool.release(response)
        return opened, response is first, state.get("connect_ns") is not None, first.open

    (opened, reused, connected, old_open), seen = asyncio.run(_serve(script, aged))
    assert (opened, reused, connected, old_open, seen) == (1, False, True, False, 2)

    async def fresh(pool: Pool) -> bool:  # within its expiry the opened one is used
        await pool.open_idle(1, 5.0)
        state: dict = {}
        response = await pool.post(pool_url(pool), {}, b"{}", state)
        await response.consume(lambda *_: None, 5.0)
        pool.release(response)
        return state.get("connect_ns") is None

    assert asyncio.run(_serve(script, fresh)) == (True, 1)


def test_connections_opened_ahead_are_bounded_together_not_each() -> None:
    """A server that accepts TCP and never answers a TLS handshake: 130 connections, 64 at a
    time, bounded by 0.5 s all together (each bounded alone: 3 batches, 1.5 s), none kept."""

    async def stalled() -> tuple[int, float, int]:
        held: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", 0)
        pool = Pool(f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", kernel_clock=True)
        started = time.monotonic()
        try:
            opened = await pool.open_idle(130, 0.5)
            return opened, time.monotonic() - started, len(pool._idle)
        finally:
            await pool.close()
            for writer in held:
                writer.close()
            server.close()

    opened, took_s, idle = asyncio.run(stalled())
    assert (opened, idle) == (0, 0)
    assert 0.5 <= took_s < 1.2


def test_a_cut_body_raises_after_the_bytes_before_the_cut_and_a_stall_is_ended() -> None:
    async def cut(reader, writer) -> None:
        await _read_request(reader)
        writer.write(CHUNKED_HEAD + b"%x\r\n%b\r\n" % (len(EVENTS[0]), EVENTS[0]))
        await writer.drain()  # then the handler closes: no last chunk

    async def read_until_error(pool: Pool) -> tuple[list[bytes], BaseException | None]:
        state: dict = {}
        response = await pool.post(pool_url(pool), {}, b"{}", state)
        got: list[bytes] = []
        try:
            await response.consume(lambda piece, _read_ns, _rx_ns: got.append(piece), 5.0)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return got, exc
        finally:
            pool.release(response)
        return got, None

    (got, error), _ = asyncio.run(_serve(cut, read_until_error))
    assert b"".join(got) == EVENTS[0]
    assert isinstance(error, ConnectionError) and "before the response ended" in str(error)

    async def stall(reader, writer) -> None:
        await _read_request(reader)
        writer.write(CHUNKED_HEAD + b"%x\r\n%b\r\n" % (len(EVENTS[0]), EVENTS[0]))
        await writer.drain()
        await asyncio.sleep(3)

    async def timed(pool: Pool) -> tuple[float, BaseException | None]:
        start = time.perf_counter()
        state: dict = {}
        response = await pool.post(pool_url(pool), {}, b"{}", state)
        try:
            await response.consume(lambda *_: None, 0.4)
        except TimeoutError as exc:
            return time.perf_counter() - start, exc
        finally:
            pool.release(response)
        return time.perf_counter() - start, None

    (took_s, error), _ = asyncio.run(_serve(stall, timed))
    assert isinstance(error, TimeoutError)
    assert 0.4 <= took_s < 0.6 + 0.3, took_s  # 1 to 1.5 bounds after the last byte


def test_a_read_of_one_whole_chunk_is_handed_on_as_the_framing_would() -> None:
    """A streaming server's usual read, exactly one whole chunk, takes a shorter path through
    ``Response.data_received``: what it hands on (pieces, each with its own read's stamps), the
    connection kept after it, and a reader's exception raised on it are the framing's own. An
    upper-case size, data holding CRLF, an extension and the last chunk go the general way."""
    pieces = [b"data: 1\r\n\r\n", b"y" * 300, b"data: [DONE]\n\n"]
    writes = [b"%X\r\n%b\r\n" % (len(piece), piece) for piece in pieces] + [b"3;e=1\r\nabc\r\n", b"0\r\n\r\n"]

    async def script(reader, writer) -> None:
        while True:
            await _read_request(reader)
            writer.write(CHUNKED_HEAD)
            for write in writes:  # each its own read
                await writer.drain()
                await asyncio.sleep(0.005)
                writer.write(write)
            await writer.drain()

    async def read_then_refuse(pool: Pool) -> tuple[object, list[bytes], BaseException | None]:
        first = await _post_and_read(pool)
        return first, *await _refuse_the_second_piece(pool)

    ((status, body, response), got, error), connections = asyncio.run(_serve(script, read_then_refuse))
    assert status == 200 and body == b"".join(pieces) + b"abc"
    assert [piece for piece, _, _ in response.pieces] == [*pieces, b"abc"] and response.kept
    reads_ns = [read_ns for _, read_ns, _ in response.pieces]
    assert reads_ns == sorted(reads_ns) and len(set(reads_ns)) == len(reads_ns)
    if rxclock.SUPPORTED:
        kernel_ns = [rx_ns for _, _, rx_ns in response.pieces]
        assert all(kernel_ns) and len(set(kernel_ns)) == len(kernel_ns)
    # refused on its second one-chunk read: raised after the first piece, the connection closed
    assert got == [pieces[0]] and str(error) == "not a chunk this reader takes" and connections == 1


def test_a_read_of_several_whole_chunks_and_a_part_hands_each_on_with_that_reads_stamps() -> None:
    """Whole chunks that came in one read (a server that fell behind wrote them together) are
    handed on one by one in the short path, each with the one read's stamps; the part of a chunk
    after them goes on to the general framing, its rest with the next read's."""
    pieces = [b"data: 1\n\n", b"data: 22\n\n", b"x" * 40, b"data: 4444\n\n"]
    frames = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces)
    cut = len(frames) - 8  # inside the last chunk's data

    async def script(reader, writer) -> None:
        await _read_request(reader)
        writer.write(CHUNKED_HEAD)
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(frames[:cut])
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(frames[cut:] + b"0\r\n\r\n")

    (status, body, response), _ = asyncio.run(_serve(script, _post_and_read))
    assert status == 200 and body == b"".join(pieces)
    got = [piece for piece, _, _ in response.pieces]
    assert got == [*pieces[:3], pieces[3][:-6], pieces[3][-6:]]
    reads = [(read_ns, rx_ns) for _, read_ns, rx_ns in response.pieces]
    assert len(set(reads[:4])) == 1 and reads[4][0] > reads[0][0]
    if rxclock.SUPPORTED:
        assert reads[0][1] and reads[4][1] > reads[0][1]


def test_a_readers_exception_ends_the_response_with_it_and_closes_the_connection() -> None:
    """The sink runs in the read's callback: what it raises is what consume raises, after the
    pieces before it, and the connection (its body not read to the end) is not reused."""

    async def script(reader, writer) -> None:
        while True:
            await _read_request(reader)
            writer.write(CHUNKED_HEAD + CHUNKED_BODY)
            await writer.drain()

    async def refuse_second(pool: Pool) -> tuple[list[bytes], BaseException | None, bytes]:
        got, error = await _refuse_the_second_piece(pool)
        return got, error, (await _post_and_read(pool))[1]

    (got, error, next_body), connections = asyncio.run(_serve(script, refuse_second))
    assert got == [EVENTS[0]] and str(error) == "not a chunk this reader takes"
    assert next_body == b"".join(EVENTS) and connections == 2  # a new connection for the next


def test_a_head_that_is_not_http_names_the_part() -> None:
    async def script(reader, writer) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def post(pool: Pool) -> BaseException | None:
        try:
            await pool.post(pool_url(pool), {}, b"{}", {})
        except h1.ProtocolError as exc:
            return exc
        return None

    error, _ = asyncio.run(_serve(script, post))
    assert isinstance(error, h1.ProtocolError) and "not an HTTP/1.1 status line" in str(error)


def test_a_read_allocates_its_bytes_not_the_read_size() -> None:
    """Reads land in the reactor's one buffer and only their bytes are copied out
    (tasks.wire.reactor.Reactor): 60 reads of 17 bytes peak far below one READ_BYTES
    (256 KiB), which each read allocated before (an mmap and munmap per read where malloc's mmap
    threshold is fixed, as a Dask worker fixes it); each piece stays whole after the next reads."""
    import socket
    import tracemalloc

    from tasks.wire import reactor

    if not reactor.SUPPORTED:
        pytest.skip("no epoll: asyncio's transports read")

    class Collect(asyncio.Protocol):
        def __init__(self) -> None:
            self.pieces: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            self.pieces.append(data)

    async def main() -> tuple[list[bytes], int]:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        protocol = Collect()
        reading = reactor.Reactor(asyncio.get_running_loop())
        reactor.PlainTransport(reading, ours, protocol)
        tracemalloc.start()
        try:
            for i in range(60):
                theirs.send(b"data: piece %04d\n" % i)
                while len(protocol.pieces) <= i:
                    await asyncio.sleep(0)
            return protocol.pieces, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            reading.close()
            theirs.close()

    pieces, peak_bytes = asyncio.run(main())
    assert pieces == [b"data: piece %04d\n" % i for i in range(60)]
    assert all(type(piece) is bytes for piece in pieces)
    assert peak_bytes < reactor.READ_BYTES // 4, peak_bytes


def test_a_request_larger_than_the_socket_takes_at_once_is_sent_whole() -> None:
    """A plain connection's request goes out as far as the socket takes it, the rest as the
    server reads (tasks.wire.reactor.PlainTransport.write): 16 MiB to a server reading in
    64 KiB steps, then the next request on the same connection."""
    sizes: list[int] = []

    async def script(reader, writer) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            got = 0
            while got < length:
                got += len(await reader.read(min(65536, length - got)))
                await asyncio.sleep(0)
            sizes.append(got)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def big_then_small(pool: Pool) -> list[bytes]:
        bodies = []
        for body in (b"x" * (16 << 20), b"{}"):
            response = await pool.post(pool_url(pool), {}, body, {})
            try:
                bodies.append(await response.read_all(10.0))
            finally:
                pool.release(response)
        return bodies

    bodies, connections = asyncio.run(_serve(script, big_then_small))
    assert bodies == [b"ok", b"ok"] and sizes == [16 << 20, 2] and connections == 1


def test_closing_the_pool_ends_a_response_in_flight_and_closes_its_socket() -> None:
    """Pool.close closes the connections still reading (tasks.wire.reactor.Reactor.close): a
    body being consumed then fails as a connection lost, and no socket stays open."""

    async def stall(reader, writer) -> None:
        await _read_request(reader)
        writer.write(CHUNKED_HEAD + b"%x\r\n%b\r\n" % (len(EVENTS[0]), EVENTS[0]))
        await writer.drain()
        await asyncio.sleep(3)

    async def close_mid_body(pool: Pool) -> tuple[list[bytes], BaseException | None, int]:
        response = await pool.post(pool_url(pool), {}, b"{}", {})
        got: list[bytes] = []
        reading = asyncio.ensure_future(response.consume(lambda piece, *_: got.append(piece), 5.0))
        while not got:
            await asyncio.sleep(0.01)
        sock = response.transport.get_extra_info("socket")
        await pool.close()
        try:
            await reading
        except ConnectionError as exc:
            return got, exc, sock.fileno()
        return got, None, sock.fileno()

    (got, error, fileno), _ = asyncio.run(_serve(stall, close_mid_body))
    assert got == [EVENTS[0]] and isinstance(error, ConnectionError), error
    assert fileno == -1  # closed


def test_only_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="base_url must be an http:// or https:// URL"):
        Pool("ftp://example.com/v1", kernel_clock=False)
