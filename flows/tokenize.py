"""The tokenize stage alone: `infermeter tokenize`.

One MLflow parent run per flow run (config as params, headline `token_count_<tokenizer>_total`
metrics, summary.md) with the tokenize stage's child run under it (rows as a table artifact,
tokenize.json, token_counts.png).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from prefect import flow
from prefect.states import Completed, Failed
from rich.table import Table
from rich.text import Text

from flows.cli_common import (
    apply_overrides, console, fail_input, parse_list, print_run_links, run_flow, write_json,
)
from flows.stage_runs import finish_parent, new_workdir, run_tags, start_parent
from tasks import tokenizers
from tasks.config import DEFAULT_TOKENIZE_PROMPTS, TokenizeConfig, TrackingConfig
from tasks.tracking import TrackingTarget

DEFAULT_TOKENIZERS = "model,cl100k_base,qwen"


@flow(name="tokenize", log_prints=True)
def tokenize(
    config: TokenizeConfig = TokenizeConfig(),
    model: str = "gguf:default",
    tracking: TrackingConfig = TrackingConfig(),
    track: bool = True,
):
    """Tokenize the prompts with every tokenizer: ids, pieces, counts, chars/bytes per token."""
    target = TrackingTarget(tracking.experiment, None, tracking.enabled and track)
    tracker, parent = start_parent(target, "tokenize", config.model_dump(mode="json"),
                                   run_tags("tokenize", {"model": model}))
    try:
        from tasks.pipeline import tokenize_stage  # torch and transformers: not at import

        result = tokenize_stage(config, model, target, parent, str(new_workdir("tokenize")))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        finish_parent(tracker, parent, {}, error, f"# infermeter tokenize\n\nfailed: {error}\n")
        return Failed(message=error, data={"rows": [], "error": error, "mlflow_run_id": parent})
    finish_parent(tracker, parent, result["metrics"], None, _summary(result["rows"]))
    return Completed(data={**result, "mlflow_run_id": parent,
                           "ui_command": tracker.ui_command() if parent else None})


def _summary(rows: list[dict]) -> str:
    lines = ["# infermeter tokenize", "", "| tokenizer | text | tokens | chars/token | bytes/token |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        text = r["text"].replace("\n", "⏎").replace("|", "\\|")
        lines.append(f"| {r['tokenizer']} | {text} | {r['token_count']} | "
                     f"{r['chars_per_token'] or 0:.2f} | {r['bytes_per_token'] or 0:.2f} |")
    return "\n".join(lines) + "\n"


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
    text: Annotated[Optional[list[str]], typer.Option("--text", help="A text to tokenize (repeat for more).")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help="File of prompts: one per line, or a YAML/JSON list.")] = None,
    tokenizers_opt: Annotated[str, typer.Option(
        "--tokenizers", help="Comma-separated: model, cl100k_base, qwen, hf:PATH_OR_ID, gguf:PATH."
    )] = DEFAULT_TOKENIZERS,
    model: Annotated[str, typer.Option(help="Model spec whose tokenizer is `model`.")] = "gguf:default",
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the result here.")] = None,
    no_track: Annotated[bool, typer.Option("--no-track", help="Do not record in MLflow.")] = False,
) -> None:
    """Tokenize texts with several tokenizers side by side: ids, pieces, counts, chars/token.

    Default texts: English, Chinese, code and the seed's probes ('smart', 'smarter', 'token',
    'tokenization').
    """
    texts = list(text or []) + (read_prompts(prompts) if prompts else [])
    names = parse_list("--tokenizers", tokenizers_opt, str)
    cfg = apply_overrides(TokenizeConfig(), None, {
        "prompts": texts or list(DEFAULT_TOKENIZE_PROMPTS), "tokenizers": names,
    })
    try:  # load (and verify) every tokenizer before any run starts: bad data exits 2
        for name in cfg.tokenizers:
            tokenizers.load(name, model)
    except tokenizers.TokenizerError as exc:
        fail_input(f"--tokenizers: {exc}")
    state, result = run_flow("tokenize", tokenize, cfg, model=model, track=not no_track)
    if state.is_failed():
        typer.echo(f"tokenize failed: {result.get('error')}", err=True)
        raise typer.Exit(1)
    write_json(json_path, {"rows": result["rows"], "mlflow_run_id": result["mlflow_run_id"]})
    table = Table(title="infermeter tokenize", header_style="bold")
    for column, justify in (("tokenizer", "left"), ("text", "left"), ("tokens", "right"),
                            ("chars/token", "right"), ("pieces", "left")):
        table.add_column(column, justify=justify)
    for r in result["rows"]:
        table.add_row(Text(r["tokenizer"]), Text(r["text"].replace("\n", "⏎")[:40]), str(r["token_count"]),
                      f"{r['chars_per_token'] or 0:.2f}", Text(" | ".join(r["pieces"])[:80]))
    console.print(table)
    print_run_links(result)
