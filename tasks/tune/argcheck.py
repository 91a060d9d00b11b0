"""Server parameters -> command-line flags, checked by the engine's own argument parser.

Standard library only, on purpose: the same code runs in-process for llama.cpp (its parser is
built from its pydantic settings in the main ``.venv``) and as a script inside vLLM's own
environment (``.venv-vllm/bin/python -m``-free: ``python argcheck.py`` with JSON on stdin),
where vLLM's ``make_arg_parser`` -- the parser ``vllm serve`` itself uses, built from
``EngineArgs`` -- judges each configuration. A parameter is accepted exactly when the engine
would accept its flag.

Flag spelling (from the parser's own actions, never guessed):

- a switch (``store_true`` / ``BooleanOptionalAction``): ``true`` -> ``--name``, ``false`` ->
  ``--no-name`` (refused where the parser has no negative form);
- any other option: ``--name VALUE`` (a list value: ``--name V1 V2``), the option string the
  parser lists first for that destination (vLLM: ``--max-num-seqs``; llama.cpp: ``--n_threads``,
  whose booleans take ``True`` / ``False`` as values).

Names are matched by the parser's destination (``max_num_seqs``) or any option string without
its dashes (``max-num-seqs``).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import sys

#: what infermeter itself sets on the embedded servers: a grid must not move them
RESERVED = frozenset(
    {"model", "host", "port", "served_model_name", "model_alias", "api_key", "interrupt_requests"}
)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every spelling of every option -> its action (dest, and option strings undashed)."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its actions
        if not action.option_strings or isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        found.setdefault(action.dest, action)
        for option in action.option_strings:
            if option.startswith("--"):
                found.setdefault(option[2:], action)
                found.setdefault(option[2:].replace("-", "_"), action)
    return found


def _switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _flag_of(action: argparse.Action) -> str:
    longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
    return (longs or action.option_strings)[0]


def _text(value: object) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def flags_for(parser: argparse.ArgumentParser, params: dict[str, object]) -> tuple[list[str], str | None]:
    """The flags of one configuration and the first problem found (None when the parser takes
    them all): an unknown name (with the closest known names), a reserved one, a switch given a
    value that is not true/false, or what the parser itself says of a value (wrong type, not
    among the choices)."""
    actions = _actions(parser)
    flags: list[str] = []
    for name, value in params.items():
        key = name.strip().lstrip("-")
        if key.replace("-", "_") in RESERVED:
            return flags, f"server parameter {name!r}: infermeter sets it itself; leave it out of the grid"
        action = actions.get(key) or actions.get(key.replace("-", "_"))
        if action is None:
            near = difflib.get_close_matches(key.replace("-", "_"), [k for k in actions if "-" not in k], n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            return flags, f"server parameter {name!r}: the engine has no such option{hint}"
        flag = _flag_of(action)
        if _switch(action):
            truth = {"true": True, "false": False}.get(str(value).strip().lower())
            if truth is None:
                return flags, f"server parameter {name!r}: a switch takes true or false, not {value!r}"
            if truth:
                flags.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):
                flags.append("--no-" + flag[2:])
            elif action.default not in (None, False):
                return flags, f"server parameter {name!r}: the engine has no way to switch it off"
            continue
        values = value if isinstance(value, list) else [value]
        flags += [flag, *(_text(v) for v in values)]
    return flags, _parse_error(parser, flags)


def _parse_error(parser: argparse.ArgumentParser, flags: list[str]) -> str | None:
    """What the parser says of ``flags`` (None: it takes them). Its own message, e.g.
    ``argument --max-num-seqs: invalid int value: 'abc'``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _, unknown = parser.parse_known_args(flags)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if "error:" in line]
        return (lines[-1].split("error:", 1)[1].strip() if lines else err.getvalue().strip()) or "refused"
    except Exception as exc:  # a type callable of the engine's raised something of its own
        return f"{type(exc).__name__}: {exc}"
    return f"unrecognised: {' '.join(unknown)}" if unknown else None


def llamacpp_parser() -> argparse.ArgumentParser:
    """The parser ``python -m llama_cpp.server`` builds (from its pydantic settings)."""
    from llama_cpp.server.cli import add_args_from_model
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    parser = argparse.ArgumentParser(add_help=False)
    add_args_from_model(parser, ModelSettings)
    add_args_from_model(parser, ServerSettings)
    return parser


def vllm_parser() -> argparse.ArgumentParser:
    """The parser ``vllm serve`` builds (``EngineArgs`` and the OpenAI server's own options)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(add_help=False))


PARSERS = {"llamacpp": llamacpp_parser, "vllm": vllm_parser}


def check(engine: str, configurations: list[dict[str, object]]) -> list[dict[str, object]]:
    """``[{"flags": [...], "error": str | None}]``, one per configuration, in order."""
    parser = PARSERS[engine]()
    return [dict(zip(("flags", "error"), flags_for(parser, params))) for params in configurations]


if __name__ == "__main__":  # inside the engine's environment: JSON in on stdin, JSON out on stdout
    request = json.load(sys.stdin)
    with contextlib.redirect_stdout(sys.stderr):  # the engine's import-time chatter
        answer = check(request["engine"], request["configurations"])
    json.dump(answer, sys.stdout)
