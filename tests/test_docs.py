"""The docs site builds, and the docs' commands still parse and run (issue 51, "docs that run").

Three checks, on README.md and every page under docs/ (not docs/_generated):

1. ``mkdocs build --strict`` succeeds (a broken link or anchor, a page missing from the nav, a
   snippet that is not there fails it), and the generated CLI reference names every command of
   the app and every option of ``stream`` (so a hook that silently wrote nothing fails too).
2. Every line of a ```bash fence that runs ``infermeter`` (optionally after ``$ ``, ``.venv/bin/``
   or ``NAME=value`` assignments; ``\\`` continues a line; the command ends at the first shell
   operator) is parsed against the real typer app with click's ``make_context``, which converts
   every value and raises on an unknown command or option, and invokes nothing.
3. A ```bash fence whose previous line is exactly ``<!-- docs-test: run -->`` is run: a page's
   marked blocks in order, in one ``bash -euo pipefail`` process, in a fresh folder holding
   copies of ``configs/`` and ``tests/``, ``.venv/bin`` first on PATH, MLflow in that folder and
   Prefect on the session's API server (tests/conftest.py), so nothing touches the user's
   mlruns/ or ~/.prefect. The process group is killed at the end, whatever the block started.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RUN_MARK = "<!-- docs-test: run -->"
#: Seconds one page's run blocks may take (their commands are small: a few requests each).
PAGE_LIMIT_S = 420


def doc_files() -> list[Path]:
    """README.md and the site's pages, the generated ones left out."""
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_generated" not in p.parts)
    return [ROOT / "README.md", *pages]


def _hook():
    """docs/hooks/generate_cli.py, the hook that finds the app as the console script does."""
    spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "docs" / "hooks" / "generate_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def group():
    """The click group behind ``infermeter``."""
    return _hook().find_group(ROOT)


# -- the fences ---------------------------------------------------------------------------------


def bash_blocks(text: str) -> list[tuple[int, list[str], bool]]:
    """Every ```bash fence of ``text``: (line number of its first line, its lines, whether the
    line before its opening is the run mark)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,}|~{3,})\s*(\w*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.group(2), opening.group(3)
        marked = i > 0 and lines[i - 1].strip() == RUN_MARK
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j])
            j += 1
        if lang in ("bash", "sh", "shell"):
            blocks.append((i + 2, body, marked))
        i = j + 1
    return blocks


_OPERATORS = {"|", "||", "&", "&&", ";", ";;", ">", ">>", "<", "<<", "(", ")", ">&", "<&", "2>", "&>"}


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, the line) of every ``infermeter`` command in the bash fences of ``text``,
    continuation lines joined."""
    found = []
    for first, body, _ in bash_blocks(text):
        k = 0
        while k < len(body):
            start, line = first + k, body[k]
            while line.rstrip().endswith("\\") and k + 1 < len(body):
                k += 1
                line = line.rstrip()[:-1] + " " + body[k].strip()
            k += 1
            words = line.strip().removeprefix("$ ").split()
            while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
                words.pop(0)
            if words and (words[0] == "infermeter" or words[0].endswith("/infermeter")):
                found.append((start, line.strip()))
    return found


