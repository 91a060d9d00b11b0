"""`infermeter sweep --target local --distribution`: the sampler's view as one table per
temperature (rank x decode step: piece, id, probability), with each step's entropy and the
nucleus every top_p keeps, from the rows of ``StepDistribution.to_dict``."""

from __future__ import annotations

from rich.markup import escape

from flows.tables.common import console, make_table


def _piece(text: str) -> str:
    return escape(repr(text)[1:-1])  # "\n" and friends shown, not printed; "[" not markup


def print_distribution(rows: list[dict]) -> None:
    """One table per temperature: a row per rank (1 = most likely; probability in %, the
    tokens outside the tightest nucleus dimmed), a column pair per decode step, then the
    entropy (bits) and each top_p's nucleus (tokens kept, mass) of every step."""
    steps = sorted({r["step"] for r in rows})
    for t in sorted({r["temperature"] for r in rows}):
        cells = {r["step"]: r for r in rows if r["temperature"] == t}
        columns = [("rank", "right")]
        for step in steps:
            columns += [(f"step {step} token (id)", "left"), ("p %", "right")]
        table = make_table(
            f"sampler's view, T={t:g}: next-token distribution (greedy path)", columns, compact=True
        )
        table.columns[0].no_wrap = True  # its row labels ("entropy", "top_p 0.9") stay whole
        ranks = max(len(c["top"]) for c in cells.values())
        for rank in range(ranks):
            row = [str(rank + 1)]
            for step in steps:
                cell = cells[step]
                if rank >= len(cell["top"]):
                    row += ["", ""]
                    continue
                top = cell["top"][rank]
                kept = min(cell["nucleus"], key=lambda n: n["top_p"])["tokens"] if cell["nucleus"] else ranks
                style = "" if rank < kept else "[dim]"
                row += [
                    f"{style}{_piece(top['piece'])} ({top['id']})",
                    f"{style}{100 * top['probability']:.2f}",
                ]
            table.add_row(*row, end_section=rank == ranks - 1)
        table.add_row("entropy", *[x for s in steps for x in (f"{cells[s]['entropy_bits']:.3f} bits", "")])
        for i, n in enumerate(cells[steps[0]]["nucleus"]):
            table.add_row(
                f"top_p {n['top_p']:g}",
                *[
                    x
                    for s in steps
                    for x in (
                        f"keeps {cells[s]['nucleus'][i]['tokens']}",
                        f"{100 * cells[s]['nucleus'][i]['mass']:.1f}",
                    )
                ],
            )
        console.print(table)
