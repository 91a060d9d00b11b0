"""The bodies a stream's endpoint sends through what stands in front of it (issue 50, items 2-4):
compressed (a compressing proxy or router), never terminated after ``[DONE]`` (a server or proxy
keeping the body open: openai-python #3440's class), a redirect. Against the raw server of
tests/wire_server.py (a thread of this module's, its own event loop, 127.0.0.1, a free port): exact
bytes on a known schedule, every text chunk stamped just before its bytes go to the socket.

Before: a body sent with ``Content-Encoding: gzip`` was recorded ``empty_response ... 0 chunks``
(the request said ``Accept-Encoding: identity`` and the bytes went to the SSE parser as sent); a
body left open after ``[DONE]`` was a ``timeout`` after ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest

from tasks.stream.client import SSEClient, stream_chat
from tasks.stream.load import make_client
from tasks.stream.records import RequestRecord
from tasks.wire import codings, h1, transports

try:
    from tests.wire_server import GAP_MS, TTFT_MS, WORDS, WireServer, chat_events, compressor
except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
    from wire_server import GAP_MS, TTFT_MS, WORDS, WireServer, chat_events, compressor

#: How far an arrival may be from its chunk's write stamp (loopback: tens of us; 2 shared cores:
#: a few ms). A decoded chunk given the time of a later read (the body's end, a decoder's buffer)
#: would be >= GAP_MS off.
TOL_MS = 10.0


@pytest.fixture(scope="module")
def server():
    wire = WireServer()
    yield wire
    wire.stop()


def _requests(
    server: WireServer, *models: str, api: str = "chat", timeout_s: float = 10.0, transport: str = "sse"
) -> list[RequestRecord]:
    """One request per model, in turn, on one client (its connections kept between them)."""

    async def main() -> list[RequestRecord]:
        client = (
            SSEClient(server.base_url, None, timeout_s)
            if transport == "sse"
            else make_client(server.base_url, None, timeout_s, 1, transport)
        )
        try:
            records = []
            for model in models:
                prompt = f"{model}-{len(server.requests)}"
                records.append(
                    await stream_chat(
                        client,
                        model=model,
                        prompt=prompt,
                        max_tokens=8,
                        count_tokens=None,
                        request_id=prompt,
                        api=api,
                    )
                )
            return records
        finally:
            await client.close()

    return asyncio.run(main())


def _stamp_errors_ms(server: WireServer, r: RequestRecord) -> list[float]:
    """Each text chunk's recorded arrival minus its write stamp (ms)."""
    sent_ns = server.stamps[r.request_id]
    assert len(r.token_offsets_ms) == len(sent_ns) == WORDS, (r.token_offsets_ms, sent_ns)
    return [offset - (t - r.send_ns) / 1e6 for offset, t in zip(r.token_offsets_ms, sent_ns)]


@pytest.mark.parametrize("coding", ["gzip", "deflate", "deflate_raw", "br"])
def test_a_compressed_body_is_decoded_each_chunk_at_its_own_arrival(server, coding) -> None:
    (r,) = _requests(server, coding)
    assert r.succeeded, r.error_message
    assert r.output_text == "".join(f" w{i}" for i in range(WORDS))
    assert (r.output_tokens, r.output_tokens_source) == (WORDS, "usage")
    assert r.content_encoding == ("deflate" if coding == "deflate_raw" else coding)
    assert r.to_json()["content_encoding"] == r.content_encoding
    # the request said what it reads
    assert server.requests[-1]["headers"]["accept-encoding"] == codings.ACCEPT_ENCODING == "gzip, deflate, br"
    # each decoded chunk has the time of the read that carried its compressed bytes: its write
    errors_ms = _stamp_errors_ms(server, r)
    assert all(-0.01 <= e < TOL_MS for e in errors_ms), errors_ms
    # so TTFT and ITL are the schedule's (the server's own lateness aside: its stamps)
    sent_ms = [(t - r.send_ns) / 1e6 for t in server.stamps[r.request_id]]
    assert r.ttft_ms == pytest.approx(sent_ms[0], abs=TOL_MS) and r.ttft_ms >= TTFT_MS
    gaps_ms = [b - a for a, b in zip(sent_ms, sent_ms[1:])]
    assert all(abs(got - want) < TOL_MS for got, want in zip(r.itl_ms, gaps_ms)), (r.itl_ms, gaps_ms)
    print(
        f"{coding}: arrival - write stamp max {max(errors_ms):.3f} ms; TTFT {r.ttft_ms:.2f} ms "
        f"(schedule {TTFT_MS}); ITL {min(r.itl_ms):.2f}-{max(r.itl_ms):.2f} ms (schedule {GAP_MS}); "
        f"clock {r.arrival_clock}"
    )


