"""The calls to the endpoint's host beside the measured streams, all on the streams' way there.

The pre-flight's model list and probe (:mod:`tasks.endpoint.preflight`), the ``/metrics`` scrapes
(:func:`tasks.endpoint.prometheus.scrape`), the gauge sampler's kept GETs
(:class:`tasks.endpoint.gauges.GaugeSampler`) and the prefix-cache reset
(:func:`reset_prefix_cache`) reach the user's endpoint as the measured streams do
(:mod:`tasks.wire.pool`):

- through the proxy :func:`tasks.wire.proxy.proxy_for` names for the URL, or directly where it
  names none (loopback always: urllib's own environment rule lacks that one, so it is never
  consulted here); ``https`` through an HTTP ``CONNECT`` tunnel, ``http`` forwarded;
- with the endpoint's TLS context (:func:`tasks.wire.proxy.tls_context`: the CA bundle,
  ``endpoint.ca_bundle`` / ``Connection.ca_bundle``, else the default store or
  ``SSL_CERT_FILE``);
- never following a redirect: a 3xx is the call's failure, its message naming where it points
  (:func:`redirect_message`), as the stream client's is (``tasks.wire.errors``). Followed
  silently, the figures beside a level would describe another server than the one its streams
  measured, and a 301/302/303 turns a POST into a GET (RFC 9110 §15.4).

Two shapes: :func:`opener`, a urllib opener for a one-off call; :func:`connection`, an
``http.client`` connection to keep (the gauge sampler's, one GET every 250 ms). A call that
fails here (a redirect included) is a diagnostic's failure, said once (:func:`warn_once`), not
the run's. infermeter's own loopback services (Prefect, a local MLflow, the embedded engines'
health checks) do not come here: they stay direct. Standard library only.
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.error
import urllib.request
from urllib.parse import urljoin, urlsplit, urlunsplit

from tasks.wire import proxy as proxies

__all__ = ["connection", "opener", "redirect_message", "reset_prefix_cache", "warn_once"]

_LOG = logging.getLogger("infermeter.stream")
_said: set[str] = set()
_said_lock = threading.Lock()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """urllib's redirect handler, replaced: a 3xx reaches the default error handler, which raises
    ``urllib.error.HTTPError`` with the answer's fields (``Location`` among them)."""

    def http_error_302(self, req, fp, code, msg, headers):  # noqa: ANN001 - urllib's signature
        return None

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def opener(url: str, ca_bundle: str | None = None) -> urllib.request.OpenerDirector:
    """A urllib opener for requests to ``url``'s origin: the proxy ``proxy_for`` names (none:
    direct, whatever urllib's own rule says), for ``https`` the TLS context of ``ca_bundle``, no
    redirect followed (a 3xx raises ``HTTPError``; its ``headers["Location"]`` says where).

    Raises:
        tasks.wire.proxy.ProxyError: (a ``ConnectionError``) the proxy variable that applies
            names a proxy that cannot be used; ``OSError``: ``ca_bundle`` cannot be read.
    """
    scheme = urlsplit(url).scheme
    proxy = proxies.proxy_for(url)
    handlers: list[urllib.request.BaseHandler] = [
        urllib.request.ProxyHandler({scheme: proxy.url} if proxy else {}),
        _NoRedirect(),
    ]
    if scheme == "https":
        handlers.append(urllib.request.HTTPSHandler(context=proxies.tls_context(ca_bundle)))
    return urllib.request.build_opener(*handlers)


def connection(
    url: str, ca_bundle: str | None = None, timeout_s: float = 5.0
) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """A new ``http.client`` connection for requests to ``url`` (not yet connected; keep it for
    the next ones), the request target to send for ``url`` and the fields to add: directly
    (origin form); through the proxy's ``CONNECT`` tunnel for ``https`` (``set_tunnel``: SNI and
    the certificate check are the endpoint's, ``Proxy-Authorization`` on the CONNECT); forwarded
    for ``http`` (absolute form, RFC 9112 §3.2.2, ``Proxy-Authorization`` on each request).
    ``http.client`` follows no redirect.

    Raises:
        tasks.wire.proxy.ProxyError: as :func:`opener`; ``OSError``: ``ca_bundle`` unreadable.
    """
    parts = urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    proxy = proxies.proxy_for(url)
    auth = {"Proxy-Authorization": proxy.authorization} if proxy and proxy.authorization else {}
    if not https:
        if proxy is None:
            return http.client.HTTPConnection(host, port, timeout=timeout_s), target, {}
        forwarded = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], target, "", ""))
        return http.client.HTTPConnection(proxy.host, proxy.port, timeout=timeout_s), forwarded, auth
    context = proxies.tls_context(ca_bundle)
    if proxy is None:
        return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=context), target, {}
    tunnelled = http.client.HTTPSConnection(proxy.host, proxy.port, timeout=timeout_s, context=context)
    tunnelled.set_tunnel(host, port, headers=auth)
    return tunnelled, target, {}


def redirect_message(url: str, status: int, reason: str, location: str | None, tail: str = "") -> str:
    """A 3xx answer to ``url`` as an error: ``status`` and ``reason``, where it points
    (``location`` resolved against ``url``), that it was not followed; where ``url`` is the base
    URL plus ``tail`` (``/models``) and the target ends with ``tail`` too, the ``base_url`` that
    would reach it (``set base_url to ...``), as ``tasks.wire.errors``' message."""
    said = f"{status} {reason}".strip()
    if not location:
        return f"{url} answered {said} with no Location: a redirect that names no target; check the URL"
    where = urljoin(url, location.strip())
    fix = ""
    if tail:
        base = where[: -len(tail)] if where.endswith(tail) else "where it points"
        fix = f"; set base_url to {base}"
    return f"{url} answered {said} to {where}: not followed (a benchmark does not follow redirects){fix}"


def warn_once(message: str, logger: logging.Logger | logging.LoggerAdapter | None = None) -> None:
    """``message`` as a warning (``logger``, default ``infermeter.stream``), once per process:
    a diagnostic that fails at every level (a redirected ``/metrics``) is said once."""
    with _said_lock:
        if message in _said:
            return
        _said.add(message)
    (logger or _LOG).warning("%s", message)


def reset_prefix_cache(
    base_url: str, api_key: str | None = None, timeout_s: float = 10.0, ca_bundle: str | None = None
) -> str | None:
    """Ask the server to empty its prefix cache: ``POST <root>/reset_prefix_cache`` (vLLM; the
    route exists in its development mode, ``VLLM_SERVER_DEV_MODE=1``), on the endpoint's way
    (module docstring: its proxy, its CA bundle, no redirect followed).

    Returns None when the server said yes (HTTP 2xx), else why not, in a few words (``HTTP 404``,
    ``HTTP 307 to URL, not followed``, ``connection refused``): a server without the route keeps
    its cache (``tasks.endpoint.cache.reset_refused`` words the warning).
    """
    root = base_url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    url = f"{root}/reset_prefix_cache"
    request = urllib.request.Request(url, data=b"", method="POST")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with opener(url, ca_bundle).open(request, timeout=timeout_s) as response:
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:
            location = exc.headers.get("Location")
            where = f"to {urljoin(url, location.strip())}" if location else "with no Location"
            return f"HTTP {exc.code} {where}, not followed"
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))
