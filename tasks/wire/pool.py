"""Keep-alive HTTP/1.1 connections to one origin for the stream client (:mod:`tasks.wire.h1`
reads each response): a connection is reused only after its response ended as framed and the
server kept it, and a level's connections can be opened before its start (:meth:`Pool.open_idle`).
Plain connections are read through :mod:`tasks.wire.reactor`, TLS through asyncio's transport.
Through a proxy (:mod:`tasks.wire.proxy`: ``HTTP(S)_PROXY``, ``NO_PROXY``, never for loopback)
the connections are the proxy's: for ``https`` a CONNECT tunnel on the same kernel-stamped socket,
then TLS over it; for ``http`` the requests are forwarded (absolute-form target, RFC 9112 §3.2.2),
read by the reactor as direct ones are. Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from tasks.wire import proxy as proxies
from tasks.wire import reactor, rxclock
from tasks.wire.h1 import Response

__all__ = ["Pool"]


class Pool:
    """Keep-alive connections to the origin of ``base_url`` (``http`` or ``https``; TLS trusting
    ``ca_bundle`` when given, else the default context, which honours ``SSL_CERT_FILE``:
    :func:`tasks.wire.proxy.tls_context`), through the proxy the environment names for it
    (:func:`tasks.wire.proxy.proxy_for`; ``connect_ns`` then spans the proxy's TCP, its CONNECT
    and the TLS handshake). A connection goes back to the pool
    only after its response ended as framed and the server did not ask to close it, and is not
    used again after ``keepalive_expiry_s`` idle: servers close an idle connection after 5 s
    (uvicorn's ``timeout_keep_alive``, under vLLM and llama-cpp-python; cpp-httplib's keep-alive
    timeout, under llama.cpp's server), and a request sent as the server's close crosses it
    fails without a response (httpx's pool expires them at 5 s for the same reason).

    ``kernel_clock``: the sockets stamp their reads in the kernel (``rxclock``; Linux).

    Raises (from :meth:`post`): ``OSError`` (``ConnectionError``) when no address accepts a
    connection or the connection is lost before the head; :class:`tasks.wire.proxy.ProxyError`
    (a ``ConnectionError``) when the proxy refuses the tunnel or answers 407 to a forwarded
    request, naming the proxy (never its credentials) and its status;
    :class:`tasks.wire.h1.ProtocolError` for a head this client cannot read. Constructor:
    ValueError for a URL that is not http(s), ProxyError for a proxy variable it cannot use,
    OSError (``FileNotFoundError``, ``ssl.SSLError``) for a CA bundle it cannot read.
    """

    def __init__(
        self,
        base_url: str,
        kernel_clock: bool,
        keepalive_expiry_s: float = 4.0,
        ca_bundle: str | None = None,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        default = url.port is None
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._authority = url.netloc.rpartition("@")[2] if not default else host
        self._tls = proxies.tls_context(ca_bundle) if url.scheme == "https" else None
        self._proxy = proxies.proxy_for(base_url)
        # forwarded (http through a proxy): the request target in absolute form (RFC 9112 §3.2.2)
        self._forward = f"http://{self._authority}" if self._proxy and self._tls is None else ""
        self._kernel_clock = kernel_clock
        self._addresses: list[tuple[Any, ...]] | None = None
        self._idle: list[tuple[Response, float]] = []  # with the time.monotonic() it went idle
        self._expiry_s = keepalive_expiry_s
        self._reactor: reactor.Reactor | None = None  # plain connections' reads (tasks.wire.reactor)
        self._heads: dict[tuple[str, tuple[tuple[str, str], ...]], bytes] = {}

    def _request_bytes(self, url: str, headers: dict[str, str], body: bytes) -> bytes:
        key = (url, tuple(headers.items()))
        head = self._heads.get(key)
        if head is None:
            parts = urlsplit(url)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            fields = {"Host": self._authority, "User-Agent": "infermeter", **headers}
            if self._forward:
                target = self._forward + target
                if self._proxy is not None and self._proxy.authorization:
                    fields["Proxy-Authorization"] = self._proxy.authorization
            lines = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
            head = self._heads[key] = f"POST {target} HTTP/1.1\r\n{lines}".encode("latin-1")
        return b"%bContent-Length: %d\r\n\r\n%b" % (head, len(body), body)

    async def _open(self, state: dict[str, Any]) -> Response:
        loop = asyncio.get_running_loop()
        start_ns = time.perf_counter_ns()
        proxy = self._proxy
        if self._addresses is None:  # the proxy's, through one: it resolves the endpoint's name
            host, port = (proxy.host, proxy.port) if proxy else (self._host, self._port)
            try:
                self._addresses = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                if proxy is None:
                    raise
                raise proxies.ProxyError(f"the proxy {proxy} (from {proxy.variable}): {exc}") from exc
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
                    if proxy is not None:  # https through a proxy: TLS inside its tunnel
                        await proxies.tunnel(sock, proxy, self._host, self._port)
                    await loop.create_connection(
                        lambda response=response: response,
                        sock=sock,
                        ssl=self._tls,
                        server_hostname=self._host if self._tls else None,
                    )
            except proxies.ProxyError:
                sock.close()
                raise  # the proxy answered: another of its addresses would answer the same
            except OSError as exc:
                sock.close()
                failure = exc
                continue
            except BaseException:
                sock.close()
                raise
            state["connect_ns"] = (start_ns, time.perf_counter_ns())
            return response
        if proxy is not None:
            raise proxies.ProxyError(
                f"the proxy {proxy} (from {proxy.variable}) is not reachable: {failure}"
            ) from failure
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
        if response.status == 407 and self._forward:  # the proxy's answer, not the endpoint's
            response.reusable = False
            self.release(response)
            proxy = self._proxy
            assert proxy is not None
            fix = "check the credentials in its URL" if proxy.authorization else "put them in its URL"
            raise proxies.ProxyError(
                f"the proxy {proxy} (from {proxy.variable}) answered 407 {response.reason}: it asks "
                f"for credentials; {fix} (http://user:password@host:port)",
                407,
            )
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
