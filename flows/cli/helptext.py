"""``--help`` that shows every option's default: an option whose default is None in the
command's signature takes its value from the config model (``StreamFlowConfig`` ...), so its
help shows that value (``[default: 10]``), read from the model, never copied by hand."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tasks.config import AuditConfig, ProfileFlowConfig, StreamFlowConfig, SweepFlowConfig, TokenizeFlowConfig

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
    return "none" if value is None else str(value)


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
            if is_option and param.default is None and param.name in defaults:
                param.show_default = _text(defaults[param.name])
    return group
