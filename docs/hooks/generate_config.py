"""MkDocs hook: the configuration reference, written from the pydantic models before every build.

Writes ``docs/_generated/config.md``: first the config files a user writes (the models of
``tasks.config`` that no other model holds: the audit's and each standalone flow's), then every
model they hold, one section each, every field with its YAML key, type, default, constraints and
description, a field holding a model linked to that model's section. Models are found by
walking the fields from ``tasks.config``'s exports, so a new model or field appears without a
change here (vLLM's docs make their references the same way, at build time).
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

sys.path.insert(0, str(Path(__file__).resolve().parent))  # MkDocs loads hooks by path (hook_markdown.py)
from hook_markdown import cell, write_if_changed  # noqa: E402


def code(text: str) -> str:
    """``text`` as inline code in a table cell, or escaped text where code cannot hold it."""
    text = " ".join(str(text).split())
    return f"`{text}`" if text and not set(text) & set("`|\\") else cell(text)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def type_text(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML terms: ``list[int] | None``, a model's name
    linked to its section, a Literal as its choices."""
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{_anchor(annotation)})"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_text(a) for a in args)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return cell(str(annotation).replace("typing.", ""))


_BOUNDS = {
    "gt": ">",
    "ge": "≥",
    "lt": "<",
    "le": "≤",
    "min_length": "length ≥",
    "max_length": "length ≤",
    "multiple_of": "multiple of",
    "pattern": "matches",
}


def constraints(field: Any) -> str:
    """The field's declared constraints (``gt=0`` -> ``> 0``), from its metadata."""
    found = []
    for item in field.metadata:
        for attr, word in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{word} {value}")
    return cell(", ".join(found))


def default_text(field: Any) -> str:
    """A field's default as a table cell: its value (a factory's called), ``(its defaults)`` for
    a section, ``required`` where there is none."""
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return ""
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "(its defaults)"
    if value is None:
        return code("null")
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, str):
        return code(value) if value else code('""')
    return code(repr(value) if not isinstance(value, list | dict | tuple) else _yaml_inline(value))


def _yaml_inline(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


def _first_paragraph(model: type[BaseModel]) -> str:
    """The model's own docstring's first paragraph (a model without one: empty)."""
    return (model.__dict__.get("__doc__") or "").strip().split("\n\n")[0]


def model_section(model: type[BaseModel], top: bool) -> str:
    doc = _first_paragraph(model)
    lines = [f"{'##' if top else '###'} {model.__name__} {{#{_anchor(model)}}}", ""]
    if doc:
        lines += [cell(doc).replace("\\|", "|").replace("\\*", "*"), ""]
    lines += ["| key | type | default | constraints | description |", "| --- | --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        key = field.alias or name
        inner = _models_in(field.annotation)
        about = field.description or (_first_paragraph(inner[0]) if inner else "")
        lines.append(
            f"| `{key}` | {type_text(field.annotation)} | {default_text(field)} | {constraints(field)} "
            f"| {cell(about)} |"
        )
    return "\n".join(lines) + "\n"


def collect(exported: list[Any]) -> tuple[list[type[BaseModel]], list[type[BaseModel]]]:
    """The top-level models (held by no other) and the nested ones, each in first-seen order."""
    roots = [m for m in exported if isinstance(m, type) and issubclass(m, BaseModel)]
    seen: list[type[BaseModel]] = []
    held: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.append(model)
        for field in model.model_fields.values():
            for inner in _models_in(field.annotation):
                held.add(inner)
                walk(inner)

    for model in roots:
        walk(model)
    return [m for m in seen if m not in held], [m for m in seen if m in held]


def render() -> str:
    """The whole reference (markdown): the config files' sections, then the nested models'."""
    import tasks.config as config

    top, nested = collect([getattr(config, name) for name in config.__all__])
    lines = [
        "## Config files",
        "",
        "Each is a YAML file whose top-level keys are the model's fields (`--config FILE`), or a "
        "deployment's parameters in the Prefect UI.",
        "",
    ]
    lines += [model_section(m, top=True) for m in top]
    lines += ["## Sections", "", "The models the config files hold, one YAML mapping each.", ""]
    lines += [model_section(m, top=False) for m in nested]
    return "\n".join(lines).rstrip() + "\n"


def generate(root: Path) -> None:
    """Write ``root/docs/_generated/config.md`` (unchanged text: not rewritten)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    write_if_changed(root / "docs" / "_generated" / "config.md", render())


def on_pre_build(config: Any) -> None:
    generate(Path(config["config_file_path"]).resolve().parent)
