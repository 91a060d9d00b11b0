"""Flag values read as the commands take them: comma-separated lists (every item present, each
converted), rates, SLO pairs; bad input is one line naming the flag and the fix, exit 2."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import typer

T = TypeVar("T")


def fail_input(message: str) -> None:
    """Bad input: one plain line on stderr, exit 2 (never a traceback, never wrapped)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def comma_items(option: str, text: str, what: str = "values") -> list[str]:
    """The stripped items of a comma-separated option value; an empty one (``1,,2``, ``1,``,
    ``,``) exits 2 naming the option and its position, and the value without it (an empty
    item is a typo, never "none")."""
    items = [item.strip() for item in text.split(",")]
    given = [item for item in items if item]
    if not given:
        fail_input(f"{option}: no value in {text!r}; give one or more {what}, comma-separated")
    for position, item in enumerate(items, 1):
        if not item:
            fail_input(
                f"{option}: item {position} of {text!r} is empty; give comma-separated {what} "
                f"without empty items, e.g. {option} {','.join(given)}"
            )
    return items


def parse_list(option: str, text: str | None, convert: Callable[[str], T]) -> list[T] | None:
    """`"1,4,16"` -> [1, 4, 16]; None stays None. Bad or empty items exit 2 naming the option
    (:func:`comma_items`)."""
    if text is None:
        return None
    items = comma_items(option, text)
    try:
        return [convert(item) for item in items]
    except ValueError as exc:
        # int() and float() explain in Python's words; our converters (rate) in the user's
        reason = "" if convert in (int, float) or "could not convert" in str(exc) else f": {exc}"
        fail_input(f"{option}: cannot read {text!r} as a comma-separated list of {convert.__name__}{reason}")


def rate(text: str) -> float | None:
    """A request rate: a positive number, or `inf` (None: send all at once)."""
    value = float(text)
    if math.isinf(value) and value > 0:
        return None
    if not value > 0:
        raise ValueError(f"{text} is not > 0; a rate is requests/s > 0, or inf")
    return value


def parse_slos(text: str | None) -> dict[str, float] | None:
    """`"ttft_ms:500,tpot_ms:50"` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    if text is None:
        return None
    slos: dict[str, float] = {}
    for item in comma_items("--goodput", text, "metric:limit pairs"):
        name, sep, value = item.partition(":")
        try:
            if not sep:
                raise ValueError
            slos[name.strip()] = float(value)
        except ValueError:
            fail_input(f"--goodput: expected metric:limit pairs like ttft_ms:500,tpot_ms:50, got {item!r}")
    return slos
