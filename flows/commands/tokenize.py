"""`infermeter tokenize`: the tokenize flow from the command line.

Texts from ``--text`` (repeated) and ``--prompts`` (a file), the seed's probes by default;
every tokenizer is loaded (and its data file verified) before the run starts, so a bad name or
file exits 2 with one line. Writes ``--json`` (``{"rows", "mlflow_run_id"}``) and prints one
table row per text x tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from flows.shared.common import (
    JsonOption,
    NoTrackOption,
    apply_overrides,
    check_tokenizer_sources,
    fail_input,
    parse_list,
    preflight,
    run_flow,
    write_json,
)
from flows.tables.common import console, make_table, print_run_links
from tasks.config import DEFAULT_TOKENIZE_PROMPTS, TokenizeConfig, TokenizeFlowConfig
from tasks.tokenize import tokenizers

DEFAULT_TOKENIZERS = "model,cl100k_base,qwen"


def read_prompts(path: Path) -> list[str]:
    """Prompts from a ``--prompts`` file, as ``stream --prompts`` reads them
    (:func:`tasks.workload.prompts.read_prompts_file`: a YAML/JSON list, JSONL, or one prompt per
    line). Exits 2 with one line naming --prompts, the file and (JSONL, not UTF-8) the line."""
    from tasks.workload.prompts import PromptsError, read_prompts_file

    try:
        return read_prompts_file(path)
    except PromptsError as exc:
        fail_input(str(exc))


def command(
    text: Annotated[
        Optional[list[str]], typer.Option("--text", help="A text to tokenize (repeat for more).")
    ] = None,
    prompts: Annotated[
        Optional[Path],
        typer.Option(help="File of prompts: one per line, a YAML/JSON list, or .jsonl with 'prompt'."),
    ] = None,
    tokenizers_opt: Annotated[
        str,
        typer.Option(
            "--tokenizers", help="Comma-separated: model, cl100k_base, qwen, hf:PATH_OR_ID, gguf:PATH."
        ),
    ] = DEFAULT_TOKENIZERS,
    model: Annotated[str, typer.Option(help="Model spec whose tokenizer is `model`.")] = "gguf:default",
    json_path: JsonOption = None,
    no_track: NoTrackOption = False,
) -> None:
    """Compare tokenizers on the same texts: ids, pieces, token counts and characters per token,
    side by side.

    Default texts: English, Chinese, code and the seed's probes ('smart', 'smarter', 'token',
    'tokenization').
    """
    texts = list(text or []) + (read_prompts(prompts) if prompts else [])
    names = parse_list("--tokenizers", tokenizers_opt, str)
    section = apply_overrides(
        TokenizeConfig(),
        None,
        {
            "prompts": texts or list(DEFAULT_TOKENIZE_PROMPTS),
            "tokenizers": names,
        },
    )
    preflight(track=not no_track)  # a tracking URI that cannot work: before the tokenizers load
    check_tokenizer_sources(section.tokenizers, model, "--tokenizers", "--model")  # hf: in seconds
    try:  # load (and verify) every tokenizer before any run starts: bad data exits 2
        for name in section.tokenizers:
            tokenizers.load(name, model)
    except tokenizers.TokenizerError as exc:
        fail_input(f"--tokenizers: {exc}")
    from flows.tokenize import tokenize

    cfg = TokenizeFlowConfig(tokenize=section, model=model)
    state, result = run_flow("tokenize", tokenize, cfg, track=not no_track)
    if state.is_failed():
        typer.echo(f"tokenize failed: {result.get('error')}", err=True)
        raise typer.Exit(1)
    write_json(json_path, {"rows": result["rows"], "mlflow_run_id": result["mlflow_run_id"]})
    print_rows(result["rows"])
    print_run_links(result)


def print_rows(rows: list[dict]) -> None:
    """One row per text x tokenizer: token count, chars per token and the first pieces (texts
    are plain Text: a piece such as '[/INST]' is not rich markup)."""
    table = make_table(
        "infermeter tokenize",
        (
            ("tokenizer", "left"),
            ("text", "left"),
            ("tokens", "right"),
            ("chars/token", "right"),
            ("pieces", "left"),
        ),
    )
    for r in rows:
        table.add_row(
            Text(r["tokenizer"]),
            Text(r["text"].replace("\n", "⏎")[:40]),
            str(r["token_count"]),
            f"{r['chars_per_token'] or 0:.2f}",
            Text(" | ".join(r["pieces"])[:80]),
        )
    console.print(table)
