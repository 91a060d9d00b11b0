"""Error classes of a streamed request, and the mapping from client exceptions to them.

The classes are those of DESIGN.md ("Metric definitions"): a failed request is counted under
exactly one class, reported as ``errors_<class>`` and in ``error_rate``, and left out of the
latency percentiles. Three classes are added for what DESIGN.md does not name: ``bad_request``
(any other 4xx, e.g. 400 "context too long" or 422), ``unknown`` (an exception nothing here
recognises; the message names its type) and ``server_died`` (refused or cut because the
embedded server this command started had died: set by ``tasks.stream.client.stream_chat``).

The openai client (3.x) sends through ``httpx2``; a transport failure during the request or the
stream reaches the caller as ``openai.APIConnectionError`` / ``APITimeoutError`` with the httpx2
(or httpx) exception as ``__cause__``, so :func:`classify` walks the cause chain.

Messages never contain an API key: any known secret is replaced, and anything shaped like a
bearer token or an ``sk-`` key is masked.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urljoin

import httpx2

from tasks.wire.codings import EncodingError
from tasks.wire.proxy import ProxyError

if TYPE_CHECKING:
    import openai

AUTH = "auth"  #: HTTP 401 / 403
NOT_FOUND = "not_found"  #: HTTP 404 (model or path)
RATE_LIMITED = "rate_limited"  #: HTTP 429
SERVER = "server"  #: HTTP 5xx, or an error object inside the stream
TIMEOUT = "timeout"  #: no response / no next chunk within the timeout
STREAM_BROKEN = "stream_broken"  #: connection or chunked body cut after the request was sent
BAD_PAYLOAD = "bad_payload"  #: a data line that is not valid JSON; a body in a coding not decoded
EMPTY_RESPONSE = "empty_response"  #: HTTP 200 but no token
CONNECTION = "connection"  #: refused, DNS failure: the request never reached a server
BAD_REQUEST = "bad_request"  #: any other 4xx; a 3xx (a redirect, not followed) (not in DESIGN.md's list)
UNKNOWN = "unknown"  #: an exception not recognised here (not in DESIGN.md's list)
#: refused or cut because the embedded server this command started had died (tasks.engines.death):
#: the server's death, not the endpoint's address (not in DESIGN.md's list)
SERVER_DIED = "server_died"

#: Every class, in report order.
ERROR_CLASSES: tuple[str, ...] = (
    AUTH,
    NOT_FOUND,
    RATE_LIMITED,
    SERVER,
    TIMEOUT,
    STREAM_BROKEN,
    BAD_PAYLOAD,
    EMPTY_RESPONSE,
    CONNECTION,
    BAD_REQUEST,
    UNKNOWN,
    SERVER_DIED,
)


class StreamError(Exception):
    """An error the client detects itself (in-stream error object, no token): already classed."""

    def __init__(self, error_class: str, message: str) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message


_KEY_PATTERNS = (
    re.compile(r"(?i)(bearer\s+)[^\s\"',]+"),
    re.compile(r"\bsk-[A-Za-z0-9_\-*]{4,}"),
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with every given secret and anything shaped like an API key replaced."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "[redacted]")
    text = _KEY_PATTERNS[0].sub(r"\1[redacted]", text)
    return _KEY_PATTERNS[1].sub("[redacted]", text)


def _httpx_modules() -> list:
    """httpx2 always; legacy httpx only when something already imported it."""
    modules = [httpx2]
    legacy = sys.modules.get("httpx")
    if legacy is not None:
        modules.append(legacy)
    return modules


def _is(exc: BaseException, name: str) -> bool:
    """isinstance against the exception class ``name`` of httpx2 and (if loaded) httpx."""
    types = tuple(getattr(m, name) for m in _httpx_modules() if hasattr(m, name))
    return bool(types) and isinstance(exc, types)


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(chain) < 16:
        chain.append(current)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return chain


def _server_message(exc: openai.APIError) -> str:
    body = exc.body
    if isinstance(body, dict):
        message = body.get("message") or body.get("error") or body.get("detail")
        if message:
            return str(message)
    if isinstance(body, str) and body.strip():
        return body.strip()[:300]
    return exc.message


def _url(exc: BaseException) -> str:
    try:
        request = getattr(exc, "request", None)
        return str(request.url) if request is not None else "the endpoint"
    except Exception:  # noqa: BLE001 - httpx raises if the request is unset
        return "the endpoint"


def _classify_status(
    exc: openai.APIStatusError, *, api_key_env: str | None, model: str | None
) -> tuple[str, str]:
    code = exc.status_code
    detail = _server_message(exc)
    if code == 401:
        where = (
            f"set a valid key in the environment variable {api_key_env}"
            if api_key_env
            else "set endpoint.api_key_env to the NAME of the environment variable that holds "
            "the key (default OPENAI_API_KEY)"
        )
        return AUTH, f"HTTP 401: the endpoint rejected the API key; {where}. Server said: {detail}"
    if code == 403:
        key = f" (key from {api_key_env})" if api_key_env else ""
        return AUTH, (
            f"HTTP 403: the API key{key} is not allowed to use this model or endpoint. Server said: {detail}"
        )
    if code == 404:
        name = f"model {model!r}" if model else "the model"
        return NOT_FOUND, (
            f"HTTP 404 from {_url(exc)}: {name} or the path was not found; check endpoint.model "
            f"and that base_url ends with /v1. Server said: {detail}"
        )
    if code == 429:
        retry = exc.response.headers.get("retry-after")
        after = f" (retry-after: {retry} s)" if retry else ""
        return RATE_LIMITED, (
            f"HTTP 429: rate limited{after}; lower max_concurrency or the request rate, or raise "
            f"the endpoint's limit. Server said: {detail}"
        )
    if code >= 500:
        return SERVER, f"HTTP {code}: server error. Server said: {detail}"
    if 300 <= code < 400:
        return BAD_REQUEST, _redirect_message(exc)
    return BAD_REQUEST, f"HTTP {code}: the endpoint refused the request. Server said: {detail}"


#: The paths the stream client posts to under ``base_url`` (tasks.stream.client.SSEClient).
_ENDPOINT_PATHS = ("/chat/completions", "/completions", "/responses")


def _redirect_message(exc: openai.APIStatusError) -> str:
    """A 3xx answer's error: where it points (``Location``, resolved against the request's URL)
    and the ``base_url`` that would reach it. Not followed: a second request's time would be
    charged to the first's TTFT, and a 301/302/303 turns a POST into a GET (RFC 9110 §15.4)."""
    code, url = exc.status_code, _url(exc)
    said = f"{code} {exc.response.reason_phrase}".strip()
    location = exc.response.headers.get("location")
    if not location:
        return f"HTTP {code}: the endpoint {url} answered {said} with no Location; check base_url"
    target = urljoin(url, location.strip())
    base = next((target[: -len(path)] for path in _ENDPOINT_PATHS if target.endswith(path)), None)
    fix = f"set base_url to {base}" if base else "set base_url to where it points"
    return (
        f"HTTP {code}: the endpoint answered {said} to {target}: a benchmark does not follow "
        f"redirects (the second request's time would be charged to the first); {fix}"
    )


