"""MkDocs hook: the CLI reference, written from the real typer app before every build.

Writes ``docs/_generated/cli.md`` (every command: its help and its options) and
``docs/_generated/cli/<command>.md`` (one command's usage and options table, which its page
includes with ``--8<-- "docs/_generated/cli/<command>.md"``). The app is found as the console
script finds it: ``[project.scripts] infermeter`` in pyproject.toml names the entry function's
module, and the app is that module's ``app`` or the one it imports (``from X import app``), so
a module moved between rooms moves the reference with it. The option defaults are the ones
``infermeter <command> --help`` shows (the config model's default where the option has none:
``show_config_defaults``, applied where the entry module uses it).

The pattern is vLLM's (docs/mkdocs/hooks/generate_argparse.py): the reference is made from the
parser at build time, so it cannot drift from the code. Files are rewritten only when their
text changed, so ``mkdocs serve`` does not rebuild in a loop.
"""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # MkDocs loads hooks by path (hook_markdown.py)
from hook_markdown import cell, write_if_changed  # noqa: E402

SCRIPT = "infermeter"


def _root(config: Any) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def find_group(root: Path) -> Any:
    """The click group behind the console script, as ``infermeter --help`` builds it.

    Raises:
        LookupError: pyproject.toml names no ``infermeter`` script, or its module neither
            holds nor imports a typer app called ``app``.
    """
    import typer

    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"].get("scripts", {})
    if SCRIPT not in scripts:
        raise LookupError(f"pyproject.toml: no [project.scripts] {SCRIPT}")
    module = importlib.import_module(scripts[SCRIPT].split(":")[0])
    source = Path(module.__file__).read_text(encoding="utf-8")
    imports = {
        name.strip(): mod
        for mod, names in re.findall(r"from ([\w.]+) import ([\w, ]+)", source)
        for name in names.split(",")
    }
    app = getattr(module, "app", None)
    if not isinstance(app, typer.Typer):
        if "app" not in imports:
            raise LookupError(f"{module.__name__} neither holds nor imports a typer app named `app`")
        app = importlib.import_module(imports["app"]).app
    group = typer.main.get_command(app)
    if "show_config_defaults" in imports:
        group = importlib.import_module(imports["show_config_defaults"]).show_config_defaults(group)
    return group


def prose(text: str) -> str:
    """A command's help as markdown paragraphs: click's ``\\f`` cut and ``\\b`` markers honoured,
    HTML escaped."""
    text = (text or "").split("\f")[0]
    paragraphs = []
    for block in re.split(r"\n\s*\n", text.strip()):
        if block.lstrip().startswith("\b"):
            lines = block.lstrip().lstrip("\b").strip("\n").splitlines()
            paragraphs.append("\n".join("    " + line for line in lines))
        else:
            paragraphs.append(cell(block).replace("\\|", "|").replace("\\*", "*"))
    return "\n\n".join(paragraphs)


def _default(param: Any) -> str:
    if isinstance(param.show_default, str):
        return param.show_default
    if param.show_default is False or param.default is None or callable(param.default):
        return ""
    if isinstance(param.default, list | tuple):
        return ",".join(str(v) for v in param.default)
    return str(param.default).lower() if isinstance(param.default, bool) else str(param.default)


def options_table(command: Any, ctx: Any) -> str:
    """One command's parameters as a markdown table: flags, type, default, help."""
    rows = ["| option | type | default | help |", "| --- | --- | --- | --- |"]
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False) or param.name == "help":
            continue
        if param.param_type_name == "argument":
            flags = param.name.upper() + ("..." if param.nargs == -1 else "")
        else:
            flags = ", ".join(param.opts + param.secondary_opts)
        kind = "flag" if getattr(param, "is_flag", False) else param.display_type(ctx).strip("<>")
        raw = " ".join(_default(param).split())
        default = f"`{raw}`" if raw and not set(raw) & set("`|<&*\\") else cell(raw)
        rows.append(f"| `{flags}` | {cell(kind)} | {default} | {cell(param.help or '')} |")
    return "\n".join(rows) + "\n"


def command_page(name: str, command: Any) -> str:
    """``docs/_generated/cli/<name>.md``: the usage line and the options table."""
    ctx = command.make_context(f"{SCRIPT} {name}", [], resilient_parsing=True)
    usage = " ".join(command.collect_usage_pieces(ctx))
    return f"```text\n{SCRIPT} {name} {usage}\n```\n\n" + options_table(command, ctx)


def reference(group: Any, pages: dict[str, str]) -> str:
    """``docs/_generated/cli.md``: the commands' list, then each command's help and options."""
    lines = [
        f"`{SCRIPT} [OPTIONS] COMMAND [ARGS]...`: {cell(group.help or '')}",
        "",
        "| command | what it is for |",
        "| --- | --- |",
    ]
    for name, command in group.commands.items():
        first = (command.help or "").split("\f")[0].strip().split("\n\n")[0]
        lines.append(f"| [`{name}`](#{SCRIPT}-{name}) | {cell(first)} |")
    for name, command in group.commands.items():
        lines += ["", f"## `{SCRIPT} {name}` {{#{SCRIPT}-{name}}}", "", prose(command.help), "", pages[name]]
    return "\n".join(lines).rstrip() + "\n"


def generate(root: Path) -> list[str]:
    """Write the CLI reference under ``root/docs/_generated``; returns the commands' names."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    group = find_group(root)
    out = root / "docs" / "_generated"
    pages = {name: command_page(name, command) for name, command in group.commands.items()}
    for name, text in pages.items():
        write_if_changed(out / "cli" / f"{name}.md", text)
    write_if_changed(out / "cli.md", reference(group, pages))
    return list(pages)


def on_pre_build(config: Any) -> None:
    generate(_root(config))