def test_a_body_in_a_coding_not_read_is_an_error_naming_it_never_0_chunks(server) -> None:
    (r,) = _requests(server, "zstd")
    assert r.error_class == "bad_payload", (r.error_class, r.error_message)
    assert "Content-Encoding 'zstd'" in r.error_message and "does not decode" in r.error_message
    assert "0 chunks" not in r.error_message


def test_an_error_response_compressed_is_read_for_its_message(server) -> None:
    (r,) = _requests(server, "gzip_503")
    assert r.error_class == "server" and "the pool is overloaded" in r.error_message, r.error_message


def test_an_error_response_labelled_gzip_but_sent_plain_keeps_its_status(server) -> None:
    """A gateway's error page labelled ``Content-Encoding: gzip`` but sent as is: the 503 is the
    error, its text as sent (it was ``bad_payload`` "does not decode", the 503 lost)."""
    (r,) = _requests(server, "plain_503_said_gzip")
    assert r.error_class == "server", (r.error_class, r.error_message)
    assert "503" in r.error_message and "the pool is overloaded" in r.error_message, r.error_message


def test_an_error_body_left_open_keeps_its_status_not_a_timeout(server) -> None:
    """A 503 whose body is never terminated: the 503 is the error, recorded within
    ``transports.ERROR_BODY_WAIT_S`` of its head (it was a ``timeout`` after request_timeout_s),
    and its connection is not reused."""
    (r, again) = _requests(server, "open_503", "gzip")
    assert r.error_class == "server" and "503" in r.error_message, (r.error_class, r.error_message)
    assert "overloaded" in r.error_message, r.error_message  # the body as far as it came
    assert r.error_after_ms < 1000 * 1.5 * transports.ERROR_BODY_WAIT_S + 200, r.error_after_ms
    assert again.succeeded, again.error_message
    first, second = server.requests[-2:]
    assert second["connection"] != first["connection"]


def test_a_transfer_coding_never_asked_for_is_named(server) -> None:
    """``Transfer-Encoding: gzip, chunked`` to a client that sent no TE header (RFC 9112 §7): an
    error naming the coding (it was ``empty_response`` "0 chunks")."""
    (r,) = _requests(server, "te_gzip")
    assert not r.succeeded and "Transfer-Encoding 'gzip, chunked'" in r.error_message, r.error_message
    assert "0 chunks" not in r.error_message


def test_zero_padding_after_a_gzip_body_is_ignored(server) -> None:
    """Zeros after the gzip member (Python's gzip module skips them; urllib3 ignores trailing
    bytes): the answer, whole before them, is a success (it was ``bad_payload`` "incorrect header
    check" after every chunk had arrived)."""
    (r,) = _requests(server, "gzip_padded")
    assert r.succeeded, r.error_message
    assert r.content_encoding == "gzip" and r.output_text == "".join(f" w{i}" for i in range(WORDS))
    assert (r.output_tokens, r.output_tokens_source) == (WORDS, "usage")