def _classify_transport(exc: BaseException, url: str, in_stream: bool) -> tuple[str, str] | None:
    """Class of an httpx2/httpx/OS transport exception, or None when it is not one."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, ProxyError):  # its message names the proxy, its answer and the fix: the
        # server's state and the base_url are not in question ("is the server running?" misled)
        return CONNECTION, f"could not reach {url} through its proxy: {exc}"
    if _is(exc, "TimeoutException") or isinstance(exc, TimeoutError):
        return TIMEOUT, f"timed out waiting for {url} ({text}); raise endpoint.request_timeout_s"
    cut = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
    if _is(exc, "ConnectError") or (isinstance(exc, OSError) and not isinstance(exc, cut)):
        if in_stream and not _is(exc, "ConnectError"):
            return STREAM_BROKEN, f"the stream from {url} was cut: {text}"
        return CONNECTION, (
            f"could not connect to {url} ({text}); is the server running and the base_url right?"
        )
    if (
        _is(exc, "RemoteProtocolError")
        or _is(exc, "ReadError")
        or _is(exc, "NetworkError")
        or _is(exc, "ProtocolError")
        or isinstance(exc, cut)
        or type(exc).__name__ in {"EndOfStream", "BrokenResourceError", "ClosedResourceError"}
    ):
        return STREAM_BROKEN, f"the connection to {url} was cut mid-response: {text}"
    return None


def classify(
    exc: BaseException,
    *,
    api_key_env: str | None = None,
    model: str | None = None,
    in_stream: bool = False,
    secrets: Iterable[str | None] = (),
) -> tuple[str, str]:
    """Map an exception from a streamed chat request to ``(error_class, message)``.

    Args:
        exc: what the openai client (or httpx2 / httpx / the SSE decoder) raised.
        api_key_env: NAME of the variable holding the key, named in 401/403 messages.
        model: the requested model, named in 404 messages.
        in_stream: the response headers had arrived (a refused/closed socket is then a broken
            stream, not a connection failure).
        secrets: values to scrub from the message (the API key).

    Mapping: 401/403 -> auth; 404 -> not_found; 429 -> rate_limited; 5xx and an error object in
    the stream -> server; other 4xx, and a 3xx (the message names its ``Location``: a redirect is
    not followed) -> bad_request; timeouts -> timeout; refused / DNS -> connection; connection
    or chunked body cut -> stream_broken; invalid JSON data line, and a body in a content coding
    not decoded (``tasks.wire.codings.EncodingError``) -> bad_payload; :class:`StreamError`
    keeps its own class.
    """
    error_class, message = _classify(exc, api_key_env=api_key_env, model=model, in_stream=in_stream)
    return error_class, redact(message, secrets)


def _classify(
    exc: BaseException, *, api_key_env: str | None, model: str | None, in_stream: bool
) -> tuple[str, str]:
    # imported here: the command's own process classifies no request, and openai's import
    # (0.5 s) would sit on its path (tasks.stream.level_result)
    import openai

    if isinstance(exc, StreamError):
        return exc.error_class, exc.message
    for cause in _causes(exc):  # a body this client could not decode (raised by h1, or under one)
        if isinstance(cause, EncodingError):
            return BAD_PAYLOAD, str(cause)
    if isinstance(exc, openai.APIStatusError):
        return _classify_status(exc, api_key_env=api_key_env, model=model)
    if isinstance(exc, openai.APITimeoutError):
        return TIMEOUT, (
            f"timed out waiting for {_url(exc)}; raise endpoint.request_timeout_s or check the server's load"
        )
    if isinstance(exc, json.JSONDecodeError):
        line = (exc.doc or "")[:120]
        return BAD_PAYLOAD, f"the server sent a data line that is not valid JSON ({exc.msg}): {line!r}"
    if isinstance(exc, openai.APIConnectionError):
        url = _url(exc)
        for cause in _causes(exc)[1:]:
            found = _classify_transport(cause, url, in_stream)
            if found:
                return found
        if in_stream:
            return STREAM_BROKEN, f"the stream from {url} was cut: {exc.message}"
        return CONNECTION, f"could not reach {url}: {exc.message}"
    if isinstance(exc, openai.APIError):
        # Raised by the client for a data line holding {"error": {...}} (an in-stream error).
        return SERVER, f"the server sent an error inside the stream: {_server_message(exc)}"
    for cause in _causes(exc):
        found = _classify_transport(cause, _url(cause), in_stream)
        if found:
            return found
    if isinstance(exc, UnicodeDecodeError):
        return BAD_PAYLOAD, f"the server sent bytes that are not UTF-8: {exc}"
    text = str(exc)
    return UNKNOWN, f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def server_died_message(server_pid: int, message: str | None) -> str:
    """A ``server_died`` record's message: the death first, then what the client saw."""
    saw = f" (the client saw: {message})" if message else ""
    return f"the embedded server this command started (pid {server_pid}) had died{saw}"


