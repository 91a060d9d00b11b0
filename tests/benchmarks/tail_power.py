"""Benchmark: which test sees a tail that moves only a minority of requests, at the default audit
size, without crying wolf when whole runs shift? (issue 28, item 4)

Seeded synthetic TTFT samples (numpy): a run is 50 requests, each ``80 ms x exp(sigma z)``
(sigma 0.25: p90 110 ms, as the noisy instrument at its default), times a run-level factor
``exp(tau z)`` drawn once per run (machine load moves whole runs; tau 0.05 .. 0.1). The current
side is one run, the baseline 3 or 5 runs. Cases:

- ``no change``: false alarms;
- ``run +30 %``: the current run x1.3 (the median metrics judge it; what does a tail test say?);
- ``15 % x4 tail``: each request, with probability 0.15, waits 4x longer for its first token
  (``--exact-share``: exactly 15 % of the run's requests);
- ``10 % x3 tail``: the same, 10 % x3;
- ``25 % x1.5 tail``: a nearer tail, 25 % of requests x1.5;
- ``all 30 % faster``: the current run x0.7;
- ``tail fixed``: the baseline runs have the 15 % x4 tail, the current run not (the improved
  direction);
- ``15 % x4 + hiccup``: the 15 % x4 tail against a baseline with one stalled request (x10) in
  its 150 or 250.

Tests (p-values; two-sided unless said):

- ``exceed pQ scaled``: :func:`tasks.stats.tails.tail_shift` (exceedances of the baseline's pQ,
  each run divided by its median, exact distribution; two-sided ``p_value``); ``1s``: its
  one-sided ``p_worse`` and ``p_better`` as two hypotheses (a tail case: its direction's; a case
  without a tail move: either);
- ``exceed max scaled``: the same with each side's largest value as the edge;
- ``exceed p90 raw``: the same count on the raw values (no scaling);
- ``AD raw`` / ``AD scaled``: ``scipy.stats.anderson_ksamp`` of the current run against the
  pooled baseline (p-value capped to [0.001, 0.25] by scipy);
- ``perm p90 raw`` / ``perm p90 scaled``: a permutation test of ``log(p90 current / p90
  baseline)``, requests permuted across the pooled runs (999 permutations);
- ``bootstrap p90``: today's verdict on ``ttft_ms_p90`` (:func:`tasks.stats.verdict.change`:
  two-level bootstrap, the baseline's between-run spread lent to the one current run).

Each cell is the share of trials rejecting at alpha 0.05 (a test on its own) and at 0.05 / 8
(Holm's first step among 8 tested metrics: what a lone tail test must beat inside the verdict);
a tail case counts only rejections in its direction. The figures and the choice they led to are
in :mod:`tasks.stats.tails`' docstring.

    .venv/bin/python tests/benchmarks/tail_power.py [--trials 200] [--sigmas 0.1,0.25]
        [--baselines 3,5] [--taus 0.05,0.1] [--tests exceed,AD,perm,bootstrap|NAME,...]
        [--cases NAME,...] [--decimals 0] [--exact-share]

About 25 minutes on two shared cores with every test at 200 trials (``bootstrap p90`` is most
of it); ``--tests exceed``: 1 minute. ``scipy`` (``AD``) comes with mlflow. Not collected by
pytest (no test_ prefix); prints, never asserts.
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

from tasks.stats import verdict  # noqa: E402
from tasks.stats.samples import Unit  # noqa: E402
from tasks.stats.tails import exceedance_pmf, tail_shift  # noqa: E402

MEDIAN_MS = 80.0
REQUESTS = 50
ALPHAS = (0.05, 0.05 / 8)
#: name -> (current tail share, its factor, current run factor, baseline tail share, its factor,
#: the tail's true move: None (any call is a false one), "worse" or "better")
CASES = {
    "no change": (0.0, 1.0, 1.0, 0.0, 1.0, None),
    "run +30 %": (0.0, 1.0, 1.3, 0.0, 1.0, None),
    "15 % x4 tail": (0.15, 4.0, 1.0, 0.0, 1.0, "worse"),
    "10 % x3 tail": (0.10, 3.0, 1.0, 0.0, 1.0, "worse"),
    "25 % x1.5 tail": (0.25, 1.5, 1.0, 0.0, 1.0, "worse"),
    "all 30 % faster": (0.0, 1.0, 0.7, 0.0, 1.0, None),
    "tail fixed": (0.0, 1.0, 1.0, 0.15, 4.0, "better"),
    "15 % x4 + hiccup": (0.15, 4.0, 1.0, 0.0, 1.0, "worse"),
}
#: Cases whose baseline has one hiccup: one request of its first run x10 (a stall, a GC pause).
HICCUP = ("15 % x4 + hiccup",)


def one_run(rng, sigma: float, tau: float, share: float, factor: float, scale: float, exact: bool):
    """One run's TTFTs (ms), shape (REQUESTS,)."""
    values = (
        MEDIAN_MS
        * scale
        * np.exp(tau * rng.standard_normal())
        * np.exp(sigma * rng.standard_normal(REQUESTS))
    )
    if share:
        slow = rng.permutation(REQUESTS) < round(share * REQUESTS) if exact else rng.random(REQUESTS) < share
        values[slow] *= factor
    return values


