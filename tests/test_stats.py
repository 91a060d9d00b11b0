"""tasks.stats: percentiles against hand-computed and numpy values, level aggregates by hand."""

from __future__ import annotations

import math
import random

import pytest

from tasks.stats import (
    STAT_NAMES,
    aggregate_level,
    count_short_outputs,
    flatten_stats,
    meets_slos,
    percentile,
    summarize,
)
from tasks.stream.records import RequestRecord


def test_summarize_hand_computed() -> None:
    # numpy 'linear': h = (n-1) q/100; [1,2,3,4]: p50 h=1.5 -> 2.5, p90 h=2.7 -> 3.7
    stats = summarize([4, 1, 3, 2])
    assert stats == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p95": 3.85, "p99": 3.97, "max": 4.0})
    assert list(stats) == list(STAT_NAMES)


def test_summarize_edge_cases() -> None:
    assert summarize([]) == {name: None for name in STAT_NAMES}
    assert summarize([None, None]) == {name: None for name in STAT_NAMES}
    one = summarize([7.5])
    assert all(value == 7.5 for value in one.values())
    assert summarize([1.0, None, 3.0])["mean"] == 2.0
    assert percentile([10.0, 20.0], 0) == 10.0 and percentile([10.0, 20.0], 100) == 20.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    for n in (2, 3, 10, 101, 1000):
        values = [rng.expovariate(1 / 50) for _ in range(n)]
        stats = summarize(values)
        for name, q in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99)):
            assert stats[name] == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
        assert stats["mean"] == pytest.approx(float(np.mean(values)), rel=1e-12)
        assert stats["max"] == max(values)


def test_percentile_is_numpys_linear_bit_for_bit() -> None:
    """percentile == float(numpy.percentile(x, q)) exactly (no tolerance), on 1,000 random sorted
    lists of 1 to 300 values (skewed, signed, with ties) at the report's and random q."""
    np = pytest.importorskip("numpy")
    rng = random.Random(51)
    for trial in range(1000):
        draw = (
            lambda: rng.lognormvariate(3, 1),
            lambda: rng.uniform(-1e6, 1e6),
            lambda: float(rng.randint(0, 5)),
        )
        data = sorted(draw[trial % 3]() for _ in range(rng.randint(1, 300)))
        for q in (0, 50, 90, 95, 99, 99.9, 100, rng.uniform(0, 100)):
            assert percentile(data, q) == float(np.percentile(data, q)), (data, q)


def test_flatten_stats_names() -> None:
    flat = flatten_stats("ttft_ms", [1.0, 2.0])
    assert set(flat) == {f"ttft_ms_{s}" for s in STAT_NAMES}
    assert flat["ttft_ms_p50"] == 1.5


def _ok(rid: str, ttft: float, e2e: float, tokens: int, itl: list[float], **kw) -> RequestRecord:
    tpot = (e2e - ttft) / (tokens - 1) if tokens >= 2 else None
    return RequestRecord(
        request_id=rid,
        ttft_ms=ttft,
        e2e_ms=e2e,
        output_tokens=tokens,
        tpot_ms=tpot,
        itl_ms=itl,
        output_tokens_source="usage",
        **kw,
    )


def _level_records() -> list[RequestRecord]:
    return [
        _ok("r1", 100, 200, 3, [40, 60]),  # tpot 50
        _ok("r2", 300, 500, 5, [100, 100]),  # tpot 50
        _ok("r3", 200, 260, 4, [30, 30]),  # tpot 20
        # a timed-out request that had produced a token: excluded from latency stats
        RequestRecord("r4", ttft_ms=50, e2e_ms=50, output_tokens=1, error_class="timeout", error_message="t"),
        RequestRecord("r5", error_class="auth", error_message="401"),
        _ok("w1", 1000, 2000, 10, [500, 500], warmup=True),  # warm-up: excluded entirely
        _ok("r7", 80, 80, 1, []),  # one token: tpot None
    ]


def test_aggregate_level_hand_computed() -> None:
    agg = aggregate_level(_level_records(), wall_s=2.0)
    # ttft over successes [80, 100, 200, 300]
    assert agg["ttft_ms_mean"] == pytest.approx(170.0)
    assert agg["ttft_ms_p50"] == pytest.approx(150.0)
    assert agg["ttft_ms_p90"] == pytest.approx(270.0)
    assert agg["ttft_ms_p95"] == pytest.approx(285.0)
    assert agg["ttft_ms_p99"] == pytest.approx(297.0)
    assert agg["ttft_ms_max"] == 300.0
    # ITL pooled over successes [30, 30, 40, 60, 100, 100]
    assert agg["itl_ms_mean"] == pytest.approx(60.0)
    assert agg["itl_ms_p50"] == pytest.approx(50.0)
    assert agg["itl_ms_p90"] == pytest.approx(100.0)
    # TPOT [20, 50, 50] (r7 has none)
    assert agg["tpot_ms_mean"] == pytest.approx(40.0)
    assert agg["tpot_ms_p50"] == pytest.approx(50.0)
    # E2E [80, 200, 260, 500]
    assert agg["e2e_ms_mean"] == pytest.approx(260.0)
    assert agg["e2e_ms_p50"] == pytest.approx(230.0)
    assert agg["e2e_ms_max"] == 500.0
    assert agg["num_requests"] == 6
    assert agg["num_succeeded"] == 4
    assert agg["num_errors"] == 2
    assert agg["error_rate"] == pytest.approx(2 / 6)
    assert agg["errors_timeout"] == 1 and agg["errors_auth"] == 1
    assert not any(k.startswith("errors_") and k not in ("errors_timeout", "errors_auth") for k in agg)
    assert agg["output_tokens_total"] == 3 + 5 + 4 + 1
    assert agg["output_tokens_per_s"] == pytest.approx(13 / 2.0)
    assert agg["requests_per_s"] == pytest.approx(4 / 2.0)
    assert "goodput_requests_per_s" not in agg and "goodput_fraction" not in agg


