"""Reading a user's text file (a config, a prompts file, a dataset) as UTF-8, with one line
naming the file, the byte offset and the line when it is not UTF-8, instead of Python's
``UnicodeDecodeError`` traceback. Standard library only."""

from __future__ import annotations

from pathlib import Path

__all__ = ["read_utf8"]


def read_utf8(path: str | Path, error: type[Exception] = ValueError, option: str | None = None) -> str:
    """The text of ``path``, decoded as UTF-8 (as ``Path.read_text(encoding="utf-8")``).

    Args:
        error: the exception raised for a file that is not UTF-8 (the caller's own kind,
            e.g. ``ConfigError``), with a one-line message.
        option: the flag that named the file (``--prompts``), written before the path.

    Raises:
        error: e.g. ``--prompts: p.txt: not UTF-8 text: byte 0xff at offset 7 (line 2);
            save the file as UTF-8``.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        where = f"{option}: {path}" if option else str(path)
        raise error(
            f"{where}: not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
            f"(line {line}); save the file as UTF-8"
        ) from None
