"""Benchmark: change points in a history of audits, Apache Otava against MongoDB's library.

Issue 28 asks for change points found by a well-kept library, chosen by measuring. This plants
run-level histories (one figure per audit, seeded numpy) that look like a shared endpoint's:
each run's figure is its level times a log-normal factor ``exp(sd x z)`` (run-to-run sd 3, 5,
8 %), and measures, per library configuration and case:

- (a) no change, 20 audits: false change points per history, and the share with any;
- (b) one step of +30 % at a random audit (3..17): share found within one audit of it, and
  the other points per history;
- (c) a step of +30 % up and back down (raised stretch of 3 or more audits): share with both
  found within one audit;
- (d) a slow drift (+30 % over the 20 audits, linear): points per history (no right answer:
  what a drift turns into);
- (e) one outlier audit (x 1.5) at a random place: share with any change point (should be 0);
- (f) histories of 2, 3, 4 audits, no change: share with any point, and errors;
- (g) a step the runs' own intervals cannot resolve (+4 %, run-to-run sd 1 %, each run's
  interval +- 8 %): share found (the interval filter of ``tasks.stats.changepoint`` should drop
  it; the libraries know no intervals);
- (h) a short history, +30 % up and back: 4 or 5 audits, 3 raised, 4 or 5 after (a team's
  first fortnight): share with both found within one audit;

and the run time per 20-audit history. Then the whole rule, ``choose_baseline``, on histories
of six correlated metrics (a shared run factor plus each figure's own noise; no verdicts
recorded, the hardest case: only the data speak), 20 audits: how often the baseline it picks
holds only runs of the current level.

Libraries: ``apache-otava`` (``otava.analysis``: ``compute_change_points_orig``, the E-Divisive of
Matteson & James 2014 with a permutation test; ``compute_change_points``, Hunter's windowed
split-and-merge with a t-test, Fleming et al. ICPE 2023) and ``signal-processing-algorithms``
(``energy_statistics.e_divisive``, Daly et al. ICPE 2020). Only Otava is a project dependency;
MongoDB's caps numpy below 2, so install it beside, without its dependencies:

    .venv/bin/pip install --no-deps --target /tmp/cp-libs signal-processing-algorithms==2.1.6 \\
        more-itertools structlog
    PYTHONPATH=/tmp/cp-libs .venv/bin/python tests/benchmarks/changepoints.py \\
        [--histories 200] [--sd 0.03,0.05,0.08] [--baseline-histories 150] [--baseline-sd 0.05,0.08]

A library that does not import is reported and skipped. About 20 minutes on one core with the
defaults (``--sd ''`` or ``--baseline-sd ''`` skips a part). Not collected by pytest; prints, never asserts.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tasks.stats import changepoint, stretch  # noqa: E402

Detector = Callable[[np.ndarray, np.ndarray], list[int]]
N_AUDITS = 20
STEP = 1.30


def detectors() -> dict[str, Detector]:
    found: dict[str, Detector] = {}
    try:
        from otava.analysis import compute_change_points, compute_change_points_orig

        def otava_orig(p: float) -> Detector:
            def run(x: np.ndarray, h: np.ndarray) -> list[int]:
                points, _ = compute_change_points_orig(x, max_pvalue=p, seed=0)
                return sorted(int(c.index) for c in points)

            return run

        def otava_hunter(x: np.ndarray, h: np.ndarray) -> list[int]:
            points, _ = compute_change_points(x, window_len=50, max_pvalue=0.001)
            return sorted(int(c.index) for c in points)

        found["otava e-divisive p=0.05"] = otava_orig(0.05)
        found["otava e-divisive p=0.01"] = otava_orig(0.01)
        found["otava hunter t-test p=0.001"] = otava_hunter
    except ImportError as error:
        print(f"apache-otava not importable ({error}): skipped")
    try:
        from signal_processing_algorithms.determinism import deterministic_numpy_random
        from signal_processing_algorithms.energy_statistics import energy_statistics

        def mongodb(p: float) -> Detector:
            def run(x: np.ndarray, h: np.ndarray) -> list[int]:
                if x.size == 0:
                    return []  # it raises on an empty series
                with deterministic_numpy_random(0):  # it permutes with numpy's global generator
                    return sorted(int(i) for i in energy_statistics.e_divisive(x, pvalue=p, permutations=100))

            return run

        found["mongodb e-divisive p=0.05"] = mongodb(0.05)
        found["mongodb e-divisive p=0.01"] = mongodb(0.01)
    except ImportError as error:
        print(f"signal-processing-algorithms not importable ({error}): skipped (see the docstring)")
    found[
        f"ours: change_points() (otava p={changepoint.MAX_PVALUE}, or {changepoint.WEAK_PVALUE} at {changepoint.WEAK_STEP_SD:g} sd, + filter)"
    ] = lambda x, h: changepoint.change_points(x, h)
    return found


def noisy(rng: np.random.Generator, levels: np.ndarray, sd: float, hw_rel: float | None = None):
    """Figures and their half-widths: each run's interval as wide as the run-to-run noise (a run's
    own 95 % interval, 1.96 sd) unless ``hw_rel`` says otherwise."""
    x = 100.0 * levels * np.exp(rng.normal(0.0, sd, levels.size))
    return x, x * (1.96 * sd if hw_rel is None else hw_rel)


def histories(sd: float, count: int, seed: int = 7) -> dict[str, list]:
    """Per case: (values, half_widths, planted points) for ``count`` histories."""
    rng = np.random.default_rng(seed)
    cases: dict[str, list] = {k: [] for k in ("a", "b", "c", "d", "e", "f", "g", "h")}
    for _ in range(count):
        flat = np.ones(N_AUDITS)
        cases["a"].append((*noisy(rng, flat, sd), ()))
        k = int(rng.integers(3, N_AUDITS - 2))
        levels = flat.copy()
        levels[k:] = STEP
        cases["b"].append((*noisy(rng, levels, sd), (k,)))
        k1 = int(rng.integers(3, 10))
        k2 = int(rng.integers(k1 + 3, N_AUDITS - 2))
        levels = flat.copy()
        levels[k1:k2] = STEP
        cases["c"].append((*noisy(rng, levels, sd), (k1, k2)))
        cases["d"].append((*noisy(rng, np.linspace(1.0, STEP, N_AUDITS), sd), ()))
        k = int(rng.integers(1, N_AUDITS - 1))
        levels = flat.copy()
        levels[k] = 1.5
        cases["e"].append((*noisy(rng, levels, sd), (k,)))
        n = int(rng.integers(2, 5))
        cases["f"].append((*noisy(rng, np.ones(n), sd), ()))
        k = int(rng.integers(3, N_AUDITS - 2))
        levels = flat.copy()
        levels[k:] = 1.04
        cases["g"].append((*noisy(rng, levels, 0.01, hw_rel=0.08), (k,)))
        before, after = int(rng.integers(4, 6)), int(rng.integers(4, 6))
        levels = np.ones(before + 3 + after)
        levels[before : before + 3] = STEP
        cases["h"].append((*noisy(rng, levels, sd), (before, before + 3)))
    return cases


def near(points: list[int], planted: tuple[int, ...]) -> bool:
    return all(any(abs(p - q) <= 1 for p in points) for q in planted)


def measure(detect: Detector, cases: dict[str, list]) -> tuple[dict[str, str], float]:
    out: dict[str, str] = {}
    started, timed = time.perf_counter(), 0
    for case, items in cases.items():
        results, errors = [], 0
        for x, h, planted in items:
            try:
                results.append((detect(x, h), planted))
            except Exception:  # noqa: BLE001 - a library's failure is a measured outcome here
                errors += 1
        if case != "f":
            timed += len(items)
        count = np.array([len(r) for r, _ in results])
        if case == "a":
            out[case] = f"{count.mean():.3f} / {np.mean(count > 0):.2f}"
        elif case in ("b", "c"):
            hit = np.mean([near(r, p) for r, p in results])
            extra = np.mean([len(r) - len(p) for r, p in results])
            out[case] = f"{hit:.2f} ({extra:+.2f})"
        elif case == "d":
            out[case] = f"{count.mean():.2f}"
        elif case == "e":
            out[case] = f"{np.mean(count > 0):.2f}"
        elif case == "f":
            out[case] = f"{np.mean(count > 0):.2f}" + (f" ({errors} errors)" if errors else "")
        else:
            out[case] = f"{np.mean([near(r, p) for r, p in results]):.2f}"
    return out, (time.perf_counter() - started) / max(timed, 1) * 1000


HEAD = {
    "a": "(a) none: fp/h / any",
    "b": "(b) step: +-1 (extra)",
    "c": "(c) up+back: both (extra)",
    "d": "(d) drift: points",
    "e": "(e) outlier: any",
    "f": "(f) n<5: any",
    "g": "(g) in-interval step: found",
    "h": "(h) short up+back: both",
}

# The rule's part: six metrics with a shared run factor (machine load moves whole runs).
METRICS = {
    "ttft_ms_p50": (100.0, 0.09),  # (level, the run's own half-width as a share of its figure)
    "ttft_ms_p90": (165.0, 0.15),
    "itl_ms_p90": (12.0, 0.05),
    "tpot_ms_mean": (10.0, 0.04),
    "e2e_ms_p50": (800.0, 0.05),
    "output_tokens_per_s": (90.0, 0.05),
}


def audit_history(rng: np.random.Generator, levels: np.ndarray, sd: float):
    """Six figures per audit: a shared factor (sd x 0.8) and each figure's own noise (sd x 0.6)."""
    shared = np.exp(rng.normal(0.0, 0.8 * sd, levels.size))
    series, widths = {}, {}
    for metric, (level, hw) in METRICS.items():
        factor = levels * shared * np.exp(rng.normal(0.0, 0.6 * sd, levels.size))
        figures = level / factor if metric.endswith("_per_s") else level * factor
        series[metric], widths[metric] = list(figures), list(figures * hw)
    return series, widths


