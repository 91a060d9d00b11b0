"""Proxies and private CAs (issue 50, item 3): every path to an endpoint (the stream client's own
HTTP/1.1, the openai transport, the pre-flight and its model list) follows ``HTTP(S)_PROXY`` /
``NO_PROXY`` as tasks/wire/proxy.py says, and none of infermeter's own loopback calls does; a
CA bundle option beside ``SSL_CERT_FILE``.

Real parts: a forwarding proxy the tests own (tests/http_proxy.py: CONNECT and absolute-form
forwarding, counting per target) and the instrument serving TLS with a certificate signed by a
CA made here (trustme). The endpoint is addressed as ``endpoint.test``, a name only the proxy
resolves (to 127.0.0.1, ``--map``): the client never resolves a proxied host, so a request that
arrives went through the proxy, and a direct one fails to resolve. Loopback itself
(127.0.0.1, localhost) is never proxied, whatever the variables say.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trustme

try:
    from tests import groundtruth_server as gt
    from tests import http_proxy
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import groundtruth_server as gt
    import http_proxy

from tasks.endpoint.preflight import PreflightError, check_endpoint
from tasks.stream.client import stream_chat
from tasks.stream.load import make_client
from tasks.wire.proxy import ProxyError, bypassed, is_loopback, proxy_for, tls_context

BIN = Path(sys.executable).parent / "infermeter"
NAME = "endpoint.test"  # resolved by the test proxy only
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    """A private CA and the instrument's certificate from it (for endpoint.test and 127.0.0.1):
    ``(ca.pem, server.pem)``; server.pem holds the key, the certificate and the CA's."""
    folder = tmp_path_factory.mktemp("ca")
    authority = trustme.CA()
    issued = authority.issue_cert(NAME, "127.0.0.1", "localhost")
    ca_pem, server_pem = folder / "ca.pem", folder / "server.pem"
    authority.cert_pem.write_to_path(str(ca_pem))
    chain = b"".join(blob.bytes() for blob in issued.cert_chain_pems)
    server_pem.write_bytes(issued.private_key_pem.bytes() + chain + authority.cert_pem.bytes())
    return str(ca_pem), str(server_pem)


@pytest.fixture(scope="module")
def tls_instrument(ca):
    with gt.serve(tls=(ca[1], ca[1])) as handle:
        yield handle


@pytest.fixture(scope="module")
def plain_instrument():
    with gt.serve() as handle:
        yield handle


@pytest.fixture(scope="module")
def proxy():
    with http_proxy.serve(
        names={NAME: "127.0.0.1", "other.test": "127.0.0.1"}, deny=("denied.test",)
    ) as handle:
        yield handle


