"""The tokenize stage as a Prefect task."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task

from tasks.config import TokenizeConfig
from tasks.pipeline.common import STAGE, StageRun
from tasks.report import plots as plots_module
from tasks.tokenize import tokenizers
from tasks.tokenize.stage import summary_metrics, tokenize_prompts
from tasks.tracking import TrackingTarget


@task(name="tokenize", **STAGE)
def tokenize_stage(
    cfg: TokenizeConfig,
    model_spec: str,
    target: TrackingTarget,
    parent_run_id: str | None,
    workdir: str,
) -> dict:
    """Token ids, pieces, counts and chars/bytes per token for every prompt x tokenizer
    (``model`` = the tokenizer of ``model_spec``); a table artifact, a bar chart PNG and
    ``token_count_<tokenizer>_total`` metrics.

    Raises:
        tasks.tokenize.tokenizers.TokenizerError: a tokenizer cannot be loaded (data file missing,
            SHA-256 mismatch, unknown name).
    """
    with StageRun(target, "tokenize", parent_run_id) as run:
        loaded = [tokenizers.load(name, model_spec) for name in cfg.tokenizers]
        tokenized = tokenize_prompts(loaded, cfg.prompts)
        rows = [row.to_row() for row in tokenized]
        metrics = summary_metrics(tokenized)
        path = Path(workdir) / "tokenize.json"
        path.write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
        chart = plots_module.token_count_bars(rows, Path(workdir) / "token_counts.png")
        run.tracker.log_params(
            run.run_id,
            {
                "tokenizer": model_spec,
                "tokenizers": ",".join(cfg.tokenizers),
                "prompts.count": str(len(cfg.prompts)),
            },
        )
        run.tracker.set_tags(
            run.run_id, {f"tokenizer_source.{tokenizers.metric_name(t.name)}": t.source for t in loaded}
        )
        run.tracker.log_metrics(run.run_id, metrics)
        run.tracker.log_table(
            run.run_id,
            [
                {
                    **row,
                    "ids": json.dumps(row["ids"]),
                    "pieces": json.dumps(row["pieces"], ensure_ascii=False),
                }
                for row in rows
            ],
            "tokens_table.json",
        )
        for artifact in (path, chart):
            run.tracker.log_artifact(run.run_id, artifact)
        return {"rows": rows, "metrics": metrics, "mlflow_run_id": run.run_id}
