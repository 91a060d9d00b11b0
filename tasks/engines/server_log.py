"""What a server's log says when the server did not start: the lines that name the error
(:func:`error_lines`), for :class:`tasks.engines.server.ServerStartError`'s message. A server's log
often says it at the top and ends with something else: llama-cpp-python's server prints its
settings' pydantic validation, then the whole of argparse's help. Standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path

#: A line that names what failed (case-insensitive words; see :func:`error_lines`).
_ERROR_WORDS = re.compile(
    r"\b(errors?|exception|fatal|failed|failure|invalid|cannot|can't|could not|unable to|"
    r"not found|no such|denied|refused|out of memory|input should|field required|not permitted)\b",
    re.IGNORECASE,
)
#: Lines that hold those words and say nothing of what failed (pydantic's link, Python's chaining).
_NOISE = (
    "For further information visit",
    "During handling of the above exception",
    "The above exception was the direct cause",
)
#: Lines that hold those words and are not errors (llama.cpp's load: "... cannot be used with
#: preferred buffer type CPU_REPACK, using CPU instead" is a choice it made, not a failure).
_NOT_ERRORS = re.compile(r"using CPU instead|HTTP/1\.[01]\" \d{3}")
_ARGPARSE_ERROR = re.compile(r"^\S+: error: ")
_PYDANTIC_HEADER = re.compile(r"^\d+ validation errors? for ")
#: vLLM's prefix on the lines of its processes: ``(APIServer pid=4242) ``, ``(EngineCore_DP0 pid=7) ``.
_PROCESS_PREFIX = re.compile(r"^\([\w.-]+ pid=\d+\) ")


def error_lines(text: str, limit: int = 12) -> list[str]:
    """The lines of a server's log that say what failed, in the log's order, each once.

    Picked: lines naming an error (:data:`_ERROR_WORDS`: ``Error``, ``Exception``, ``invalid``,
    ``Input should`` ...); a traceback's last line (the exception, not its frames); a pydantic
    ``N validation error(s) for X`` block as its header and one ``<field>: <message>`` line per
    error (llama-cpp-python's server prints its settings' validation so, then argparse's help);
    from argparse's ``usage:`` block on, only its ``prog: error: ...`` line (the help text is not
    an error). vLLM's ``(APIServer pid=N)`` prefixes are read past. More than ``limit``: the first ``limit - limit // 3`` and the last ``limit // 3``,
    with ``...`` between. Returns [] when no line names an error (then the log's tail is all
    there is to show)."""
    lines = [_PROCESS_PREFIX.sub("", line) for line in text.splitlines()]
    picked: list[str] = []
    mode = ""  # "usage" (argparse's help), "traceback" (its frames), "pydantic" (its block)
    for i, line in enumerate(lines):
        stripped = line.strip()
        indented = line[:1].isspace()
        if not stripped:
            if mode == "pydantic":
                mode = ""
            continue
        if line.startswith("Traceback (most recent call last)"):
            mode = "traceback"
            continue
        if mode == "traceback":
            if indented:
                continue
            mode = ""
            picked.append(stripped)  # the exception the frames led to
            continue
        if line.startswith("usage:"):
            mode = "usage"
            continue
        if mode == "usage":
            if _ARGPARSE_ERROR.match(line):
                picked.append(stripped)
            continue
        if _PYDANTIC_HEADER.match(line):
            mode = "pydantic"
            picked.append(stripped)
            continue
        if mode == "pydantic":
            if stripped.startswith(_NOISE[0]):
                continue
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if not indented and following[:1].isspace() and "[type=" in following:
                continue  # the field; its message, next, carries it
            if indented and "[type=" in line:
                field = lines[i - 1].strip()
                picked.append(f"{field}: {stripped}" if not lines[i - 1][:1].isspace() else stripped)
                continue
            mode = ""
        if _ERROR_WORDS.search(line) and not stripped.startswith(_NOISE) and not _NOT_ERRORS.search(line):
            picked.append(stripped)
    unique = list(dict.fromkeys(picked))  # engines with several processes repeat their errors
    if len(unique) > limit:
        unique = [*unique[: limit - limit // 3], "...", *unique[len(unique) - limit // 3 :]]
    return unique


def log_excerpt(log_path: Path, tail_lines: int = 20) -> tuple[str, str]:
    """(one line of what failed, or ""; the lines to show: those that name the error, then
    the log's last lines) of the server's log at ``log_path``."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "", f"its log ({log_path}): (no log)"
    picked = error_lines(text)
    if not picked:
        tail = "\n".join(text.splitlines()[-tail_lines:])
        return "", f"its log ({log_path}) ends:\n{tail}"
    tail = "\n".join(text.splitlines()[-(tail_lines // 2) :])
    said = "\n".join(f"  {line}" for line in picked)
    summary = " | ".join(line for line in picked if line != "...")
    return summary, f"its log ({log_path}) says what failed:\n{said}\nand ends:\n{tail}"
