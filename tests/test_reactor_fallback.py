"""tasks.wire.reactor's fallback: the stream client without asyncio's private attributes.

The compiled read waits in the loop's own epoll, which needs asyncio's ``_selector``, ``_ready``
and ``_scheduled`` (``reactor.probe`` checks them once per reactor). Where they are missing or of
another type (another Python's asyncio, a loop that is not asyncio's epoll loop, uvloop), or
``INFERMETER_REACTOR_FALLBACK=1`` is set, the reactor reads what is ready each loop turn through
public APIs only. The Pythons this project supports (3.11-3.13) all have the attributes, so the
fallback is forced here: tests/test_h1.py's tests and the stamped-stream tests of
tests/test_stream_hot_path.py run again on it, beside the probe's own cases on real loops.
"""

from __future__ import annotations

import asyncio
import select
import selectors
import sys
from collections.abc import Iterator

import pytest

from tasks.wire import reactor
from tasks.wire.pool import Pool

try:
    from tests import test_h1, test_stream_hot_path
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    import test_h1  # type: ignore[no-redef]
    import test_stream_hot_path  # type: ignore[no-redef]

pytestmark = pytest.mark.skipif(not reactor.SUPPORTED, reason="the reactor is Linux's (epoll)")

# The stream client's own tests, collected here again and run on the fallback (fixture below).
for _name, _test in vars(test_h1).items():
    if _name.startswith("test_"):
        globals()[_name] = _test
for _name in (
    "test_a_read_costs_no_timer",
    "test_a_stamped_stream_is_framed_in_each_reads_callback_with_its_times",
    "test_a_stamped_stream_ends_when_its_body_ends",
):
    globals()[_name] = getattr(test_stream_hot_path, _name)
server = test_stream_hot_path.server  # the module's instrument, as there


@pytest.fixture(autouse=True)
def read_path(request, monkeypatch) -> Iterator[str]:
    """Every test of this module on the fallback: the compiled read (where built) with no wait
    in the loop's epoll, forced by the environment; each reactor made in the test must say so.
    (The name is tests/test_h1.py's fixture's, which it replaces for the tests collected here.)"""
    if request.node.name.startswith("test_probe_"):  # the probe's own cases set their loops up
        yield "probe"
        return
    monkeypatch.setenv(reactor.FALLBACK_ENV, "1")
    paths: list[str] = []
    made = reactor.Reactor.__init__

    def watched(self, loop) -> None:
        made(self, loop)
        paths.append(self.path)

    monkeypatch.setattr(reactor.Reactor, "__init__", watched)
    yield "fallback"
    assert set(paths) <= {"read" if reactor.COMPILED else "python"}, paths


def _body_through(pool_on_loop) -> tuple[bytes, str, str | None, int]:
    """One POST through a pool on the loop ``pool_on_loop`` makes, read whole: the body, its
    reactor's path and fallback reason, and how many pieces had a kernel stamp."""

    async def script(reader, writer) -> None:
        await test_h1._read_request(reader)
        writer.write(test_h1.CHUNKED_HEAD)
        for event in test_h1.EVENTS:  # one event per write, apart: one read each
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.write(b"0\r\n\r\n")
        await reader.read()

    async def body(pool: Pool):
        status, data, response = await test_h1._post_and_read(pool)
        assert status == 200, status
        return data, pool._reactor.path, pool._reactor.fallback_reason, response

    with asyncio.Runner(loop_factory=pool_on_loop) as runner:
        (data, path, reason, response), _ = runner.run(test_h1._serve(script, body))
    stamped = sum(1 for _, _, rx_ns in response.pieces if rx_ns is not None)
    return data, path, reason, stamped


def test_probe_finds_asyncios_private_attributes_on_this_python() -> None:
    """CPython 3.11-3.13's selector loop has what the wait needs: the compiled read waits here
    (a Python whose asyncio changed fails this test rather than falling back unseen)."""
    data, path, reason, stamped = _body_through(asyncio.SelectorEventLoop)
    assert data == b"".join(test_h1.EVENTS)
    assert (path, reason) == ("wait" if reactor.COMPILED else "python", None)
    assert stamped == len(test_h1.EVENTS)  # kernel stamps on each read


@pytest.mark.parametrize(
    "loop_factory, why",
    [
        (lambda: asyncio.SelectorEventLoop(selectors.PollSelector()), "PollSelector holds no select.epoll"),
        (lambda: __import__("uvloop").new_event_loop(), "Loop has no selector"),
    ],
    ids=["poll-selector", "uvloop"],
)
def test_probe_falls_back_on_a_loop_without_asyncios_epoll(loop_factory, why) -> None:
    """A loop whose internals the wait cannot use is read on the fallback, the body whole and
    the reason given (uvloop reads its own sockets in C: the reactor's epoll is one of them)."""
    if "uvloop" in why:
        pytest.importorskip("uvloop")
    data, path, reason, stamped = _body_through(loop_factory)
    assert data == b"".join(test_h1.EVENTS)
    assert path == ("read" if reactor.COMPILED else "python") and why in reason, (path, reason)
    assert stamped == len(test_h1.EVENTS)


def test_probe_falls_back_when_the_environment_says_so(monkeypatch) -> None:
    monkeypatch.setenv(reactor.FALLBACK_ENV, "1")
    data, path, reason, _ = _body_through(asyncio.SelectorEventLoop)
    assert data == b"".join(test_h1.EVENTS)
    assert (
        path == ("read" if reactor.COMPILED else "python") and reason == "INFERMETER_REACTOR_FALLBACK is set"
    )
    monkeypatch.setenv(reactor.FALLBACK_ENV, "0")  # "0" is the default: the wait
    _, path, reason, _ = _body_through(asyncio.SelectorEventLoop)
    assert path == ("wait" if reactor.COMPILED else "python") and reason is None


@pytest.mark.parametrize(
    "attribute, value, why",
    [
        ("_ready", [], "_ready is not a deque"),
        ("_scheduled", (), "_scheduled is not a list of TimerHandle"),
        ("_scheduled", [object()], "_scheduled is not a list of TimerHandle"),
        ("_selector", None, "has no selector"),
    ],
)
def test_probe_refuses_internals_of_another_shape(attribute, value, why) -> None:
    """What a later asyncio might hold instead (another container, another timer object, no
    selector): the probe says which, and the reactor reads without the wait."""
    loop = asyncio.SelectorEventLoop()
    epoll = select.epoll()
    try:
        loop.add_reader(epoll.fileno(), lambda: None)
        assert reactor.probe(loop, epoll.fileno()) == (loop._selector._selector.fileno(), None)
        saved = getattr(loop, attribute)
        setattr(loop, attribute, value)
        try:
            epfd, reason = reactor.probe(loop, epoll.fileno())
        finally:
            setattr(loop, attribute, saved)
        assert epfd == -1 and why in reason, reason
        # a reader this selector does not hold: not the loop the reactor reads on
        loop.remove_reader(epoll.fileno())
        assert reactor.probe(loop, epoll.fileno())[0] == -1
    finally:
        loop.close()
        epoll.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the compiled read is Linux's")
def test_probe_python_read_when_not_compiled(monkeypatch) -> None:
    """Where _rx.c was not built the reactor reads in Python: path "python", the body whole."""
    monkeypatch.setattr(reactor, "_rx", None)
    monkeypatch.setattr(test_h1.h1, "_rx", None)
    data, path, _, stamped = _body_through(asyncio.SelectorEventLoop)
    assert data == b"".join(test_h1.EVENTS) and path == "python"
    assert stamped == len(test_h1.EVENTS)
