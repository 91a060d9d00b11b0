"""The report step: one headline dict and a short summary.md from the stages' results.

Plain functions over the stages' return values; no MLflow, no Prefect.
"""

from __future__ import annotations

from typing import Any

CAVEATS = [
    "The local profile runs the model dequantised in transformers; the embedded llama.cpp "
    "server runs the same weights quantised. Their latencies are not comparable.",
    "The embedded llama.cpp server answers one request at a time (no continuous batching): at "
    "concurrency above 1 its TTFT is mostly queueing time, not prefill.",
]
VLLM_CAVEATS = [
    "The local profile runs the model in float32 in transformers; the embedded vLLM server runs "
    "the same weights in bfloat16 with its own kernels. Their latencies are not comparable.",
]


def headline(stages: dict[str, dict]) -> dict[str, float | int | None]:
    """All stages' headline metrics in one flat dict (names are unique across stages)."""
    merged: dict[str, Any] = {}
    for name in ("tokenize", "profile", "stream", "sweep"):
        result = stages.get(name) or {}
        merged.update(result.get("headline") or result.get("metrics") or {})
    return merged


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def summary_markdown(
    stages: dict[str, dict], errors: dict[str, str], endpoint_kind: str | None
) -> str:
    """A short human summary: headline table, per-level stream table, sweep table, caveats."""
    lines = ["# infermeter audit", ""]
    if errors:
        lines += ["## Failed stages", ""] + [f"- **{k}**: {v}" for k, v in errors.items()] + [""]
    lines += ["## Headline", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in headline(stages).items()]
    stream = stages.get("stream")
    if stream:
        lines += ["", "## Stream levels", "",
                  "| max_concurrency | ttft_ms_p50 | itl_ms_p50 | tpot_ms_mean | e2e_ms_p50 | "
                  "output_tokens_per_s | error_rate |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for level in stream["levels"]:
            m = level["metrics"]
            lines.append(
                f"| {level['max_concurrency']} | {_fmt(m.get('ttft_ms_p50'))} | "
                f"{_fmt(m.get('itl_ms_p50'))} | {_fmt(m.get('tpot_ms_mean'))} | "
                f"{_fmt(m.get('e2e_ms_p50'))} | {_fmt(m.get('output_tokens_per_s'))} | "
                f"{_fmt(m.get('error_rate'))} |"
            )
        lines += ["", "GenAI-Perf calls TPOT \"inter-token latency\"; here ITL is every gap "
                  "between text chunks and TPOT is (E2E - TTFT) / (output tokens - 1)."]
    sweep = stages.get("sweep")
    if sweep:
        lines += ["", "## Sampling sweep", "",
                  "| temperature | top_p | identical_fraction | distinct_2 | output_tokens_mean | "
                  "determinism_violated |", "| --- | --- | --- | --- | --- | --- |"]
        for p in sweep["points"]:
            lines.append(
                f"| {p['temperature']} | {p['top_p']} | {_fmt(p['identical_fraction'])} | "
                f"{_fmt(p['distinct_2'])} | {_fmt(p['output_tokens_mean'])} | "
                f"{p['determinism_violated']} |"
            )
    caveats = {"llama.cpp": CAVEATS, "vllm": VLLM_CAVEATS}.get(endpoint_kind, CAVEATS[:1])
    lines += ["", "## Read with care", ""] + [f"- {c}" for c in caveats]
    return "\n".join(lines) + "\n"