def test_gzip_trailing_bytes_are_ignored_but_a_broken_member_raises() -> None:
    text = b"".join(chat_events())
    member = zlib.compress(text, wbits=31)
    for tail in (b"\0" * 8, b"<!-- cache -->"):
        wire = member + tail
        for step in (1, len(wire)):
            _, decoder = codings.decoder_for("gzip")
            out = b"".join(decoder.decompress(wire[i : i + step]) for i in range(0, len(wire), step))
            assert out + decoder.flush() == text, (tail, step)
    # a second member that starts (its magic) and then breaks is no padding
    _, decoder = codings.decoder_for("gzip")
    with pytest.raises(codings.EncodingError, match="does not decode"):
        decoder.decompress(member + b"\x1f\x8b\x08\xffbroken member")
    # the first member's bytes broken: raised, never read as trailing
    _, decoder = codings.decoder_for("gzip")
    with pytest.raises(codings.EncodingError, match="does not decode"):
        decoder.decompress(b"data: sent as is\n\n")
    # an error's body (unread_raises False): bytes not of the coding named are handed on as sent
    for body in (b'{"error": "as sent"}', zlib.compress(b'{"error": "as sent"}', wbits=31)):
        for step in (1, len(body)):
            _, decoder = codings.decoder_for("gzip", unread_raises=False)
            out = b"".join(decoder.decompress(body[i : i + step]) for i in range(0, len(body), step))
            assert out + decoder.flush() == b'{"error": "as sent"}', (body, step)


def test_codings_decode_a_body_split_at_every_byte() -> None:
    text = b"".join(chat_events())
    for coding, name in (("gzip", "gzip"), ("deflate", "deflate"), ("deflate_raw", "deflate"), ("br", "br")):
        compress, finish = compressor(coding)
        wire = compress(text) + finish()
        got, decoder = codings.decoder_for(name.upper())
        assert got == name
        out = b"".join(decoder.decompress(wire[i : i + 1]) for i in range(len(wire))) + decoder.flush()
        assert out == text, coding
    # two codings in the order applied: gzip, then br
    compress, finish = compressor("br")
    wire = compress(zlib.compress(text, wbits=31)) + finish()
    got, decoder = codings.decoder_for("gzip, br")
    assert got == "gzip, br" and decoder.decompress(wire) + decoder.flush() == text
    assert codings.decoder_for("identity") == (None, None) and codings.decoder_for("") == (None, None)
    # bytes that are not of the coding named
    _, decoder = codings.decoder_for("gzip")
    with pytest.raises(codings.EncodingError, match="Content-Encoding 'gzip' does not decode"):
        decoder.decompress(b"data: not gzip\n\n")
    # a coding not read: named, at the body's first bytes or at its end (an empty body)
    _, decoder = codings.decoder_for("compress")
    for call in (lambda: decoder.decompress(b"x"), decoder.flush):
        with pytest.raises(codings.EncodingError, match="Content-Encoding 'compress'"):
            call()
    assert codings.decoder_for("zstd", unread_raises=False) == ("zstd", None)


def test_an_answer_left_open_after_done_ends_at_done_and_its_connection_is_not_reused(server) -> None:
    """A request timeout of 10 s: before, the record was a timeout 10-15 s later."""
    start = time.perf_counter()
    r, after = _requests(server, "open", "plain")
    took_s = time.perf_counter() - start
    assert r.succeeded, r.error_message
    assert len(r.token_offsets_ms) == WORDS and r.output_tokens == WORDS
    errors_ms = _stamp_errors_ms(server, r)
    assert all(-0.01 <= e < TOL_MS for e in errors_ms), errors_ms
    # complete at [DONE] (written with the last text chunk), plus the grace for the body's end
    grace_ms = h1.END_GRACE_S * 1e3
    assert grace_ms <= r.stream_close_ms - r.e2e_ms < grace_ms + 100, (r.e2e_ms, r.stream_close_ms)
    assert took_s < 1.0, took_s  # both requests
    # the next request: a new connection; the open one closed by the client
    first, second = server.requests[-2:]
    assert second["connection"] != first["connection"] and after.connect_ms is not None
    assert after.succeeded, after.error_message
    closed_after_ms = (server.closed_ns[first["connection"]] - r.send_ns) / 1e6
    assert closed_after_ms < r.stream_close_ms + 100, (closed_after_ms, r.stream_close_ms)
    print(
        f"open after [DONE]: e2e {r.e2e_ms:.1f} ms, stream_close {r.stream_close_ms:.1f} ms, "
        f"two requests in {took_s * 1e3:.0f} ms (request_timeout_s 10)"
    )


def test_a_terminating_chunk_in_its_own_read_just_after_done_keeps_the_connection(server) -> None:
    r, after = _requests(server, "soon", "plain")
    assert r.succeeded and after.succeeded, (r.error_message, after.error_message)
    first, second = server.requests[-2:]
    assert second["connection"] == first["connection"] and after.connect_ms is None
    assert r.stream_close_ms - r.e2e_ms < h1.END_GRACE_S * 1e3, (r.e2e_ms, r.stream_close_ms)


