"""Pre-flight of a remote endpoint: one cheap check before the first level, so a wrong setting
fails in seconds with one line naming the setting and the fix, not after every request of
every level has failed.

Used by every command whose stages talk to an endpoint (``stream``, ``sweep``, ``audit``).
Standard library only (urllib): no client library, no event loop.

The checks, in order (:func:`check_endpoint`):

1. TCP: something accepts connections at the host and port (refused / no answer in
   ``timeout_s``) -> ``base_url``. Through a proxy (:mod:`tasks.wire.proxy`: the rule every
   path to the endpoint follows) the proxy must accept the connection, and for ``https`` grant
   a CONNECT tunnel to the endpoint (its refusal named with its status). For ``https``, a TLS
   handshake with the CA bundle (``endpoint.ca_bundle``, else the system store or
   ``SSL_CERT_FILE``): an untrusted certificate -> ``ca_bundle``.
2. ``GET {base_url}/models`` (OpenAI, vLLM, llama.cpp, SGLang, TGI serve it): 401/403 ->
   ``api_key_env``; 200 with a model list that lacks the model -> ``model`` (naming what it
   serves).
3. When ``/models`` did not settle it (404: a server without the route, or a base URL without
   ``/v1``): ``POST {base_url}/chat/completions`` with one output token, read to the status
   line only: 404 -> ``base_url`` (suggesting ``/v1`` when it is missing) or ``model`` (when
   the server says the model does not exist), 401/403 -> ``api_key_env``, 405/501 (a web server
   that takes no POST there, e.g. a static file server) -> ``base_url``. ``--api completions``
   probes ``POST {base_url}/completions`` instead, ``--api responses`` ``POST
   {base_url}/responses``.

A redirect (3xx) at either call -> ``base_url``, naming where it points and the base URL that
would reach it: it is not followed (the run does not follow one either). Any other answer (other
5xx, 400, 429, a slow server) is left to the run, which records it per request: pre-flight only
stops settings that can never work. The HTTP calls go the endpoint's way
(:mod:`tasks.endpoint.endpoint_http`: the proxy its URL is given, or none; the run's TLS context).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from tasks.endpoint import endpoint_http
from tasks.wire import proxy as proxies

__all__ = [
    "PreflightError",
    "check_endpoint",
    "check_flow_settings",
    "check_hf_source",
    "check_reachable",
    "check_settings",
    "check_tokenizers",
]


class PreflightError(Exception):
    """A setting that cannot work. ``setting``: ``base_url``, ``model`` or ``api_key_env``;
    ``message``: what is wrong and the fix, without the setting's name (the caller names it as
    the user wrote it: ``--base-url`` or ``endpoint.base_url``)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.message = message

    def line(self, names: dict[str, str] | None = None) -> str:
        """The one line a user reads: the setting as ``names`` spell it (a CLI flag), else as
        the config file does (``endpoint.<field>``; ``sweep.local_model``; a setting that is
        a config path or a flag already, ``tokenize.tokenizers`` or ``--tokenizers``, as it
        is), then the message."""
        if "." in self.setting or self.setting.startswith("-"):  # a config path or a flag already
            default = self.setting
        else:
            default = "sweep.local_model" if self.setting == "local_model" else f"endpoint.{self.setting}"
        return f"{(names or {}).get(self.setting, default)}: {self.message}"


