"""The endpoint as the client sees it: which one it is, whether it answers, and what it says of
itself beside the measured streams.

:mod:`spec` (which endpoint: the configured base_url or the embedded server, and its key),
:mod:`preflight` (one cheap check of a remote endpoint before the first level),
:mod:`endpoint_http` (the calls beside the streams: the model list, ``/metrics``, the prefix-cache
reset, all on the streams' way there), :mod:`prometheus` (the server's counters and histograms
over a level), :mod:`gauges` (its gauges sampled during a level) and :mod:`cache` (its prefix
cache over a level: hit rate, the cached share, what a perfect cache would give).

Imports the wire (:mod:`tasks.wire.proxy`: the endpoint's way) and, for the embedded server, the
engines; ``tasks.stream`` imports this room, never the reverse.

:mod:`preflight_store`, the pre-flight of the MLflow store a command writes to, sits beside the
endpoint's (it raises the same :class:`preflight.PreflightError`, said the same way) rather than
in ``tasks.tracking``: the engines import the tracking (the lifeline ends a killed command's
runs) and this room imports the engines, so a tracking module importing this room would close a
cycle. It imports no mlflow: it reads the URI, opens a SQLite store read-only and asks a
tracking server over HTTP.
"""