def test_goodput() -> None:
    records = _level_records()
    agg = aggregate_level(records, wall_s=2.0, goodput_slos={"ttft_ms": 250, "tpot_ms": 50})
    # r1 (100, 50) and r3 (200, 20) pass; r2 ttft 300 fails; r7 has no TPOT -> fails
    assert agg["goodput_requests_per_s"] == pytest.approx(2 / 2.0)
    assert agg["goodput_fraction"] == pytest.approx(2 / 6)
    assert aggregate_level(records, 2.0, {"e2e_ms": 250})["goodput_fraction"] == pytest.approx(2 / 6)
    # itl SLO: every gap <= limit; r1 (max 60) and r3 pass, r2 (100) fails, r7 (no gap) fails
    by_id = {r.request_id: r for r in records}
    assert [meets_slos(by_id[i], {"itl_ms": 60}) for i in ("r1", "r2", "r3", "r7")] == [
        True,
        False,
        True,
        False,
    ]
    # a failed request never meets an SLO, even with good numbers
    assert not meets_slos(by_id["r4"], {"ttft_ms": 1000})
    with pytest.raises(ValueError, match="unknown SLO"):
        aggregate_level(records, 2.0, {"latency": 1})


def test_aggregate_empty_and_degenerate() -> None:
    agg = aggregate_level([], wall_s=0.0, goodput_slos={"ttft_ms": 1})
    assert agg["num_requests"] == 0 and agg["error_rate"] is None
    assert agg["ttft_ms_p99"] is None and agg["requests_per_s"] is None
    assert agg["goodput_fraction"] is None
    # a success without an output-token count makes the total unknown, not smaller
    records = [_ok("a", 10, 20, 2, [10]), RequestRecord("b", ttft_ms=5, e2e_ms=5)]
    agg = aggregate_level(records, wall_s=1.0)
    assert agg["output_tokens_total"] is None and agg["output_tokens_per_s"] is None
    assert agg["requests_per_s"] == 2.0
    # all failed
    agg = aggregate_level([RequestRecord("x", error_class="connection")], wall_s=1.0)
    assert agg["error_rate"] == 1.0 and agg["errors_connection"] == 1
    assert agg["output_tokens_total"] == 0 and agg["ttft_ms_mean"] is None


def test_aggregate_accepts_json_dicts() -> None:
    records = [r.to_json() for r in _level_records()]
    agg = aggregate_level(records, wall_s=2.0)
    assert agg["num_succeeded"] == 4 and agg["errors_auth"] == 1
    assert agg["ttft_ms_p50"] == pytest.approx(150.0)
    assert math.isclose(agg["error_rate"], 2 / 6)


def test_short_outputs_trust_usage_but_not_a_re_tokenized_count_alone() -> None:
    def rec(tokens, source, chunks, error=None):
        return RequestRecord(
            "r",
            ttft_ms=5.0,
            output_tokens=tokens,
            output_tokens_source=source,
            token_offsets_ms=[float(i) for i in range(chunks)],
            error_class=error,
        )

    records = [
        rec(24, "usage", 24),  # full
        rec(23, "usage", 24),  # the server says 23: short
        rec(23, "tokenizer", 24),  # 24 chunks re-tokenized to 23 (merge): not short
        rec(7, "tokenizer", 7),  # stopped early: short
        rec(3, "tokenizer", 3, "server"),  # failed: not counted
    ]
    assert count_short_outputs(records, 24) == 2
    assert count_short_outputs(records, 7) == 0


def test_tpot_slo_skips_a_request_whose_tokens_came_in_one_chunk():
    # 300 output tokens in one text chunk: TPOT is null (the client cannot see the decode), so a
    # TPOT SLO neither passes nor fails it and the TTFT SLO decides (DESIGN.md, tpot_ms).
    one_chunk = RequestRecord(
        "one",
        ttft_ms=120.0,
        e2e_ms=120.0,
        output_tokens=300,
        tpot_ms=None,
        itl_ms=[],
        token_offsets_ms=[120.0],
        output_tokens_source="usage",
    )
    assert meets_slos(one_chunk, {"ttft_ms": 500, "tpot_ms": 50})
    assert not meets_slos(one_chunk, {"ttft_ms": 100, "tpot_ms": 50})
    assert meets_slos(one_chunk, {"itl_ms": 50})  # no decode seen: nor an ITL SLO (issue 23)
    # one output token: no decode to see either: judged on the other SLOs (issue 23; it failed
    # every TPOT SLO before, so a one-token server had goodput 0)
    one_token = RequestRecord(
        "tok",
        ttft_ms=120.0,
        e2e_ms=120.0,
        output_tokens=1,
        tpot_ms=None,
        token_offsets_ms=[120.0],
        output_tokens_source="usage",
    )
    assert meets_slos(one_token, {"tpot_ms": 50}) and not meets_slos(one_token, {"ttft_ms": 100})
    agg = aggregate_level([one_chunk, one_token], wall_s=2.0, goodput_slos={"ttft_ms": 500, "tpot_ms": 50})
    assert agg["goodput_fraction"] == 1.0 and agg["goodput_requests_per_s"] == 1.0
    assert agg["num_decode_unobserved"] == 2
