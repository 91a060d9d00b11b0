"""A small forwarding HTTP proxy the tests own: HTTP CONNECT tunnels (RFC 9110 §9.3.6) and
absolute-form forwarding (RFC 9112 §3.2.2), counting what it is asked per target.

Run as a separate process (``python tests/http_proxy.py [options]``; it prints ``PORT <n>``), so
its relaying does not share a GIL with the client under test. Options:

- ``--auth USER:PASS``: every CONNECT and forwarded request must carry ``Proxy-Authorization:
  Basic`` with them, else 407 with ``Proxy-Authenticate`` (RFC 9110 §11.7.1);
- ``--map NAME=ADDRESS`` (repeatable): the proxy resolves NAME to ADDRESS itself, as a proxy
  with its own DNS view does: a test addresses its 127.0.0.1 endpoint as ``endpoint.test``,
  which only the proxy can reach (the client never resolves a proxied host);
- ``--deny HOST`` (repeatable): CONNECT to HOST (any port) is answered 403.

A target it cannot connect to is answered 502. A request in origin form (``GET /counts``) is
for the proxy itself: ``GET /counts`` -> ``{"connects": {target: n}, "requests": {target: n},
"refused": {status: n}, "authorizations": [...]}`` (targets ``host:port`` as asked; the
``Proxy-Authorization`` values it received, for the tests that check what a client sent);
``GET /relays`` -> ``{"offset_ns": CLOCK_REALTIME - CLOCK_MONOTONIC, "relays": [[[rx_ns, write_ns,
bytes], ...] per upstream connection]}``: each read relayed towards the client, with its kernel
receive stamp on the proxy's upstream socket (CLOCK_REALTIME ns, 0: none; ``tasks.wire.rxclock``
where importable) and the ``perf_counter_ns`` just before the proxy wrote it on (what the proxy
itself adds to a chunk's arrival, for tests/benchmarks/proxy_tls.py);
``POST /reset`` zeroes them. Forwarded requests are rewritten to origin form, without the
hop-by-hop ``Proxy-Authorization`` and ``Proxy-Connection`` fields; a client connection keeps
its upstream connection while it asks the same target. Responses are relayed byte for byte.

Use :func:`serve` (a context manager) from tests.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

try:  # the kernel's receive stamps on the upstream sockets (the project installed)
    from tasks.wire import rxclock
except ImportError:  # pragma: no cover - run outside the project's environment
    rxclock = None  # type: ignore[assignment]


class _State:
    def __init__(self, auth: str | None, names: dict[str, str], deny: set[str]) -> None:
        self.expected = "Basic " + base64.b64encode(auth.encode()).decode() if auth else None
        self.names, self.deny = names, deny
        self.connects: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.authorizations: list[str] = []
        self.relays: list[list[tuple[int, int, int]]] = []

    def counts(self) -> dict[str, Any]:
        return {
            "connects": dict(self.connects),
            "requests": dict(self.requests),
            "refused": dict(self.refused),
            "authorizations": self.authorizations,
        }

    def reset(self) -> None:
        self.connects.clear()
        self.requests.clear()
        self.refused.clear()
        self.authorizations.clear()
        self.relays.clear()


async def _head(reader: asyncio.StreamReader) -> tuple[str, list[tuple[str, str]]] | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = raw.decode("latin-1").split("\r\n")[:-2]
    fields = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields.append((name.strip(), value.strip()))
    return lines[0], fields


def _field(fields: list[tuple[str, str]], name: str) -> str | None:
    return next((v for k, v in fields if k.lower() == name), None)


async def _answer(
    writer: asyncio.StreamWriter, status: int, reason: str, body: bytes = b"", extra: str = ""
) -> None:
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: list | None = None, sock: Any = None
) -> None:
    try:
        while data := await reader.read(256 * 1024):
            if log is not None:
                log.append((getattr(sock, "rx_ns", 0), time.perf_counter_ns(), len(data)))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _open(state: _State, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    """The upstream connection's streams and a relay of its reads towards the client (the
    coroutine that pipes them, logging each into ``state.relays``)."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    loop = asyncio.get_running_loop()
    (family, kind, proto, _, address), *_ = await loop.getaddrinfo(
        state.names.get(host, host), int(port), type=socket.SOCK_STREAM
    )
    sock = (rxclock.stamped_socket((family, kind, proto)) if rxclock else None) or socket.socket(
        family, kind, proto
    )
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    reader, writer = await asyncio.open_connection(sock=sock)
    log: list[tuple[int, int, int]] = []
    state.relays.append(log)
    return reader, writer, (log, sock)


def _authorized(state: _State, fields: list[tuple[str, str]]) -> bool:
    given = _field(fields, "proxy-authorization")
    if given is not None:
        state.authorizations.append(given)
    return state.expected is None or given == state.expected


