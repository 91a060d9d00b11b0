"""Benchmark: how often does the regression verdict cry wolf, and how often does it miss?

Drives the ground-truth instrument (tests/groundtruth_server.py) with a controlled, seeded jitter
(``noisy`` scenario: each request's TTFT and every ITL gap are their medians times a log-normal
factor ``exp(sigma * z)``) and a known injected change (TTFT and ITL both scaled), through the
command a user runs, ``infermeter stream`` (Prefect flow, client process, everything), at the
default audit's request count (50 requests a level, ``configs/default.yaml``). Each of the
command's levels is one independent "audit" (a fresh client process and warm-up; the
instrument's draws continue from one level to the next, so no two levels share a value).

Then, per trial, the audit's own verdict function (``tasks.report.regression.verdict``, on the
stream headline's default thresholds) judges a current level against a baseline of 1 level and
of 5, by two rules:

- ``legacy``: today's rule before issue 21 (the median of the baseline runs, their min..max as
  noise, the signed thresholds);
- ``test``: the samples' rule (two-level bootstrap intervals, four classes, Holm).

It prints per case and rule how often a trial was judged *regressed* (any metric) and
*improved* (any metric):

- no change: false alarms (regressed) and false improvements;
- +2x threshold (TTFT and ITL +30 %): detection; +0.5x (+7.5 %): judged regressed (should not);
- -2x / -0.5x: the same for improvements (TTFT and ITL x0.7 / x0.925).

Goals (issue 21): false alarms <= 5 % per audit across all metrics; detection >= 90 %;
half-threshold changes judged regressed <= 10 %.

    .venv/bin/python tests/benchmarks/verdict_error_rates.py [--trials 20] [--sigma 0.1]
        [--requests 50] [--concurrency 1] [--save F] [--load F] [--cases 5,6] [--explain]

``--histories`` (issue 28): the audit HISTORY's rule instead, as ``tasks.report.baseline.judge``
applies it (the history's change points choose the baseline, a regressed audit stays out of it
until confirmed, a short baseline borrows the history's run-to-run spread, the tail test joins
Holm). The instrument also moves whole runs (``--run-sd``: a factor exp(run_sd z) per level:
machine load) and plants a tail (15 % of requests x4 TTFT). Pools of levels per case are
measured once (``--save`` / ``--load``), then per trial a history is drawn from them:

- no change, against a baseline of 3 and of 5 audits: false alarms (any metric regressed);
- +2x threshold (x1.3 on TTFT and gaps): detection per metric (TTFT p50, ITL p90, TPOT mean);
- the 15 % x4 TTFT tail: detection (any metric regressed, and which);
- x0.7 right after a x1.3 audit (judged regressed, left out): judged improved;
- a baseline of ONE audit, no history, under machine load: never regressed;
- histories of 20 audits with a x1.3 step at a random audit (5..15): the change point of TTFT
  p50 found within one audit of it;
- an incident before the baseline: 7 audits at x0.7, then the step to today's level 3 (or 5)
  audits ago: the baseline chosen (the audits since the step?), a x1.3 audit's detection per
  metric and a no-change audit's false alarms (the history knows the run-to-run spread on
  6 + 2 (or 4) degrees of freedom, the baseline alone on 2 (or 4)).

    .venv/bin/python tests/benchmarks/verdict_error_rates.py --histories --sigma 0.25 \
        --run-sd 0.05 --trials 20 [--save F | --load F] [--only x1.3,incident] [--seed 7]

Since issue 49 the spread is learned from the whole history with a prior (``--prior-pct``,
``--prior-runs``: the audit's defaults 5 and 3), and the "learning" rows judge histories of 3, 5
and 10 audits at one level with the prior right, 3x too small and 3x too large against the true
spread: false alarms (no change) and TTFT p50 detection (x1.3). ``--move-runs SD`` moves each
judged copy of a level as a whole by exp(SD z) (TTFT, gaps, TPOT, E2E times the factor, output
tokens/s over it: what the instrument's ``--run-sd`` does at the source), a fresh factor for
each use, so that pools measured once at ``--run-sd 0`` serve every spread and a level reused
by several trials is another run each time:

    .venv/bin/python tests/benchmarks/verdict_error_rates.py --histories --sigma 0.25 --run-sd 0 \
        --trials 30 --save h25.json
    .venv/bin/python tests/benchmarks/verdict_error_rates.py --histories --load h25.json \
        --trials 100 --seed 9 --move-runs 0.05 --only nochange,x1.3,tail,incident,learning

A level the machine disturbed is measured again (``--keep-disturbed`` keeps it): one in which the
instrument wrote 1 % of its chunks or more over 0.5 ms after their deadlines (its own loop
held up: ``GET /stats`` ``late_chunk_ns``), or one flagged client-bound. The pools then hold the instrument's jitter and
nothing else, the issue's condition; the measuring lines say how many were measured again (on the
shared 2-core machine, stretches of 30-60 s every few minutes put ITL p99 at 8-20 ms against 5).

Each pool holds --trials x its levels per trial (normal 3, slow 2, fast 1, tail 1) as measured;
a --load with more --trials than its pools were measured for reuses their levels (each pool
in its order first, then in fresh random orders: every level equally often), so the rates'
precision is then bounded by the pools' size, not the trials'. Each row prints its 95 % Wilson
interval. ``--only`` judges some groups of rows (nochange, x1.3, tail, after, one, incident,
changepoint); ``--seed`` draws other histories from the same pools (to split trials across
processes; a seed other than 7 also shuffles each pool's first pass).

Concurrency 1, as the audit's first level (the one its headline reads): at 10 the level's
throughput moves with the waves' tails more than its requests' E2E say. ``--save F`` keeps the
measured levels, ``--load F`` judges them again, measuring only the cases F lacks. About 25 minutes (200 levels).
Not collected by pytest (no test_ prefix); prints, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import groundtruth_server as gt  # noqa: E402

from tasks.metrics import DEFAULT_THRESHOLDS_PCT, lookup  # noqa: E402
from tasks.report.regression import verdict  # noqa: E402
from tasks.stats.samples import from_rows, rows, stream_units  # noqa: E402

INFERMETER = ROOT / ".venv" / "bin" / "infermeter"
#: The default thresholds of the stream stage's metrics (the profile's have no stream samples).
THRESHOLDS = {m: t for m, t in DEFAULT_THRESHOLDS_PCT.items() if lookup(m).stage == "stream"}
#: (case name, the factor on TTFT and ITL); thresholds are 15 % on latencies.
CASES = (
    ("no change", 1.0),
    ("+2x threshold (+30 %)", 1.30),
    ("+0.5x threshold (+7.5 %)", 1.075),
    ("-2x threshold (x0.7)", 0.70),
    ("-0.5x threshold (x0.925)", 0.925),
    # At concurrency 1 a level's output tokens/s moves as 1 / the factor, against its own
    # threshold of 10 %: x1.075 / x0.925 change it by -7 % / +8 %, 0.7x / 0.8x of that threshold,
    # not half. These two are half of every judged metric's threshold: tokens/s -5 % / +5 %
    # (latencies +5.3 % / -4.8 %, a third of theirs).
    ("+0.5x every threshold (x1.0526)", 1 / 0.95),
    ("-0.5x every threshold (x0.952)", 1 / 1.05),
)


def stream_levels(server, args, model: str, count: int) -> list[dict]:
    """``count`` levels of ``infermeter stream`` against the instrument's ``model``: its --json
    levels."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts, out = Path(tmp) / "prompts.txt", Path(tmp) / "out.json"
        prompts.write_text("".join(f"p{i}\n" for i in range(args.requests)), encoding="utf-8")
        command = [
            str(INFERMETER), "stream", "--base-url", server.base_url, "--model", model,
            "--prompts", str(prompts), "--max-tokens", str(args.tokens),
            "--max-concurrency", ",".join([str(args.concurrency)] * count),
            "--num-requests", str(args.requests), "--warmup", "1", "--no-track", "--json", str(out),
        ]  # fmt: skip
        subprocess.run(
            command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "INFERMETER_WORK_DIR": tmp},
        )  # fmt: skip
        return json.loads(out.read_text(encoding="utf-8"))["levels"]