def command_args(line: str) -> list[str]:
    """The arguments after ``infermeter`` in a shell line: quotes removed, comments and
    everything from the first shell operator (pipe, redirect, ``&&``, ``&``, ``$(``) on cut."""
    lexer = shlex.shlex(line.removeprefix("$ "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word in _OPERATORS or (word and set(word) <= set("|&;<>()")):
            if word[0] in "<>" and words and words[-1].isdigit():
                words.pop()  # the 2 of 2>&1
            break
        words.append(word)
    while words and not (words[0] == "infermeter" or words[0].endswith("/infermeter")):
        words.pop(0)  # NAME=value before the command
    return words[1:]


def parse_error(group, args: list[str]) -> str | None:
    """None when ``infermeter ARGS`` parses (command, options and values), else click's message.
    ``--help`` anywhere parses."""
    try:
        ctx = group.make_context("infermeter", list(args), resilient_parsing=False)
        with ctx:
            name, command, rest = group.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
            command.make_context(name, rest, parent=ctx, resilient_parsing=False).close()
    except Exception as exc:  # typer's own click: its Exit and ClickException classes
        if type(exc).__name__ == "Exit" and getattr(exc, "exit_code", 1) == 0:
            return None  # --help
        if hasattr(exc, "format_message"):
            return exc.format_message()
        raise
    return None


def parse_failures(group, text: str, name: str) -> list[str]:
    """``name:LINE: the line -> click's error`` for each command of ``text`` that does not parse."""
    failures = []
    for number, line in command_lines(text):
        error = parse_error(group, command_args(line))
        if error:
            failures.append(f"{name}:{number}: {line}\n    -> {error}")
    return failures


# -- 1. the strict build ------------------------------------------------------------------------


def test_site_builds_strict_with_its_references(tmp_path, group):
    started = time.monotonic()
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{(result.stdout + result.stderr)[-6000:]}"
    assert time.monotonic() - started < 120
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
    generated = ROOT / "docs" / "_generated"
    cli = (generated / "cli.md").read_text()
    for name in group.commands:
        assert f"## `infermeter {name}`" in cli, name
        assert (generated / "cli" / f"{name}.md").exists(), name
    stream = (generated / "cli" / "stream.md").read_text()
    options = [opt for p in group.commands["stream"].params for opt in p.opts if opt.startswith("--")]
    assert len(options) > 20
    missing = [opt for opt in options if opt != "--help" and f"`{opt}" not in stream]
    assert not missing, f"the generated stream reference misses {missing}"
    config = (generated / "config.md").read_text()
    for section in ("AuditConfig", "StreamConfig", "EndpointConfig", "`max_concurrency`"):
        assert section in config, section
    assert "`ttft_ms`" in (generated / "metrics.md").read_text()
    # the reference pages include them (the HTML holds the stream command's options)
    html = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--max-concurrency" in html and "--num-requests" in html


# -- 2. every command in the docs parses --------------------------------------------------------


def test_parse_check_catches_wrong_lines(group):
    """The checker itself: a wrong flag, a value that does not convert and an unknown command
    fail; a right line, its continuation, ``$ `` and ``.venv/bin/`` prefixes, pipes and comments
    pass; fences of other languages and non-infermeter lines are not read."""
    page = "\n".join(
        [
            "Intro.",
            "```bash",
            "$ infermeter stream --num-requests 4 --max-concurrency 1,2 \\",
            "    --max-tokens 8 --no-track   # a comment",
            ".venv/bin/infermeter compare --markdown 2>&1 | head -5",
            "PREFECT_API_URL=http://127.0.0.1:4200/api infermeter serve --help",
            "infermeter stream --no-such-flag",
            "infermeter stream --num-requests four",
            "infermeter no-such-command",
            "echo infermeter stream --also-not-read",
            "```",
            "```text",
            "infermeter stream --not-read-either",
            "```",
        ]
    )
    assert [n for n, _ in command_lines(page)] == [3, 5, 6, 7, 8, 9]
    failures = parse_failures(group, page, "fake.md")
    assert len(failures) == 3, failures
    assert (
        failures[0].startswith("fake.md:7: infermeter stream --no-such-flag")
        and "--no-such-flag" in failures[0]
    )
    assert failures[1].startswith("fake.md:8:") and "four" in failures[1]
    assert failures[2].startswith("fake.md:9:") and "no-such-command" in failures[2]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_commands_parse(path, group):
    failures = parse_failures(group, path.read_text(), str(path.relative_to(ROOT)))
    assert not failures, "commands the CLI does not accept:\n" + "\n".join(failures)


# -- 3. the run-marked blocks run ---------------------------------------------------------------


def run_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, script) of each run-marked bash fence of ``text``, in order."""
    return [(first, "\n".join(body)) for first, body, marked in bash_blocks(text) if marked]


def pages_with_runs() -> list[Path]:
    return [p for p in doc_files() if run_blocks(p.read_text())]


def test_run_marks_are_found():
    """The getting-started page's first stream is run-marked, so the run test below cannot
    quietly have nothing to run; and a mark is read only right above a bash fence."""
    assert ROOT / "docs" / "getting-started.md" in pages_with_runs()
    page = f"{RUN_MARK}\n```bash\necho one\n```\n\n{RUN_MARK}\n\n```bash\necho not marked\n```\n"
    assert run_blocks(page) == [(3, "echo one")]


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the shell is gone; what it left in its group goes too
            time.sleep(0.5)


def run_page(name: str, blocks: list[tuple[int, str]], tmp_path: Path, api_url: str, limit_s: float):
    """Run one page's ``blocks`` (:func:`run_blocks`) in order in one ``bash -euo pipefail``, in
    ``tmp_path/run`` holding copies of ``configs/`` and ``tests/``; kill its process group at
    the end. Returns (exit status, or None when it ran past ``limit_s`` seconds; seconds taken;
    the output's last 5,000 characters)."""
    from flows.prefect_server import stop_server

    folder = tmp_path / "run"
    folder.mkdir(parents=True)
    shutil.copytree(ROOT / "configs", folder / "configs")
    shutil.copytree(ROOT / "tests", folder / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    script = "\n".join(f'echo "== {name}:{first} at $SECONDS s"\n{body}' for first, body in blocks)
    script += '\necho "== done at $SECONDS s"'
    (tmp_path / "blocks.sh").write_text(script + "\n")
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}",
        "INFERMETER_WORK_DIR": str(tmp_path / "work"),
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "NO_COLOR": "1",
    }
    (folder / "mlruns").mkdir()
    log = tmp_path / "output.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", str(tmp_path / "blocks.sh")],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(proc)
            stop_server(tmp_path / "prefect-home")  # a server a block made there, if any
    return code, time.monotonic() - started, log.read_text(errors="replace")[-5000:]


