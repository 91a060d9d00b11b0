"""The wire: how one streamed request travels, from the socket to the parsed chunk.

The stream client's own HTTP/1.1 (:mod:`h1`) on keep-alive connections (:mod:`pool`), read by a
reactor (:mod:`reactor`) through the compiled read where it was built (``_rx.c``, an optional
extension declared in pyproject.toml) with the kernel's receive stamps (:mod:`rxclock`); the SSE
framing (:mod:`sse`); the receive loops of the transports (:mod:`transports`, the openai
client's in :mod:`openai_reader`, the Responses API's in :mod:`responses`); content codings
(:mod:`codings`), proxies (:mod:`proxy`), the grace after an answer (:mod:`grace`), the stall
watch (:mod:`stall`), the error classes (:mod:`errors`) and the usage read (:mod:`usage`).

Imports no other room of ``tasks`` (pyproject.toml's import contracts): what a level does with the
chunks (records, figures, load) is ``tasks.stream``'s, above this one.
"""
