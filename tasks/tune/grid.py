"""The configurations a tune run measures: a grid of server parameters or an explicit list,
typed, bounded, and checked by the engine's own argument parser before any server starts.

- ``--server-param max_num_seqs=1,4,16`` (repeat the option for more parameters) or YAML
  ``tune.server_params: {max_num_seqs: [1, 4, 16]}``: the cross product, in the order given
  (the last parameter varies fastest, as ``itertools.product``);
- ``tune.configurations: [{max_num_seqs: 1}, {max_num_seqs: 8, enable_chunked_prefill: false}]``:
  exactly these, instead of a product.

A value on the command line is read as YAML reads a scalar (``4`` int, ``0.5`` float,
``true`` / ``false`` bool, anything else text), so the CLI and a config file mean the same thing.

For the embedded engines each configuration's flags come from, and are judged by, the engine's
own parser (:mod:`tasks.tune.argcheck`: vLLM's ``make_arg_parser`` over ``EngineArgs``,
llama-cpp-python's settings parser). For a user's ``--serve-cmd`` the flags are spelled
``--name-with-dashes VALUE`` (switches ``--name`` / ``--no-name``) and only the server can judge.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.tune import argcheck

#: more configurations than this need ``--yes`` (``tune.max_configurations``)
MAX_CONFIGURATIONS = 64


#: the parser's answers, by engine and parameter sets (vLLM's takes seconds to build)
_JUDGED: dict[str, list[dict]] = {}


class TuneInputError(ValueError):
    """A grid that cannot be measured: the message names the parameter and the fix."""


@dataclass(frozen=True)
class Configuration:
    """One way of running the server.

    Attributes:
        index: its place in the run (0-based).
        params: parameter name -> typed value, as given.
        flags: the command-line flags that start the server so (appended to its command).
    """

    index: int
    params: dict[str, Any]
    flags: tuple[str, ...]

    @property
    def label(self) -> str:
        """``max_num_seqs=4 enable_chunked_prefill=false`` (``defaults`` for an empty one)."""
        return " ".join(f"{k}={_scalar_text(v)}" for k, v in self.params.items()) or "defaults"


def _scalar_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def scalar(text: str) -> Any:
    """A command-line value as YAML would read it: int, float, bool, else the text."""
    stripped = text.strip()
    if stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    for convert in (int, float):
        try:
            return convert(stripped)
        except ValueError:
            pass
    return stripped


def parse_server_params(options: Sequence[str]) -> dict[str, list[Any]]:
    """``["max_num_seqs=1,4,16", "enable_chunked_prefill=true,false"]`` -> a grid.

    Raises:
        TuneInputError: an option without ``=``, an empty name or value list, a name twice.
    """
    grid: dict[str, list[Any]] = {}
    for option in options:
        name, sep, values = option.partition("=")
        name = name.strip()
        if not sep or not name:
            raise TuneInputError(f"--server-param {option!r}: write NAME=V1,V2 (e.g. max_num_seqs=1,4,16)")
        items = [v for v in values.split(",") if v.strip()]
        if not items:
            raise TuneInputError(f"--server-param {name}: no values; write {name}=V1,V2")
        if name in grid:
            raise TuneInputError(f"--server-param {name}: given twice; put all its values in one option")
        grid[name] = [scalar(v) for v in items]
    return grid


def expand(
    grid: Mapping[str, Sequence[Any]] | None, explicit: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The parameter sets to measure: ``explicit`` when given, else the cross product of ``grid``.

    Raises:
        TuneInputError: both or neither given, an empty grid or list, a parameter without values.
    """
    if grid and explicit:
        raise TuneInputError("tune: give server_params (a grid) or configurations (a list), not both")
    if explicit:
        return [dict(params) for params in explicit]
    if not grid:
        raise TuneInputError(
            "tune: the grid is empty; give --server-param NAME=V1,V2 (or tune.server_params / "
            "tune.configurations in --config)"
        )
    for name, values in grid.items():
        if not isinstance(values, (list, tuple)) or not values:
            raise TuneInputError(f"tune.server_params.{name}: give a non-empty list of values")
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


def check_count(count: int, limit: int, yes: bool) -> None:
    """Raises TuneInputError: more than ``limit`` configurations without ``yes``."""
    if count > limit and not yes:
        raise TuneInputError(
            f"tune: {count} configurations exceed tune.max_configurations ({limit}); each restarts "
            "the server: pass --yes to run them all, or narrow the grid"
        )


def generic_flags(params: Mapping[str, Any]) -> tuple[str, ...]:
    """Flags for a user's own server command: ``--name-with-dashes VALUE``, switches
    ``--name`` / ``--no-name``, a list ``--name V1 V2``."""
    flags: list[str] = []
    for name, value in params.items():
        flag = "--" + name.strip().lstrip("-").replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *(str(v) for v in value)]
        else:
            flags += [flag, str(value)]
    return tuple(flags)


def engine_flags(
    engine: str, param_sets: list[dict[str, Any]], python: Path | None = None
) -> list[tuple[str, ...]]:
    """Each parameter set's flags, judged by ``engine``'s own argument parser: llama.cpp's
    in this process, vLLM's in its environment (``python``: its interpreter; one subprocess
    for all sets, ~10-30 s for vLLM's imports).

    Raises:
        TuneInputError: the first set the parser refuses, naming the parameter (or the
            parser's own words: ``argument --max-num-seqs: invalid int value: 'abc'``).
    """
    memo_key = json.dumps([engine, str(python), param_sets], sort_keys=True, default=str)
    if memo_key in _JUDGED:  # the command plans before its flow runs, in this process: once
        answers = _JUDGED[memo_key]
    elif python is None:
        answers = argcheck.check(engine, param_sets)
    else:
        done = subprocess.run(
            [str(python), argcheck.__file__],
            input=json.dumps({"engine": engine, "configurations": param_sets}),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode:
            tail = "\n".join(done.stderr.splitlines()[-5:])
            raise TuneInputError(f"tune: could not read {engine}'s argument parser:\n{tail}")
        answers = json.loads(done.stdout)
    _JUDGED[memo_key] = answers
    for params, answer in zip(param_sets, answers):
        if answer["error"]:
            label = " ".join(f"{k}={_scalar_text(v)}" for k, v in params.items())
            raise TuneInputError(f"{engine} refuses configuration {label!r}: {answer['error']}")
    return [tuple(answer["flags"]) for answer in answers]


def configurations(param_sets: list[dict[str, Any]], flags: list[tuple[str, ...]]) -> list[Configuration]:
    """Pair each parameter set with its flags."""
    return [Configuration(i, params, tuple(f)) for i, (params, f) in enumerate(zip(param_sets, flags))]


def configuration_key(params: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """A stable hash of one configuration and everything else that shapes its measurement (the
    engine or server command, the model, the workload): equal keys = the same measurement, so
    a resumed run may skip it (sha256 of canonical JSON, 16 hex digits)."""
    text = json.dumps({"params": dict(params), "context": dict(context)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