def levels(server, args, factor: float, count: int, seed: int) -> list[tuple[dict, dict]]:
    """``count`` levels of ``infermeter stream`` at this factor: (figures, samples) each."""
    model = f"noisy:{args.tokens}:{args.gap_ms * factor:g}:{args.ttft_ms * factor:g}:{args.sigma:g}:{seed}"
    return [
        ({m: level["metrics"].get(m) for m in THRESHOLDS}, {"stream": stream_units(level["requests"])})
        for level in stream_levels(server, args, model, count)
    ]


def _saved(run: tuple[dict, dict]) -> dict:
    return {"figures": run[0], "samples": rows(run[1])}


def _run(saved: dict) -> tuple[dict, dict]:
    return saved["figures"], from_rows(saved["samples"])


def judged(current, baseline, rule: str, explain: bool = False) -> tuple[bool, bool]:
    """(any metric regressed, any improved) of one trial; ``explain``: print a regressed trial's rows."""
    figures, samples = current
    if rule == "legacy":
        verdicts = verdict(figures, [b[0] for b in baseline], THRESHOLDS)
    else:
        verdicts = verdict(figures, [b[0] for b in baseline], THRESHOLDS, samples, [b[1] for b in baseline])
    regressed = any(r.verdict == "regressed" for r in verdicts)
    if explain and (regressed or any(r.verdict == "improved" for r in verdicts)):
        for r in verdicts:
            ci = (
                ""
                if r.change_pct_ci_low is None
                else f" [{r.change_pct_ci_low:+.1f}, {r.change_pct_ci_high:+.1f}]"
            )
            change = "n/a" if r.change_pct is None else f"{r.change_pct:+.1f} %"
            print(
                f"  {rule} {len(baseline)}: {r.metric} {r.baseline} -> {r.current} {change}{ci} {r.verdict}"
            )
    return regressed, any(r.verdict == "improved" for r in verdicts)