def rule_rates(sd: float, count: int, seed: int = 11) -> tuple[dict[str, str], float]:
    rng = np.random.default_rng(seed)
    tallies: dict[str, list[float]] = {k: [] for k in ("a", "a_exc", "b", "c", "d", "e", "e_in")}
    started, runs = time.perf_counter(), 0
    none: list[str | None] = [None] * N_AUDITS
    for _ in range(count):
        flat = np.ones(N_AUDITS)
        choice = stretch.choose_baseline(*audit_history(rng, flat, sd), none)
        tallies["a"].append(choice.change_point is not None)
        tallies["a_exc"].append(len(choice.excluded))
        k = int(rng.integers(3, N_AUDITS - 2))
        levels = flat.copy()
        levels[k:] = STEP
        choice = stretch.choose_baseline(*audit_history(rng, levels, sd), none)
        tallies["b"].append(bool(choice.indices) and min(choice.indices) >= k)
        k1 = int(rng.integers(3, 10))
        k2 = int(rng.integers(k1 + 3, N_AUDITS - 2))
        levels = flat.copy()
        levels[k1:k2] = STEP
        choice = stretch.choose_baseline(*audit_history(rng, levels, sd), none)
        tallies["c"].append(bool(choice.indices) and min(choice.indices) >= k2)
        levels = np.linspace(1.0, STEP, N_AUDITS)
        choice = stretch.choose_baseline(*audit_history(rng, levels, sd), none)
        # the spread of the planted level within the baseline, in percent
        tallies["d"].append(
            100 * (levels[list(choice.indices)].max() / levels[list(choice.indices)].min() - 1)
        )
        k = int(rng.integers(1, N_AUDITS - 1))
        levels = flat.copy()
        levels[k] = 1.5
        choice = stretch.choose_baseline(*audit_history(rng, levels, sd), none)
        tallies["e"].append(choice.change_point is not None)
        tallies["e_in"].append(k in choice.indices)
        runs += 5
    out = {
        "(a) none: a change point confirmed": f"{np.mean(tallies['a']):.2f}",
        "(a) none: runs left out per history": f"{np.mean(tallies['a_exc']):.2f}",
        "(b) step: baseline only after it": f"{np.mean(tallies['b']):.2f}",
        "(c) up+back: baseline only after the way back": f"{np.mean(tallies['c']):.2f}",
        "(d) drift: level spread within the baseline, %": f"{np.mean(tallies['d']):.1f}",
        "(e) outlier: a change point confirmed": f"{np.mean(tallies['e']):.2f}",
        "(e) outlier: outlier in the baseline": f"{np.mean(tallies['e_in']):.2f}",
    }
    return out, (time.perf_counter() - started) / runs * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=int, default=200, help="histories per case and sd")
    parser.add_argument(
        "--sd", default="0.03,0.05,0.08", help="run-to-run sd (log), comma-separated; '' skips"
    )
    parser.add_argument("--baseline-histories", type=int, default=150, help="histories per case, the rule")
    parser.add_argument(
        "--baseline-sd", default="0.05,0.08", help="run-to-run sd for the rule's part; '' skips"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the libraries' 0/0 on flat stretches
    found = detectors()
    for sd in (float(s) for s in args.sd.split(",") if s):
        cases = histories(sd, args.histories)
        print(f"\nrun-to-run sd {sd:.0%}, {args.histories} histories of {N_AUDITS} audits per case")
        print(f"| library | {' | '.join(HEAD.values())} | ms / history |")
        print("| --- " * (len(HEAD) + 2) + "|")
        for name, detect in found.items():
            rates, ms = measure(detect, cases)
            print(f"| {name} | {' | '.join(rates[c] for c in HEAD)} | {ms:.1f} |", flush=True)
    for sd in (float(s) for s in args.baseline_sd.split(",") if s):
        rates, ms = rule_rates(sd, args.baseline_histories)
        print(
            f"\nchoose_baseline, six metrics, run-to-run sd {sd:.0%}, no verdicts, {args.baseline_histories} histories"
        )
        for what, rate in rates.items():
            print(f"  {what}: {rate}")
        print(f"  ms per history: {ms:.0f}", flush=True)


if __name__ == "__main__":
    main()