def test_an_answer_read_with_its_head_leaves_the_next_request_on_its_connection_alone(server) -> None:
    """The answer's end seen before the reader waited (it came with the head): the next request
    on the connection (200 ms long, four times the grace) is not ended by the first's grace."""
    r, after = _requests(server, "whole", "plain")
    assert r.succeeded and after.succeeded, (r.error_message, after.error_message)
    assert len(after.token_offsets_ms) == WORDS and after.e2e_ms >= TTFT_MS + (WORDS - 1) * GAP_MS
    first, second = server.requests[-2:]
    assert second["connection"] == first["connection"]


def test_a_terminating_chunk_300_ms_late_breaks_nothing(server) -> None:
    r, after = _requests(server, "late", "late")
    for record in (r, after):
        assert record.succeeded, record.error_message
        errors_ms = _stamp_errors_ms(server, record)
        assert all(-0.01 <= e < TOL_MS for e in errors_ms), errors_ms
        assert record.stream_close_ms - record.e2e_ms < 300, (record.e2e_ms, record.stream_close_ms)
    first, second = server.requests[-2:]
    assert second["connection"] != first["connection"]


def test_a_responses_answer_left_open_after_response_completed_ends_there(server) -> None:
    start = time.perf_counter()
    (r,) = _requests(server, "open", api="responses")
    assert r.succeeded, r.error_message
    assert time.perf_counter() - start < 1.0
    assert r.output_tokens == WORDS and len(r.token_offsets_ms) == WORDS
    assert server.requests[-1]["path"] == "/v1/responses"


@pytest.mark.parametrize("transport", ["sse", "openai"])
def test_a_redirect_is_an_error_naming_where_it_points(server, transport) -> None:
    (r,) = _requests(server, "redirect", transport=transport)
    assert r.error_class == "bad_request", (r.error_class, r.error_message)
    where = f"http://127.0.0.1:{server.port}/moved"
    assert f"307 Temporary Redirect to {where}/v1/chat/completions" in r.error_message, r.error_message
    assert f"set base_url to {where}/v1" in r.error_message
    assert not any(request["path"].startswith("/moved") for request in server.requests)  # not followed


def _closed_at_its_answer(server: WireServer, r: RequestRecord, after: RequestRecord) -> None:
    """``r``'s answer complete in its own time, the grace after it, its open connection not
    reused (``after`` on a new one)."""
    assert r.succeeded, r.error_message
    assert r.output_text == "".join(f" w{i}" for i in range(WORDS))
    assert (r.output_tokens, r.output_tokens_source) == (WORDS, "usage")
    # complete at the usage (written with the last text chunk), plus the grace for the body's end
    grace_ms = h1.END_GRACE_S * 1e3
    assert grace_ms <= r.stream_close_ms - r.e2e_ms < grace_ms + 100, (r.e2e_ms, r.stream_close_ms)
    first, second = server.requests[-2:]
    assert second["connection"] != first["connection"], (first, second)
    assert after.succeeded, after.error_message


@pytest.mark.parametrize("close", ["nodone", "nodone_finish"])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_an_answer_closed_by_its_finish_and_usage_without_done_ends_there(server, close, api) -> None:
    """No ``[DONE]``, the body left open: the finish and the usage-only chunk (OpenAI's, vLLM's,
    SGLang's close with ``include_usage``), or the usage on the finish chunk itself (llama.cpp's
    before #16048). A request timeout of 10 s: before, the record was a timeout 10-15 s later."""
    start = time.perf_counter()
    r, after = _requests(server, close, "plain", api=api)
    took_s = time.perf_counter() - start
    _closed_at_its_answer(server, r, after)
    assert server.requests[-2]["path"] == (
        "/v1/completions" if api == "completions" else "/v1/chat/completions"
    )
    errors_ms = _stamp_errors_ms(server, r)  # its figures: each chunk at its own arrival
    assert all(-0.01 <= e < TOL_MS for e in errors_ms), errors_ms
    assert r.ttft_ms >= TTFT_MS and len(r.itl_ms) == WORDS - 1
    assert after.connect_ms is not None  # the open connection closed, a new one opened
    assert took_s < 1.0, took_s  # both requests
    print(
        f"{close} ({api}): TTFT {r.ttft_ms:.1f} ms, e2e {r.e2e_ms:.1f} ms, stream_close "
        f"{r.stream_close_ms:.1f} ms, two requests in {took_s * 1e3:.0f} ms (request_timeout_s 10)"
    )


