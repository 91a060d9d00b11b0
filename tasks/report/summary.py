"""The report step: one headline dict and a short summary.md from the stages' results.

Plain functions over the stages' return values; no MLflow, no Prefect.
"""

from __future__ import annotations

from typing import Any

from tasks import metrics
from tasks.stats.samples import Samples, profile_units, stream_units

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


def samples(stages: dict[str, dict]) -> Samples:
    """The samples behind the headline (``tasks.stats.samples``): the stream stage's first
    level's requests (``stream``) and the profile stage's first successful point's timed repeats
    (``profile``), the same level and point the headline reads."""
    out: Samples = {}
    levels = (stages.get("stream") or {}).get("levels") or []
    if levels:
        out["stream"] = stream_units(levels[0].get("requests") or [])
    points = [p for p in (stages.get("profile") or {}).get("points") or [] if not p.get("failed")]
    if points:
        out["profile"] = profile_units(points[0])
    return {group: units for group, units in out.items() if units}


def client_bound(stages: dict[str, dict]) -> bool:
    """Whether the stream stage's first level, the one the headline reads, was flagged
    client-bound (``tasks.stream.quality``)."""
    levels = (stages.get("stream") or {}).get("levels") or []
    return bool(levels) and (levels[0].get("metrics") or {}).get("client_bound") == 1


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table_head(columns: tuple[str, ...]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]


def _table_row(settings: list[Any], values: dict[str, Any], columns: tuple[str, ...]) -> str:
    """Settings as they are, then each metric column: 0/1 flags as they are, others by _fmt."""
    cells = [str(v) for v in settings] + [
        str(values.get(c)) if metrics.lookup(c).unit == "0/1" else _fmt(values.get(c)) for c in columns
    ]
    return "| " + " | ".join(cells) + " |"


def summary_markdown(
    stages: dict[str, dict],
    errors: dict[str, str],
    endpoint_kind: str | None,
    title: str = "infermeter audit",
) -> str:
    """A short human summary: ``# title``, headline table, per-level stream table, sweep table
    (with each point's determinism note), caveats."""
    lines = [f"# {title}", ""]
    if errors:
        lines += ["## Failed stages", ""] + [f"- **{k}**: {v}" for k, v in errors.items()] + [""]
    lines += ["## Headline", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in headline(stages).items()]
    verdict = (stages.get("profile") or {}).get("decode_verdict")
    if verdict:  # issue 12: the roofline of the profile's first point (profiled apart)
        lines += ["", "## Roofline (local profile)", "", f"- {verdict}"]
    stream = stages.get("stream")
    if stream:
        columns = metrics.SUMMARY_COLUMNS["stream"]
        lines += ["", "## Stream levels", ""] + _table_head(("max_concurrency", *columns))
        for level in stream["levels"]:
            lines.append(_table_row([level["max_concurrency"]], level["metrics"], columns))
        lines += [
            "",
            'GenAI-Perf calls TPOT "inter-token latency"; here ITL is every gap '
            "between text chunks and TPOT is (E2E - TTFT) / (output tokens - 1).",
        ]
    sweep = stages.get("sweep")
    if sweep:
        columns = metrics.SUMMARY_COLUMNS["sweep"]
        lines += ["", "## Sampling sweep", ""] + _table_head(("temperature", "top_p", *columns))
        for p in sweep["points"]:
            lines.append(_table_row([p["temperature"], p["top_p"]], p, columns))
        notes = [p for p in sweep["points"] if p.get("determinism_note")]
        lines += [""] * bool(notes) + [
            f"- T={p['temperature']} top_p={p['top_p']}: {p['determinism_note']}" for p in notes
        ]
    caveats = {"llama.cpp": CAVEATS, "vllm": VLLM_CAVEATS}.get(endpoint_kind, CAVEATS[:1])
    lines += ["", "## Read with care", ""] + [f"- {c}" for c in caveats]
    return "\n".join(lines) + "\n"
