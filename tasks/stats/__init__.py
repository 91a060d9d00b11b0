"""Percentiles, goodput and per-level aggregates: one place, used by every stage.

Pure standard library. Definitions (DESIGN.md, "Metric definitions"):

- Percentiles use linear interpolation between closest ranks, the same as numpy's default
  ``method="linear"`` (Hyndman & Fan type 7), which vLLM's ``benchmark_serving.py`` and
  GenAI-Perf both use (through numpy).
- A distribution ``name`` is reported as ``name_mean``, ``name_p50``, ``name_p90``,
  ``name_p95``, ``name_p99``, ``name_max``.
- ``itl_ms``: every gap between successive text-carrying chunks of a request, pooled over the
  successful requests of a level (vLLM / SGLang ``benchmark_serving``: ``itls += output.itl``),
  leaving out requests whose decode the client could not see (every chunk in one read: their
  gaps of 0 are the buffering's, not the decode's); the level counts those requests
  (``num_decode_unobserved``).
- ``tpot_ms``: per request ``(e2e_ms - ttft_ms) / (output_tokens - 1)`` (vLLM's TPOT; GenAI-Perf
  calls this per-request figure "inter token latency").
- ``output_tokens_per_s``: output tokens of the successful requests / wall time of the whole
  level (vLLM ``output_throughput``); ``requests_per_s``: successful requests / wall time
  (vLLM ``request_throughput``); ``total_tokens_per_s``: input + output tokens of the
  successful requests / wall time (vLLM ``total_token_throughput``).
- Goodput: requests per second that met every SLO given (vLLM ``--goodput``, from DistServe,
  Zhong et al. 2024): a request is good when it succeeded and each named metric is
  ``<= limit``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The names live in the registry; re-exported here, where the statistics are computed.
from tasks.metrics import SLO_METRICS, STAT_NAMES

__all__ = [
    "SLO_METRICS",
    "STAT_NAMES",
    "aggregate_level",
    "count_short_outputs",
    "flatten_stats",
    "meets_slos",
    "percentile",
    "summarize",
]

#: Percentile of each ``pNN`` statistic of :data:`STAT_NAMES`.
_PERCENTILES: dict[str, float] = {s: float(s[1:]) for s in STAT_NAMES if s.startswith("p")}


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of already sorted values, numpy's 'linear' method.

    ``h = (n - 1) * (q / 100)``; the result interpolates between ``x[floor(h)]`` and
    ``x[floor(h) + 1]`` in the order numpy's ``_lerp`` does (from the upper value when the
    weight is >= 0.5), so it equals ``float(numpy.percentile(x, q))`` bit for bit
    (tests/test_stats.py; 0 of 140,000 random cases differ in the benchmark below). None for no
    values.

    Not numpy itself, measured (``.venv/bin/python tests/benchmarks/library_pieces.py
    percentile``, 2026-12-06, 2 loaded cores): one call on a sorted list of 10 or 100 values
    takes 0.4 us against 39 / 48 us for ``numpy.percentile`` (which first makes the list an
    array), and the stream's client processes import this module but not numpy, which would
    add 138 ms to each one's start (40 ms bare, 178 ms importing numpy).

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    n = len(sorted_values)
    if n == 0:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must lie in [0, 100], got {q}")
    h = (n - 1) * (q / 100.0)
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    lower, upper = float(sorted_values[lo]), float(sorted_values[hi])
    weight, step = h - lo, upper - lower
    return upper - step * (1.0 - weight) if weight >= 0.5 else lower + step * weight


def summarize(values: Iterable[float | None]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 and max of the values (None entries are skipped).

    Returns a dict keyed by :data:`STAT_NAMES`; every value is None when there is no value.
    Units are those of the input.
    """
    data = sorted(float(v) for v in values if v is not None)
    if not data:
        return {name: None for name in STAT_NAMES}
    out: dict[str, float | None] = {"mean": math.fsum(data) / len(data)}
    for name, q in _PERCENTILES.items():
        out[name] = percentile(data, q)
    out["max"] = data[-1]
    return {name: out[name] for name in STAT_NAMES}


def flatten_stats(name: str, values: Iterable[float | None]) -> dict[str, float | None]:
    """``{f"{name}_{stat}": value}`` for each statistic of :func:`summarize`."""
    return {f"{name}_{stat}": value for stat, value in summarize(values).items()}


def _field(record: Any, name: str) -> Any:
    if isinstance(record, Mapping):
        return record.get(name)
    return getattr(record, name, None)