def check_reachable(base_url: str, timeout_s: float = 5.0, ca_bundle: str | None = None) -> None:
    """Something accepts a TCP connection at ``base_url``'s host and port, or at its proxy's
    (:func:`tasks.wire.proxy.proxy_for`), which for ``https`` grants a CONNECT tunnel to it;
    for ``https``, the endpoint's certificate is trusted (``ca_bundle``, else the default store).

    Raises:
        PreflightError: (``base_url``) refused, DNS failure, or no answer in ``timeout_s``, the
            proxy's included (named without credentials, with its status); (``ca_bundle``) a
            certificate the TLS context does not trust.
    """
    url = urlsplit(base_url)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        proxy = proxies.proxy_for(base_url)
        where = f"{host}:{port}" if proxy is None else f"the proxy {proxy} (from {proxy.variable})"
        if proxy is None:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        elif url.scheme == "https":
            sock = proxies.tunnel_sync(proxy, host, port, timeout_s)
        else:  # forwarded: only the proxy is connected to here; _call asks it the rest
            sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout_s)
    except proxies.ProxyError as exc:  # a proxy variable it cannot use, or the proxy's refusal
        raise PreflightError("base_url", str(exc)) from None
    except TimeoutError:
        raise PreflightError(
            "base_url",
            f"{where} does not answer (timed out after {timeout_s:g} s); check the host and port, "
            "and that the server is up",
        ) from None
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        fix = "start the server or fix the URL" if proxy is None else f"check {proxy.variable}"
        # a proxy that took the connection and dropped it listens: it is no proxy that tunnels
        dropped = proxy and isinstance(exc, ConnectionError) and not isinstance(exc, ConnectionRefusedError)
        said = "{} took the connection and closed it" if dropped else "nothing accepts connections at {}"
        raise PreflightError("base_url", f"{said.format(where)} ({reason}); {fix}") from None
    with sock:
        if url.scheme == "https":
            _check_tls(sock, host, port, ca_bundle, timeout_s, proxy)


def _check_tls(
    sock: socket.socket, host: str, port: int, ca_bundle: str | None, timeout_s: float, proxy: Any = None
) -> None:
    """A TLS handshake on ``sock`` (to ``host``; tunnelled through ``proxy``) with the run's context.

    Raises:
        PreflightError: (``ca_bundle``) the certificate is not trusted; (``base_url``) not ``host``'s;
            (``base_url``) the handshake fails otherwise (not a TLS server, or a proxy that
            closed the tunnel).
    """
    sock.settimeout(timeout_s)
    try:
        with proxies.tls_context(ca_bundle).wrap_socket(sock, server_hostname=host):
            return
    except ssl.SSLCertVerificationError as exc:  # untrusted (ca_bundle), or another host's (base_url)
        raise PreflightError(*proxies.certificate_refused(host, port, ca_bundle, exc)) from None
    except (ssl.SSLError, OSError) as exc:
        through = f" through the proxy {proxy} (from {proxy.variable}), which tunnelled," if proxy else ""
        raise PreflightError(
            "base_url",
            f"the TLS handshake with {host}:{port}{through} failed ({exc}); is it an https server? "
            "(an http one: write http://)",
        ) from None


def _call(
    base: str, path: str, key: str | None, body: dict | None, timeout_s: float, ca_bundle: str | None = None
) -> tuple[int, str]:
    """(HTTP status, up to 2 kB of the body: the error text; empty for a 200 chat stream,
    which is not read) of ``{base}/{path}``. Status 0: no answer in time, or the connection
    broke. On the endpoint's way (``tasks.endpoint.endpoint_http``: its proxy, its TLS context).

    Raises:
        PreflightError: (``base_url``) a redirect (not followed), naming where it points.
    """
    url = f"{base}/{path}"
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with endpoint_http.opener(url, ca_bundle).open(request, timeout=timeout_s) as response:
            return response.status, "" if data else response.read(1 << 20).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:  # not followed: the run would measure where it points instead
            location = exc.headers.get("Location")
            said = endpoint_http.redirect_message(url, exc.code, exc.reason, location, f"/{path}")
            raise PreflightError("base_url", said) from None
        try:
            text = exc.read(2048).decode(errors="replace")
        except OSError:
            text = ""
        return exc.code, text
    except (urllib.error.URLError, OSError):
        return 0, ""


def _error_text(body: str) -> str:
    """The server's own message from an OpenAI-style error body, else the body's start."""
    try:
        data = json.loads(body)
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message") if isinstance(error, dict) else error
        text = str(message or body)
    except ValueError:
        text = body
    return " ".join(text.split())[:200]


def _key_error(status: int, body: str, key_env: str | None, key: str | None = None) -> PreflightError:
    said = _error_text(body)
    if key:  # some servers and proxies echo the key they refused: it never reaches a message
        said = said.replace(key, "***")
    if key_env:
        fix = f"the key in {key_env} was refused; put the right key in {key_env}"
    else:
        fix = "no key was sent (nor OPENAI_API_KEY); name the variable that holds the key"
    return PreflightError("api_key_env", f"the server answered {status} ({said}): {fix}")


def _served_models(body: str) -> list[str] | None:
    try:
        data = json.loads(body).get("data")
        return [str(m["id"]) for m in data] if isinstance(data, list) else None
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


