"""The server's Prometheus gauges sampled during a level's measured requests, off the timed path.

A level's ``/metrics`` scrapes before and after it (:mod:`tasks.endpoint.prometheus`) give what
*changed* over the level; a gauge (requests running, waiting, KV-cache usage) means something
only at an instant, so :class:`GaugeSampler` reads it every :data:`INTERVAL_S` (250 ms) while
the level's measured requests run and keeps each reading with its time on the client's clock:
``time.perf_counter_ns()``, CLOCK_MONOTONIC on Linux, the clock of every ``RequestRecord``'s
``send_ns`` and arrivals (one clock for all processes), so the samples and the client's windows
(:mod:`tasks.stream.timeline`) line up without any conversion. The sample's time is the
midpoint of its GET (the server read its gauges somewhere between send and answer; the GET's
duration is kept as ``fetch_ms``, the bound on that error).

Off the timed path: the sampler is a thread of the orchestrating process, and
:func:`tasks.scaleout.levels.run_levels` always times the requests in client processes of their
own (``tasks.scaleout.multiproc``, one at the least), so its GETs and its parsing never share a GIL
or an event loop with a timed stream. They do share the machine's cores and the server: one
small GET every 250 ms, on one kept connection (AIPerf's server-metrics collection scrapes
every 333 ms during a run and reports each gauge's mean and max per time slice; guidellm's
users ask for the server side, guidellm#457). A server without ``/metrics`` (llama.cpp's embedded server) is never sampled: the level's
first scrape already found none.

What is sampled: the names in :data:`GAUGES` (vLLM, SGLang, TGI, llama.cpp's native server) and
the counters in :data:`COUNTERS` (vLLM's preemptions), each summed over its labels as
:func:`tasks.endpoint.prometheus.parse` sums them (one engine: its value; several data-parallel
engines: running / waiting add up, and a usage fraction then reads as their sum).

Standard library only (and this room's Prometheus parser, :mod:`tasks.endpoint.prometheus`).
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tasks.endpoint import endpoint_http, prometheus

#: Seconds between two samples (a GET that takes longer skips the ticks it overran).
INTERVAL_S = 0.25
#: A GET slower than this is given up (that sample is missing, the next tick tries again).
TIMEOUT_S = 2.0

#: Instantaneous gauges, by server: vLLM (``kv_cache_usage_perc`` is a 0-1 fraction despite its
#: name; ``gpu_cache_usage_perc`` before v0.10), SGLang, TGI, llama.cpp's ``--metrics``.
GAUGES: tuple[str, ...] = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "tgi_batch_current_size",
    "tgi_queue_size",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "llamacpp:kv_cache_usage_ratio",
)
#: Cumulative counters sampled beside them: a window reports their increase
#: (:func:`tasks.stream.timeline.windows`).
COUNTERS: tuple[str, ...] = ("vllm:num_preemptions_total",)


@dataclass(frozen=True)
class GaugeSample:
    """One reading of the server's gauges.

    Attributes:
        t_ns: ``time.perf_counter_ns()`` at the midpoint of the GET (the client's clock).
        values: sampled name (as served, e.g. ``vllm:num_requests_running``) -> value, for the
            names the page had.
        fetch_ms: the GET's duration (ms): the reading was taken somewhere within it.
    """

    t_ns: int
    values: dict[str, float] = field(default_factory=dict)
    fetch_ms: float = 0.0


class GaugeSampler:
    """Sample the server's gauges every ``interval_s`` on a thread, between :meth:`start` and
    :meth:`stop` (callable several times: a level's repeats each add their measured part).

    Use as a context manager so the thread stops however the level ends. ``samples`` holds every
    reading in time order; read it after :meth:`stop`. The GETs go the endpoint's way
    (:mod:`tasks.endpoint.endpoint_http`: its proxy, ``ca_bundle``'s TLS); a redirect is not
    followed (no sample; a warning naming where it points, once, to ``logger``).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        interval_s: float = INTERVAL_S,
        names: Sequence[str] = GAUGES + COUNTERS,
        timeout_s: float = TIMEOUT_S,
        ca_bundle: str | None = None,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
    ) -> None:
        self.base_url, self.api_key = base_url, api_key
        self.interval_s, self.names, self.timeout_s = interval_s, tuple(names), timeout_s
        self.samples: list[GaugeSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._page = _KeptGet(prometheus.metrics_url(base_url), api_key, timeout_s, ca_bundle, logger)

    def start(self) -> None:
        """Start sampling now (the first GET at once); no-op while already sampling."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="gauge-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and wait for the thread (at most one GET's timeout); no-op when stopped.
        The kept connection is closed."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._page.close()

    def sample_once(self) -> GaugeSample | None:
        """One GET of ``/metrics``: the sample (also appended to ``samples``), or None when the
        page could not be read or had none of the names."""
        sent = time.perf_counter_ns()
        text = self._page.get()
        done = time.perf_counter_ns()
        page = prometheus.parse(text) if text else None
        values = {name: page[name] for name in self.names if page and name in page}
        if not values:
            return None
        sample = GaugeSample((sent + done) // 2, values, (done - sent) / 1e6)
        self.samples.append(sample)
        return sample

    def _loop(self) -> None:
        due = time.perf_counter()
        while not self._stop.is_set():
            self.sample_once()
            due += self.interval_s
            now = time.perf_counter()
            if now > due:  # the GET overran its tick: skip to the next tick on the same grid
                due += self.interval_s * int((now - due) / self.interval_s + 1)
            self._stop.wait(due - now)

    def __enter__(self) -> GaugeSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _KeptGet:
    """GETs of one URL on one kept HTTP/1.1 connection (RFC 9112 §9.3): a sample costs the server
    no new connection every 250 ms and its ``fetch_ms`` no connect. The connection is the
    endpoint's (:func:`tasks.endpoint.endpoint_http.connection`: direct, tunnelled or forwarded
    through its proxy, its TLS context). After a failure, or a server that closes, the next GET
    opens a new one; a kept connection that the server closed while idle is retried once on a
    new one. ``get`` returns the page's text, or None (not 200, a redirect: not followed, no
    answer within ``timeout_s``, a connection failure)."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        timeout_s: float,
        ca_bundle: str | None = None,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
    ) -> None:
        self._url, self._ca_bundle, self._logger = url, ca_bundle, logger
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._connection: http.client.HTTPConnection | None = None
        self._target, self._fields = "/", dict[str, str]()

    def get(self) -> str | None:
        for kept in (self._connection is not None, False):
            try:
                if self._connection is None:
                    self._connection, self._target, self._fields = endpoint_http.connection(
                        self._url, self._ca_bundle, self._timeout_s
                    )
                self._connection.request("GET", self._target, headers=self._headers | self._fields)
                response = self._connection.getresponse()
                body = response.read(8_000_000)
            except (OSError, http.client.HTTPException):
                self.close()
                if kept:
                    continue  # closed by the server while idle: once more, on a new connection
                return None
            if response.will_close or response.status != 200 or not response.isclosed():
                self.close()  # not to be kept: closing, an error, or a page left unread
            if 300 <= response.status < 400:
                said = endpoint_http.redirect_message(
                    self._url, response.status, response.reason, response.getheader("Location")
                )
                endpoint_http.warn_once(f"the server's gauges are not sampled: {said}", self._logger)
            return body.decode("utf-8", "replace") if response.status == 200 else None
        return None

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