def every_request_failed(levels: Iterable[dict]) -> str | None:
    """When every measured request of the levels (``Level.to_dict()`` each: ``requests`` with
    ``warmup`` and ``error``) failed: ``every request failed; first error (<class>): <message>``,
    the error a flow ends with (a run that measured nothing ends FAILED, as the command's exit
    code says). None when one succeeded, or none was measured."""
    measured = [r for level in levels for r in level["requests"] if not r["warmup"]]
    if not measured or any(r["error"] is None for r in measured):
        return None
    first = measured[0]["error"]
    return f"every request failed; first error ({first['class']}): {first['message']}"


def error_rate_exceeded(
    levels: Iterable[dict], limit: float, setting: str = "regression.max_error_rate"
) -> str | None:
    """When a level's error rate (failed / measured requests, warm-up left out) exceeds
    ``limit``: ``error rate 0.48 at concurrency 4 exceeds regression.max_error_rate 0.05; first
    errors: server: HTTP 500 ... (x 12), ...`` naming the first level over it and the first 3
    distinct errors of its failed requests (each with its count there), the error an audit ends
    with (its run FAILED, never a baseline). None when no level exceeds it (or none measured)."""
    for level in levels:
        measured = [r for r in level["requests"] if not r["warmup"]]
        failed = [r for r in measured if r["error"] is not None]
        if not measured or len(failed) / len(measured) <= limit:
            continue
        seen: dict[tuple[str, str], int] = {}
        for record in failed:
            key = (record["error"]["class"], record["error"]["message"])
            seen[key] = seen.get(key, 0) + 1
        first = [f"{kind}: {_short(message)} (x {n})" for (kind, message), n in list(seen.items())[:3]]
        more = f" and {len(seen) - 3} other kinds" if len(seen) > 3 else ""
        where = f"concurrency {level['max_concurrency']}"
        if level.get("request_rate") is not None:
            where += f", {level['request_rate']:g} requests/s"
        return (
            f"error rate {len(failed) / len(measured):.2f} ({len(failed)} of {len(measured)} requests) "
            f"at {where} exceeds {setting} {limit:g}; first errors: {', '.join(first)}{more}"
        )
    return None


def _short(message: str, limit: int = 200) -> str:
    """One line of an error message, cut at ``limit`` characters."""
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
