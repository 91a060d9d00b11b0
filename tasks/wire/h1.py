"""HTTP/1.1 for the stream client: one POST and its streamed body, on a connection of
:class:`tasks.wire.pool.Pool` (which keeps them alive).

The stream client's own HTTP/1.1 (RFC 9112: head §4-5, body length §6.3, chunked §7.1) over an
asyncio protocol, in place of aiohttp (its request cost ~614 us of CPU against ~187 us here: README
"Cheaper per chunk"). One ``data_received`` per read decodes the framing and hands the body's
bytes, with the stamps of that read (``recvmsg`` on the :class:`tasks.wire.rxclock.StampedSocket`
under the transport; for TLS the raw read that carried the record), to the reader's sink
(:meth:`Response.consume`) in that same callback: the reading coroutine does not wake until the
body ends (a wake per read, or per drain of what reads buffered, cost more than the parsing).
Scope (what the endpoints the client measures send): status 200 with a chunked,
``Content-Length`` or close-delimited body; 1xx heads skipped; trailers read and dropped; a body in
a content coding (gzip, deflate, br: :mod:`tasks.wire.codings`) decoded read by read, with each
read's stamps (the fast paths are for bodies as sent); an answer that ended (``[DONE]``, or the
finish and usage that close it) ends the request even where the body is never terminated
(:meth:`Response.answered`); proxies are the pool's (:mod:`tasks.wire.proxy`); no upgrades, no
redirects (a 3xx is the caller's error), no retries (a retried request would hide an error and
stretch its latency). A malformed response raises :class:`ProtocolError`; a body in a coding it
does not read or that does not decode, ``codings.EncodingError``; a connection lost
before the body's end, ``ConnectionError``; a body without bytes for its read bound,
``TimeoutError``. Standard library (and ``brotli``) only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from tasks.wire import codings, rxclock
from tasks.wire.reactor import _rx  # the compiled read, or None (tasks/wire/_rx.c)
from tasks.wire.stall import Stall

__all__ = ["ProtocolError", "Response", "Sink"]

#: A body's reader: ``sink(piece, read_ns, rx_ns)`` in the callback of the read that delivered the
#: piece: ``read_ns`` the ``perf_counter_ns`` that read returned, ``rx_ns`` its kernel stamp
#: (CLOCK_REALTIME ns, 0: none) or None without a stamped socket (:meth:`Response.consume`).
Sink = Callable[[bytes, int, "int | None"], None]
_perf_ns = time.perf_counter_ns

MAX_HEAD_BYTES = 64 * 1024  # the longest head (status line and header fields) taken
#: How long an answer that ended waits for its body's end (:meth:`Response.answered`): the
#: terminating chunk comes just after ``[DONE]``, often in a read of its own (uvicorn writes it
#: apart); closing without it loses the connection (openai-python #3440), waiting unbounded
#: hangs on a server that keeps the body open (that issue's PR #3520 review: a bounded drain).
END_GRACE_S = 0.05
_IDLE, _HEAD, _SIZE, _DATA, _CRLF, _TRAILER, _LENGTH, _UNTIL_CLOSE = range(8)  # framing states


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 response this client reads (the message: which)."""


class _Refused(Exception):
    """A sink's exception on its way out of the framing (``args[0]``: that exception)."""


