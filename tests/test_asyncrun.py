"""tasks.asyncrun: asyncio.run's result and errors, never the repr of the result."""

from __future__ import annotations

import asyncio

import pytest

from tasks import asyncrun


class Loud:
    """A result that counts how often it was formatted."""

    reprs = 0

    def __repr__(self) -> str:
        Loud.reprs += 1
        return "Loud()"


def test_the_result_comes_back_unformatted() -> None:
    async def level() -> Loud:
        await asyncio.sleep(0)
        return Loud()

    Loud.reprs = 0
    result = asyncrun.run(level())
    assert isinstance(result, Loud)
    assert Loud.reprs == 0  # asyncio.run on Python 3.11 formats it twice (the module docstring)


def test_an_exception_of_the_coroutine_is_raised() -> None:
    async def failing() -> None:
        raise ValueError("bad level")

    with pytest.raises(ValueError, match="bad level"):
        asyncrun.run(failing())
