"""``infermeter doctor``: what infermeter needs on this machine, checked one by one, each
failure with its fix (``flows.commands.doctor`` prints them; ``checks.py`` holds one function
per check).

A check returns a :class:`Check`; :func:`run_checks` runs a list of them so that one that
raises is a failed check (its exception named), never the end of the others. Neither prefect
nor mlflow here: the MLflow store is checked through ``tasks.tracking``, Prefect's API by the
command (``flows``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

#: A check's outcome: ``ok``; ``warn`` (works, with a caveat); ``fail`` (a command needing it
#: will fail: the fix says what to do); ``skip`` (not applicable here).
STATUSES = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True)
class Check:
    """One check's result.

    Attributes:
        name: what was checked (``engine answers``, ``MLflow store``).
        status: one of :data:`STATUSES`.
        detail: what was found, with figures (a CPU's name, seconds, GiB free).
        fix: for ``warn`` and ``fail``, what to do (a command, a variable); else "".
    """

    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def run_checks(
    checks: Iterable[tuple[str, Callable[[], Check]]], on_check: Callable[[Check], None] | None = None
) -> list[Check]:
    """Run each ``(name, check)`` in order; one that raises is ``fail`` with its exception and
    the fix "report it" (a check must not end the others). ``on_check`` sees each result as it
    comes (the command prints it: some checks take seconds)."""
    results = []
    for name, check in checks:
        try:
            result = check()
        except Exception as exc:  # noqa: BLE001 - a broken check is a failed check, not a traceback
            result = Check(name, "fail", f"the check itself failed: {type(exc).__name__}: {exc}", "report it")
        results.append(result)
        if on_check is not None:
            on_check(result)
    return results