def _error_class_or_none(record: Any) -> str | None:
    error_class = _field(record, "error_class")
    if error_class is None and isinstance(record, Mapping):
        error = record.get("error")
        if isinstance(error, Mapping):
            error_class = error.get("class") or "unknown"
    return error_class


def _succeeded(record: Any) -> bool:
    """Success = at least one token and no error (DESIGN.md)."""
    value = _field(record, "succeeded")
    if isinstance(value, bool):
        return value
    return _error_class_or_none(record) is None and _field(record, "ttft_ms") is not None


def _error_class(record: Any) -> str:
    return _error_class_or_none(record) or "unknown"


def _check_slos(slos: Mapping[str, float]) -> None:
    for metric in slos:
        if metric not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {metric!r}; use one of {list(SLO_METRICS)}")


def meets_slos(record: Any, slos: Mapping[str, float]) -> bool:
    """Whether one request met every SLO (``metric <= limit``; all limits in milliseconds).

    A failed request meets none. A request whose decode the client could not see
    (``decode_unobserved`` set: one output token, all the text in one chunk, or every chunk
    arriving at one instant; ``tasks.stream.timing.decode_unobserved``) has ``tpot_ms`` None and
    neither passes nor fails a ``tpot_ms`` or ``itl_ms`` SLO: it is judged on the others (DESIGN.md;
    vLLM's ``benchmark_serving`` counts such requests as meeting a TPOT SLO). Any other metric a
    request lacks fails its SLO. An ``itl_ms`` SLO asks that every inter-chunk gap of the request
    be ``<= limit``.
    """
    _check_slos(slos)
    if not _succeeded(record):
        return False
    unobserved = _field(record, "decode_unobserved") is not None
    for metric, limit in slos.items():
        if unobserved and metric in _DECODE_SLOS:
            continue
        if metric == "itl_ms":
            gaps = _field(record, "itl_ms") or []
            if not gaps or max(gaps) > limit:
                return False
            continue
        value = _field(record, metric)
        if value is None or value > limit:
            return False
    return True


#: The SLOs that judge the decode: not applied where the client could not see it.
_DECODE_SLOS = frozenset({"tpot_ms", "itl_ms"})


def _per_second(count: float | None, wall_s: float | None) -> float | None:
    if count is None or wall_s is None or not wall_s > 0:
        return None
    return count / wall_s


def aggregate_level(
    records: Iterable[Any],
    wall_s: float | None,
    goodput_slos: Mapping[str, float] | None = None,
) -> dict[str, float | int | None]:
    """The figures of one load level, over its non-warm-up records.

    Args:
        records: request records (``tasks.stream.records.RequestRecord`` or anything with the
            same attribute / mapping keys). Records with ``warmup`` true are left out.
        wall_s: wall time of the whole level in seconds (first measured send to last measured
            completion). None or 0 gives None for the per-second figures.
        goodput_slos: e.g. ``{"ttft_ms": 500, "tpot_ms": 50}``; see :func:`meets_slos`. Goodput
            keys appear only when SLOs are given.

    Returns a flat dict: ``ttft_ms_*``, ``itl_ms_*`` (all gaps of the successful requests
    pooled), ``tpot_ms_*``, ``e2e_ms_*`` (successful requests only; stats in
    :data:`STAT_NAMES`); ``num_requests``, ``num_succeeded``, ``num_errors``, ``error_rate``
    (errors / requests), ``errors_<class>`` for each error class present;
    ``error_after_ms_p50`` / ``_max`` (the failed requests' send -> error: how long their users
    waited; None without one); ``num_refusals`` (answers that were refusals: text, not errors);
    ``output_tokens_total`` (successful requests; None when a successful request has no
    count), ``output_tokens_per_s``, ``input_tokens_total`` (prompt tokens of the successful
    requests; None when one has no count), ``total_tokens_per_s`` ((input + output tokens) /
    wall_s), ``requests_per_s`` (successful / wall_s), ``num_decode_unobserved`` (successful
    requests whose decode the client could not see: no TPOT, not judged on TPOT / ITL SLOs),
    ``num_usage_untrusted`` (requests whose server usage count was not used); with SLOs,
    ``goodput_requests_per_s`` (good / wall_s) and ``goodput_fraction`` (good / requests).
    """
    if goodput_slos:
        _check_slos(goodput_slos)
    measured = [r for r in records if not _field(r, "warmup")]
    ok = [r for r in measured if _succeeded(r)]
    failed = [r for r in measured if not _succeeded(r)]

    out: dict[str, float | int | None] = {}
    out.update(flatten_stats("ttft_ms", (_field(r, "ttft_ms") for r in ok)))
    seen = [r for r in ok if _field(r, "decode_unobserved") is None]  # gaps of a decode seen
    out.update(flatten_stats("itl_ms", (gap for r in seen for gap in (_field(r, "itl_ms") or []))))
    out.update(flatten_stats("tpot_ms", (_field(r, "tpot_ms") for r in ok)))
    out.update(flatten_stats("e2e_ms", (_field(r, "e2e_ms") for r in ok)))

    num_requests = len(measured)
    out["num_requests"] = num_requests
    out["num_succeeded"] = len(ok)
    out["num_errors"] = len(failed)
    out["error_rate"] = len(failed) / num_requests if num_requests else None
    for error_class, count in sorted(Counter(_error_class(r) for r in failed).items()):
        out[f"errors_{error_class}"] = count
    waits = sorted(w for r in failed if (w := _field(r, "error_after_ms")) is not None)
    out["error_after_ms_p50"] = percentile(waits, 50)
    out["error_after_ms_max"] = waits[-1] if waits else None
    out["num_refusals"] = sum(1 for r in measured if _field(r, "refusal"))

    counts = [_field(r, "output_tokens") for r in ok]
    total = None if any(c is None for c in counts) else int(sum(counts))
    out["output_tokens_total"] = total
    out["output_tokens_per_s"] = _per_second(total, wall_s)
    inputs = [_field(r, "input_tokens") for r in ok]
    input_total = None if not ok or any(c is None for c in inputs) else int(sum(inputs))
    out["input_tokens_total"] = input_total
    both = None if input_total is None or total is None else input_total + total
    out["total_tokens_per_s"] = _per_second(both, wall_s)
    out["requests_per_s"] = _per_second(len(ok), wall_s)
    out["num_decode_unobserved"] = len(ok) - len(seen)
    out["num_usage_untrusted"] = sum(1 for r in measured if _field(r, "usage_problem") is not None)

    if goodput_slos:
        good = sum(1 for r in ok if meets_slos(r, goodput_slos))
        out["goodput_requests_per_s"] = _per_second(good, wall_s)
        out["goodput_fraction"] = good / num_requests if num_requests else None
    out.update(by_turn(measured))
    return out


