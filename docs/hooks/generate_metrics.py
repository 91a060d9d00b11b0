"""MkDocs hook: the metrics reference, written from the one metric registry before every build.

Writes ``docs/_generated/metrics.md``: the registry's table as :func:`tasks.metrics.doc.markdown_table`
renders it (the same renderer that keeps DESIGN.md's table equal to the registry, so the two
cannot disagree), one row per metric: MLflow name, unit, stage, the direction that is worse,
the statistics it is logged under, its roles (SLO, headline, threshold) and what it means.
vLLM's docs make theirs the same way (docs/mkdocs/hooks/generate_metrics.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # MkDocs loads hooks by path (hook_markdown.py)
from hook_markdown import write_if_changed  # noqa: E402


def generate(root: Path) -> None:
    """Write ``root/docs/_generated/metrics.md`` (unchanged text: not rewritten)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tasks.metrics.doc import markdown_table

    write_if_changed(root / "docs" / "_generated" / "metrics.md", markdown_table())


def on_pre_build(config: Any) -> None:
    generate(Path(config["config_file_path"]).resolve().parent)
