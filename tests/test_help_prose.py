"""`infermeter --help` and every `infermeter <command> --help` read as prose (issue 51): no
sentence is broken across lines by a newline of the source, and each command's first help line
says what the command is for, as one sentence ending with a period.

The help is rendered as the console script renders it (``flows.cli.main``: the typer app, its
config defaults shown) on a terminal 200 columns wide. A line break is hard when the next line's
first word would have fitted on the line: rich wraps greedily, so a break it made itself always
means the word did not fit (issue 51's example: "in the foreground / (127.0.0.1)").
"""

import re

import typer
from click.testing import CliRunner

from flows.cli.app import COMMANDS, app
from flows.cli.helptext import prose, show_config_defaults

WIDTH = 200
#: the end of a line that leaves its sentence open: a word or a comma, no closing punctuation
OPEN_END = re.compile(r"[A-Za-z0-9_,]$")
#: a line that starts a list item, which a deliberate break may precede
ITEM = re.compile(r"([-*+•]|\d+[.)]) ")


def _render(group, args: list[str]) -> str:
    result = CliRunner().invoke(group, args, env={"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH)})
    assert result.exit_code == 0, result.output
    return result.output


def _cells(line: str) -> tuple[str, int, int, int]:
    """(the line's text, the column after it, the column after the last one text may use, the
    column the text starts at). Inside a panel (``│ ... │``) text keeps two columns off the right
    border (the panel's padding and the table's); a paragraph keeps one off the edge."""
    stripped = line.rstrip()
    limit = WIDTH - 1
    if stripped.startswith("│") and stripped.endswith("│"):
        stripped = stripped[:-1].rstrip()
        limit = len(line.rstrip()) - 1 - 2
    text = stripped.lstrip("│ ")
    return text, len(stripped), limit, len(stripped) - len(text)


def hard_breaks(text: str) -> list[str]:
    """The pairs of lines (``"A / B"``) of a rendered help where a sentence was broken although
    the next word fitted: the line ends open (a word or a comma), the next one continues it (it
    starts further right inside a panel row, or at the same column in a paragraph, with a
    lowercase word, an option or an opening bracket or quote, not a list item) and that word
    would have fitted before the right edge."""
    found = []
    lines = text.splitlines()
    for line, following in zip(lines, lines[1:]):
        body, end, limit, start = _cells(line)
        next_body, _, _, next_start = _cells(following)
        word = next_body.split(" ")[0]
        if not word or not OPEN_END.search(body) or not (word[0].islower() or word[0] in "(`'\"-"):
            continue
        if ITEM.match(next_body) or next_start < start:
            continue  # a list item, or a new row of the panel
        if end + 1 + len(word) <= limit:
            found.append(f"{body} / {next_body}")
    return found


def test_the_check_sees_a_sentence_broken_by_the_source():
    """The check itself: the server command's docstring as written (wrapped at 100 columns in
    the source), registered without :func:`prose`, shows its breaks in the commands list (the
    first paragraph) and in the command's own help (the second); through :func:`prose`, none."""
    from flows.commands.server import command

    for help_text, broken in ((None, True), (prose(command.__doc__), False)):
        one = typer.Typer(add_completion=False)
        one.command("server", help=help_text)(command)
        one.command("other")(lambda: None)  # two commands: a group, as infermeter's app is
        group = typer.main.get_command(one)
        for args in (["--help"], ["server", "--help"]):
            assert bool(hard_breaks(_render(group, args))) is broken, (help_text, args)


def test_every_help_reads_as_prose():
    group = show_config_defaults(typer.main.get_command(app))
    names = [name for name, _ in COMMANDS]
    assert sorted(group.commands) == sorted(names)
    for args in ([], *([name] for name in names)):
        shown = _render(group, [*args, "--help"])
        assert hard_breaks(shown) == [], f"infermeter {' '.join(args)} --help"
    for name in names:
        command = group.commands[name]
        first = command.help.split("\n\n")[0]
        assert first and "\n" not in first and first.endswith("."), (name, first)
        for param in command.params:  # an option's help: one paragraph, one line
            assert "\n" not in (getattr(param, "help", None) or ""), (name, param.name)
