"""Keep-alive HTTP/1.1 connections to one origin for the stream client (:mod:`tasks.stream.h1`
reads each response): a connection is reused only after its response ended as framed and the
server kept it, and a level's connections can be opened before its start (:meth:`Pool.open_idle`).
Plain connections are read through :mod:`tasks.stream.reactor`, TLS through asyncio's transport.
Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

from tasks.stream import reactor, rxclock
from tasks.stream.h1 import Response

__all__ = ["Pool"]


class Pool:
    """Keep-alive connections to the origin of ``base_url`` (``http`` or ``https``; TLS with
    the default context, which honours ``SSL_CERT_FILE``). A connection goes back to the pool
    only after its response ended as framed and the server did not ask to close it, and is not
    used again after ``keepalive_expiry_s`` idle: servers close an idle connection after 5 s
    (uvicorn's ``timeout_keep_alive``, under vLLM and llama-cpp-python; cpp-httplib's keep-alive
    timeout, under llama.cpp's server), and a request sent as the server's close crosses it
    fails without a response (httpx's pool expires them at 5 s for the same reason).

    ``kernel_clock``: the sockets stamp their reads in the kernel (``rxclock``; Linux).

    Raises (from :meth:`post`): ``OSError`` (``ConnectionError``) when no address accepts a
    connection or the connection is lost before the head; :class:`tasks.stream.h1.ProtocolError` for a head this
    client cannot read; ValueError (constructor) for a URL that is not http(s).
    """

    def __init__(self, base_url: str, kernel_clock: bool, keepalive_expiry_s: float = 4.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        default = url.port is None
        self._authority = url.netloc.rpartition("@")[2] if not default else self._host
        self._tls = ssl.create_default_context() if url.scheme == "https" else None
        self._kernel_clock = kernel_clock
        self._addresses: list[tuple[Any, ...]] | None = None
        self._idle: list[tuple[Response, float]] = []  # with the time.monotonic() it went idle
        self._expiry_s = keepalive_expiry_s
        self._reactor: reactor.Reactor | None = None  # plain connections' reads (tasks.stream.reactor)
        self._heads: dict[tuple[str, tuple[tuple[str, str], ...]], bytes] = {}

    def _request_bytes(self, url: str, headers: dict[str, str], body: bytes) -> bytes:
        key = (url, tuple(headers.items()))
        head = self._heads.get(key)
        if head is None:
            parts = urlsplit(url)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            fields = {"Host": self._authority, "User-Agent": "infermeter", **headers}
            lines = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
            head = self._heads[key] = f"POST {target} HTTP/1.1\r\n{lines}".encode("latin-1")
        return b"%bContent-Length: %d\r\n\r\n%b" % (head, len(body), body)

    async def _open(self, state: dict[str, Any]) -> Response:
        loop = asyncio.get_running_loop()
        start_ns = time.perf_counter_ns()
        if self._addresses is None:
            self._addresses = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        failure: OSError | None = None
        for family, kind, proto, _, address in self._addresses:
            sock = rxclock.stamped_socket((family, kind, proto)) if self._kernel_clock else None
            sock = sock or socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                response = Response(sock if isinstance(sock, rxclock.StampedSocket) else None)
                if self._tls is None and reactor.SUPPORTED:
                    self._reactor = self._reactor or reactor.Reactor(loop)
                    await self._reactor.connect(sock, address, response)
                else:
                    await loop.sock_connect(sock, address)
                    await loop.create_connection(
                        lambda response=response: response,
                        sock=sock,
                        ssl=self._tls,
                        server_hostname=self._host if self._tls else None,
                    )
            except OSError as exc:
                sock.close()
                failure = exc
                continue
            except BaseException:
                sock.close()
                raise
            state["connect_ns"] = (start_ns, time.perf_counter_ns())
            return response
        raise failure or ConnectionError(f"no address for {self._host}:{self._port}")

    async def post(self, url: str, headers: dict[str, str], body: bytes, state: dict[str, Any]) -> Response:
        """POST ``body`` to ``url`` (on this pool's origin) on an idle connection or a new one
        (then ``state["connect_ns"]`` = its ``(start, end)`` ``perf_counter_ns``) and return
        the response once its head came. Hand it back with :meth:`release`."""
        request = self._request_bytes(url, headers, body)
        response = None
        now = time.monotonic()
        while self._idle:
            candidate, since = self._idle.pop()
            if candidate.open and now - since < self._expiry_s:
                response = candidate
                break
            if candidate.transport is not None:
                candidate.transport.close()
        if response is None:
            response = await self._open(state)
        try:
            await response.send(request)
        except BaseException:
            self.release(response)
            raise
        response.note_sent()
        return response

    async def open_idle(self, count: int, timeout_s: float, at_once: int = 64) -> int:
        """Open new connections until ``count`` are idle in the pool, ``at_once`` handshakes at
        a time, all within ``timeout_s`` together (not each: a server that accepts TCP and
        stalls its TLS handshakes would hold a level one bound per batch), and return how many
        were opened. One that fails or is not open in time is left out, not retried: the
        requests that would have used it meet the same failure and record it."""
        gate, opened = asyncio.Semaphore(at_once), []

        async def one() -> None:
            async with gate:
                with contextlib.suppress(OSError):
                    opened.append(await self._open({}))

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):  # the rest cancelled: their sockets closed
                await asyncio.gather(*(one() for _ in range(count - len(self._idle))))
        now = time.monotonic()
        self._idle.extend((response, now) for response in opened)
        return len(opened)

    def release(self, response: Response) -> None:
        """Keep the connection for the next request if its response ended as framed, else
        close it."""
        if response.settle():
            self._idle.append((response, time.monotonic()))
        elif response.transport is not None:
            response.transport.close()

    async def close(self) -> None:
        """Close every connection."""
        idle, self._idle = self._idle, []
        for response, _ in idle:
            if response.transport is not None:
                response.transport.close()
        await asyncio.sleep(0)  # let the transports' close callbacks run
        if self._reactor is not None:
            self._reactor.close()
            self._reactor = None
