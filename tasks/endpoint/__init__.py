"""The endpoint as the client sees it: which one it is, whether it answers, and what it says of
itself beside the measured streams.

:mod:`spec` (which endpoint: the configured base_url or the embedded server, and its key),
:mod:`preflight` (one cheap check of a remote endpoint before the first level),
:mod:`endpoint_http` (the calls beside the streams: the model list, ``/metrics``, the prefix-cache
reset, all on the streams' way there), :mod:`prometheus` (the server's counters and histograms
over a level), :mod:`gauges` (its gauges sampled during a level) and :mod:`cache` (its prefix
cache over a level: hit rate, the cached share, what a perfect cache would give).

Imports the wire (:mod:`tasks.wire.proxy`: the endpoint's way) and, for the embedded server, the
engines; ``tasks.stream`` imports this room, never the reverse. The MLflow store's own pre-flight
is ``tasks.tracking.preflight_store`` (it raises this room's :class:`preflight.PreflightError`).
"""