def by_turn(records: Iterable[Any]) -> dict[str, float | int | None]:
    """Conversation figures by turn index (records with a ``turn``; none: an empty dict):
    ``num_sessions`` and, for each turn ``k``, ``num_requests_turn{k}`` (turns sent),
    ``ttft_ms_p50_turn{k}`` and ``e2e_ms_p50_turn{k}`` (successful turns),
    ``input_tokens_mean_turn{k}`` (prompt tokens: the history grows with the turn) and
    ``cached_tokens_mean_turn{k}`` (the server's ``cached_tokens``; None when it sent none), so
    that turn 5 can be compared with turn 1 (guidellm's and AIPerf's per-turn views)."""
    turns = [r for r in records if _field(r, "turn") is not None]
    if not turns:
        return {}
    out: dict[str, float | int | None] = {"num_sessions": len({_field(r, "session_id") for r in turns})}
    for k in sorted({_field(r, "turn") for r in turns}):
        sent = [r for r in turns if _field(r, "turn") == k]
        ok = [r for r in sent if _succeeded(r)]
        out[f"num_requests_turn{k}"] = len(sent)
        out[f"ttft_ms_p50_turn{k}"] = summarize(_field(r, "ttft_ms") for r in ok)["p50"]
        out[f"e2e_ms_p50_turn{k}"] = summarize(_field(r, "e2e_ms") for r in ok)["p50"]
        for name in ("input_tokens", "cached_tokens"):
            values = [_field(r, name) for r in ok if _field(r, name) is not None]
            out[f"{name}_mean_turn{k}"] = sum(values) / len(values) if values else None
    return out


def count_short_outputs(records: Iterable[Any], max_tokens: int) -> int:
    """Successful requests that returned fewer than ``max_tokens`` output tokens (with
    ``ignore_eos`` sent, a server that honours it never does).

    A count re-tokenized from the text (``output_tokens_source`` "tokenizer": the server sent no
    usage) can fall one short of what the server generated where tokens merge across chunk
    boundaries, so such a request is short only when it also carried fewer text chunks
    (``token_offsets_ms``) than ``max_tokens``. A server's own usage count is taken as it is.
    """
    return sum(
        1
        for r in records
        if _succeeded(r)
        and _field(r, "output_tokens") is not None
        and _field(r, "output_tokens") < max_tokens
        and (
            _field(r, "output_tokens_source") == "usage"
            or len(_field(r, "token_offsets_ms") or ()) < max_tokens
        )
    )
