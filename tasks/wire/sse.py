"""The parsing on the stream client's hot path: an SSE body's framing and its JSON.

:class:`SSEFramer` cuts a body read in blocks into events, :func:`loads` decodes a data line;
the readers of :mod:`tasks.wire.transports` (chat and completions) and
:mod:`tasks.wire.responses` (the Responses API) use both, once per body piece and once per
event: nothing else runs there (README "Cheaper per chunk" for what each costs).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson


def loads(payload: bytes) -> Any:
    """A data line's JSON value (RFC 8259): orjson's parser (a chat chunk in ~1 us, ~4 us with
    the standard library's: README "Cheaper per chunk"), and ``json``'s wherever orjson refuses
    the line: ``NaN``, ``Infinity`` and lone surrogates, which Python servers write and ``json``
    reads, or a line that is not JSON, which then raises ``json``'s own ``JSONDecodeError`` (the
    error :func:`tasks.wire.errors.classify` reads). (Integers beyond 64 bits come as floats.)"""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return json.loads(payload)


class SSEFramer:
    """Server-sent events framing of a body read in pieces (WHATWG HTML, "Server-sent events"):
    events end with a blank line; ``data:`` lines (one optional space after the colon) carry the
    payload, joined by ``\n`` when there are several; other lines (comments ``:``, ``event:``)
    are skipped; ``\r\n`` line ends are accepted. Shared by ``tasks.wire.transports.receive_sse``
    and ``tasks.wire.responses.receive_responses``, on their hot path: :meth:`sink` is the body's
    reader (``tasks.wire.h1.Sink``), one call per body piece, no per-event generator, and a piece
    that is one whole ``data: ...`` event (what a streaming server writes per chunk) is handed on
    without splitting it.

    ``on_event(payload, read_ns, rx_ns)``: called by :meth:`sink` for every event's payload
    (bytes) with the stamps of the read that completed it."""

    __slots__ = ("_data", "_on_event", "_pending")

    def __init__(self, on_event: Callable[[bytes, int, int | None], None] | None = None) -> None:
        self._pending = b""  # the last, unfinished line
        self._data: list[bytes] = []  # the data lines of the event being read
        self._on_event = on_event

    @property
    def idle(self) -> bool:
        """Nothing is held (no part of a line, no data line of an unfinished event): a block
        that is one whole ``data: ...`` event is then handed on as that event."""
        return not self._pending and not self._data

    def sink(self, block: bytes, read_ns: int, rx_ns: int | None) -> None:
        """Frame ``block`` (the body's next bytes, delivered by the read stamped ``read_ns`` /
        ``rx_ns``) and hand every event it completes to ``on_event``."""
        if (
            not self._pending
            and not self._data
            and block.startswith(b"data: ")
            and block.find(b"\n") == len(block) - 2
            and block[-1] == 10  # the event's blank line: "\n\n" ends it ...
            and block[-3] != 13  # ... and not "\r\n\n" (then the line's end is "\r\n")
        ):
            self._on_event(block[6:-2], read_ns, rx_ns)
            return
        for payload in self.feed(block):
            self._on_event(payload, read_ns, rx_ns)

    def feed(self, block: bytes) -> list[bytes]:
        """The payloads (bytes) of the events that ``block`` (the body's next bytes) completes."""
        data = self._data
        lines = (self._pending + block).split(b"\n")
        self._pending = lines.pop()
        events = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if line:
                if line.startswith(b"data:"):
                    data.append(line[6:] if line[5:6] == b" " else line[5:])
                continue
            if data:
                events.append(data[0] if len(data) == 1 else b"\n".join(data))
                data.clear()
        return events