@pytest.mark.parametrize("model", ["nodone", "open"])
def test_the_openai_transport_ends_an_answer_left_open_too(server, model) -> None:
    """The openai client's stream reads on to the body's end without ``[DONE]`` (with it, openai
    3.x drains 0.1 s at most: openai-python #3440's fix); tasks.wire.grace ends it."""
    start = time.perf_counter()
    r, after = _requests(server, model, "plain", transport="openai")
    took_s = time.perf_counter() - start
    _closed_at_its_answer(server, r, after)
    assert took_s < 2.0, took_s  # both requests, not request_timeout_s (10 s)
    print(f"openai transport, {model}: e2e {r.e2e_ms:.1f} ms, stream_close {r.stream_close_ms:.1f} ms")


def test_the_openai_transport_ends_a_responses_answer_left_open(server) -> None:
    """No ``[DONE]`` in the Responses API: before, a timeout after ``request_timeout_s``."""
    (r,) = _requests(server, "open", api="responses", transport="openai")
    assert r.succeeded, r.error_message
    assert r.output_tokens == WORDS and len(r.token_offsets_ms) == WORDS
    assert r.stream_close_ms - r.e2e_ms < h1.END_GRACE_S * 1e3 + 100, (r.e2e_ms, r.stream_close_ms)
    assert r.stream_close_ms < 1000, r.stream_close_ms  # not request_timeout_s (10 s)
    print(f"openai transport, responses open: e2e {r.e2e_ms:.1f} ms, stream_close {r.stream_close_ms:.1f} ms")


@pytest.mark.parametrize("transport", ["sse", "openai"])
def test_a_usage_on_every_chunk_does_not_end_the_answer_before_its_finish(server, transport) -> None:
    """vLLM's ``continuous_usage_stats``: a usage on every chunk, 30 ms apart (under the grace:
    an answer ended at the first usage would lose the chunks after it); ``[DONE]`` 5 ms after the
    final usage, in a read of its own, then the body's end: all read, the connection kept."""
    r, after = _requests(server, "continuous", "plain", transport=transport)
    assert r.succeeded and after.succeeded, (r.error_message, after.error_message)
    assert r.output_text == "".join(f" w{i}" for i in range(WORDS)), r.output_text
    assert len(r.token_offsets_ms) == WORDS and (r.output_tokens, r.output_tokens_source) == (WORDS, "usage")
    assert r.e2e_ms >= TTFT_MS + (WORDS - 1) * GAP_MS
    if transport == "sse":  # the openai client reads [DONE] and the end ~10 ms later: on 2 busy
        first, second = server.requests[-2:]  # cores its grace may run out first (not an error)
        assert second["connection"] == first["connection"]  # [DONE] and the body's end were read
        assert r.stream_close_ms - r.e2e_ms < h1.END_GRACE_S * 1e3, (r.e2e_ms, r.stream_close_ms)


def test_the_summary_says_which_answers_came_compressed_and_whole(server) -> None:
    """Under the level table: the answers in a content coding, and those of them that came in one
    read (a compressing hop that held them: their timings are its flushes')."""
    import io

    from rich.console import Console

    from flows.tables.stream import print_outcomes

    plain, coded = (r.to_json() for r in _requests(server, "plain", "gzip"))
    held = {**coded, "token_offsets_ms": [5.0] * len(coded["token_offsets_ms"])}  # as one read gives
    held["decode_unobserved"] = "one_read"
    out = io.StringIO()
    level = {"max_concurrency": 1, "request_rate": None, "metrics": {"num_requests": 3}}
    print_outcomes([{**level, "requests": [plain, coded, held]}], Console(file=out, width=200))
    assert out.getvalue().strip() == (
        "conc 1 rate inf: gzip bodies 2 of 3, 1 read in one piece (timings are the compressing hop's)"
    )
