"""infermeter's own loopback services never go through the user's proxy.

``HTTP(S)_PROXY`` is for the way to a remote endpoint; the embedded engines, infermeter's local
Prefect API server and a local MLflow server listen on 127.0.0.1, which the user's proxy cannot
reach. urllib and httpx send every request to the proxy unless ``NO_PROXY`` names the host: with
``HTTP_PROXY`` set and loopback not named, the install's smoke generation, every health check
and every Prefect call failed after their timeouts, blaming the engine (issue 48's trial).
:func:`keep_loopback_off_proxies` adds loopback to both spellings of ``NO_PROXY`` where a proxy is
set (``flows/__init__.py`` at every entry point, ``python -m tasks.engines.smoke``); children
inherit it. Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: The variables that set a proxy (urllib reads both spellings; the lower one wins).
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
#: What loopback is called in NO_PROXY.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def no_proxy_hosts(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """The hosts NO_PROXY names, in order, each once, read as urllib (and so httpx, requests)
    and :mod:`tasks.wire.proxy` read it: ``no_proxy`` where it is set, even empty (which
    unsets the other), else ``NO_PROXY``."""
    value = environ["no_proxy"] if "no_proxy" in environ else environ.get("NO_PROXY", "")
    return list(dict.fromkeys(item.strip() for item in value.split(",") if item.strip()))


def keep_loopback_off_proxies(environ: MutableMapping[str, str] = os.environ) -> None:
    """Where a proxy is set, add :data:`LOOPBACK` to ``NO_PROXY`` and ``no_proxy`` (both set to
    the same list: what :func:`no_proxy_hosts` reads, then loopback). Nothing where no proxy is
    set."""
    if not any(environ.get(name) for name in PROXY_VARS):
        return
    hosts = no_proxy_hosts(environ)
    joined = ",".join([*hosts, *(host for host in LOOPBACK if host not in hosts)])
    environ["NO_PROXY"] = environ["no_proxy"] = joined