class Response(asyncio.Protocol):
    """One connection and the response being read on it (one at a time: HTTP/1.1 without
    pipelining). Made by :class:`Pool`; after :meth:`Pool.post` its ``status``, ``reason`` and
    ``headers`` (names lower-cased) are the response's head, ``content_encoding`` its body's
    codings (``"gzip"``; None: as sent), ``sent_ns`` the ``perf_counter_ns`` the request's last
    byte was handed to the kernel (0 unknown); :meth:`consume` reads the body."""

    def __init__(self, sock: rxclock.StampedSocket | None) -> None:
        self._sock = sock
        self.transport: asyncio.Transport | None = None
        self.status, self.reason, self.headers = 0, "", {}
        self.content_encoding, self._decoder = None, None  # the body's codings, their decoder
        self.sent_ns = 0
        self.reusable = False  # the body ended as framed and the server keeps the connection
        self._state = _IDLE
        self._rest = b""  # bytes of a framing element split across reads
        self._left = 0
        self._head: asyncio.Future[None] | None = None
        self._sink: Sink | None = None
        self._fast: Sink | None = None  # the sink, where the fast paths may run (a body as sent)
        self._grace: Any = None  # after the answer's end (False), the timer awaiting the body's
        self._events: tuple[Any, Callable[[bytes, int, int | None], None]] | None = None  # consume's
        self._early: list[tuple[bytes, int, int | None]] = []  # body pieces before a sink came
        self._read_ns, self._rx_ns = 0, None  # the stamps of the read being framed
        self._total, self._ended = 0, False  # body bytes so far; the body ended as framed
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # asyncio's side -------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:  # noqa: D102
        self.transport = transport

    def data_received(self, data: bytes) -> None:  # noqa: D102
        sock = self._sock
        if sock is None:
            read_ns, rx_ns = _perf_ns(), None
        else:
            read_ns, rx_ns = sock.read_ns, sock.rx_ns
        self._read_ns, self._rx_ns = read_ns, rx_ns
        sink = self._fast
        if self._state == _SIZE and sink is not None and not self._rest:
            # A streaming server's usual read: whole chunks (size line, data, CRLF), most often
            # one, handed on in one loop without the general framing's states and calls (README
            # "A read of one whole chunk in one step"); whatever is not a whole chunk with a plain
            # size (a part, an extension, the last chunk) goes on to the general framing below.
            pos, n = 0, len(data)
            events = self._events
            if events is not None and events[0].idle:  # compiled: chunks of one event each
                try:
                    pos, size = _rx.sse_chunks(data, events[1], read_ns, rx_ns)
                except Exception as exc:  # noqa: BLE001 - the reader's, raised by consume
                    self._fail(exc)
                    return
                self._total += size
                if pos == n:
                    return
            while True:
                end = data.find(b"\r\n", pos)
                if end <= pos:
                    break
                try:
                    size = int(data[pos:end], 16)
                except ValueError:
                    break
                stop = end + 2 + size
                if size <= 0 or not data.startswith(b"\r\n", stop):
                    break
                self._total += size
                try:
                    sink(data[end + 2 : stop], read_ns, rx_ns)
                except Exception as exc:  # noqa: BLE001 - the reader's, raised by consume
                    self._fail(exc)
                    return
                pos = stop + 2
                if pos == n:
                    return
            if pos:
                data = data[pos:]
        if self._rest:
            data, self._rest = self._rest + data, b""
        try:
            self._parse(data)
        except (ProtocolError, codings.EncodingError) as exc:
            self._fail(exc)
        except _Refused as refused:
            self._fail(refused.args[0])
        except ValueError as exc:  # int() of a chunk size or a Content-Length
            self._fail(ProtocolError(f"a length that is not a number: {exc}"))

    def eof_received(self) -> bool:  # noqa: D102 - close: connection_lost says the rest
        return False

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self.reusable = False
        if self._state == _UNTIL_CLOSE:
            self._end()
        elif self._state != _IDLE:
            lost = ConnectionError("the server closed the connection before the response ended")
            if exc is not None:
                lost.__cause__ = exc
            self._fail(lost)

    # the framing (RFC 9112) -------------------------------------------------------------------
    def _parse(self, data: bytes) -> None:
        pos, n = 0, len(data)
        while pos < n:
            state = self._state
            if state == _SIZE or state == _TRAILER:  # first: a streamed body is mostly size lines
                end = data.find(b"\r\n", pos)
                if end < 0:
                    self._rest = data[pos:]
                    return
                line, pos = data[pos:end], end + 2
                if state == _TRAILER:
                    if not line:
                        self._end()
                    continue
                if b";" in line:  # chunk extensions are dropped (RFC 9112 §7.1.1)
                    line = line[: line.find(b";")]
                size = int(line, 16)
                if size < 0:
                    raise ProtocolError(f"bad chunk size {line[:40]!r}")
                stop = pos + size
                if size and data.startswith(b"\r\n", stop):  # the whole chunk in this read: the
                    self._body(data[pos:stop])  # usual case, one pass instead of three
                    pos = stop + 2
                    continue
                self._left, self._state = size, (_DATA if size else _TRAILER)
            elif state == _DATA:
                take = min(self._left, n - pos)
                self._body(data[pos : pos + take] if take < n else data)
                pos += take
                self._left -= take
                if not self._left:
                    self._state = _CRLF
            elif state == _CRLF:
                if n - pos < 2:
                    self._rest = data[pos:]
                    return
                if data[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("a chunk's data is not followed by CRLF")
                pos += 2
                self._state = _SIZE
            elif state == _LENGTH:
                take = min(self._left, n - pos)
                self._body(data[pos : pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._end()
            elif state == _UNTIL_CLOSE:
                self._body(data[pos:])
                return
            elif state == _HEAD:
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    self._rest = data[pos:]
                    if len(self._rest) > MAX_HEAD_BYTES:
                        raise ProtocolError(f"a response head over {MAX_HEAD_BYTES} bytes")
                    return
                self._read_head(data[pos:end])
                pos = end + 4
            else:  # bytes while no response is expected: the connection is not reused
                self.reusable = False
                return

    def _read_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return  # an interim response (100 Continue, 103 Early Hints): the final one follows
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise ProtocolError(f"a header line without a colon: {line[:80]!r}")
            name, value = name.strip().lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self.status, self.reason, self.headers = status, parts[2] if len(parts) > 2 else "", headers
        coding = headers.get("content-encoding", "")  # an error's body in a coding not read: as sent
        self.content_encoding, self._decoder = codings.decoder_for(coding, unread_raises=status == 200)
        keep = "close" not in headers.get("connection", "").lower() and parts[0] != "HTTP/1.0"
        transfer = headers.get("transfer-encoding", "").lower().replace(" ", "")
        if transfer not in ("", "chunked"):  # RFC 9112 §7: none but chunked unless asked (TE)
            raise ProtocolError(
                f"the server sent its body in Transfer-Encoding {headers['transfer-encoding']!r}: "
                "this client asked for none (no TE header) and reads only 'chunked'"
            )
        if transfer == "chunked":
            self._state, self.reusable = _SIZE, keep
        elif "content-length" in headers:
            self._left = int(headers["content-length"])
            self._state, self.reusable = _LENGTH, keep
            if not self._left:
                self._end()
        else:
            self._state, self.reusable = _UNTIL_CLOSE, False
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def _body(self, piece: bytes) -> None:
        if not piece:
            return
        self._total += len(piece)
        if self._decoder is not None:  # the decoded bytes go on with the stamps of this read
            piece = self._decoder.decompress(piece)
        self._hand(piece)

    def _hand(self, piece: bytes) -> None:
        if not piece:
            return
        sink = self._sink
        if sink is None:
            self._early.append((piece, self._read_ns, self._rx_ns))
            return
        try:
            sink(piece, self._read_ns, self._rx_ns)
        except Exception as exc:  # noqa: BLE001 - the reader's, raised by consume
            raise _Refused(exc) from None

    def _end(self) -> None:
        decoder, self._decoder = self._decoder, None
        if decoder is not None:  # what the decoder held to the body's end
            try:
                self._hand(decoder.flush())
            except (codings.EncodingError, _Refused) as exc:
                self._fail(exc.args[0] if isinstance(exc, _Refused) else exc)
                return
        if self._grace:
            self._grace.cancel()
        self._state, self._ended = _IDLE, True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        if self._error is None:
            self._error = exc
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # the client's side ------------------------------------------------------------------------
    def send(self, request: bytes) -> asyncio.Future[None]:
        """Write ``request`` and expect a response: the future of its head."""
        self._head = asyncio.get_running_loop().create_future()
        self.status, self.headers, self.reusable, self._state = 0, {}, False, _HEAD
        self._sink, self._early, self._total, self._ended, self._error = None, [], 0, False, None
        self.content_encoding = self._decoder = self._grace = None
        assert self.transport is not None
        self.transport.write(request)
        return self._head

    async def consume(
        self,
        sink: Sink,
        timeout_s: float,
        events: tuple[Any, Callable[[bytes, int, int | None], None]] | None = None,
    ) -> None:
        """Hand the body to ``sink`` (:data:`Sink`), each piece in the loop callback of the read
        that delivered it (pieces that came with the head first, with their own reads' stamps),
        and return when the body has ended. ``events``: when ``sink`` is an SSE framer's
        (``tasks.wire.sse.SSEFramer``), ``(the framer, its on_event)``: while the framer holds
        nothing (``idle``), the whole chunks of a read that are each one one-line ``data:`` event
        go straight to ``on_event`` (``tasks/wire/_rx.c``'s ``sse_chunks``, where it was built),
        as the framer would hand them on (a body in a coding: decoded first, the short paths not
        taken). Returns early after :meth:`answered`. Raises the response's failure:
        ``ConnectionError``, :class:`ProtocolError`, ``codings.EncodingError``, ``TimeoutError``
        for a body without new bytes for ``timeout_s`` (1 to 1.5 ``timeout_s`` after its last
        byte: one look per half bound, no timer per read), or whatever ``sink`` raised (the
        connection is then closed)."""
        early, self._early = self._early, []
        try:
            for piece, read_ns, rx_ns in early:
                sink(piece, read_ns, rx_ns)
        except Exception as exc:  # noqa: BLE001 - raised below, as from a read
            self._fail(exc)
        if not self._ended and self._error is None:
            self._sink = sink
            identity = self._decoder is None  # a body in a coding: every byte through _body
            self._fast = sink if identity else None
            self._events = events if _rx is not None and identity else None
            self._waiter = asyncio.get_running_loop().create_future()
            watch = Stall(lambda: self._total, self._fail, timeout_s)
            try:
                await self._waiter
            finally:
                watch.cancel()
                self._sink = self._fast = self._events = None
        if self._error is not None:
            raise self._error

    def answered(self) -> None:
        """Called by the sink's reader when its answer ended (``[DONE]``; a usage after the
        ``finish_reason``, as OpenAI, vLLM and SGLang close a stream with ``include_usage``; the
        Responses API's ``response.completed`` / ``incomplete``): a body not ended :data:`END_GRACE_S`
        later is not awaited (a server or proxy keeping it open): :meth:`consume` returns, the
        request complete in the time of its answer, and the connection is not reused."""
        if self._grace is None:  # once a response (its usage, then [DONE]): a call_soon less
            self._grace = False
            asyncio.get_running_loop().call_soon(self._await_end, self._head)  # after this read's rest

    def _await_end(self, head: asyncio.Future[None] | None) -> None:  # head: of the answer's response
        if head is self._head and self._grace is False and self._state != _IDLE and self._error is None:
            self._grace = asyncio.get_running_loop().call_later(END_GRACE_S, self._unterminated, head)

    def _unterminated(self, head: asyncio.Future[None] | None) -> None:
        if head is self._head and self._state != _IDLE and self._error is None:
            self.reusable, self._state = False, _IDLE  # bytes after it are not read (_parse)
            self._wake()

    async def read_all(self, timeout_s: float) -> bytes:
        """An error response's body as far as it came: to its end, or until ``timeout_s`` without
        new bytes or a cut (then the status is the error: what came is kept, not reused)."""
        pieces: list[bytes] = []
        with contextlib.suppress(TimeoutError, ConnectionError):
            await self.consume(lambda piece, _read_ns, _rx_ns: pieces.append(piece), timeout_s)
        return b"".join(pieces)

    @property
    def open(self) -> bool:
        """The connection is still up."""
        return self.transport is not None and not self.transport.is_closing()

    def note_sent(self) -> None:
        """``sent_ns`` from the socket, once the head came (every byte of the request left)."""
        if self._sock is not None:
            self.sent_ns = self._sock.sent_ns

    def settle(self) -> bool:
        """After a response: whether the connection can carry the next request (the body
        ended as framed, the server keeps the connection, it is up); it is idle again then."""
        if self.reusable and self._ended and self.open:
            self._state = _IDLE
            return True
        return False