async def _handle(state: _State, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    upstream: tuple[str, asyncio.StreamWriter, asyncio.Task] | None = None
    try:
        while (head := await _head(reader)) is not None:
            line, fields = head
            method, target, _ = line.split(" ", 2)
            if method == "CONNECT":
                host = target.rpartition(":")[0].strip("[]")
                if not _authorized(state, fields):
                    state.refused["407"] += 1
                    await _answer(
                        writer,
                        407,
                        "Proxy Authentication Required",
                        extra='Proxy-Authenticate: Basic realm="test"\r\n',
                    )
                    continue
                if host in state.deny:
                    state.refused["403"] += 1
                    await _answer(writer, 403, "Forbidden")
                    continue
                state.connects[target] += 1
                try:
                    up_reader, up_writer, (log, sock) = await _open(state, target)
                except OSError:
                    state.refused["502"] += 1
                    await _answer(writer, 502, "Bad Gateway")
                    continue
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer, log, sock))
                return
            length = int(_field(fields, "content-length") or 0)
            body = await reader.readexactly(length) if length else b""
            if not target.startswith("http://"):  # origin form: a request for the proxy itself
                if target.startswith("/counts"):
                    await _answer(writer, 200, "OK", json.dumps(state.counts()).encode())
                elif target.startswith("/relays"):
                    offset = rxclock.realtime_offset_ns() if rxclock else 0
                    relays = {"offset_ns": offset, "relays": state.relays}
                    await _answer(writer, 200, "OK", json.dumps(relays).encode())
                elif target.startswith("/reset"):
                    state.reset()
                    await _answer(writer, 200, "OK", b"{}")
                else:
                    await _answer(writer, 404, "Not Found")
                continue
            if not _authorized(state, fields):
                state.refused["407"] += 1
                await _answer(
                    writer,
                    407,
                    "Proxy Authentication Required",
                    extra='Proxy-Authenticate: Basic realm="test"\r\n',
                )
                continue
            url = urlsplit(target)
            authority = url.netloc.rpartition("@")[2]
            if ":" not in authority.rpartition("]")[2]:
                authority += ":80"
            state.requests[authority] += 1
            if upstream is None or upstream[0] != authority or upstream[1].is_closing():
                if upstream is not None:
                    upstream[1].close()
                    upstream[2].cancel()
                try:
                    up_reader, up_writer, (log, sock) = await _open(state, authority)
                except OSError:
                    state.refused["502"] += 1
                    await _answer(writer, 502, "Bad Gateway")
                    continue
                upstream = (authority, up_writer, asyncio.ensure_future(_pipe(up_reader, writer, log, sock)))
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            hop = {"proxy-authorization", "proxy-connection"}
            kept = "".join(f"{k}: {v}\r\n" for k, v in fields if k.lower() not in hop)
            upstream[1].write(f"{method} {path} HTTP/1.1\r\n{kept}\r\n".encode("latin-1") + body)
            await upstream[1].drain()
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        if upstream is not None:
            upstream[1].close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(upstream[2], 1.0)
        with contextlib.suppress(Exception):
            writer.close()


async def _main(args: argparse.Namespace) -> None:
    names = dict(item.split("=", 1) for item in args.map)
    state = _State(args.auth, names, set(args.deny))
    server = await asyncio.start_server(
        lambda r, w: _handle(state, r, w), "127.0.0.1", args.port, backlog=1024
    )
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


class Proxy:
    """Handle on a running proxy: ``url`` (``http://127.0.0.1:PORT``, with ``user:pass@`` when
    it asks for them: ``auth``), :meth:`counts`, :meth:`reset`."""

    def __init__(self, port: int, auth: str | None) -> None:
        self.port = port
        self.plain_url = f"http://127.0.0.1:{port}"
        self.url = f"http://{auth}@127.0.0.1:{port}" if auth else self.plain_url
        # its own control calls never go through any proxy (the environment's included)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def counts(self) -> dict[str, Any]:
        with self._opener.open(f"{self.plain_url}/counts", timeout=10) as response:
            return json.loads(response.read())

    def relays(self) -> dict[str, Any]:
        """``GET /relays`` (module docstring)."""
        with self._opener.open(f"{self.plain_url}/relays", timeout=10) as response:
            return json.loads(response.read())

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.plain_url}/reset", data=b"", method="POST")
        with self._opener.open(request, timeout=10):
            pass


@contextlib.contextmanager
def serve(
    auth: str | None = None,
    names: dict[str, str] | None = None,
    deny: tuple[str, ...] = (),
    nice: int = 0,
    realtime: bool = False,
) -> Iterator[Proxy]:
    """Start the proxy in a child process on a free port; stop it on exit (options: module
    docstring). ``nice``: added to its scheduling niceness (negative: ahead of the other
    processes on a shared machine); ``realtime``: ``SCHED_FIFO`` (it runs as soon as a read
    wakes it, as a proxy on a host of its own would). Both need the privilege."""

    def schedule() -> None:
        if nice:
            os.nice(nice)
        if realtime:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))

    command = [sys.executable, os.path.abspath(__file__), "--port", "0"]
    if auth:
        command += ["--auth", auth]
    for name, address in (names or {}).items():
        command += ["--map", f"{name}={address}"]
    for host in deny:
        command += ["--deny", host]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=schedule if nice or realtime else None,  # noqa: PLW1509 - no threads started here
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"the test proxy did not start: {line!r}")
        yield Proxy(int(line.split()[1]), auth)
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout:
            process.stdout.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--auth")
    parser.add_argument("--map", action="append", default=[])
    parser.add_argument("--deny", action="append", default=[])
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(parser.parse_args()))