def test_run_page_reports_a_failure_and_kills_what_it_started(tmp_path, shared_prefect_api):
    """The runner itself: a failing line stops the page (``-e``) with its output kept, a
    background process a block started is killed at the end, and a hung page is stopped at
    its limit."""
    blocks = [
        (3, "sleep 300 &\necho $! > background.pid\nls configs/default.yaml tests/groundtruth_server.py"),
        (9, "echo before-the-failure\nfalse\necho never-printed"),
    ]
    code, took, tail = run_page("fake.md", blocks, tmp_path / "a", shared_prefect_api, 60)
    assert code == 1 and took < 30, (code, took, tail)
    assert "== fake.md:9" in tail and "before-the-failure" in tail and "never-printed" not in tail
    background = Path(f"/proc/{int((tmp_path / 'a' / 'run' / 'background.pid').read_text())}/stat")
    # gone, or a zombie its new parent has not reaped yet (the shell that started it has exited)
    assert not background.exists() or background.read_text().split(")")[-1].split()[0] == "Z"
    code, took, tail = run_page(
        "hung.md", [(1, "echo waiting\nsleep 60")], tmp_path / "b", shared_prefect_api, 2
    )
    assert code is None and took < 20 and "waiting" in tail


@pytest.mark.parametrize("path", pages_with_runs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_runs(path, tmp_path, shared_prefect_api):
    blocks = run_blocks(path.read_text())
    code, took, tail = run_page(path.name, blocks, tmp_path, shared_prefect_api, PAGE_LIMIT_S)
    where = f"{path.relative_to(ROOT)} (blocks at lines {', '.join(str(f) for f, _ in blocks)})"
    print(f"{where}: exit {code} in {took:.0f} s; output's tail:\n{tail}")  # shown by pytest -rP
    assert code is not None, f"{where}: still running after {PAGE_LIMIT_S} s; output's tail:\n{tail}"
    assert code == 0, f"{where}: exit {code} after {took:.0f} s; output's tail:\n{tail}"
