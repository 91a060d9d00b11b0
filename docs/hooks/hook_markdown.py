"""What the reference hooks share (generate_cli.py, generate_config.py, generate_metrics.py):
writing a generated file only when its text changed, and one markdown table cell's escaping.

MkDocs loads each hook from its file path, not as a package, so the hooks import this module
after putting their own folder on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path


def write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (folders made) unless it holds exactly that already, so that
    ``mkdocs serve`` does not see a change and rebuild in a loop."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def cell(text: str) -> str:
    """``text`` made safe for one markdown table cell: one line, pipes and HTML escaped."""
    text = " ".join(str(text).split())
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|").replace("*", "\\*")
