"""The tokenize stage alone: the `tokenize` flow.

One MLflow parent run per flow run (the tokenize section as params, headline
`token_count_<tokenizer>_total` metrics, summary.md) with the tokenize stage's child run under
it (rows as a table artifact, tokenize.json, token_counts.png). The command is
``flows.commands.tokenize``.
"""

from __future__ import annotations

from prefect import flow

from flows.runs import final_state, model_label, parent_run
from tasks.config import TokenizeFlowConfig


def run_tokenize(config: TokenizeFlowConfig, track: bool = True) -> dict:
    """The flow's body: ``{"rows", "metrics", "error", "mlflow_run_id", "workdir",
    "ui_command", "runs_url"}`` (``error`` None, or why the stage failed)."""
    from tasks.pipeline import tokenize_stage  # torch and transformers: not at import

    # the params are the tokenize section's fields, unprefixed: the names tokenize runs have
    with parent_run(
        "tokenize",
        config.name,
        config.tokenize.model_dump(mode="json"),
        config.tracking,
        track,
        {"model": config.model},
        what=[model_label(config.model)],
    ) as run:
        try:
            result = tokenize_stage(config.tokenize, config.model, **run.stage_args())
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            run.finish({}, f"# infermeter tokenize\n\nfailed: {error}\n", error)
            result = {"rows": [], "error": error}
        else:
            run.finish(result["metrics"], summary_markdown(result["rows"]))
            result = {**result, "error": None}
    return {**result, **run.links()}


@flow(name="tokenize", log_prints=True)
def tokenize(config: TokenizeFlowConfig = TokenizeFlowConfig(), track: bool = True):
    """Tokenize the prompts with every tokenizer: ids, pieces, counts, chars/bytes per token."""
    return final_state(run_tokenize(config, track))


def summary_markdown(rows: list[dict]) -> str:
    """The parent run's summary.md: one table row per prompt x tokenizer."""
    lines = [
        "# infermeter tokenize",
        "",
        "| tokenizer | text | tokens | chars/token | bytes/token |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        text = r["text"].replace("\n", "⏎").replace("|", "\\|")
        lines.append(
            f"| {r['tokenizer']} | {text} | {r['token_count']} | "
            f"{r['chars_per_token'] or 0:.2f} | {r['bytes_per_token'] or 0:.2f} |"
        )
    return "\n".join(lines) + "\n"