def check_endpoint(
    base_url: str,
    model: str,
    key: str | None,
    key_env: str | None,
    timeout_s: float = 10.0,
    api: str = "chat",
    ca_bundle: str | None = None,
) -> None:
    """Run the pre-flight checks (module docstring) against ``base_url`` (``…/v1``).

    Args:
        key: the API key to send (None: none); ``key_env`` names where it came from.
        timeout_s: per check; a server slower than that is left to the run.
        api: ``chat`` probes ``/chat/completions``, ``completions`` ``/completions``,
            ``responses`` ``/responses`` (the endpoint the run will stream from).
        ca_bundle: a PEM file of the CAs trusted for an https endpoint (None: the default
            store, or ``SSL_CERT_FILE``).

    Raises:
        PreflightError: naming ``base_url``, ``model``, ``api_key_env`` or ``ca_bundle``, with
            the fix.
    """
    base = base_url.rstrip("/")
    check_reachable(base, min(timeout_s, 5.0), ca_bundle)
    status, body = _call(base, "models", key, None, timeout_s, ca_bundle)
    if status == 407 and (proxy := proxies.proxy_for(base)):  # forwarded (https: check_reachable's)
        raise PreflightError("base_url", proxies.refusal(proxy, 407, "Proxy Authentication Required", base))
    if status in (401, 403):
        raise _key_error(status, body, key_env, key)
    served = _served_models(body) if status == 200 else None
    if served:
        if model not in served:
            shown = ", ".join(served[:5]) + (", ..." if len(served) > 5 else "")
            raise PreflightError("model", f"the server does not serve {model!r}; it serves: {shown}")
        return
    request = {"model": model, "max_tokens": 1, "stream": True}
    if api == "completions":
        path, request["prompt"] = "completions", "ping"
    elif api == "responses":  # the Responses API: input, max_output_tokens (no max_tokens)
        path = "responses"
        request = {"model": model, "input": "ping", "max_output_tokens": 16, "stream": True}
    else:
        path, request["messages"] = "chat/completions", [{"role": "user", "content": "ping"}]
        request["max_completion_tokens"] = 1
    status, body = _call(base, path, key, request, timeout_s, ca_bundle)
    if status in (401, 403):
        raise _key_error(status, body, key_env, key)
    if status == 404:
        said = _error_text(body)
        if "model" in said.lower():
            raise PreflightError("model", f"the server answered 404 ({said}); give a model name it serves")
        hint = f"; try {base}/v1" if not base.endswith("/v1") else "; check the URL's path"
        raise PreflightError(
            "base_url", f"{base}/{path} answered 404 (not an OpenAI-compatible base URL){hint}"
        )
    if status in (405, 501):  # a web server, but not one that takes an OpenAI POST there
        raise PreflightError(
            "base_url",
            f"{base}/{path} answered {status} (the server does not take POST there: not an "
            "OpenAI-compatible base URL); check the URL",
        )


#: Seconds to wait for the Hugging Face hub's TCP port before calling it unreachable.
HUB_TIMEOUT_S = 3.0


def _hub_reachable(timeout_s: float) -> bool:
    """Whether the hub's host (``HF_ENDPOINT``, default huggingface.co) accepts a TCP
    connection. Name resolution runs in a thread, since ``getaddrinfo`` has no timeout."""
    import threading

    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    answer: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s + 0.5)
    return bool(answer and answer[0])


def check_hf_source(spec: str, setting: str) -> None:
    """An ``hf:`` hub id (not a local folder) must be in the local Hugging Face cache or the
    hub must be reachable; when it is cached and the hub is not, ``HF_HUB_OFFLINE=1`` is set
    for this process, so loading it does not spend half a minute on retries. Other specs pass.

    Raises:
        PreflightError: (``setting``) neither cached nor reachable, with the fix.
    """
    from pathlib import Path

    kind, _, rest = spec.partition(":")
    if kind != "hf" or Path(rest).expanduser().exists():
        return
    if rest.startswith(("/", ".", "~")) or rest.count("/") > 1:
        return  # a folder path, not a hub id: loading it names the missing folder itself
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        cached_only = True
    else:
        cached_only = not _hub_reachable(HUB_TIMEOUT_S)
    if not cached_only:
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(rest, "config.json"), str) or isinstance(
        try_to_load_from_cache(rest, "tokenizer_config.json"), str
    ):
        os.environ["HF_HUB_OFFLINE"] = "1"
        return
    raise PreflightError(
        setting,
        f"{spec!r} is not in the local Hugging Face cache and the hub is not reachable (offline); "
        "download it where the hub is reachable (`hf download ID`), or give hf:/path/to/folder",
    )


