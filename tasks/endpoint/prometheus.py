"""The server's own view of a load level, from its Prometheus ``/metrics`` endpoint.

vLLM, TGI, SGLang and llama.cpp's native server (``--metrics``) expose Prometheus text at
``<host>/metrics`` (base_url without ``/v1``). The stream stage scrapes it just before a level's
measured requests and just after them (around each repeat's, summed by :func:`combine`), and
logs what changed beside the client's figures:

- ``server_<name>_delta``: the increase of every counter (``*_total``) and every histogram /
  summary ``*_count`` and ``*_sum`` (samples summed over their labels);
- ``server_<name>_mean``: ``delta(sum) / delta(count)`` of every histogram / summary, e.g.
  vLLM's ``vllm:time_to_first_token_seconds`` -> ``server_vllm_time_to_first_token_seconds_mean``
  (in the metric's own unit, seconds there).

- ``server_<name>_p50`` / ``_p90`` / ``_p99``: quantile estimates of every histogram from the
  level's bucket increases, interpolated linearly inside a bucket as Prometheus'
  ``histogram_quantile`` does (so they are only as fine as the server's bucket bounds).

Names are made MLflow-safe (``:`` and other characters become ``_``). A server without the
endpoint gives None and nothing is logged. Format: Prometheus text exposition format 0.0.4.
The scrape goes the endpoint's way (:mod:`tasks.endpoint.endpoint_http`: its proxy, its CA
bundle); a redirect is not followed (None, and a warning naming where it points).

``cross_check`` then puts the server's latency histograms that have a client counterpart
(:data:`CLIENT_COUNTERPARTS`, vLLM's names) beside the client's, in the client's unit:
``server_ttft_ms_mean`` / ``_p50`` / ``_p90`` / ``_p99``, ``ttft_ms_mean_client_minus_server``
(likewise ``itl_ms``, ``tpot_ms``, ``e2e_ms``, and ``server_queue_ms_*`` which has no client
counterpart), and ``server_client_disagree`` (0/1; see :func:`cross_check`).
"""

from __future__ import annotations

import logging
import math
import re
import urllib.error
import urllib.request
from collections.abc import Sequence

from tasks.endpoint import endpoint_http

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")
_LE = re.compile(r'le="([^"]+)"')
#: Info gauges (value 1, the facts in their labels) whose one label is kept in the key, as
#: ``NAME{LABEL="VALUE"}``: vLLM's cache block size (``tasks.endpoint.cache.block_size_tokens``).
INFO_LABELS = {"vllm:cache_config_info": "block_size"}
QUANTILES = (50, 90, 99)

#: server histogram (seconds) -> the client's metric (ms) it estimates. vLLM V1: TTFT and E2E
#: run from the request's arrival in the server (queue included), ITL is every gap between
#: output tokens, request_time_per_output_token is TPOT. The queue time has no client figure.
CLIENT_COUNTERPARTS = {
    "vllm:time_to_first_token_seconds": "ttft_ms",
    "vllm:inter_token_latency_seconds": "itl_ms",
    "vllm:request_time_per_output_token_seconds": "tpot_ms",
    "vllm:e2e_request_latency_seconds": "e2e_ms",
    "vllm:request_queue_time_seconds": "queue_ms",
}
#: What the network, HTTP and SSE framing between server and client may add to a mean, before
#: a client is flagged: this many ms plus this fraction of the server's mean plus the client's
#: event-loop lag p99. Client figures *below* the server's are as suspect (e.g. a client that
#: starts TTFT's clock late or counts a role-only chunk as the first token).
AGREEMENT_TOLERANCE_MS = 25.0
AGREEMENT_TOLERANCE_FRACTION = 0.10


def metrics_url(base_url: str) -> str:
    """``http://h:8000/v1`` -> ``http://h:8000/metrics``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/metrics"


def parse(text: str) -> dict[str, float]:
    """Sample values of a Prometheus text page, summed over labels per metric name.

    A histogram's cumulative buckets are kept per bound, under the series name
    ``NAME_bucket{le="BOUND"}`` (summed over the other labels); an info gauge of
    :data:`INFO_LABELS` under ``NAME{LABEL="VALUE"}`` (e.g.
    ``vllm:cache_config_info{block_size="16"}``). Comment lines, lines that do not parse and
    values that are not finite are skipped.

    Not ``prometheus_client.parser.text_string_to_metric_families``, measured
    (``.venv/bin/python tests/benchmarks/library_pieces.py prometheus``, 2026-12-06, 2 loaded
    cores): on a real vLLM page (tests/data/vllm_metrics.txt, 629 lines) both give the same 399
    series (tests/test_prometheus.py), this in 0.56 ms and prometheus_client in 13.2 ms, and
    :mod:`tasks.endpoint.gauges` parses a page 4 times a second during a level (0.2 % of a core
    against 5.3 %). prometheus_client also renames a counter typed without ``_total`` (TGI's
    ``tgi_request_count`` becomes ``tgi_request_count_total``: another MLflow name), and one
    line it cannot parse loses the whole page (a ValueError), where this skips that line.
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name = match.group(1)
        if name.endswith("_bucket"):
            bound = _LE.search(match.group(2) or "")
            if not bound:
                continue
            name = f'{name}{{le="{bound.group(1)}"}}'
        elif name in INFO_LABELS:
            label = INFO_LABELS[name]
            found = re.search(rf'[{{,]\s*{label}="([^"]*)"', match.group(2) or "")
            if not found:
                continue
            name = f'{name}{{{label}="{found.group(1)}"}}'
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile (0..1) of a histogram given as ``{upper bound: cumulative count}``
    (``inf`` for ``+Inf``), interpolated linearly inside the bucket that holds it (from 0 for
    the first bucket); a quantile in the ``+Inf`` bucket is the highest finite bound.
    None for an empty histogram. Source: Prometheus ``histogram_quantile``."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _level_buckets(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[float, float]]:
    out: dict[str, dict[float, float]] = {}
    for series, value in after.items():
        if "_bucket{" not in series or series not in before:
            continue
        name, _, rest = series.partition("_bucket{")
        bound = float(_LE.search("{" + rest).group(1))  # "+Inf" -> inf
        out.setdefault(name, {})[bound] = value - before[series]
    return out


