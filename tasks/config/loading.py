"""Reading a YAML config into one of the models, and one-line messages for a bad one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tasks.config.flows import AuditConfig


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the fix."""


def describe_validation_error(error: ValidationError, source: str = "config") -> str:
    """One line naming the first bad field, what is wrong and (where the model says) the fix."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown key (check the spelling; see configs/default.yaml for the fields)"
    more = len(error.errors()) - 1
    suffix = f" (+{more} more)" if more else ""
    return f"{source}: {where}: {message}{suffix}"


def load_config(path: str | Path | None = None, model: type[BaseModel] = AuditConfig) -> Any:
    """Read and validate a YAML config (None = the built-in defaults).

    Raises:
        ConfigError: the file is missing, is not YAML mapping, or a field is invalid; the
            message is one line that names the file and the field.
    """
    if path is None:
        return model()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of stage names to settings")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, str(path))) from None
