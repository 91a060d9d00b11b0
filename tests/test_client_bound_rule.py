"""The kernel clock's client-bound rule (issue 50): a level is flagged when its coalesced reads
may have cost ITL gaps more than the tolerance, judged from what the client saw of its own
loop (tasks.wire.rxclock.late_coalesced_gaps), not from a count of coalesced chunks.

Synthetic records on a known timeline (ms after a send at 1 s): what the instrument's
truth would be is written beside each case. The benchmark against the real instrument is
tests/benchmarks/client_bound_flags.py."""

from __future__ import annotations

from tasks.scaleout.multiproc import merge_lags
from tasks.stream.lag import LagFigures
from tasks.stream.quality import client_figures
from tasks.stream.records import RequestRecord
from tasks.wire import rxclock

SEND_NS = 1_000_000_000


def record(name: str, reads: list[tuple[float, float, int]]) -> RequestRecord:
    """A kernel-clock record from its reads: (kernel stamp ms, read ms, text chunks in it)."""
    kernel = [k for k, _, n in reads for _ in range(n)]
    user = [u for _, u, n in reads for _ in range(n)]
    late = sum(n - 1 for k, u, n in reads if u - k > rxclock.LATE_READ_NS / 1e6)
    return RequestRecord(
        request_id=name,
        send_ns=SEND_NS,
        token_offsets_ms=kernel,
        user_token_offsets_ms=user,
        arrival_clock="kernel",
        coalesced_events=late,
    )


def at(ms: float) -> int:
    return SEND_NS + round(ms * 1e6)


def probe(samples: list[tuple[float, float]]) -> LagFigures:
    """The loop-lag probe's figures with its samples (written ms, read ms) as its timeline."""
    figures = LagFigures(client_loop_lag_ms_p99=0.1, client_bound=0)
    figures.timeline = ([at(w) for w, _ in samples], [at(r) for _, r in samples])
    return figures


# Stream A: chunks 10 ms apart; at 30 ms two chunks in one read 3 ms late (its loop was behind).
LATE_PAIR = record("a", [(10.0, 10.1, 1), (20.0, 20.1, 1), (30.0, 33.0, 2), (40.0, 40.1, 1)])


def others(last_single_ms: float) -> list[RequestRecord]:
    """Streams read one chunk a read, the last of them arriving at ``last_single_ms`` and
    read 0.2 ms before stream A's late read (33 ms): what the loop served before it."""
    reads = [(t, t + 0.1, 1) for t in (10.0, 15.0, 20.0)] + [(last_single_ms, 32.8, 1)]
    return [record(f"b{i}", reads) for i in range(3)]


def test_chunks_written_together_and_read_late_are_not_doubtful() -> None:
    """The instrument stalled and wrote A's two chunks at 29.99 and 30.0 ms (truth: 0.01 ms
    apart); the client read them 3 ms late. Other connections' chunks that arrived at 29.9 ms
    were read before A's: A's first chunk came after them, so its error is under 0.1 ms."""
    records = [LATE_PAIR, *others(29.9)]
    assert rxclock.late_coalesced_gaps(records, ([], []), 1.0) == 0
    figures = client_figures(records, probe([]), lag_tolerance_ms=1.0, coalesced_tolerance=0.01)
    # the old rule's count says 1 chunk of 13 gaps came coalesced (7.7 %): it flagged this level
    assert figures["coalesced_events"] == 1 and figures["coalesced_event_fraction"] == 1 / 13
    assert figures["client_bound"] == 0


