"""The parsing on the stream client's hot path: an SSE body's framing and its JSON.

:class:`SSEFramer` cuts a body read in blocks into events, :func:`loads` decodes a data line;
the receive loops of :mod:`tasks.stream.transports` (chat and completions) and
:mod:`tasks.stream.responses` (the Responses API) use both, once per network read and once per
event: nothing else runs there (README "Cheaper per chunk" for what each costs).
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(payload: bytes) -> Any:
    """A data line's JSON value (RFC 8259): orjson's parser (a chat chunk in ~1 us, ~4 us with
    the standard library's: README "Cheaper per chunk"), and ``json``'s wherever orjson refuses
    the line: ``NaN``, ``Infinity`` and lone surrogates, which Python servers write and ``json``
    reads, or a line that is not JSON, which then raises ``json``'s own ``JSONDecodeError`` (the
    error :func:`tasks.stream.errors.classify` reads). (Integers beyond 64 bits come as floats.)"""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return json.loads(payload)


class SSEFramer:
    """Server-sent events framing of a body read in blocks (WHATWG HTML, "Server-sent events"):
    events end with a blank line; ``data:`` lines (one optional space after the colon) carry the
    payload, joined by ``\n`` when there are several; other lines (comments ``:``, ``event:``)
    are skipped; ``\r\n`` line ends are accepted. Shared by ``tasks.stream.transports.receive_sse`` and
    ``tasks.stream.responses.receive_responses``, on their hot path: one call per network
    read, no per-event generator."""

    __slots__ = ("_consumed", "_data", "_pending")

    def __init__(self) -> None:
        self._pending = b""  # the last, unfinished line
        self._data: list[bytes] = []  # the data lines of the event being read
        self._consumed = 0  # body bytes fed so far

    def feed(self, block: bytes) -> list[tuple[int, bytes]]:
        """The events that ``block`` (the body's next bytes) completes: ``(position, payload)``,
        ``position`` the body offset (bytes) of the ``\n`` that ended the event (for
        ``tasks.stream.rxclock``'s ``stamps_at``), ``payload`` its data (bytes)."""
        pending, data = self._pending, self._data
        position = self._consumed - len(pending) - 1  # body offset of the current line's "\n"
        self._consumed += len(block)
        lines = (pending + block).split(b"\n")
        self._pending = lines.pop()
        events = []
        for line in lines:
            position += len(line) + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if line:
                if line.startswith(b"data:"):
                    data.append(line[6:] if line[5:6] == b" " else line[5:])
                continue
            if data:
                events.append((position, data[0] if len(data) == 1 else b"\n".join(data)))
                data.clear()
        return events
