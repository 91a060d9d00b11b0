"""One real generation through the embedded server: the install's last step, and a check of
``infermeter doctor``.

``python -m tasks.engines.smoke`` starts the embedded server (llama.cpp on the packaged
SmolLM2 model, as ``infermeter server`` does), asks it for a few tokens of one chat
completion, prints what came back and how long it took, and stops it; exit 1 with the server's
death or its log's last lines and what to do where the engine cannot answer. An engine that
compiles but dies on its first request (AMX kernels on a CPU whose VM does not give them
tiles: issue 48) is caught here, at install, not by the first audit. Neither prefect nor
mlflow; the server's own imports only.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

#: Tokens asked for: enough to see a decode step, few enough to take a second.
SMOKE_TOKENS = 8
SMOKE_PROMPT = "Say hello."


class SmokeError(RuntimeError):
    """The embedded engine did not answer; the message says why and what to do."""


@dataclass(frozen=True)
class SmokeResult:
    """A generation that worked.

    Attributes:
        engine: ``llamacpp`` or ``vllm``.
        text: what the model said.
        completion_tokens: the server's usage count (None where it sent none).
        start_s: seconds until the server answered ``/v1/models``.
        generate_s: seconds of the chat completion (non-streamed).
    """

    engine: str
    text: str
    completion_tokens: int | None
    start_s: float
    generate_s: float

    def line(self) -> str:
        tokens = f"{self.completion_tokens} tokens" if self.completion_tokens is not None else "text"
        return (
            f"embedded {self.engine} engine answered: {self.text.strip()[:60]!r} ({tokens} in "
            f"{self.generate_s:.1f} s; server up in {self.start_s:.1f} s)"
        )


def smoke_generation(
    model: str = "gguf:default", engine: str = "llamacpp", timeout_s: float = 60.0
) -> SmokeResult:
    """Start the embedded server of ``engine`` on ``model``, ask for :data:`SMOKE_TOKENS`
    tokens, stop it.

    Raises:
        SmokeError: the server did not start, died, or answered without text (the message
            holds the server's own words: its death by signal, its log's lines).
    """
    from tasks.engines.death import ServerDiedError, gone_within
    from tasks.engines.server import ServerStartError, embedded_server

    started = time.monotonic()
    try:
        with embedded_server(model, engine=engine, n_ctx=512, startup_timeout_s=timeout_s) as server:
            up = time.monotonic()
            body = json.dumps(
                {
                    "model": server.model,
                    "messages": [{"role": "user", "content": SMOKE_PROMPT}],
                    "max_tokens": SMOKE_TOKENS,
                    "temperature": 0,
                }
            ).encode()
            headers = {"Content-Type": "application/json"}
            if server.api_key:
                headers["Authorization"] = f"Bearer {server.api_key}"
            request = urllib.request.Request(f"{server.base_url}/chat/completions", body, headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    answer = json.loads(response.read())
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as exc:
                answer = {"_failure": f"{type(exc).__name__}: {exc}"}
                gone_within(server.pid, 5.0)  # a crash: let the block name it (its signal, its log)
            done = time.monotonic()
    except ServerDiedError as exc:
        raise SmokeError(f"the engine died on its first request:\n{exc}") from exc
    except ServerStartError as exc:
        raise SmokeError(f"the engine did not start:\n{exc}") from exc
    if "_failure" in answer:
        raise SmokeError(f"the engine's server did not answer a chat completion: {answer['_failure']}")
    try:
        text = answer["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        text = ""
    if not text.strip():
        raise SmokeError(f"the engine answered without text: {json.dumps(answer)[:300]}")
    tokens = (answer.get("usage") or {}).get("completion_tokens")
    return SmokeResult(engine, text, tokens if isinstance(tokens, int) else None, up - started, done - up)


def main(argv: list[str]) -> int:
    """``python -m tasks.engines.smoke [ENGINE]``: one generation; exit 0 or 1."""
    from tasks.engines.loopback import keep_loopback_off_proxies

    keep_loopback_off_proxies()  # the install behind a proxy: the server is on 127.0.0.1
    engine = argv[0] if argv else "llamacpp"
    try:
        print(smoke_generation(engine=engine).line())
    except SmokeError as exc:
        print(
            f"error: the embedded {engine} engine cannot answer: {exc}\n"
            "what to do: run `infermeter doctor` for the CPU and the engine's build; "
            "`make install` rebuilds a portable engine (INFERMETER_LLAMA_BUILD unset)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
