"""``--help`` as prose, with every option's default.

- :func:`prose`: a command's docstring with each paragraph on one line. The docstrings are
  wrapped at 100 columns in the source, and typer's rich help keeps every newline after the
  first paragraph (and in the commands list, the first paragraph's too): ``--help`` broke
  sentences mid-line ("in the foreground / (127.0.0.1)", issue 51). The terminal wraps prose
  at its own width.
- :func:`show_config_defaults`: an option whose default is None in the command's signature
  takes its value from the config model (``StreamFlowConfig`` ...), so its help shows that
  value (``[default: 10]``), read from the model, never copied by hand.
"""

from __future__ import annotations

import inspect
import re
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel

from tasks.config import AuditConfig, ProfileFlowConfig, StreamFlowConfig, SweepFlowConfig, TokenizeFlowConfig

#: A paragraph line that starts a list item ("- ", "* ", "1. ", "2) ")
_ITEM = re.compile(r"([-*+]|\d+[.)]) ")


def prose(text: str | None) -> str | None:
    """``text`` (a docstring) dedented, with each paragraph (lines between blank lines) joined
    into one line, so that the help wraps at the terminal's width and never inside a sentence.

    Kept as written: what follows click's ``\\f`` (hidden from ``--help``), a paragraph that
    starts with click's ``\\b`` (no rewrap), and a code block (a fence of three backticks, or
    indented lines). A list keeps one line per item, each item's continuation lines joined to
    it. None stays None (a command without a docstring)."""
    if text is None:
        return None
    shown, cut, hidden = inspect.cleandoc(text).partition("\f")
    paragraphs = []
    for paragraph in shown.strip("\n").split("\n\n"):
        lines = paragraph.split("\n")
        is_list = _ITEM.match(lines[0]) is not None  # its indented lines continue an item
        indented = any(line.startswith((" ", "\t")) for line in lines)
        fenced = any(line.startswith("```") for line in lines)
        if paragraph.startswith("\b") or fenced or (indented and not is_list):
            paragraphs.append(paragraph)
            continue
        joined: list[str] = []
        for line in lines:
            if joined and not _ITEM.match(line):
                joined[-1] += " " + line.strip()
            else:
                joined.append(line.strip())
        paragraphs.append("\n".join(joined))
    return "\n\n".join(paragraphs) + cut + hidden


#: command name -> the config model its None-default options fall back to
CONFIGS: dict[str, type[BaseModel]] = {
    "stream": StreamFlowConfig,
    "sweep": SweepFlowConfig,
    "profile": ProfileFlowConfig,
    "tokenize": TokenizeFlowConfig,
    "audit": AuditConfig,
}


def _defaults(model: type[BaseModel]) -> dict[str, object]:
    """Field name -> default, over the model's sections (first section wins on a clash)."""
    instance = model()
    found: dict[str, object] = {}
    for name in model.model_fields:
        value = getattr(instance, name)
        if isinstance(value, BaseModel):
            for key, inner in value.model_dump(mode="json").items():
                found.setdefault(key, inner)
    return found


def _text(value: object) -> str:
    if isinstance(value, list):
        return ",".join("inf" if v is None else str(v) for v in value) or "none"
    return "none" if value in (None, {}) else str(value)


def show_config_defaults(group: Any) -> Any:
    """Set ``show_default`` on each None-default option of the commands in :data:`CONFIGS`
    to its config model's default; returns ``group`` (typer's click group of the app)."""
    for name, model in CONFIGS.items():
        command = group.commands.get(name)
        if command is None:
            continue
        defaults = _defaults(model)
        for param in command.params:
            is_option = getattr(param, "param_type_name", "") == "option"  # typer's own click
            # a file option whose name is a field's holds a path, not the field's value (stream's
            # --prompts is a prompts file; the config's prompts are texts)
            annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            is_path = isinstance(annotation, type) and issubclass(annotation, PurePath)
            if is_option and not is_path and param.default is None and param.name in defaults:
                param.show_default = _text(defaults[param.name])
    return group
