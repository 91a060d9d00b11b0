"""The calls to the endpoint beside the measured streams (issue 50, item 3): the ``/metrics``
scrape, the gauge sampler, the prefix-cache reset and the pre-flight go the streams' way
(tasks/endpoint/endpoint_http.py: the proxy rule of tasks/wire/proxy.py, the CA bundle's TLS) and
follow no redirect.

Before: the scrape, the gauges and the reset used urllib's or http.client's defaults: the
system CA store only (against a private-CA endpoint every call failed, silently: a level without
its server figures), urllib's own proxy rule (no loopback exception) or none (the gauges went
direct behind a proxy), and urllib followed a 3xx (the pre-flight checked whatever the redirect
pointed to).

Real parts: tests/test_proxies.py's fixtures (the test-owned forwarding proxy, which alone
resolves ``endpoint.test``, and the instrument serving TLS with a trustme CA), and two small
HTTP servers of this module's (threads, 127.0.0.1): one answering every request 307 with an
absolute Location, the other that Location's target, counting what reaches it.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

try:
    from tests.test_proxies import BIN, NAME, _url, ca, env, plain_instrument, proxy, tls_instrument
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    from test_proxies import BIN, NAME, _url, ca, env, plain_instrument, proxy, tls_instrument

from tasks.endpoint.cache import reset_refused
from tasks.endpoint.endpoint_http import reset_prefix_cache
from tasks.endpoint.gauges import GaugeSampler
from tasks.endpoint.preflight import PreflightError, check_endpoint
from tasks.endpoint.prometheus import scrape

__all__ = ["ca", "env", "plain_instrument", "proxy", "tls_instrument"]  # fixtures, shared


def test_scrape_gauges_and_reset_tunnel_through_the_proxy_with_the_ca(env, proxy, tls_instrument, ca):
    env(HTTPS_PROXY=proxy.url, HTTP_PROXY=proxy.url)
    proxy.reset()
    url = _url(tls_instrument)  # https://endpoint.test:PORT/v1: only the proxy reaches it
    # without the CA: the certificate is not trusted (as before the option reached these calls)
    assert scrape(url) is None
    assert "CERTIFICATE_VERIFY_FAILED" in reset_prefix_cache(url, timeout_s=5.0)
    page = scrape(url, ca_bundle=ca[0])
    assert page is not None and page["gt_in_flight"] == 0.0 and "gt_requests_total" in page
    assert reset_prefix_cache(url, timeout_s=5.0, ca_bundle=ca[0]) is None  # 200 from the instrument
    with GaugeSampler(url, names=("gt_in_flight", "gt_text_chunks_total"), ca_bundle=ca[0]) as sampler:
        first, second = sampler.sample_once(), sampler.sample_once()
    assert first is not None and second is not None
    assert first.values["gt_in_flight"] == 0.0 and set(first.values) == set(second.values)
    counts = proxy.counts()
    # one tunnel each: two refused handshakes, the scrape, the reset, the sampler's kept one (two GETs)
    assert counts["connects"] == {f"{NAME}:{tls_instrument.port}": 5}
    assert counts["requests"] == {}


def test_scrape_gauges_and_reset_are_forwarded_and_loopback_stays_direct(env, proxy, plain_instrument):
    env(HTTP_PROXY=proxy.url, HTTPS_PROXY=proxy.url, ALL_PROXY=proxy.url)
    proxy.reset()
    url = _url(plain_instrument)  # http://endpoint.test:PORT/v1
    assert scrape(url)["gt_in_flight"] == 0.0
    assert reset_prefix_cache(url, timeout_s=5.0) is None
    with GaugeSampler(url, names=("gt_in_flight",)) as sampler:
        samples = [sampler.sample_once() for _ in range(2)]
    assert [s.values for s in samples] == [{"gt_in_flight": 0.0}] * 2
    loopback = _url(plain_instrument, "127.0.0.1")  # never proxied, whatever the variables say
    assert scrape(loopback)["gt_in_flight"] == 0.0 and reset_prefix_cache(loopback) is None
    with GaugeSampler(loopback, names=("gt_in_flight",)) as sampler:
        assert sampler.sample_once().values == {"gt_in_flight": 0.0}
    counts = proxy.counts()
    assert counts["requests"] == {f"{NAME}:{plain_instrument.port}": 4} and counts["connects"] == {}


class _Handler(BaseHTTPRequestHandler):
    """``server.target`` set: every request answered 307 to the same path under it; else 200."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.paths.append(f"{self.command} {self.path}")
        target = self.server.target
        self.send_response(307 if target else 200)
        if target:
            self.send_header("Location", f"{target}/moved{self.path}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:  # quiet
        pass


def _server(target: str | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.paths, server.target = [], target
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def redirect():
    """``(redirecting server, its target)``: the first answers 307 to the second, absolute."""
    target = _server(None)
    moved = _server(f"http://127.0.0.1:{target.server_address[1]}")
    yield moved, target
    for server in (moved, target):
        server.shutdown()
        server.server_close()


def test_the_preflight_names_a_redirect_and_does_not_follow_it(redirect, env):
    moved, target = redirect
    moved.paths.clear()
    base = f"http://127.0.0.1:{moved.server_address[1]}/v1"
    there = f"http://127.0.0.1:{target.server_address[1]}/moved/v1"
    with pytest.raises(PreflightError) as raised:
        check_endpoint(base, "m", None, None, timeout_s=5.0)
    assert raised.value.setting == "base_url"
    assert raised.value.line({"base_url": "--base-url"}) == (
        f"--base-url: {base}/models answered 307 Temporary Redirect to {there}/models: not followed "
        f"(a benchmark does not follow redirects); set base_url to {there}"
    )
    assert moved.paths == ["GET /v1/models"] and target.paths == []  # asked once, never followed
    # the command: one error line naming where it points, exit 2, nothing sent to the target
    result = subprocess.run(
        [str(BIN), "stream", "--base-url", base, "--model", "m", "--no-track"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: --base-url: ") and f"set base_url to {there}" in lines[0]
    assert target.paths == []


def test_scrape_gauges_and_reset_name_a_redirect_once_and_do_not_follow_it(redirect, env, caplog):
    moved, target = redirect
    base = f"http://127.0.0.1:{moved.server_address[1]}/v1"
    root = f"http://127.0.0.1:{target.server_address[1]}/moved"
    with caplog.at_level(logging.WARNING):
        assert scrape(base) is None and scrape(base) is None
        with GaugeSampler(base, names=("gt_in_flight",)) as sampler:
            assert sampler.sample_once() is None and sampler.sample_once() is None
        why = reset_prefix_cache(base, timeout_s=5.0)
    said = [record.getMessage() for record in caplog.records]
    assert (
        said
        == [  # once each, however often asked
            f"the server's metrics are left out: {base[:-3]}/metrics answered 307 Temporary Redirect to "
            f"{root}/metrics: not followed (a benchmark does not follow redirects)",
            f"the server's gauges are not sampled: {base[:-3]}/metrics answered 307 Temporary Redirect to "
            f"{root}/metrics: not followed (a benchmark does not follow redirects)",
        ]
    )
    assert why == f"HTTP 307 to {root}/reset_prefix_cache, not followed"
    assert f"(HTTP 307 to {root}/reset_prefix_cache, not followed at /reset_prefix_cache)" in reset_refused(
        why
    )
    assert target.paths == []
