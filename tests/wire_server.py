"""A raw HTTP/1.1 server for the stream client's wire tests (tests/test_wire_bodies.py) and
benchmark (tests/benchmarks/wire_bodies.py): exact bytes on a known schedule, as an endpoint sends
them through what stands in front of it: a body compressed per event (gzip / deflate with
``Z_SYNC_FLUSH``, brotli with its flush: a compressing proxy that flushes), in a coding the client
does not read, an error's body compressed, a body never terminated after ``[DONE]`` (or terminated
5 ms / 300 ms late) or after the finish and usage without ``[DONE]``, a usage on every chunk
(vLLM's ``continuous_usage_stats``), ``/completions`` text choices, a redirect. Every text chunk
is stamped with ``time.perf_counter_ns()`` just before its bytes go to the socket
(CLOCK_MONOTONIC: one clock for all processes on Linux, so the client's ``send_ns`` and these
stamps compare directly).

    python tests/wire_server.py   # prints PORT <n>; serves until killed
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib

import brotli

TTFT_MS, GAP_MS, WORDS = 40.0, 30.0, 6  # the schedule: first text at 40 ms, then every 30 ms
OK_HEAD = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"


def chat_events(
    words: int = WORDS, usage: str = "last", done: bool = True, text: bool = False
) -> list[bytes]:
    """A chat stream's events: ``words`` text chunks, the finish, the usage, ``[DONE]`` (unless
    ``done`` is False). ``usage``: ``"last"``, a usage-only chunk (``choices: []``) after the
    finish (OpenAI's, vLLM's, SGLang's with ``include_usage``); ``"finish"``, on the finish chunk
    itself and no usage-only chunk (llama.cpp's before its PR #16048); ``"every"``, a running
    usage on every chunk as well (vLLM's ``continuous_usage_stats``). ``text``: ``/completions``
    choices (``choices[].text``)."""

    def choice(piece: str | None, finish: str | None) -> dict:
        content = {"text": piece or ""} if text else {"delta": {"content": piece} if piece else {}}
        return {"index": 0, **content, "finish_reason": finish}

    def counts(n: int) -> dict:
        return {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}

    chunks = [{"choices": [choice(f" w{i}", None)]} for i in range(words)]
    chunks.append({"choices": [choice(None, "stop")]})
    if usage == "every":
        for i, chunk in enumerate(chunks):
            chunk["usage"] = counts(min(i + 1, words))
    if usage == "finish":
        chunks[-1]["usage"] = counts(words)
    else:
        chunks.append({"choices": [], "usage": counts(words)})
    return [b"data: %b\n\n" % json.dumps(c).encode() for c in chunks] + (
        [b"data: [DONE]\n\n"] if done else []
    )


def responses_events(words: int = WORDS) -> list[bytes]:
    """A Responses API stream's events: ``words`` text deltas, then ``response.completed``."""
    events = [{"type": "response.output_text.delta", "delta": f" w{i}"} for i in range(words)]
    usage = {"input_tokens": 3, "output_tokens": words, "total_tokens": 3 + words}
    events.append({"type": "response.completed", "response": {"status": "completed", "usage": usage}})
    return [b"event: %b\ndata: %b\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in events]


def compressor(coding: str):
    """``(compress(bytes) -> bytes flushed to the byte, finish() -> bytes)`` of a coding, as a
    compressing proxy that flushes per event writes it (gzip's Z_SYNC_FLUSH, brotli's flush)."""
    if coding == "br":
        c = brotli.Compressor()
        return (lambda data: c.process(data) + c.flush()), c.finish
    wbits = {"gzip": 31, "deflate": 15, "deflate_raw": -15}[coding]
    z = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return (lambda data: z.compress(data) + z.flush(zlib.Z_SYNC_FLUSH)), z.flush


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


#: Chat answers closed otherwise than by the usage-only chunk and ``[DONE]``: the model's name ->
#: (:func:`chat_events`'s ``usage``, ``done``).
_CLOSES = {
    "nodone": ("last", False),  # the finish, the usage-only chunk, no [DONE]: body left open
    "nodone_finish": ("finish", False),  # the usage on the finish chunk, no [DONE]: body left open
    "continuous": ("every", False),  # usage on every chunk; [DONE] 5 ms after, then the body's end
}


class WireServer:
    """The raw server, on a thread of its own (``WireServer()``; :meth:`stop`) or a process of its
    own (``python tests/wire_server.py``): the request's ``model`` names the scenario
    (:meth:`_answer`), ``NAME:WORDS:GAP_MS`` another schedule. ``GET /stamps``: ``{prompt: [each
    text chunk's write stamp, ns]}`` as JSON (for a server in its own process)."""

    def __init__(self, thread: bool = True) -> None:
        self.requests: list[dict] = []  # per request: model, prompt, path, connection, headers
        self.stamps: dict[str, list[int]] = {}  # prompt -> each text chunk's write stamp (ns)
        self.closed_ns: dict[int, int] = {}  # connection -> when the server saw the client close it
        self._connections = 0
        self._loop = asyncio.new_event_loop()
        if not thread:
            return
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _run(self, ready: threading.Event | None = None) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        if ready is None:
            print(f"PORT {self.port}", flush=True)
        else:
            ready.set()
        self._loop.run_forever()
        server.close()
        self._loop.run_until_complete(server.wait_closed())
        self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        connection = self._connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                received_ns = time.perf_counter_ns()
                lines = head.decode("latin-1").split("\r\n")
                if lines[0].startswith("GET /stamps"):
                    stamps = json.dumps(self.stamps).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(stamps), stamps))
                    continue
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)
                }
                body = json.loads(await reader.readexactly(int(headers["content-length"])))
                prompt = body.get("input") or body.get("prompt") or body["messages"][-1]["content"]
                path = lines[0].split(" ")[1]
                self.requests.append(
                    {
                        "model": body["model"],
                        "prompt": prompt,
                        "path": path,
                        "connection": connection,
                        "headers": headers,
                    }
                )
                if not await self._answer(body["model"], prompt, path, received_ns, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed_ns.setdefault(connection, time.perf_counter_ns())
            writer.close()

    async def _events(self, prompt: str, events: list[bytes], schedule, writer, frame) -> None:
        """Write ``events`` on ``schedule`` (``(request read ns, words, gap ms)``: text events at
        TTFT_MS + i * gap after the request was read, the rest with the last), each through
        ``frame`` (bytes -> wire bytes)."""
        received_ns, words, gap_ms = schedule
        stamps = self.stamps.setdefault(prompt, [])
        for i, event in enumerate(events):
            due_ns = received_ns + (TTFT_MS + min(i, words - 1) * gap_ms) * 1e6
            await asyncio.sleep(max(0.0, (due_ns - time.perf_counter_ns()) / 1e9))
            wire = frame(event)
            if i < words:
                stamps.append(time.perf_counter_ns())
            writer.write(wire)

    async def _answer(self, model: str, prompt: str, path: str, received_ns: int, reader, writer) -> bool:
        """Answer one request as ``model`` says; False: the connection is done with."""
        name, _, rest = model.partition(":")
        words, _, gap = rest.partition(":")
        schedule = (received_ns, int(words or WORDS), float(gap or GAP_MS))
        if path.endswith("/responses"):
            events = responses_events(schedule[1])
        else:  # the answer's close as the model names it: _CLOSES
            usage, done = _CLOSES.get(name, ("last", True))
            events = chat_events(schedule[1], usage, done, text=path.endswith("/v1/completions"))
        if name in ("gzip", "deflate", "deflate_raw", "br", "gzip_padded"):
            compress, finish = compressor(name.removesuffix("_padded"))
            coding = {"deflate_raw": "deflate", "gzip_padded": "gzip"}.get(name, name)
            writer.write(f"{OK_HEAD}Content-Encoding: {coding}\r\n\r\n".encode())
            await self._events(prompt, events, schedule, writer, lambda e: _chunk(compress(e)))
            padding = b"\0" * 8 if name == "gzip_padded" else b""  # after the member: gzip(1) skips
            writer.write(_chunk(finish() + padding) + b"0\r\n\r\n")
            return True
        if model == "zstd":  # a coding this client does not read (zstd's magic number, then bytes)
            writer.write(
                f"{OK_HEAD}Content-Encoding: zstd\r\n\r\n".encode() + _chunk(b"\x28\xb5\x2f\xfd" + b"x" * 20)
            )
            writer.write(b"0\r\n\r\n")
            return True
        if model == "gzip_503":  # an error's body compressed: its message still read
            body = zlib.compress(b'{"error": {"message": "the pool is overloaded"}}', wbits=31)
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            return True
        if model == "plain_503_said_gzip":  # an error page labelled gzip but sent as is
            body = b'{"error": {"message": "the pool is overloaded"}}'
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            return True
        if model == "open_503":  # an error's head and a first chunk, the body left open
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(b'{"error": {"message": "overloaded"')
            )
            await reader.read()  # open until the client goes
            return False
        if model == "te_gzip":  # a transfer coding the client never asked for (no TE header)
            body = zlib.compress(b"".join(events), wbits=31)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" + _chunk(body))
            writer.write(b"0\r\n\r\n")
            return True
        if model == "redirect":
            writer.write(
                b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /moved/v1/chat/completions\r\n"
                b"Content-Length: 0\r\n\r\n"
            )
            return True
        if model == "whole":  # the head, the answer and the body's end in one write (one read)
            self.stamps[prompt] = [time.perf_counter_ns()] * WORDS
            writer.write(f"{OK_HEAD}\r\n".encode() + b"".join(map(_chunk, events)) + b"0\r\n\r\n")
            return True
        writer.write(f"{OK_HEAD}\r\n".encode())
        await self._events(prompt, events, schedule, writer, _chunk)
        if name in ("open", "nodone", "nodone_finish"):  # the answer whole, the body never
            await reader.read()  # terminated: open until the client goes
            return False
        if name == "continuous":  # [DONE] 5 ms after the usage, in a read of its own, then the end
            await writer.drain()
            await asyncio.sleep(0.005)
            writer.write(_chunk(b"data: [DONE]\n\n"))
            await writer.drain()
            await asyncio.sleep(0.005)
        if model in ("late", "soon"):  # the terminating chunk 300 ms (5 ms) after the answer
            await writer.drain()
            await asyncio.sleep(0.3 if model == "late" else 0.005)
        writer.write(b"0\r\n\r\n")
        return True


if __name__ == "__main__":
    WireServer(thread=False)._run()