def test_chunks_that_arrived_apart_are_doubtful_and_flag_the_level() -> None:
    """The loop stalled from 25.1 to 33 ms (nothing read, no probe sample): A's chunks, due at
    25 and 30 ms (truth: 5 ms apart), came in one read stamped 30 ms, a gap wrong by 5 ms and
    the gap into it too. Nothing the client saw bounds the first chunk's arrival after 25.1 ms:
    both gaps are doubtful."""
    records = [LATE_PAIR, *others(25.0)]
    for record_ in records[1:]:  # the last single read was at 25.1 ms, before the stall
        record_.user_token_offsets_ms[-1] = 25.1
    assert rxclock.late_coalesced_gaps(records, ([], []), 1.0) == 2
    assert rxclock.late_coalesced_gaps(records, ([], []), 6.0) == 0  # a 6 ms tolerance: within it
    figures = client_figures(records, probe([]), lag_tolerance_ms=1.0, coalesced_tolerance=0.01)
    assert figures["client_bound"] == 1
    # the same level with a tolerated share over its 2 of 13 doubtful gaps is not flagged
    assert (
        client_figures(records, probe([]), lag_tolerance_ms=1.0, coalesced_tolerance=0.2)["client_bound"] == 0
    )


def test_the_loop_lag_probe_bounds_a_read_where_no_connection_did() -> None:
    """An idle loop reads the probe at once: a sample written at 29.5 ms, whose loop turn
    ended before the probe's next read (30.01 ms, before A's read at 33 ms), says A's chunks
    arrived after 29.5 ms (error under 0.5 ms). A sample whose next read comes after A's read
    may share A's loop turn (the reactor's turn can follow the probe's), and one written after
    A's last chunk arrived says nothing."""
    records = [LATE_PAIR, *others(25.0)]
    for record_ in records[1:]:
        record_.user_token_offsets_ms[-1] = 25.1
    idle = probe([(29.0, 29.01), (29.5, 29.51), (30.0, 30.01)])
    assert rxclock.late_coalesced_gaps(records, idle.timeline, 1.0) == 0
    assert client_figures(records, idle, lag_tolerance_ms=1.0, coalesced_tolerance=0.01)["client_bound"] == 0
    same_turn = probe([(29.5, 29.51), (31.0, 33.5)])
    written_after = probe([(31.0, 31.01), (31.5, 31.51)])
    for figures in (same_turn, written_after):
        assert rxclock.late_coalesced_gaps(records, figures.timeline, 1.0) == 2


def test_without_the_loops_evidence_only_the_connections_own_reads_bound_it() -> None:
    """Records of several loops (``timeline=None``): another loop's reads say nothing of this
    one's, so only A's previous read (20.1 ms) bounds its pair: 9.9 ms, doubtful (cautious)."""
    records = [LATE_PAIR, *others(29.9)]
    assert rxclock.late_coalesced_gaps(records, None, 1.0) == 2
    # a response's first read: no gap into it, so a doubtful pair costs its one gap
    first = record("c", [(10.0, 15.0, 2), (20.0, 20.1, 1)])
    assert rxclock.late_coalesced_gaps([first], None, 1.0) == 1


def test_merged_lags_carry_each_loops_evidence() -> None:
    """Client processes' counts are summed; one process's repeats (one after another) keep
    their probes' samples; loops that overlapped in time keep none."""
    one = LagFigures(client_loop_lag_ms_p99=0.5, client_bound=0, coalesced_late_gaps=3)
    two = LagFigures(client_loop_lag_ms_p99=2.0, client_bound=1, coalesced_late_gaps=4)
    merged = merge_lags([one, two])
    assert merged["coalesced_late_gaps"] == 7 and merged["client_bound"] == 1
    assert merged["client_loop_lag_ms_p99"] == 2.0
    first, second, beside = probe([(1.0, 1.1), (3.0, 3.1)]), probe([(5.0, 5.2)]), probe([(2.0, 2.5)])
    joined = merge_lags([second, first])
    assert "coalesced_late_gaps" not in joined
    assert joined.timeline == ([at(1.0), at(3.0), at(5.0)], [at(1.1), at(3.1), at(5.2)])
    assert merge_lags([first, beside]).timeline is None
    # figures that came as JSON (a Dask worker's): no samples, no count: no loop's evidence
    records = [LATE_PAIR, *others(29.9)]
    as_json = dict(probe([(29.5, 29.51), (30.0, 30.01)]))
    kw = {"lag_tolerance_ms": 1.0, "coalesced_tolerance": 0.01}
    assert client_figures(records, as_json, **kw)["client_bound"] == 1
    assert client_figures(records, merge_lags([as_json]), **kw)["client_bound"] == 1
