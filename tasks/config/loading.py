"""Reading a YAML config into one of the models, and one-line messages for a bad one."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tasks.config.flows import AuditConfig
from tasks.textfile import read_utf8


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the fix."""


def _fields_at(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The field names of the (nested) model at ``loc``; [] where that is not a model."""
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else []


def describe_validation_error(
    error: ValidationError,
    source: str = "config",
    model: type[BaseModel] | None = None,
    names: Mapping[tuple, str] | None = None,
) -> str:
    """One line naming the first bad field, what is wrong and (where the model says) the fix.

    ``model``: the config model validated, so an unknown key (a typo) gets the closest valid
    key at its level (``difflib.get_close_matches``). ``names``: field location -> what the user
    typed for it (a CLI flag such as ``--num-requests``), named instead of ``source: loc`` (the
    longest location that is a prefix of the error's); an error of the part that holds them
    (a check across its fields) is its message alone.
    """
    first = error.errors()[0]
    loc = tuple(first["loc"])
    where = ".".join(str(part) for part in loc) or "(top level)"
    message = first["msg"]
    if first["type"] == "value_error":  # our validators' own words, without pydantic's label
        message = message.removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _fields_at(model, loc[:-1]), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else "check the spelling"
        message = f"unknown key ({hint}; configs/default.yaml has every field)"
    more = len(error.errors()) - 1
    suffix = f" (+{more} more)" if more else ""
    for end in range(len(loc), 0, -1):  # an item of a list (stream.max_concurrency.0) too
        if names and loc[:end] in names:
            return f"{names[loc[:end]]}: {message}{suffix}"
    if names and first["type"] == "value_error" and any(key[: len(loc)] == loc for key in names):
        # a check across fields of a part the user set some of (client_processes with
        # task_runner): its message names the fields and their flags; no location is a flag
        return f"{message}{suffix}"
    if not loc and first["type"] == "value_error":  # a check across the parts: its message names them
        return f"{source}: {message}{suffix}"
    return f"{source}: {where}: {message}{suffix}"


def load_config(path: str | Path | None = None, model: type[BaseModel] = AuditConfig) -> Any:
    """Read and validate a YAML config (None = the built-in defaults).

    Raises:
        ConfigError: the file is missing, not UTF-8 (naming the byte offset and line), empty
            (or whitespace / comments only), is not a YAML mapping, or a field is invalid (an
            unknown key with the closest valid one); the message is one line that names the
            file and the field.
    """
    if path is None:
        return model()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file not found: {path}")
    try:
        data = yaml.safe_load(read_utf8(path, ConfigError))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        # empty, whitespace or comments only: almost always a mistake (a wrong file, an unsaved
        # buffer); running the full default audit instead would cost minutes and mislead
        raise ConfigError(
            f"{path}: the config file is empty (no settings); give at least one setting (`{{}}` "
            "for all defaults), or leave out --config"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of stage names to settings")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, str(path), model)) from None
