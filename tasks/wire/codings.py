"""Content codings of a streamed response (RFC 9110 §8.4): what the stream client accepts and the
decoders :class:`tasks.wire.h1.Response` runs on a body sent compressed.

An endpoint behind a compressing proxy or router (one that compresses whatever it was asked, or
anything) sends its SSE body with ``Content-Encoding: gzip`` (or ``deflate``, ``br``). The client
asks for :data:`ACCEPT_ENCODING` and decodes such a body as it arrives: each read's compressed bytes
are decoded in that read's callback and the text they carry goes on with that read's stamps, so a
chunk's arrival time is the arrival of the compressed bytes that carried it. A proxy that
compresses without flushing per event (gzip's ``Z_SYNC_FLUSH``) holds the events back until its
buffer fills or the body ends: the arrival times are then the proxy's, not the server's, which is
why the record names the coding (``RequestRecord.content_encoding``).

Decoded: ``gzip`` (and ``x-gzip``, RFC 9110 §8.4.1.3), ``deflate`` (§8.4.1.2: the zlib format of
RFC 1950; the raw deflate of RFC 1951 that some servers send under that name is read too, as
urllib3 and browsers read it), ``br`` (RFC 7932, with Google's ``brotli`` package where it is
installed), several codings in the order applied, ``identity``. Any other (``zstd``, ``compress``,
an unknown name) raises :class:`EncodingError` naming it. Standard library (and ``brotli``) only.
"""

from __future__ import annotations

import zlib
from typing import Protocol

try:
    import brotli
except ImportError:  # an install without it: ``br`` is then neither asked for nor read
    brotli = None  # type: ignore[assignment]

__all__ = ["ACCEPT_ENCODING", "Decoder", "EncodingError", "decoder_for"]

#: The request's ``Accept-Encoding`` (RFC 9110 §12.5.3): the codings :func:`decoder_for` reads.
ACCEPT_ENCODING = "gzip, deflate, br" if brotli is not None else "gzip, deflate"


class EncodingError(Exception):
    """A body this client cannot decode: a coding it does not read, or bytes that are not of the
    coding named (the message says which, and what to do)."""


class Decoder(Protocol):
    """A body's decoder: ``decompress(compressed) -> decoded`` per piece, ``flush()`` at the
    body's end (what is left); both raise :class:`EncodingError`."""

    def decompress(self, data: bytes) -> bytes: ...  # noqa: D102

    def flush(self) -> bytes: ...  # noqa: D102


def _broken(coding: str, exc: Exception) -> EncodingError:
    return EncodingError(f"the server's body in Content-Encoding {coding!r} does not decode: {exc}")


class _Gzip:
    """gzip (RFC 1952), members one after another (a proxy may start a new one per flush).
    Bytes after a whole member that do not start another (no ``1f 8b`` magic: zero padding,
    trailing garbage) are ignored, as urllib3's ``GzipDecoder`` ignores them ("trailing garbage
    acceptable in other gzip clients") and Python's ``gzip`` module skips zero padding: the
    answer before them arrived whole. A member that starts and then breaks still raises."""

    __slots__ = ("_obj", "_started", "_trailing")

    def __init__(self) -> None:
        self._obj = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._started: bytes | None = None  # a later member's first bytes (up to 2); None: the first
        self._trailing = False  # bytes after the last member that start none: the rest ignored

    def decompress(self, data: bytes) -> bytes:
        if self._trailing:
            return b""
        out = b""
        try:
            if self._started is not None and len(self._started) < 2:
                self._started += data[: 2 - len(self._started)]
            out = self._obj.decompress(data)
            while self._obj.eof and self._obj.unused_data:
                rest, self._obj = self._obj.unused_data, zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._started = rest[:2]
                out += self._obj.decompress(rest)
        except zlib.error as exc:
            if self._started is None or b"\x1f\x8b".startswith(self._started):
                raise _broken("gzip", exc) from None
            self._trailing = True
        return out

    def flush(self) -> bytes:
        if self._trailing:
            return b""
        try:
            return self._obj.flush()
        except zlib.error as exc:
            raise _broken("gzip", exc) from None