def check_tokenizers(
    names: Any, model_spec: str, setting: str = "tokenize.tokenizers", model_setting: str = "profile.model"
) -> None:
    """The ``hf:`` sources a tokenize stage would load (:func:`check_hf_source`): each ``hf:``
    name of ``names``, and ``model_spec`` when ``model`` (the model's own tokenizer) is among
    them; before any stage starts, so ``hf:doesnotexist`` fails in seconds, not after the
    hub's retries (48 s) or a whole audit.

    Raises:
        PreflightError: ``setting`` (the tokenizer names' config path or flag) or
            ``model_setting`` (the model spec's).
    """
    from tasks.tokenize.tokenizers import MODEL

    for name in names:
        if name == MODEL:
            check_hf_source(model_spec, model_setting)
        else:
            check_hf_source(name, setting)


#: Seconds a pass of :func:`check_settings` holds in this process: the CLI checks, then its flow
#: (it may come from the Prefect UI); each waited out 20 s against a server that never answers.
PASSED_HOLDS_S, _passed = 60.0, dict[tuple, float]()  # settings -> time.monotonic() of their pass
_ENDPOINT_FIELDS = ("base_url", "model", "tokenizer", "ca_bundle")


def check_settings(
    endpoint: Any, local_model: str | None = None, timeout_s: float = 10.0, api: str = "chat"
) -> None:
    """Every pre-flight check of a stage's settings, as the run would meet them: the local
    model's and the tokenizer's ``hf:`` source (:func:`check_hf_source`), then, when
    ``endpoint.base_url`` and ``endpoint.model`` are set, :func:`check_endpoint` with the key
    from ``endpoint.api_key_env`` (else ``OPENAI_API_KEY`` when set, as the OpenAI client does).
    The embedded server (no base_url) is not checked: the run starts it.

    Args:
        endpoint: an ``EndpointConfig`` (base_url, model, api_key_env, tokenizer); None for
            a local sweep.
        local_model: ``sweep.local_model`` of a local sweep; None otherwise.

    Raises:
        PreflightError: ``setting`` is the field: local_model, tokenizer, base_url, model or
            api_key_env.
    """
    key_env = getattr(endpoint, "api_key_env", None) or (os.getenv("OPENAI_API_KEY") and "OPENAI_API_KEY")
    key = os.environ.get(key_env) if key_env else None
    digest = hashlib.sha256(key.encode()).hexdigest() if key else None  # never the key itself
    settings = (local_model, api, key_env, digest, *(getattr(endpoint, k, None) for k in _ENDPOINT_FIELDS))
    if time.monotonic() - _passed.get(settings, -PASSED_HOLDS_S) < PASSED_HOLDS_S:
        return  # passed moments ago in this process (PASSED_HOLDS_S)
    if local_model:
        check_hf_source(local_model, "local_model")
    if endpoint is not None and endpoint.tokenizer:
        check_hf_source(endpoint.tokenizer, "tokenizer")
    if endpoint is not None and endpoint.base_url and endpoint.model:
        ca_bundle = getattr(endpoint, "ca_bundle", None)
        ca_bundle = str(ca_bundle) if ca_bundle else None
        check_endpoint(endpoint.base_url, endpoint.model, key, key_env, timeout_s, api, ca_bundle)
    _passed[settings] = time.monotonic()


class SettingsError(ValueError):
    """A flow's setting that cannot work; the message is :meth:`PreflightError.line`."""


def check_flow_settings(endpoint: Any, local_model: str | None = None, api: str = "chat") -> None:
    """:func:`check_settings` for a flow run, which may come from the Prefect UI or a
    deployment without the CLI's checks: a failure fails the flow run at once, before its
    first level or MLflow run, with one line naming the config path and the fix.

    Raises:
        SettingsError: e.g. ``endpoint.model: the server does not serve 'x'; it serves: ...``.
    """
    try:
        check_settings(endpoint, local_model, api=api)
    except PreflightError as exc:
        raise SettingsError(exc.line()) from None