#: --histories: (pool, factor on TTFT and gaps, tail share, tail factor, levels per trial)
HISTORY_POOLS = (
    ("normal", 1.0, 0.0, 1.0, 3),
    ("slow", 1.3, 0.0, 1.0, 2),
    ("fast", 0.7, 0.0, 1.0, 1),
    ("tail", 1.0, 0.15, 4.0, 1),
)


def history_levels(server, args, name: str, count: int, seed: int) -> list[tuple[dict, dict]]:
    """``count`` levels of the history pool ``name`` (:data:`HISTORY_POOLS`): figures with their
    intervals, and samples."""
    _, factor, share, tail, _ = next(p for p in HISTORY_POOLS if p[0] == name)
    model = (
        f"noisy:{args.tokens}:{args.gap_ms * factor:g}:{args.ttft_ms * factor:g}:{args.sigma:g}:{seed}"
        f":{share:g}:{tail:g}:{args.run_sd:g}:{args.requests + 1}"
    )
    keep = [*THRESHOLDS, *(f"{m}_ci_{end}" for m in THRESHOLDS for end in ("low", "high"))]
    clean: list[dict] = []
    while len(clean) < count:
        batch = stream_levels(server, args, model, count - len(clean))
        late_ns = server.stats()["late_chunk_ns"]
        for level in batch:
            if args.keep_disturbed or not disturbed(level, late_ns):
                clean.append(level)
            else:
                DISTURBED[name] = DISTURBED.get(name, 0) + 1
        if DISTURBED.get(name, 0) > 3 * count + 10:
            raise SystemExit(
                f"{name}: {DISTURBED[name]} levels disturbed: the machine is too busy to measure"
            )
    return [
        ({m: level["metrics"][m] for m in keep if level["metrics"].get(m) is not None},
         {"stream": stream_units(level["requests"])})
        for level in clean
    ]  # fmt: skip


#: --histories: per pool, the levels measured again because they were disturbed (:func:`disturbed`).
DISTURBED: dict[str, int] = {}


