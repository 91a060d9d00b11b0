"""`infermeter tokenize`: the tokenize flow from the command line.

Texts from ``--text`` (repeated) and ``--prompts`` (a file), the seed's probes by default;
every tokenizer is loaded (and its data file verified) before the run starts, so a bad name or
file exits 2 with one line. Writes ``--json`` (``{"rows", "mlflow_run_id"}``) and prints one
table row per text x tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.text import Text

from flows.commands.common import (
    JsonOption,
    NoTrackOption,
    apply_overrides,
    fail_input,
    parse_list,
    run_flow,
    write_json,
)
from flows.commands.tables import console, make_table, print_run_links
from tasks import tokenizers
from tasks.config import DEFAULT_TOKENIZE_PROMPTS, TokenizeConfig, TokenizeFlowConfig

DEFAULT_TOKENIZERS = "model,cl100k_base,qwen"


def read_prompts(path: Path) -> list[str]:
    """Prompts from a file: a YAML/JSON list of strings (.yaml, .yml, .json), else one prompt
    per non-empty line. Exits 2 naming --prompts when the file is missing or not a list."""
    if not path.is_file():
        fail_input(f"--prompts: file not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in {".yaml", ".yml", ".json"}:
        try:
            data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError):
            fail_input(f"--prompts: {path} is not valid {path.suffix[1:].upper()}")
        if not (isinstance(data, list) and data and all(isinstance(x, str) for x in data)):
            fail_input(f"--prompts: {path} must hold a non-empty list of strings")
        return data
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        fail_input(f"--prompts: {path} holds no prompt (one per line)")
    return prompts


def command(
    text: Annotated[
        Optional[list[str]], typer.Option("--text", help="A text to tokenize (repeat for more).")
    ] = None,
    prompts: Annotated[
        Optional[Path], typer.Option(help="File of prompts: one per line, or a YAML/JSON list.")
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
    """Tokenize texts with several tokenizers side by side: ids, pieces, counts, chars/token.

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
