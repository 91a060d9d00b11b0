"""Which OpenAI-compatible endpoint the remote stages talk to, and its API key.

An endpoint is handed around as plain values: base_url, the model name, and the *name* of the
environment variable that holds its key, never the key. The embedded server's (llama.cpp or
vLLM, ``server.engine``) random key is put in this process's environment under
``EMBEDDED_KEY_ENV`` for the server's lifetime and removed afterwards.

For baselines and resume an endpoint is identified by server kind + model (+ the model file's
hash for the embedded one), never by its URL or port (``identity``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from tasks.config import EndpointConfig, ServerConfig
from tasks.engines.server import embedded_server

EMBEDDED_KEY_ENV = "INFERMETER_EMBEDDED_API_KEY"
NO_KEY = "EMPTY"  # the openai client insists on a key string; servers without auth ignore it


class EndpointError(ValueError):
    """An endpoint setting that cannot work; the message names the field and the fix."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    api_key_env: str | None
    server_kind: str  # embedded: "llama.cpp" or "vllm"; "openai-compatible" otherwise
    tokenizer: str  # model spec whose tokenizer counts output tokens when usage is missing
    model_sha256: str | None = None
    request_timeout_s: float = 120.0
    #: the embedded server's process (None for a configured base_url): requests refused or cut
    #: after its death are ``server_died``, not connection errors (tasks.engines.death)
    server_pid: int | None = None
    #: a PEM file of the CAs that sign the endpoint's certificate (``endpoint.ca_bundle``); None:
    #: the system store, or ``SSL_CERT_FILE``
    ca_bundle: str | None = None

    def api_key(self) -> str:
        """The key from the named environment variable.

        Raises:
            EndpointError: the variable is named but not set.
        """
        if self.api_key_env:
            value = os.environ.get(self.api_key_env)
            if not value:
                raise EndpointError(
                    f"endpoint.api_key_env: environment variable {self.api_key_env} is not set; "
                    f"export it or name another variable"
                )
            return value
        return os.environ.get("OPENAI_API_KEY") or NO_KEY

    def identity(self) -> dict[str, str]:
        """What identifies the endpoint across runs (tags): kind, model, model file hash."""
        ident = {"endpoint_kind": self.server_kind, "endpoint_model": self.model}
        if self.model_sha256:
            ident["endpoint_model_sha256"] = self.model_sha256
        return ident


@contextmanager
def open_endpoint(
    endpoint: EndpointConfig, server: ServerConfig, server_args: Sequence[str] = ()
) -> Iterator[Endpoint]:
    """The configured remote endpoint, or the embedded server started for the block
    (``server_args``: flags appended to its command, ``tasks.engines.server.embedded_server``).

    Raises:
        EndpointError: base_url is set without a model name.
        ServerStartError: the embedded server did not start (it is stopped either way).
    """
    if endpoint.base_url:
        if not endpoint.model:
            raise EndpointError("endpoint.model: required with endpoint.base_url (the model name)")
        yield Endpoint(
            base_url=endpoint.base_url.rstrip("/"),
            model=endpoint.model,
            api_key_env=endpoint.api_key_env,
            server_kind="openai-compatible",
            tokenizer=endpoint.tokenizer or "gguf:default",
            request_timeout_s=endpoint.request_timeout_s,
            ca_bundle=str(endpoint.ca_bundle) if endpoint.ca_bundle else None,
        )
        return
    with embedded_server(
        server.model,
        engine=server.engine,
        n_ctx=server.n_ctx,
        n_threads=server.n_threads,
        startup_timeout_s=server.startup_timeout_s,
        extra_args=server_args,
    ) as running:
        os.environ[EMBEDDED_KEY_ENV] = running.api_key
        try:
            yield Endpoint(
                base_url=running.base_url,
                model=running.model,
                api_key_env=EMBEDDED_KEY_ENV,
                server_kind=running.kind,
                tokenizer=endpoint.tokenizer or server.model,
                model_sha256=running.model_sha256,
                request_timeout_s=endpoint.request_timeout_s,
                server_pid=running.pid,
            )
        finally:
            os.environ.pop(EMBEDDED_KEY_ENV, None)