def scrape(
    base_url: str,
    api_key: str | None = None,
    timeout_s: float = 5.0,
    *,
    ca_bundle: str | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
) -> dict[str, float] | None:
    """The server's metrics now, or None when it has no Prometheus endpoint (any HTTP error,
    a connection failure, or a page that is not Prometheus text). On the endpoint's way
    (:mod:`tasks.endpoint.endpoint_http`: its proxy, ``ca_bundle``'s TLS); a redirect is not
    followed: None, and a warning naming where it points, once (``logger``)."""
    url = metrics_url(base_url)
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with endpoint_http.opener(url, ca_bundle).open(request, timeout=timeout_s) as response:
            if response.status != 200:
                return None
            text = response.read(8_000_000).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:
            said = endpoint_http.redirect_message(url, exc.code, exc.reason, exc.headers.get("Location"))
            endpoint_http.warn_once(f"the server's metrics are left out: {said}", logger)
        return None
    except (urllib.error.URLError, OSError, ValueError):
        return None
    values = parse(text)
    return values or None


def level_view(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """``server_*_delta`` and ``server_*_mean`` figures of a level (see the module docstring);
    empty when either scrape is missing."""
    if not before or not after:
        return {}
    out: dict[str, float] = {}
    for name, value in after.items():
        if name not in before or not name.endswith(("_total", "_count", "_sum")):
            continue
        out[f"server_{_UNSAFE.sub('_', name)}_delta"] = value - before[name]
    for name in after:
        if name.endswith("_count") and name in before:
            base = name[: -len("_count")]
            count = after[name] - before[name]
            if f"{base}_sum" in after and f"{base}_sum" in before and count > 0:
                total = after[f"{base}_sum"] - before[f"{base}_sum"]
                out[f"server_{_UNSAFE.sub('_', base)}_mean"] = total / count
    for base, buckets in _level_buckets(before, after).items():
        for q in QUANTILES:
            value = histogram_quantile(q / 100, buckets)
            if value is not None:
                out[f"server_{_UNSAFE.sub('_', base)}_p{q}"] = value
    return out


def combine(
    pairs: Sequence[tuple[dict[str, float] | None, dict[str, float] | None]],
) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    """One (before, after) pair for several runs of a level, each scraped around its own measured
    requests (a level's repeats): ``after - before`` is the sum of the runs' increases, so
    :func:`level_view` and the cache's counters see the measured requests alone, not the
    warm-ups between the runs (only differences mean anything: a gauge's value here does not).
    One pair comes back as it is; (None, None) when a scrape is missing."""
    if len(pairs) == 1:
        return pairs[0]
    if not pairs or any(not before or not after for before, after in pairs):
        return None, None
    first = pairs[0][0]
    names = set(first).intersection(*(set(before) & set(after) for before, after in pairs))
    after = {n: first[n] + sum(a[n] - b[n] for b, a in pairs) for n in names}
    return {n: first[n] for n in names}, after


def cross_check(metrics: dict[str, float]) -> dict[str, float]:
    """The server's latency figures beside the client's, from a level's metrics (the client's
    ``ttft_ms_mean`` etc. from ``tasks.stats.aggregate_level`` plus :func:`level_view`'s).

    Returns ``server_<m>_mean`` / ``_p50`` / ``_p90`` / ``_p99`` in ms for each histogram of
    :data:`CLIENT_COUNTERPARTS` the server sent, ``<m>_mean_client_minus_server`` where the
    client has the figure, and ``server_client_disagree``: 1 when the client's TTFT or E2E mean
    differs from the server's by more than ``AGREEMENT_TOLERANCE_MS`` +
    ``AGREEMENT_TOLERANCE_FRACTION`` x the server's mean + the client's event-loop lag p99, in
    either direction, else 0. Empty when the server sent none of them.
    """
    out: dict[str, float] = {}
    disagree = 0
    lag_ms = metrics.get("client_loop_lag_ms_p99") or 0.0
    for server_name, client_name in CLIENT_COUNTERPARTS.items():
        safe = f"server_{_UNSAFE.sub('_', server_name)}"
        for stat in ("mean", *(f"p{q}" for q in QUANTILES)):
            if f"{safe}_{stat}" in metrics:
                out[f"server_{client_name}_{stat}"] = metrics[f"{safe}_{stat}"] * 1000.0
        server_mean, client_mean = out.get(f"server_{client_name}_mean"), metrics.get(f"{client_name}_mean")
        if server_mean is None or client_mean is None:
            continue
        difference = client_mean - server_mean
        out[f"{client_name}_mean_client_minus_server"] = difference
        explained = AGREEMENT_TOLERANCE_MS + AGREEMENT_TOLERANCE_FRACTION * server_mean + lag_ms
        if client_name in ("ttft_ms", "e2e_ms") and abs(difference) > explained:
            disagree = 1
    if out:
        out["server_client_disagree"] = disagree
    return out
