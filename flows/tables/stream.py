"""The stream command's tables under its level table (``flows.commands.stream.print_levels``):
the prefix cache's figures and a conversation's by-turn view, each printed on the console
given (the command's)."""

from __future__ import annotations

from rich.console import Console

from flows.tables.common import fmt_value, make_table

#: The prefix-cache figures of a level (``tasks.endpoint.cache``), as :func:`print_cache` shows them.
CACHE_COLUMNS = (
    ("prefix_cache_hit_rate", "hit rate\n(server)"),
    ("cached_token_fraction", "cached\n(usage)"),
    ("expected_cached_token_fraction", "expected"),
)


def print_cache(levels: list[dict], console: Console) -> None:
    """Under the level table (80 columns hold no more there), where a level measured one of
    them or its workload was built to share (an expected share above 0):
    the prefix cache's share of the prompt tokens by the server's counters
    (``prefix_cache_hit_rate``), by the requests' usage (``cached_token_fraction``) and by the
    workload's construction (``expected_cached_token_fraction``), in %, and the block size the
    expected share was counted in (``cache_block_size_tokens``; ``per-token`` when unknown)."""
    rows = [lv for lv in levels if any(lv["metrics"].get(key) is not None for key, _ in CACHE_COLUMNS)]
    if not any(_says_something(lv["metrics"]) for lv in rows):
        return
    from tasks.report.plots import level_rate_label

    table = make_table(
        "prefix cache (% of prompt tokens: hit rate = the server's counters, cached = the "
        "requests' usage, expected = the workload's construction, in whole blocks)",
        [(title, "right") for title in ("conc", "rate", *(t for _, t in CACHE_COLUMNS), "block\ntokens")],
        compact=True,
        no_wrap=True,
    )
    for lv in rows:
        m = lv["metrics"]
        block = m.get("cache_block_size_tokens")
        table.add_row(
            str(lv["max_concurrency"]),
            level_rate_label(lv["request_rate"], lv["metrics"]),
            *("n/a" if m.get(key) is None else f"{100 * m[key]:.1f} %" for key, _ in CACHE_COLUMNS),
            "per-token"
            if block is None and m.get("expected_cached_token_fraction") is not None
            else fmt_value(block),
        )
    console.print(table)


def _says_something(metrics: dict) -> bool:
    """A measured share, or a workload built to share (an expected share of 0 alone, a plain
    random workload's, is not worth a table)."""
    measured = ("prefix_cache_hit_rate", "cached_token_fraction")
    return any(metrics.get(name) is not None for name in measured) or bool(
        metrics.get("expected_cached_token_fraction")
    )


def print_turns(levels: list[dict], console: Console) -> None:
    """For conversation levels (``num_sessions`` in their metrics): one row per level and turn
    index (``tasks.stats.by_turn``): turns sent, TTFT / E2E p50 (ms), mean prompt tokens (the
    client's count of the history it sent, else the server's usage) and cached tokens (the
    server's usage, else llama.cpp's ``timings.cache_n``), so that a later turn reads against
    the first."""
    rows = [(lv, k) for lv in levels for k in range(1, 1 + _turn_count(lv["metrics"]))]
    if not rows:
        return
    table = make_table(
        "by turn (ms; prompt tokens grow with the history; cached = the server's cached tokens)",
        [(t, "right") for t in ("conc", "turn", "sent", "TTFT p50", "E2E p50", "prompt tok", "cached tok")],
        compact=True,
    )
    for lv, k in rows:
        m = lv["metrics"]
        table.add_row(
            str(lv["max_concurrency"]),
            str(k),
            *(
                fmt_value(m.get(f"{name}_turn{k}"))
                for name in (
                    "num_requests",
                    "ttft_ms_p50",
                    "e2e_ms_p50",
                    "input_tokens_mean",
                    "cached_tokens_mean",
                )
            ),
        )
    console.print(table)


def _turn_count(metrics: dict) -> int:
    k = 0
    while f"num_requests_turn{k + 1}" in metrics:
        k += 1
    return k


def _compressed(level: dict) -> list[str]:
    """``gzip bodies 2 of 2, 2 read in one piece (timings are the compressing hop's)``: the
    measured answers that came in a content coding (a compressing proxy or router: it may hold
    events until it flushes), and how many of them came whole in one read."""
    measured = [r for r in level.get("requests") or () if not r.get("warmup")]
    coded = [r for r in measured if r.get("content_encoding")]
    if not coded:
        return []
    names = ", ".join(sorted({r["content_encoding"] for r in coded}))
    whole = sum(1 for r in coded if r.get("decode_unobserved") == "one_read")
    held = f", {whole} read in one piece (timings are the compressing hop's)" if whole else ""
    return [f"{names} bodies {len(coded)} of {len(measured)}{held}"]


def print_outcomes(levels: list[dict], console: Console) -> None:
    """Under the level table, one line per level whose measured requests failed, refused or came
    compressed: each error class with its count and how long its users waited for it (p50 and
    max of the records' ``error_after_ms``, in s: ``server 3 (waited p50 1.50 s, max 1.52 s)``;
    a slow failure is not a fast one), the refusals (``num_refusals``: answers, timed as text),
    and the answers in a content coding (:func:`_compressed`)."""
    from tasks.report.plots import level_rate_label
    from tasks.stream.quality import waited

    for lv in levels:
        m = lv["metrics"]
        failed = [r for r in lv.get("requests") or () if not r.get("warmup") and r.get("error")]
        said = []
        for name in sorted({r["error"]["class"] for r in failed}):
            each = [r.get("error_after_ms") for r in failed if r["error"]["class"] == name]
            said.append(f"{name} {len(each)}{waited(each)}")
        if m.get("num_refusals"):
            said.append(f"refusals {m['num_refusals']} of {m.get('num_requests')} (answers, timed as text)")
        said += _compressed(lv)
        if said:
            where = f"conc {lv['max_concurrency']} rate {level_rate_label(lv['request_rate'], m)}"
            console.print(f"{where}: " + "; ".join(said), highlight=False)