def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot (``/proc/stat``; (0, 0) off Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0, 0
    return fields[7], sum(fields[:8])


def steal_pct(since: tuple[int, int]) -> float:
    """The share of CPU time the hypervisor gave to others since ``since`` (:func:`cpu_jiffies`), %."""
    steal, total = cpu_jiffies()
    return 100.0 * (steal - since[0]) / max(1, total - since[1])


def disturbed(level: dict, late_ns: list[int]) -> bool:
    """Whether a level did not measure the instrument's schedule alone: the instrument wrote 1 %
    or more of its chunks over 0.5 ms after their deadlines while the level ran (its own loop
    held up by the machine: ``late_chunk_ns`` of its ``GET /stats``; enough to move an ITL p99),
    or the level is flagged client-bound."""
    measured = [r for r in level["requests"] if not r["warmup"]]
    start = min(r["send_ns"] for r in measured)
    end = max(r["send_ns"] + (r["stream_close_ms"] or r["e2e_ms"] or 0.0) * 1e6 for r in measured)
    chunks = sum(len(r["token_offsets_ms"]) for r in measured)
    late = sum(1 for t in late_ns if start <= t <= end)
    return level["metrics"].get("client_bound") == 1 or late >= 0.01 * chunks


#: --histories: the prior of the run-to-run spread the judge uses (--prior-pct, --prior-runs).
PRIOR: list = []


def history_judge(history: list[tuple[dict, dict, str | None]], current: tuple[dict, dict], prior=None):
    """The verdict rows of ``current`` against ``history`` (oldest first: figures, samples, its
    own overall verdict), by the audit's rule: the history's baseline choice, its run-to-run
    spread learned from the whole history and the prior, the samples test with the tail
    (tasks.report.baseline.judge, without MLflow)."""
    from tasks.report import history as audit_history
    from tasks.report.baseline import MIN_HISTORY_RUNS
    from tasks.report.regression import overall

    runs = [
        {"run_id": f"a{i}", "name": "", "start_time_ms": i, "tags": {"verdict": v} if v else {}, "metrics": f}
        for i, (f, _, v) in enumerate(history)
    ]
    hist = audit_history.build(runs, list(THRESHOLDS))
    choice = hist.baseline(min_runs=MIN_HISTORY_RUNS, max_runs=10)
    base = [history[i] for i in choice.indices] or history[-1:]
    cuts = choice.change_points or (choice.change_point,)
    spreads = hist.run_spreads(list(THRESHOLDS), cuts, prior or PRIOR[0])
    rows = verdict(
        current[0], [b[0] for b in base], THRESHOLDS, current[1], [b[1] for b in base], spreads=spreads
    )
    return rows, overall(rows), choice


def moved(level: tuple[dict, dict], factor: float) -> tuple[dict, dict]:
    """A level as a run the machine moved as a whole by ``factor`` (``--move-runs``): its TTFT,
    gaps, TPOT and E2E (samples, figures and their intervals) times the factor, its output
    tokens/s over it; what the instrument's own run factor does at the source (its TTFT and
    every gap times exp(RUN_SD z)), applied to a copy, so that one pool serves every spread
    and each reuse of a level is another run."""
    from tasks.stats.samples import Unit

    if factor == 1.0:
        return level
    figures, samples = level
    scaled = {
        m: (v / factor if m.startswith("output_tokens_per_s") else v * factor) for m, v in figures.items()
    }
    units = [
        Unit({fam: tuple(tuple(v if fam == "output_tokens" else v * factor for v in c) for c in cs)
              for fam, cs in unit.clusters.items()})
        for unit in samples["stream"]
    ]  # fmt: skip
    return scaled, {**samples, "stream": units}


#: --histories --only: the groups of rows (default: all).
HISTORY_GROUPS = ("nochange", "x1.3", "tail", "after", "one", "incident", "changepoint", "learning")
#: --histories "learning" rows: the audit numbers (history lengths) judged, and the priors
#: (the factor on --move-runs's true spread the guess is off by).
LEARNING_AUDITS = (3, 5, 10)
LEARNING_PRIORS = (("right", 1.0), ("3x too small", 1 / 3), ("3x too large", 3.0))
#: --histories: the audits of the earlier level before the incident's step (the "incident" rows).
INCIDENT_BEFORE = 7


class Draws:
    """Levels of one pool for successive trials: in the pool's order on the first pass (so a run
    of --trials on pools of that size uses each level once, as before), then in a fresh random
    order per pass (trials beyond the pool reuse its levels, each equally often)."""

    def __init__(self, size: int, rng, in_order: bool = True) -> None:
        self.size, self.rng, self.at = size, rng, 0
        self.order = list(range(size)) if in_order else [int(i) for i in rng.permutation(size)]

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.at == len(self.order):
                self.order, self.at = [int(i) for i in self.rng.permutation(self.size)], 0
            i = self.order[self.at]
            self.at += 1
            if i not in out or self.size < k:
                out.append(i)
        return out


def wilson(hits: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The 95 % Wilson score interval of a binomial share (Wilson, JASA 22, 1927)."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre, half = p + z * z / (2 * n), z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def histories_main(args) -> None:
    import numpy as np

    from tasks.report import history as audit_history

    started = time.monotonic()
    pools: dict[str, list] = {}
    if args.load:
        saved = json.loads(args.load.read_text(encoding="utf-8"))
        pools = {name: [_run(r) for r in runs] for name, runs in saved.items()}
    missing = [p for p in HISTORY_POOLS if p[0] not in pools]
    if missing:
        with gt.serve() as server:
            steal_at = cpu_jiffies()
            for name, *_rest, per_trial in missing:
                pools[name] = history_levels(
                    server,
                    args,
                    name,
                    per_trial * args.trials,
                    seed=100 + [p[0] for p in HISTORY_POOLS].index(name),
                )
                print(
                    f"  measured {len(pools[name])} {name} levels, {DISTURBED.get(name, 0)} more disturbed and "
                    f"measured again ({time.monotonic() - started:.0f} s; {steal_pct(steal_at):.1f} % of the CPU "
                    "time stolen by the host)",
                    flush=True,
                )
    if args.save:
        args.save.write_text(
            json.dumps({name: [_saved(r) for r in runs] for name, runs in pools.items()}), encoding="utf-8"
        )
    measured_s = time.monotonic() - started
    groups = set(args.only.split(",")) if args.only else set(HISTORY_GROUPS)
    unknown = groups - set(HISTORY_GROUPS)
    if unknown:
        raise SystemExit(f"--only: unknown group(s) {sorted(unknown)}; known: {', '.join(HISTORY_GROUPS)}")
    rng = np.random.default_rng(args.seed)
    normal, slow, fast, tail = (pools[n] for n in ("normal", "slow", "fast", "tail"))
    order = np.random.default_rng(args.seed + 1)  # the pools' draws beyond their first pass
    first = args.seed == 7  # the default draws use each pool in its order first, as before
    slow_at, fast_at, tail_at = (Draws(len(p), order, first) for p in (slow, fast, tail))
    earlier_at = Draws(len(fast), order, first)  # the incident's earlier level, apart from the x0.7 row's
    t_count = args.trials
    from tasks.stats.spread import SpreadPrior

    PRIOR[:] = [SpreadPrior(args.prior_pct / 100, args.prior_runs)]
    mover = np.random.default_rng(args.seed + 2)  # the whole-run factors of --move-runs

    def mv(level):  # one more run of this level: a fresh whole-run factor
        return moved(level, float(np.exp(args.move_runs * mover.standard_normal())))

    print(
        f"audit-history verdicts: {t_count} trials, "
        + (
            f"pools from {args.load.name} (their jitter and run factor as measured), "
            if args.load
            else f"{args.requests} requests a level, jitter sigma {args.sigma:g}, whole runs exp({args.run_sd:g} z) "
            "at the instrument, "
        )
        + f"whole runs exp({args.move_runs:g} z) on the copies judged, "
        f"tail 15 % x4 TTFT; the spread's prior {args.prior_pct:g} % worth {args.prior_runs:g} runs; "
        f"thresholds {THRESHOLDS}; pools: " + ", ".join(f"{n} {len(p)}" for n, p in pools.items())
    )
    rates: dict[str, list[float]] = {}

    def count(name: str, hit: bool) -> None:
        rates.setdefault(name, []).append(float(hit))

    per_metric = ("ttft_ms_p50", "itl_ms_p90", "tpot_ms_mean")
    for t in range(t_count):
        own = [mv(normal[int(i)]) for i in rng.choice(len(normal), 6, replace=False)]  # 5 history, 1 now
        slows = [mv(slow[i]) for i in slow_at.take(2)]
        faster, tailed = mv(fast[fast_at.take(1)[0]]), mv(tail[tail_at.take(1)[0]])
        for size in (3, 5):
            history = [(f, s, None) for f, s in own[:size]]
            if "nochange" in groups:
                rows, word, _ = history_judge(history, own[5])
                count(f"no change, baseline {size}: regressed (false alarm)", word == "regressed")
                if args.explain and word in ("regressed", "improved"):
                    print(
                        f"  trial {t}, baseline {size}: {word}: "
                        + ", ".join(
                            f"{r.metric} {r.change_pct} % [{r.change_pct_ci_low}, {r.change_pct_ci_high}]"
                            f" baseline runs {[f.get(r.metric) for f, _, _ in history]} now {own[5][0].get(r.metric)}"
                            for r in rows
                            if r.verdict in ("regressed", "improved")
                        )
                    )
                count(f"no change, baseline {size}: improved", word == "improved")
            if "x1.3" in groups:
                rows, word, _ = history_judge(history, slows[0])
                by = {r.metric: r.verdict for r in rows}
                for m in per_metric:
                    count(f"x1.3, baseline {size}: {m} regressed", by.get(m) == "regressed")
            if "tail" in groups:
                rows, word, _ = history_judge(history, tailed)
                count(f"tail 15 % x4, baseline {size}: regressed", word == "regressed")
                count(
                    f"tail 15 % x4, baseline {size}: a ttft row regressed",
                    any(r.metric.startswith("ttft") and r.verdict == "regressed" for r in rows),
                )
            if "after" in groups:
                _, first, _ = history_judge(history, slows[1])
                after = [*history, (*slows[1], first)]
                _, word, choice = history_judge(after, faster)
                count(f"x0.7 after x1.3, baseline {size}: improved", word == "improved")
            if "incident" in groups:
                # an incident before the baseline: INCIDENT_BEFORE audits at x0.7, then the step
                # to today's level, `size` audits ago; the history knows the run-to-run spread on
                # INCIDENT_BEFORE - 1 + size - 1 degrees of freedom
                before = [(*mv(fast[i]), None) for i in earlier_at.take(INCIDENT_BEFORE)]
                rows, word, choice = history_judge([*before, *history], slows[0])
                by = {r.metric: r.verdict for r in rows}
                since = list(choice.indices) == list(range(INCIDENT_BEFORE, INCIDENT_BEFORE + size))
                count(f"incident, then {size}: the baseline is the {size} since the step", since)
                for m in per_metric:
                    count(f"incident, then {size}: x1.3 {m} regressed", by.get(m) == "regressed")
                _, word, _ = history_judge([*before, *history], own[5])
                count(f"incident, then {size}: no change regressed (false alarm)", word == "regressed")
        if "one" in groups:
            _, word, _ = history_judge([(*own[0], None)], own[1])
            count("no change, ONE baseline audit under load: regressed", word == "regressed")
            _, word, _ = history_judge([(*own[0], None)], slows[0])
            count("x1.3, ONE baseline audit: regressed (needs the run-to-run spread)", word == "regressed")
        if "learning" in groups:
            # a history of K audits at one level (no change point), the prior right or off by 3x
            # against the true spread (--move-runs), judged at audit K: a no-change audit and a
            # x1.3 one (the same levels for every prior)
            longest = max(LEARNING_AUDITS)
            drawn = [mv(normal[int(i)]) for i in rng.choice(len(normal), longest + 1, replace=False)]
            slow_now = mv(slow[slow_at.take(1)[0]])
            for label, off in LEARNING_PRIORS:
                prior = SpreadPrior(max(args.move_runs, 0.005) * off, args.prior_runs)
                for k in LEARNING_AUDITS:
                    past = [(f, s, None) for f, s in drawn[:k]]
                    _, word, _ = history_judge(past, drawn[longest], prior)
                    count(
                        f"learning, prior {label}, audit {k}: no change regressed (false alarm)",
                        word == "regressed",
                    )
                    if off != 1.0 and k != longest:  # a wrong prior's detection: at the last audit only
                        continue
                    rows, _, _ = history_judge(past, slow_now, prior)
                    by = {r.metric: r.verdict for r in rows}
                    count(
                        f"learning, prior {label}, audit {k}: x1.3 TTFT p50 regressed",
                        by.get("ttft_ms_p50") == "regressed",
                    )
        if args.progress and (t + 1) % args.progress == 0:
            print(f"  {t + 1} trials judged ({time.monotonic() - started - measured_s:.0f} s)", flush=True)
    for _ in range(t_count if "changepoint" in groups else 0):
        k = int(rng.integers(5, 16))
        series = [mv(normal[int(i)]) for i in rng.choice(len(normal), k, replace=len(normal) < k)]
        series += [mv(slow[int(i)]) for i in rng.choice(len(slow), 20 - k, replace=len(slow) < 20 - k)]
        runs = [
            {"run_id": f"a{i}", "name": "", "start_time_ms": i, "tags": {}, "metrics": f}
            for i, (f, _) in enumerate(series)
        ]
        points = audit_history.build(runs, ["ttft_ms_p50"]).metrics["ttft_ms_p50"].change_points
        count(
            "20-audit history, x1.3 step: change point within one audit", any(abs(p - k) <= 1 for p in points)
        )
    width = max(len(name) for name in rates)
    for name, hits in rates.items():
        low, high = wilson(int(sum(hits)), len(hits))
        print(
            f"{name:<{width}}  {sum(hits) / len(hits):>5.0%}  ({int(sum(hits))}/{len(hits)}; "
            f"95 % {low:.0%}-{high:.0%})"
        )
    print(f"measured in {measured_s:.0f} s, judged in {time.monotonic() - started - measured_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--sigma", type=float, default=0.1, help="log-normal jitter of TTFT and each gap")
    parser.add_argument("--requests", type=int, default=50, help="per level (the default audit's)")
    parser.add_argument("--concurrency", type=int, default=1, help="the default audit's first level's")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--gap-ms", type=float, default=4.0)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--save", type=Path, help="write the measured levels here (JSON), for --load")
    parser.add_argument(
        "--load", type=Path, help="judge the levels a --save wrote (measuring only the cases it lacks)"
    )
    parser.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    parser.add_argument("--explain", action="store_true", help="print each alarm's metrics")
    parser.add_argument("--histories", action="store_true", help="the audit history's rule (issue 28)")
    parser.add_argument("--run-sd", type=float, default=0.05, help="--histories: whole-run factor exp(sd z)")
    parser.add_argument(
        "--only", default="", help=f"--histories: comma-separated row groups ({', '.join(HISTORY_GROUPS)})"
    )
    parser.add_argument("--seed", type=int, default=7, help="--histories: the trials' draws from the pools")
    parser.add_argument(
        "--keep-disturbed",
        action="store_true",
        help="--histories: keep levels the machine disturbed (the instrument late, or client-bound) in the pools",
    )
    parser.add_argument("--progress", type=int, default=0, help="--histories: a line every N trials judged")
    parser.add_argument(
        "--move-runs",
        type=float,
        default=0.0,
        help="--histories: move each judged copy of a level as a whole by exp(SD z) (machine load; "
        "pools measured with --run-sd 0 then serve every spread)",
    )
    parser.add_argument(
        "--prior-pct", type=float, default=5.0, help="--histories: the spread's prior (percent)"
    )
    parser.add_argument(
        "--prior-runs", type=float, default=3.0, help="--histories: the prior's weight in runs"
    )
    args = parser.parse_args()
    if args.histories:
        return histories_main(args)
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else list(CASES)
    started = time.monotonic()
    pool, current = [], {}
    if args.load:  # what a --save kept; cases it lacks are measured (against its baselines)
        saved = json.loads(args.load.read_text(encoding="utf-8"))
        pool = [_run(r) for r in saved["pool"]]
        current = {name: [_run(r) for r in runs] for name, runs in saved["current"].items()}
    missing = [(name, factor) for name, factor in cases if name not in current]
    if not pool or missing:
        with gt.serve() as server:
            if not pool:  # baselines: per trial 5 fresh no-change levels (the 1-run one: the first)
                pool = levels(server, args, 1.0, 5 * args.trials, seed=1)
            for name, factor in missing:
                current[name] = levels(
                    server, args, factor, args.trials, seed=2 + CASES.index((name, factor))
                )
    if args.save:
        kept = {
            "pool": [_saved(r) for r in pool],
            "current": {n: [_saved(r) for r in rs] for n, rs in current.items()},
        }
        args.save.write_text(json.dumps(kept), encoding="utf-8")
    baselines = [pool[5 * t : 5 * t + 5] for t in range(args.trials)]
    measured_s = time.monotonic() - started
    print(
        f"verdict error rates: {args.trials} trials per case, {args.requests} requests a level, jitter "
        f"sigma {args.sigma:g} (TTFT {args.ttft_ms:g} ms, {args.tokens} tokens {args.gap_ms:g} ms apart), "
        f"thresholds {THRESHOLDS}"
    )
    print(f"{'case':<32} {'rule':<7} {'baseline':>8} {'regressed':>10} {'improved':>9}")
    for name, _ in cases:
        for rule in ("legacy", "test"):
            for size in (1, 5):
                outcomes = [
                    judged(cur, base[:size], rule, args.explain)
                    for cur, base in zip(current[name], baselines)
                ]
                regressed = sum(r for r, _ in outcomes) / len(outcomes)
                improved = sum(i for _, i in outcomes) / len(outcomes)
                print(f"{name:<32} {rule:<7} {size:>5} run {regressed:>9.0%} {improved:>9.0%}")
    print(f"measured in {measured_s:.0f} s, judged in {time.monotonic() - started - measured_s:.0f} s")


if __name__ == "__main__":
    main()
