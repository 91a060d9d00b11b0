"""Which proxy a request to an endpoint goes through, the tunnel through it, and the TLS context.

Every path to a configured endpoint (the stream client's :class:`tasks.wire.pool.Pool`, the
openai transport, and the calls beside the streams: the pre-flight and its model list, the
``/metrics`` scrapes, the gauge sampler, the prefix-cache reset, all through
:mod:`tasks.endpoint.endpoint_http`) asks :func:`proxy_for` and follows its answer, so they never
disagree on the way to the endpoint.

The rule (:func:`proxy_for`), the one curl and urllib read from the environment:

- the proxy variable of the endpoint's scheme, ``https_proxy`` for ``https://`` endpoints,
  ``http_proxy`` for ``http://``, else ``all_proxy`` (curl's fallback); each in both spellings,
  the lower-case one winning and an empty lower-case one unsetting the upper (urllib's
  ``getproxies_environment``). A value without a scheme is an ``http://`` proxy (curl); only
  ``http://`` proxies are read (:class:`ProxyError` otherwise, naming the variable; the
  openai transport, a library API, leaves ``https://`` and SOCKS proxies to httpx);
- ``no_proxy`` / ``NO_PROXY`` (the lower-case one winning): ``*`` (every host), host names and
  domains (``example.com`` and ``.example.com`` both match the name and every name under it;
  ``*.example.com`` too, as Go's ``httpproxy``), ``host:port`` (that port only: urllib), IP
  addresses and CIDR ranges (``10.0.0.0/8``: curl 7.86), bracketed or bare IPv6;
- loopback is never proxied, whatever the variables say: ``localhost``, ``*.localhost``
  (RFC 6761 §6.3) and the loopback addresses (127.0.0.0/8, ``::1``, also IPv4-mapped). A
  user's proxy cannot reach their 127.0.0.1; Go's ``net/http.ProxyFromEnvironment``
  (``golang.org/x/net/http/httpproxy``, ``useProxy``) has the same rule. Only the URL's own
  host counts: a name that resolves to loopback is proxied (the proxy resolves it).

Through a proxy, ``https`` endpoints are reached with an HTTP ``CONNECT`` tunnel (RFC 9110
§9.3.6), then TLS over it; ``http`` endpoints by forwarding (the request target in absolute
form, RFC 9112 §3.2.2). Credentials in the proxy URL (``http://user:pass@proxy:3128``) are sent
as ``Proxy-Authorization: Basic`` (RFC 9110 §11.7.2, RFC 7617) and never shown:
:class:`Proxy`'s ``str`` and ``repr`` are its scheme, host and port.

TLS: :func:`tls_context` with the endpoint's CA bundle (``endpoint.ca_bundle``), else the
default context, which honours ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` (OpenSSL's default paths).

Standard library only.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import ipaddress
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

__all__ = [
    "Proxy",
    "ProxyError",
    "bypassed",
    "certificate_refused",
    "connect_head",
    "httpx_routing",
    "is_loopback",
    "proxy_for",
    "refusal",
    "tls_context",
    "trusted",
    "tunnel",
    "tunnel_sync",
]

#: The longest CONNECT answer head read (status line and fields).
MAX_ANSWER_BYTES = 16 * 1024


class ProxyError(ConnectionError):
    """The proxy refused the tunnel or could not be used: the message names the proxy (never its
    credentials), what it was asked and its answer. A ``ConnectionError``: the request never
    reached the endpoint (error class ``connection``). ``status``: the proxy's HTTP status (0:
    none)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Proxy:
    """An ``http://`` proxy: ``host``, ``port`` and ``variable`` (the environment variable it came
    from); ``authorization``: the ``Proxy-Authorization`` value from the URL's credentials
    (never shown), ``url`` the variable's URL (never shown). ``str()``: ``http://host:port``."""

    host: str
    port: int
    variable: str
    authorization: str | None = field(default=None, repr=False, compare=False)
    #: the URL as given, credentials included, for clients that take a URL (httpx): never shown
    url: str = field(default="", repr=False, compare=False)

    def __str__(self) -> str:
        return f"http://{_authority(self.host, self.port)}"

    def __repr__(self) -> str:
        return f"Proxy({self}, from {self.variable})"


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _variables(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``{"http": (value, variable name), "https": …, "all": …, "no": …}`` as urllib's
    ``getproxies_environment`` reads them: any spelling, then the lower-case one wins (an empty
    lower-case value unsets it)."""
    found: dict[str, tuple[str, str]] = {}
    for name, value in environ.items():
        if name.lower().endswith("_proxy") and value and name != name.lower():
            found[name[:-6].lower()] = (value, name)
    for name, value in environ.items():
        if name.endswith("_proxy") and name == name.lower():
            if value:
                found[name[:-6]] = (value, name)
            else:
                found.pop(name[:-6], None)
    return found


def is_loopback(host: str) -> bool:
    """``host`` (a URL's host, brackets stripped) is this machine's loopback: ``localhost``,
    ``*.localhost`` (RFC 6761 §6.3), 127.0.0.0/8, ``::1`` or an IPv4-mapped loopback."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (not loopback to 3.12)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether ``no_proxy`` (module docstring: ``*``, names and domains, ``host:port``, IPs,
    CIDR ranges; comma or space separated) names ``host`` at ``port``."""
    name = host.strip("[]").rstrip(".").lower()
    try:
        address = ipaddress.ip_address(name.partition("%")[0])
    except ValueError:
        address = None
    for entry in no_proxy.replace(" ", ",").split(","):
        entry = entry.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        if entry.startswith("["):  # [v6] or [v6]:port
            inner, _, rest = entry[1:].partition("]")
            entry, want = inner, rest.lstrip(":")
        elif entry.count(":") == 1:  # name:port or v4:port (a bare IPv6 has several colons)
            entry, want = entry.split(":")
        else:
            want = ""
        if want and want != str(port):
            continue
        if "/" in entry:
            try:
                if address is not None and address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        entry = entry.removeprefix("*").lstrip(".").rstrip(".")
        if entry and (name == entry or name.endswith("." + entry)):
            return True
        if address is not None and entry:
            try:
                if ipaddress.ip_address(entry) == address:
                    return True
            except ValueError:
                pass
    return False


def _parse(value: str, variable: str) -> Proxy:
    """The :class:`Proxy` a variable's value names. Raises ProxyError (a scheme other than
    http, no host, a port that is not a number)."""
    url = urlsplit(value if "://" in value else f"http://{value}")
    shown = f"{url.scheme}://{url.netloc.rpartition('@')[2]}"
    if url.scheme != "http":
        raise ProxyError(
            f"{variable}={shown}: only http:// proxies are supported (HTTP CONNECT for https "
            "endpoints; not TLS to the proxy, nor SOCKS); give the proxy's http:// address"
        )
    try:
        port = url.port or 80
    except ValueError:
        raise ProxyError(f"{variable}={shown}: the port is not a number from 0 to 65535") from None
    if not url.hostname:
        raise ProxyError(f"{variable}={shown}: no proxy host; write it like http://proxy:3128")
    authorization = None
    if url.username is not None:
        pair = f"{unquote(url.username)}:{unquote(url.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return Proxy(url.hostname, port, variable, authorization, url.geturl())


def proxy_for(url: str, environ: Mapping[str, str] | None = None) -> Proxy | None:
    """The proxy a request to ``url`` (an ``http(s)://`` URL) goes through under ``environ``
    (default ``os.environ``), or None for a direct connection (module docstring: the rule).

    Raises:
        ProxyError: the proxy variable that applies names a proxy this client cannot use (a
            scheme other than ``http://``, no host), naming the variable.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if not host or is_loopback(host):
        return None
    found = _variables(os.environ if environ is None else environ)
    chosen = found.get(parts.scheme) or found.get("all")
    if chosen is None:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if bypassed(host, port, found.get("no", ("", ""))[0]):
        return None
    return _parse(*chosen)


def httpx_routing(url: str) -> dict[str, object]:
    """An httpx client's arguments for requests to ``url`` under this module's rule: ``proxy``
    (its URL) where :func:`proxy_for` names one, else every scheme mounted direct, so httpx's
    own environment rule (which lacks the loopback one) cannot apply; ``{}`` (httpx's rule) for
    a proxy this module does not speak (``https://``, SOCKS), which httpx does."""
    try:
        proxy = proxy_for(url)
    except ProxyError:
        return {}
    if proxy is not None:
        return {"proxy": proxy.url}
    return {"mounts": dict.fromkeys(("http://", "https://", "all://"))}


def connect_head(proxy: Proxy, host: str, port: int) -> bytes:
    """The ``CONNECT host:port`` request for ``proxy`` (RFC 9110 §9.3.6: authority form, Host
    the same), with ``Proxy-Authorization`` where the proxy URL had credentials."""
    target = _authority(host, port)
    auth = f"Proxy-Authorization: {proxy.authorization}\r\n" if proxy.authorization else ""
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode("latin-1")


def _answer(head: bytes, proxy: Proxy, host: str, port: int) -> None:
    """Raise ProxyError unless ``head`` (a CONNECT answer's head) is a 2xx."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ProxyError(f"the proxy {proxy} answered CONNECT {_authority(host, port)} with {line[:80]!r}")
    status = int(parts[1])
    if 200 <= status < 300:
        return
    reason = parts[2] if len(parts) > 2 else ""
    raise ProxyError(refusal(proxy, status, reason, f"CONNECT {_authority(host, port)}"), status)


def refusal(proxy: Proxy, status: int, reason: str, asked: str) -> str:
    """The message for ``proxy``'s refusal (``status``, ``reason``) of ``asked`` (``CONNECT
    host:port``, or a forwarded request's URL), with the fix: for a 407, its credentials (never
    shown); else that it could not or would not reach the endpoint."""
    if status == 407:
        fix = (
            "the credentials in its URL were refused; check them"
            if proxy.authorization
            else f"it asks for credentials: put them in {proxy.variable} (http://user:password@host:port)"
        )
    else:
        fix = f"the proxy could not or would not reach {asked.removeprefix('CONNECT ')}"
    said = f"{status} {reason}".strip()
    return f"the proxy {proxy} (from {proxy.variable}) answered {said} to {asked}: {fix}"


async def tunnel(sock: socket.socket, proxy: Proxy, host: str, port: int) -> None:
    """Open a CONNECT tunnel to ``host:port`` on ``sock`` (non-blocking, connected to
    ``proxy``), on the running loop; the socket then carries the endpoint's bytes (TLS next).
    Bounded by the caller's timeout.

    Raises:
        ProxyError: a non-2xx answer (its status kept), an answer that is not HTTP, or bytes
            after the answer (the endpoint speaks after the client's TLS hello, never first).
        ConnectionError: the proxy closed the connection before answering.
    """
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, connect_head(proxy, host, port))
    data = b""
    while b"\r\n\r\n" not in data:
        piece = await loop.sock_recv(sock, MAX_ANSWER_BYTES)
        if not piece:
            raise ConnectionError(f"the proxy {proxy} closed the connection before answering CONNECT")
        data += piece
        if len(data) > MAX_ANSWER_BYTES:
            raise ProxyError(f"the proxy {proxy} answered CONNECT with a head over {MAX_ANSWER_BYTES} bytes")
    head, _, rest = data.partition(b"\r\n\r\n")
    _answer(head, proxy, host, port)
    if rest:
        raise ProxyError(f"the proxy {proxy} sent bytes after its CONNECT answer, before the TLS hello")


def tunnel_sync(proxy: Proxy, host: str, port: int, timeout_s: float) -> socket.socket:
    """A blocking socket through a CONNECT tunnel to ``host:port`` (the pre-flight's), each step
    bounded by ``timeout_s``. Raises OSError from the connection to the proxy (``TimeoutError``
    included), :class:`ProxyError` as :func:`tunnel`."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout_s)
    try:
        sock.sendall(connect_head(proxy, host, port))
        data = b""
        while b"\r\n\r\n" not in data:
            piece = sock.recv(MAX_ANSWER_BYTES)
            if not piece:
                raise ConnectionError(f"the proxy {proxy} closed the connection before answering CONNECT")
            data += piece
            if len(data) > MAX_ANSWER_BYTES:
                raise ProxyError(
                    f"the proxy {proxy} answered CONNECT with a head over {MAX_ANSWER_BYTES} bytes"
                )
        _answer(data.partition(b"\r\n\r\n")[0], proxy, host, port)
    except BaseException:
        sock.close()
        raise
    return sock


def trusted(ca_bundle: str | os.PathLike[str] | None = None) -> str:
    """What :func:`tls_context` trusts, for a message: the bundle, else the system store or
    ``SSL_CERT_FILE``, saying when that names no file (OpenSSL ignores it without a word)."""
    if ca_bundle:
        return f"the CA bundle {os.fspath(ca_bundle)}"
    cert_file = os.environ.get("SSL_CERT_FILE")
    if not cert_file:
        return "the system store (SSL_CERT_FILE is not set)"
    if not os.path.isfile(cert_file):
        return f"the system store (SSL_CERT_FILE={cert_file} is no file: OpenSSL ignored it)"
    return f"SSL_CERT_FILE={cert_file}"


#: OpenSSL's verify codes for a certificate that is trusted but names another host or address
#: (``X509_V_ERR_HOSTNAME_MISMATCH``, ``X509_V_ERR_IP_ADDRESS_MISMATCH``: openssl/x509_vfy.h).
NAME_MISMATCH_CODES = (62, 64)


def certificate_refused(
    host: str, port: int, ca_bundle: str | os.PathLike[str] | None, exc: ssl.SSLCertVerificationError
) -> tuple[str, str]:
    """``(the setting to blame, the message)`` for a certificate the TLS context refused: one that
    names another host blames ``base_url`` (a CA bundle would not help), any other ``ca_bundle``
    (:func:`trusted` says what was trusted)."""
    if exc.verify_code in NAME_MISMATCH_CODES:
        return "base_url", (
            f"{host}:{port}'s certificate does not name {host} ({exc.verify_message}): its CA is "
            "trusted; address the endpoint by a name (or address) its certificate holds"
        )
    return "ca_bundle", (
        f"{host}:{port}'s certificate is not trusted by {trusted(ca_bundle)} ({exc.verify_message}); "
        "give the PEM file of the CA that signed it (or set SSL_CERT_FILE to it)"
    )


def tls_context(ca_bundle: str | os.PathLike[str] | None = None) -> ssl.SSLContext:
    """The client's TLS context: ``ca_bundle`` (a PEM file of CA certificates) as the only trust
    store when given (as curl's ``--cacert``), else the default context (the system store, or
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` where set).

    Raises:
        FileNotFoundError: ``ca_bundle`` does not exist here (the message names it and this host:
            a Dask worker on another host reads the path the command was given; OpenSSL's own
            error named neither); ``ssl.SSLError``: it holds no certificate OpenSSL reads.
    """
    if ca_bundle is None:
        return ssl.create_default_context()
    path = os.fspath(ca_bundle)
    try:
        return ssl.create_default_context(cafile=path)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"the CA bundle {path} (--ca-bundle, endpoint.ca_bundle) is not on {socket.gethostname()}: "
            "every host that runs a client (each Dask worker's) needs the file at that path",
        ) from None