@pytest.fixture
def env(monkeypatch):
    """Every proxy variable unset (both spellings); returns a setter of the given ones."""
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)

    def set_(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_


def _requests(base_url: str, count: int = 2, transport: str = "sse", ca_bundle: str | None = None):
    """``count`` requests one after another on one client (its kept connection reused)."""

    async def main():
        client = make_client(base_url, None, 10.0, 1, transport, ca_bundle=ca_bundle)
        try:
            return [
                await stream_chat(
                    client,
                    model="ticks:3:5",
                    prompt=f"p{i}",
                    max_tokens=3,
                    count_tokens=None,
                    request_id=f"r{i}",
                )
                for i in range(count)
            ]
        finally:
            await client.close()

    return asyncio.run(main())


def _url(server: gt.GroundTruthServer, host: str = NAME) -> str:
    return f"{server.scheme}://{host}:{server.port}/v1"


def test_the_rule_reads_both_spellings_no_proxy_and_never_proxies_loopback():
    env = {"HTTPS_PROXY": "http://up:1", "https_proxy": "http://low:2", "HTTP_PROXY": "plain:3"}
    assert proxy_for("https://api.example.com/v1", env).host == "low"  # lower case wins
    assert (proxy_for("http://api.example.com/v1", env).host, proxy_for("http://a.b/v1", env).port) == (
        "plain",
        3,
    )
    assert proxy_for("https://x.example/v1", {"HTTPS_PROXY": "http://up:1", "https_proxy": ""}) is None
    assert proxy_for("https://x.example/v1", {"ALL_PROXY": "http://all:9"}).host == "all"  # curl's fallback
    for host in (
        "127.0.0.1",
        "127.3.2.1",
        "localhost",
        "LOCALHOST.",
        "api.localhost",
        "[::1]",
        "[::ffff:127.0.0.1]",
    ):
        assert proxy_for(f"http://{host}:8000/v1", {"HTTP_PROXY": "http://p:1"}) is None, host
    assert not is_loopback("10.0.0.1") and not is_loopback("localhost.example.com")
    cases = {
        "*": True,
        "example.com": True,
        ".example.com": True,
        "*.example.com": True,
        "ample.com": False,
        "api.example.com:8000": True,
        "api.example.com:9000": False,
        "10.0.0.0/8": False,
        "other.org, example.com": True,
    }
    for no_proxy, expected in cases.items():
        assert bypassed("api.example.com", 8000, no_proxy) is expected, no_proxy
    assert bypassed("10.1.2.3", 80, "10.0.0.0/8") and not bypassed("11.1.2.3", 80, "10.0.0.0/8")
    assert bypassed("2001:db8::5", 443, "[2001:db8::5]") and bypassed("2001:db8::5", 443, "2001:db8::/32")
    with_auth = proxy_for("https://x.example/v1", {"https_proxy": "http://me:p%40ss@p:3128"})
    assert with_auth.authorization == "Basic bWU6cEBzcw=="  # me:p@ss
    assert "p%40ss" not in f"{with_auth} {with_auth!r}" and "me" not in str(with_auth)
    with pytest.raises(ProxyError, match=r"^https_proxy=socks5://h:1080: only http:// proxies") as socks:
        proxy_for("https://x.example/v1", {"https_proxy": "socks5://me:pw@h:1080"})
    assert "pw" not in str(socks.value)
    for port in ("99999", "abc"):  # 99999 was "not a number"
        with pytest.raises(
            ProxyError, match=rf"^HTTP_PROXY=http://p:{port}: the port is not a number from 0 to"
        ):
            proxy_for("http://x.example/v1", {"HTTP_PROXY": f"p:{port}"})


@pytest.mark.parametrize("transport", ["sse", "openai"])
def test_https_endpoint_through_connect_with_the_ca_option(env, proxy, tls_instrument, ca, transport):
    env(HTTPS_PROXY=proxy.url, HTTP_PROXY=proxy.url)
    proxy.reset()
    records = _requests(_url(tls_instrument), transport=transport, ca_bundle=ca[0])
    assert [r.error_message for r in records] == [None, None]
    assert [r.output_tokens for r in records] == [3, 3]
    counts = proxy.counts()
    assert counts["connects"] == {f"{NAME}:{tls_instrument.port}": 1}  # one tunnel, kept alive
    assert counts["requests"] == {}
    if transport == "sse":  # the kernel's stamps stay: the tunnel is on the stamped socket
        assert [r.arrival_clock for r in records] == ["kernel", "kernel"]
        assert records[0].connect_ms is not None and records[1].connect_ms is None


def test_https_endpoint_trusts_ssl_cert_file_and_fails_without_a_ca(
    env, proxy, tls_instrument, ca, monkeypatch
):
    env(HTTPS_PROXY=proxy.url)
    (untrusted,) = _requests(_url(tls_instrument), count=1)
    assert untrusted.error_class == "connection" and "CERTIFICATE_VERIFY_FAILED" in untrusted.error_message
    monkeypatch.setenv("SSL_CERT_FILE", ca[0])
    records = _requests(_url(tls_instrument))
    assert [r.error_message for r in records] == [None, None]


@pytest.mark.parametrize("transport", ["sse", "openai"])
def test_http_endpoint_is_forwarded(env, proxy, plain_instrument, transport):
    env(HTTP_PROXY=proxy.url)
    proxy.reset()
    records = _requests(_url(plain_instrument), transport=transport)
    assert [r.output_tokens for r in records] == [3, 3]
    counts = proxy.counts()
    assert counts["requests"] == {f"{NAME}:{plain_instrument.port}": 2} and counts["connects"] == {}
    if transport == "sse":  # read by the reactor with the kernel's stamps, as a direct connection
        assert [r.arrival_clock for r in records] == ["kernel", "kernel"]


def test_no_proxy_sends_the_named_hosts_direct(env, proxy, plain_instrument):
    port = plain_instrument.port
    for no_proxy in (".test", "*", f"{NAME}:{port}", "example.org, endpoint.test"):
        env(HTTP_PROXY=proxy.url, NO_PROXY=no_proxy)
        proxy.reset()
        (record,) = _requests(_url(plain_instrument), count=1)
        # direct: endpoint.test resolves nowhere but in the proxy
        assert record.error_class == "connection" and NAME in record.error_message, no_proxy
        assert proxy.counts()["requests"] == {}, no_proxy
    env(HTTP_PROXY=proxy.url, NO_PROXY=f"{NAME}:1")  # another port: still proxied
    assert _requests(_url(plain_instrument), count=1)[0].output_tokens == 3


def test_loopback_endpoints_are_never_proxied(env, proxy, plain_instrument, tls_instrument, ca):
    env(HTTP_PROXY=proxy.url, HTTPS_PROXY=proxy.url, ALL_PROXY=proxy.url)  # and no NO_PROXY
    proxy.reset()
    for host in ("127.0.0.1", "localhost"):
        assert [r.output_tokens for r in _requests(_url(plain_instrument, host))] == [3, 3]
        check_endpoint(_url(plain_instrument, host), "ticks:3:5", None, None)
    assert _requests(_url(tls_instrument, "127.0.0.1"), count=1, ca_bundle=ca[0])[0].output_tokens == 3
    assert _requests(_url(plain_instrument, "127.0.0.1"), count=1, transport="openai")[0].output_tokens == 3
    assert proxy.counts() == {"connects": {}, "requests": {}, "refused": {}, "authorizations": []}


def test_the_preflight_goes_through_the_proxy(env, proxy, plain_instrument, tls_instrument, ca):
    env(HTTP_PROXY=proxy.url, HTTPS_PROXY=proxy.url)
    proxy.reset()
    check_endpoint(_url(tls_instrument), "ticks:3:5", None, None, ca_bundle=ca[0])
    check_endpoint(_url(plain_instrument), "ticks:3:5", None, None)
    counts = proxy.counts()
    # https: the probe's tunnel (its TLS handshake inside), the model list's, the POST probe's
    # (the instrument has no /models: 404); http: the model list and the POST, forwarded
    assert counts["connects"] == {f"{NAME}:{tls_instrument.port}": 3}
    assert counts["requests"] == {f"{NAME}:{plain_instrument.port}": 2}
    with pytest.raises(PreflightError) as untrusted:
        check_endpoint(_url(tls_instrument), "ticks:3:5", None, None)
    assert untrusted.value.setting == "ca_bundle" and "not trusted" in untrusted.value.message
    assert untrusted.value.line({"ca_bundle": "--ca-bundle"}).startswith("--ca-bundle: ")
    with pytest.raises(PreflightError) as denied:
        check_endpoint(f"https://denied.test:{tls_instrument.port}/v1", "m", None, None, ca_bundle=ca[0])
    assert denied.value.setting == "base_url"
    assert f"the proxy {proxy.plain_url} (from HTTPS_PROXY) answered 403 Forbidden" in denied.value.message
    env(HTTPS_PROXY=f"http://127.0.0.1:{gt.free_port()}")
    with pytest.raises(
        PreflightError, match=r"nothing accepts connections at the proxy http://127\.0\.0\.1:\d+"
    ):
        check_endpoint(_url(tls_instrument), "ticks:3:5", None, None, ca_bundle=ca[0])


def test_a_refused_connect_names_the_proxy_and_its_status(env, proxy, tls_instrument, ca):
    env(HTTPS_PROXY=proxy.url)
    (record,) = _requests(f"https://denied.test:{tls_instrument.port}/v1", count=1, ca_bundle=ca[0])
    assert record.error_class == "connection"
    assert f"the proxy {proxy.plain_url} (from HTTPS_PROXY) answered 403 Forbidden" in record.error_message
    assert record.error_message.startswith(f"could not reach https://denied.test:{tls_instrument.port}/v1")
    assert "is the server running" not in record.error_message  # the proxy said why: not the server
    (record,) = _requests(f"https://{NAME}:{gt.free_port()}/v1", count=1, ca_bundle=ca[0])
    assert "answered 502 Bad Gateway to CONNECT endpoint.test:" in record.error_message  # nothing there
    nowhere = f"http://127.0.0.1:{gt.free_port()}"
    env(HTTPS_PROXY=nowhere)
    (record,) = _requests(_url(tls_instrument), count=1, ca_bundle=ca[0])
    assert record.error_class == "connection"
    assert f"the proxy {nowhere} (from HTTPS_PROXY) is not reachable" in record.error_message


def test_proxy_credentials_are_sent_and_never_shown(env, tls_instrument, plain_instrument, ca, capfd):
    secret = "s3cr3t-pw"
    with http_proxy.serve(auth=f"alice:{secret}", names={NAME: "127.0.0.1"}) as guarded:
        env(HTTPS_PROXY=guarded.url, HTTP_PROXY=guarded.url)
        ok = _requests(_url(tls_instrument), count=1, ca_bundle=ca[0]) + _requests(
            _url(plain_instrument), count=1
        )
        assert [r.output_tokens for r in ok] == [3, 3]
        assert set(guarded.counts()["authorizations"]) == {"Basic YWxpY2U6czNjcjN0LXB3"}  # alice:s3cr3t-pw
        wrong = guarded.url.replace(secret, "nope-pw")
        env(HTTPS_PROXY=wrong, HTTP_PROXY=wrong)
        refused = _requests(_url(tls_instrument), count=1, ca_bundle=ca[0]) + _requests(
            _url(plain_instrument), count=1
        )
        for record in refused:
            assert record.error_class == "connection"
            assert (
                f"the proxy {guarded.plain_url} (from " in record.error_message
                and "407" in record.error_message
            )
        with pytest.raises(PreflightError) as failed:
            check_endpoint(_url(tls_instrument), "ticks:3:5", None, None, ca_bundle=ca[0])
        assert "407 Proxy Authentication Required" in failed.value.message
        # http, forwarded: the proxy's 407 to the model list stops the pre-flight too (it passed,
        # and every request of the run failed with the same 407)
        with pytest.raises(PreflightError) as forwarded:
            check_endpoint(_url(plain_instrument), "ticks:3:5", None, None)
        assert forwarded.value.setting == "base_url" and forwarded.value.message == (
            f"the proxy {guarded.plain_url} (from HTTP_PROXY) answered 407 Proxy Authentication Required "
            f"to {_url(plain_instrument)}: the credentials in its URL were refused; check them"
        )
        env(HTTP_PROXY=guarded.plain_url)
        with pytest.raises(
            PreflightError, match=r"\(from HTTP_PROXY\) answered 407 .*: it asks for credentials"
        ):
            check_endpoint(_url(plain_instrument), "ticks:3:5", None, None)
        shown = (
            json.dumps([r.to_json() for r in ok + refused])
            + failed.value.line()
            + forwarded.value.line()
            + "".join(capfd.readouterr())
        )
        assert secret not in shown and "nope-pw" not in shown and "alice" not in shown


def test_the_preflight_names_a_dropped_tunnel_another_hosts_certificate_and_a_missing_ssl_cert_file(
    env, proxy, tls_instrument, ca, tmp_path, monkeypatch
):
    """A "proxy" that takes the connection and closes it was "nothing accepts connections"; a
    tunnel to a server that speaks no TLS did not say it went through the proxy; an
    ``SSL_CERT_FILE`` naming no file (OpenSSL ignores it without a word) was not named; a trusted
    certificate for another name was blamed on the CA bundle."""
    listener = socket.create_server(("127.0.0.1", 0))

    def drop() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # the listener closed: the test is over
                return
            connection.recv(4096)
            connection.close()

    threading.Thread(target=drop, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        dropper = f"http://127.0.0.1:{port}"
        env(HTTPS_PROXY=dropper)
        with pytest.raises(PreflightError) as dropped:
            check_endpoint(_url(tls_instrument), "ticks:3:5", None, None)
        assert dropped.value.message.startswith(
            f"the proxy {dropper} (from HTTPS_PROXY) took the connection and closed it ("
        ) and dropped.value.message.endswith("; check HTTPS_PROXY"), dropped.value.message
        env(HTTPS_PROXY=proxy.url)  # a tunnel granted, to a server that drops the TLS hello
        with pytest.raises(PreflightError) as no_tls:
            check_endpoint(f"https://{NAME}:{port}/v1", "ticks:3:5", None, None)
        assert no_tls.value.setting == "base_url" and (
            f"the TLS handshake with {NAME}:{port} through the proxy {proxy.plain_url} "
            "(from HTTPS_PROXY), which tunnelled, failed (" in no_tls.value.message
        ), no_tls.value.message
    finally:
        listener.close()
    # a certificate from the trusted CA, for another name: the URL's host is the fix, not a CA
    env(HTTPS_PROXY=proxy.url)
    with pytest.raises(PreflightError) as other:
        check_endpoint(
            f"https://other.test:{tls_instrument.port}/v1", "ticks:3:5", None, None, ca_bundle=ca[0]
        )
    assert other.value.setting == "base_url" and other.value.message.startswith(
        f"other.test:{tls_instrument.port}'s certificate does not name other.test (Hostname mismatch"
    ), other.value.message
    missing = tmp_path / "no-such-ca.pem"
    monkeypatch.setenv("SSL_CERT_FILE", str(missing))
    with pytest.raises(PreflightError) as untrusted:
        check_endpoint(_url(tls_instrument), "ticks:3:5", None, None)
    assert untrusted.value.setting == "ca_bundle"
    assert f"not trusted by the system store (SSL_CERT_FILE={missing} is no file: OpenSSL ignored it)" in (
        untrusted.value.message
    )


def test_ca_bundle_that_is_no_file_is_a_config_error(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from tasks.config import EndpointConfig

    with pytest.raises(ValidationError, match=r"ca_bundle\n.*no file at .*absent\.pem"):
        EndpointConfig(ca_bundle=tmp_path / "absent.pem")
    with pytest.raises(ValidationError, match=r"ca_bundle\n.* is a folder; .*SSL_CERT_DIR=PATH"):
        EndpointConfig(ca_bundle=tmp_path)  # it said "no file at" the folder
    # a relative path is made absolute: a client in another folder (a Dask worker's) reads it too
    # (it failed there with "FileNotFoundError: [Errno 2] No such file or directory", no path)
    (tmp_path / "ca.pem").write_bytes(trustme.CA().cert_pem.bytes())
    monkeypatch.chdir(tmp_path)
    assert EndpointConfig(ca_bundle=Path("ca.pem")).ca_bundle == tmp_path.resolve() / "ca.pem"
    with pytest.raises(
        FileNotFoundError,
        match=r"the CA bundle .*absent\.pem \(--ca-bundle, endpoint\.ca_bundle\) is not on ",
    ):
        tls_context(tmp_path / "absent.pem")
    result = subprocess.run(
        [str(BIN), "stream", "--base-url", "https://x.example/v1", "--model", "m"]
        + ["--ca-bundle", str(tmp_path / "absent.pem"), "--no-track"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --ca-bundle: ") and "no file at" in lines[0], (
        result.stderr
    )
    # --help says the bundle replaces the system store, and which variables route the endpoint
    shown = subprocess.run(
        [str(BIN), "stream", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    ).stdout
    said = " ".join(line.strip("│ ") for line in shown.splitlines() if "│" in line)
    assert "trusted instead of the system store (as curl's --cacert)" in said, said
    assert "HTTPS_PROXY / HTTP_PROXY unless NO_PROXY names it" in said


def test_the_command_sends_its_own_loopback_calls_direct(env, proxy, tls_instrument, ca, tmp_path):
    """``infermeter stream --ca-bundle`` with every proxy variable at the test proxy and no
    NO_PROXY: the endpoint's connections (the pre-flight's, the stream's from its client
    process, the level's scrapes and cache reset) are CONNECT tunnels through the proxy, TLS
    trusting the CA given; the command's own Prefect API calls (127.0.0.1, the session's
    server) do not go through it."""
    env(HTTP_PROXY=proxy.url, HTTPS_PROXY=proxy.url, ALL_PROXY=proxy.url)
    proxy.reset()
    out = tmp_path / "out.json"
    level_flags = ["--num-requests", "3", "--warmup", "0", "--max-concurrency", "1"]
    result = subprocess.run(
        [str(BIN), "stream", "--base-url", _url(tls_instrument), "--model", "ticks:3:5", "--ca-bundle", ca[0]]
        + [*level_flags, "--no-track", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "INFERMETER_WORK_DIR": str(tmp_path / "work")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    level = json.loads(out.read_text())["levels"][0]
    assert [r["output_tokens"] for r in level["requests"]] == [3, 3, 3]
    # the level's scrapes and its prefix-cache reset took the same way, trusting the same CA
    assert level["metrics"]["server_gt_requests_total_delta"] == 3
    assert level["metrics"]["prefix_cache_reset"] == 1
    counts = proxy.counts()
    assert set(counts["connects"]) == {f"{NAME}:{tls_instrument.port}"}  # nothing else
    assert counts["connects"][f"{NAME}:{tls_instrument.port}"] >= 4  # the pre-flight's 3, the level's
    assert counts["requests"] == {}
    # the control: a Prefect API call that does go through the proxy is counted (httpx, as
    # Prefect's client, with the variables and no NO_PROXY naming loopback)
    import httpx2

    api = os.environ["PREFECT_API_URL"]  # the command's Prefect: the session's, on 127.0.0.1
    with httpx2.Client() as client:
        assert client.get(f"{api}/health").status_code == 200
    assert proxy.counts()["requests"].get(api.split("/")[2]) == 1