class _Deflate:
    """deflate: the zlib format (RFC 1950) as RFC 9110 §8.4.1.2 says, else raw deflate (RFC 1951),
    decided on the first bytes (held until they decode: urllib3's ``DeflateDecoder`` does the same)."""

    __slots__ = ("_held", "_obj")

    def __init__(self) -> None:
        self._obj = zlib.decompressobj()
        self._held: bytes | None = b""  # the bytes before the first output; None once decided

    def decompress(self, data: bytes) -> bytes:
        try:
            if self._held is None:
                return self._obj.decompress(data)
            self._held += data
            try:
                out = self._obj.decompress(data)
            except zlib.error:  # not a zlib header: raw deflate from the first byte
                self._obj, held, self._held = zlib.decompressobj(-zlib.MAX_WBITS), self._held, None
                return self._obj.decompress(held)
            if out:
                self._held = None
            return out
        except zlib.error as exc:
            raise _broken("deflate", exc) from None

    def flush(self) -> bytes:
        try:
            return self._obj.flush()
        except zlib.error as exc:
            raise _broken("deflate", exc) from None


class _Brotli:
    __slots__ = ("_obj",)

    def __init__(self) -> None:
        self._obj = brotli.Decompressor()

    def decompress(self, data: bytes) -> bytes:
        try:
            return self._obj.process(data)
        except brotli.error as exc:
            raise _broken("br", exc) from None

    def flush(self) -> bytes:
        return b""


class _Chain:
    """Several codings (``Content-Encoding: gzip, br``: gzip applied first): undone last first."""

    __slots__ = ("_decoders",)

    def __init__(self, decoders: list[Decoder]) -> None:
        self._decoders = decoders[::-1]

    def decompress(self, data: bytes) -> bytes:
        for decoder in self._decoders:
            data = decoder.decompress(data)
        return data

    def flush(self) -> bytes:
        data = b""
        for decoder in self._decoders:  # what one leaves is the next one's last input
            data = (decoder.decompress(data) if data else b"") + decoder.flush()
        return data


class _AsSentOnError:
    """An error response's decoder (read for its message only): bytes that do not decode in the
    coding named (a gateway labelling a plain error page ``gzip``) are handed on as sent, so the
    response's status stays its error (``bad_payload`` would hide a 503 behind the label)."""

    __slots__ = ("_decoder", "_held", "_failed")

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._held: bytes | None = b""  # the bytes so far while nothing decoded; None after
        self._failed = False

    def decompress(self, data: bytes) -> bytes:
        if self._failed:
            return data
        if self._held is not None:
            self._held += data
        try:
            out = self._decoder.decompress(data)
        except EncodingError:
            self._failed = True
            held, self._held = self._held, None
            return data if held is None else held
        if out:
            self._held = None
        return out

    def flush(self) -> bytes:
        if self._failed:
            return b""
        try:
            return self._decoder.flush()
        except EncodingError:
            self._failed = True
            return self._held or b""


class _Unread:
    """A coding this client does not read: the body's first bytes (or its end) raise."""

    __slots__ = ("_error",)

    def __init__(self, error: EncodingError) -> None:
        self._error = error

    def decompress(self, data: bytes) -> bytes:
        raise self._error

    def flush(self) -> bytes:
        raise self._error


_DECODERS = {"gzip": _Gzip, "x-gzip": _Gzip, "deflate": _Deflate}
if brotli is not None:
    _DECODERS["br"] = _Brotli


def decoder_for(content_encoding: str, unread_raises: bool = True) -> tuple[str | None, Decoder | None]:
    """``(the codings, lower-cased, without identity; None: none)`` and a new decoder for a body
    sent with ``Content-Encoding: content_encoding`` (None: the body is as sent). A coding this
    client does not read gives a decoder that raises :class:`EncodingError` naming it at the
    body's first bytes or its end (the head is read: an error status stays the error), or with
    ``unread_raises`` False (an error response's body, read for its message) None; with
    ``unread_raises`` False a body that does not decode in the coding named is handed on as
    sent, never raising (:class:`_AsSentOnError`)."""
    codings = [c.strip().lower() for c in content_encoding.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None, None
    name = ", ".join(codings)
    unread = [c for c in codings if c not in _DECODERS]
    if unread and not unread_raises:
        return name, None
    if unread:
        why = "" if brotli is not None or "br" not in unread else " (the brotli package is not installed)"
        return name, _Unread(
            EncodingError(
                f"the server sent a body in Content-Encoding {unread[0]!r}, which this client does not "
                f"decode{why}; it asked for {ACCEPT_ENCODING}: have the server (or the proxy in front "
                "of it) send one of those, or none"
            )
        )
    decoders: list[Decoder] = [_DECODERS[c]() for c in codings]
    decoder = decoders[0] if len(decoders) == 1 else _Chain(decoders)
    return name, decoder if unread_raises else _AsSentOnError(decoder)
