"""`infermeter profile --breakdown`: the per-part table (prefill vs mean decode step) and the
roofline verdicts of each point, from the points' rows (keys ``breakdown`` and ``roofline``)."""

from __future__ import annotations

from flows.tables.common import console, make_table


def _label(point: dict) -> str:
    return f"N={point['prompt_tokens']} B={point['batch_size']} {point['dtype']} chunk={point['prefill_chunk_size']}"


def print_analysis(points: list[dict]) -> None:
    """Per point that ran: its breakdown table (or why it failed) and both roofline verdicts."""
    for point in points:
        if point.get("failed") or "breakdown" not in point:
            continue
        breakdown, roof = point["breakdown"], point["roofline"]
        if breakdown["failed"]:
            console.print(f"{_label(point)}: breakdown failed: {breakdown['error']}", highlight=False)
        else:
            pre = {p["part"]: p for p in breakdown["prefill"]["parts"]}
            dec = {p["part"]: p for p in breakdown["decode"]["parts"]}
            table = make_table(
                f"{_label(point)}: where the time goes ({breakdown['label']}, {breakdown['clock']})",
                [
                    ("part", "left"),
                    ("prefill ms", "right"),
                    ("share", "right"),
                    ("decode ms", "right"),
                    ("share", "right"),
                ],
                compact=True,
                no_wrap=True,
            )
            for part in list(pre) + [p for p in dec if p not in pre]:
                a, b = pre.get(part, {}), dec.get(part, {})
                table.add_row(
                    part,
                    f"{a['ms']:.3f}" if a else "",
                    f"{100 * a['share']:.1f} %" if a.get("share") is not None else "",
                    f"{b['ms']:.3f}" if b else "",
                    f"{100 * b['share']:.1f} %" if b.get("share") is not None else "",
                )
            table.add_row(
                "step",
                f"{breakdown['prefill']['step_ms']:.3f}",
                "100 %",
                f"{breakdown['decode']['step_ms']:.3f}",
                "100 %",
            )
            console.print(table)
            if breakdown["unmapped_parts"]:
                console.print(
                    f"not found in this architecture (in other): {', '.join(breakdown['unmapped_parts'])}"
                )
        if roof["failed"]:
            console.print(f"{_label(point)}: roofline failed: {roof['error']}", highlight=False)
        else:
            for phase in ("prefill", "decode"):
                console.print(roof[phase]["verdict"], highlight=False)