def unit(values: np.ndarray) -> Unit:
    return Unit({"ttft_ms": tuple((float(v),) for v in values)})


def scaled(runs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([r / np.median(r) for r in runs])


# --- the candidates: (current runs, baseline runs, rng) -> (p two-sided, p worse, p better) -----


def split(p: float, worse: bool) -> tuple[float, float, float]:
    """A two-sided p and the side the data lean to, as the three p-values (one-sided: half)."""
    return p, (p / 2 if worse else 1.0), (1.0 if worse else p / 2)


def exceed_scaled(q: float | None) -> Callable:
    """``q`` None: the edge is each side's largest value (``j = 1``)."""

    def test(cur, base, rng):
        quantile = q or 1 - 1 / (REQUESTS * len(base))
        shift = tail_shift([unit(r) for r in cur], [unit(r) for r in base], quantile=quantile)
        return shift.p_value, shift.p_worse, shift.p_better

    return test


def exceed_raw(cur, base, rng):
    """The exceedance count of the current run beyond the baseline's p90, raw values, doubled."""
    c, b = np.concatenate(cur), np.concatenate(base)
    j = max(1, round(b.size * 0.1))
    edge = np.sort(b)[b.size - j]
    x = int(np.sum(c > edge))
    pmf = exceedance_pmf(c.size, b.size, j)
    upper, lower = float(pmf[x:].sum()), float(pmf[: x + 1].sum())
    return min(1.0, 2 * min(upper, lower)), upper, lower


def anderson(scale: bool) -> Callable:
    from scipy.stats import anderson_ksamp

    def test(cur, base, rng):
        c, b = (scaled(cur), scaled(base)) if scale else (np.concatenate(cur), np.concatenate(base))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "p-value capped": the cap is the point measured
            p = anderson_ksamp([c, b]).pvalue
        return split(float(p), np.quantile(c, 0.9) > np.quantile(b, 0.9))

    return test


def permutation_p90(scale: bool, permutations: int = 999) -> Callable:
    def test(cur, base, rng):
        c, b = (scaled(cur), scaled(base)) if scale else (np.concatenate(cur), np.concatenate(base))
        pooled = np.log(np.concatenate([c, b]))
        order = np.argsort(rng.random((permutations, pooled.size)), axis=1)
        drawn = pooled[order]
        stats = np.quantile(drawn[:, : c.size], 0.9, axis=1) - np.quantile(drawn[:, c.size :], 0.9, axis=1)
        seen = np.quantile(pooled[: c.size], 0.9) - np.quantile(pooled[c.size :], 0.9)
        upper = (1 + np.sum(stats >= seen)) / (permutations + 1)
        lower = (1 + np.sum(stats <= seen)) / (permutations + 1)
        return min(1.0, 2 * min(upper, lower)), upper, lower

    return test


def bootstrap_p90(cur, base, rng):
    c = np.concatenate(cur)
    b = [np.quantile(r, 0.9) for r in base]
    result = verdict.change(
        "ttft_ms_p90",
        float(np.quantile(c, 0.9)),
        float(np.median(b)),
        [unit(r) for r in cur],
        [unit(r) for r in base],
        confidence=0.95,
        seed=int(rng.integers(1 << 31)),
    )
    if isinstance(result, str):
        return 1.0, 1.0, 1.0
    return split(result.p_value, result.change_pct > 0)


TESTS = {
    "exceed p90 scaled": ("exceed", exceed_scaled(0.9)),
    "exceed p95 scaled": ("exceed", exceed_scaled(0.95)),
    "exceed p97.5 scaled": ("exceed", exceed_scaled(0.975)),
    "exceed p99 scaled": ("exceed", exceed_scaled(0.99)),
    "exceed max scaled": ("exceed", exceed_scaled(None)),
    "exceed p90 raw": ("exceed", exceed_raw),
    "AD raw": ("AD", anderson(False)),
    "AD scaled": ("AD", anderson(True)),
    "perm p90 raw": ("perm", permutation_p90(False)),
    "perm p90 scaled": ("perm", permutation_p90(True)),
    "bootstrap p90": ("bootstrap", bootstrap_p90),
}
#: The tests with one-sided rows too ("1s": the two directions as two hypotheses in Holm).
ONE_SIDED = (
    "exceed p90 scaled",
    "exceed p95 scaled",
    "exceed p97.5 scaled",
    "exceed p99 scaled",
    "exceed max scaled",
)


def rejected(ps: np.ndarray, truth: str | None, one_sided: bool, alpha: float) -> float:
    """Share of trials calling the tail moved (a case without a move: either way; with one: its
    way). ``ps``: (trials, 3) two-sided, worse, better."""
    two, worse, better = ps.T
    if one_sided:
        called = {None: np.minimum(worse, better), "worse": worse, "better": better}[truth] < alpha
    else:
        called = (two < alpha) & {None: True, "worse": worse < better, "better": better < worse}[truth]
    return float(np.mean(called))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--sigmas", default="0.1,0.25")
    parser.add_argument("--baselines", default="3,5", help="baseline runs")
    parser.add_argument("--taus", default="0.05,0.1", help="run-level shift noise exp(tau z)")
    parser.add_argument(
        "--tests",
        default="exceed,AD,perm,bootstrap",
        help="kinds (exceed, AD, perm, bootstrap) or test names",
    )
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--decimals", type=int, default=0, help="of the rates in %%")
    parser.add_argument("--exact-share", action="store_true", help="the tail: exactly its share of requests")
    args = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # the bootstrap's log of a -100 % draw
    kinds = set(args.tests.split(","))
    tests = {name: fn for name, (kind, fn) in TESTS.items() if kind in kinds or name in kinds}
    cases = args.cases.split(",") if args.cases else list(CASES)
    seconds = dict.fromkeys(tests, 0.0)
    calls = dict.fromkeys(tests, 0)
    draw = "exactly that share" if args.exact_share else "each request with that probability"
    print(
        f"tail tests: {args.trials} trials, 1 current run vs the pooled baseline runs, {REQUESTS} requests a run, "
        f"TTFT {MEDIAN_MS:g} ms x exp(sigma z) x exp(tau z) a run; tail requests: {draw}"
    )
    print(f"cells: % of trials with p < {ALPHAS[0]:g} / p < {ALPHAS[1]:.5f} (Holm's first step among 8)")
    for sigma in (float(s) for s in args.sigmas.split(",")):
        for runs in (int(u) for u in args.baselines.split(",")):
            for tau in (float(t) for t in args.taus.split(",")):
                p = {(t, c): [] for t in tests for c in cases}
                for c_index, case in enumerate(cases):
                    share, factor, scale, base_share, base_factor, _ = CASES[case]
                    for trial in range(args.trials):
                        rng = np.random.default_rng(
                            [trial, c_index, runs, round(100 * sigma), round(1000 * tau)]
                        )
                        base = [
                            one_run(rng, sigma, tau, base_share, base_factor, 1.0, args.exact_share)
                            for _ in range(runs)
                        ]
                        if case in HICCUP:
                            base[0][0] *= 10.0
                        cur = [one_run(rng, sigma, tau, share, factor, scale, args.exact_share)]
                        for name, fn in tests.items():
                            started = time.perf_counter()
                            p[(name, case)].append(fn(cur, base, np.random.default_rng(trial)))
                            seconds[name] += time.perf_counter() - started
                            calls[name] += 1
                print(f"\nsigma {sigma:g}, baseline {runs} runs, run-level tau {tau:g}")
                print(f"{'test':<22}" + "".join(f"{c:>18}" for c in cases))
                rows = list(tests) + [f"{t} 1s" for t in ONE_SIDED if t in tests]
                for row in rows:
                    name = row.removesuffix(" 1s")
                    cells = []
                    for case in cases:
                        ps = np.array(p[(name, case)])
                        truth = CASES[case][-1]
                        one = row.endswith(" 1s")
                        cells.append(
                            "/".join(f"{100 * rejected(ps, truth, one, a):.{args.decimals}f}" for a in ALPHAS)
                        )
                    print(f"{row:<22}" + "".join(f"{c:>18}" for c in cells))
    print("\ntime per call:")
    for name in tests:
        print(f"  {name:<22} {1000 * seconds[name] / max(1, calls[name]):8.2f} ms")


if __name__ == "__main__":
    main()
