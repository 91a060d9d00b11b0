"""The options several commands share (stream, capacity, tune, and the endpoint ones of sweep):
one declaration each, so a flag means one thing and says so in one set of words."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

EngineOption = Annotated[
    Optional[str], typer.Option(help="Embedded server: llamacpp (default) or vllm (needs `make vllm`).")
]
ApiKeyEnvOption = Annotated[
    Optional[str], typer.Option(help="NAME of the environment variable holding the API key.")
]
CaBundleOption = Annotated[
    Optional[Path],
    typer.Option(
        help="PEM file of the CA certificates that sign an https endpoint's certificate (a private "
        "CA), trusted instead of the system store (as curl's --cacert); default: the system store, "
        "or SSL_CERT_FILE. The endpoint is reached through HTTPS_PROXY / HTTP_PROXY unless "
        "NO_PROXY names it (never for 127.0.0.1 and localhost)."
    ),
]
TokenizerOption = Annotated[
    Optional[str], typer.Option(help="Model spec whose tokenizer counts output tokens without usage.")
]
MaxConcurrencyOption = Annotated[Optional[str], typer.Option(help="Concurrency levels, e.g. 1,4,16,64.")]
RequestRateOption = Annotated[Optional[str], typer.Option(help="Request rates in requests/s, e.g. 2,8,inf.")]
SeedOption = Annotated[
    Optional[int], typer.Option(help="Seed of the arrivals, synthetic prompts, dataset order.")
]
NumRequestsOption = Annotated[
    Optional[int], typer.Option(help="Measured requests per level (a trace: its first N rows; default all).")
]
WarmupOption = Annotated[Optional[int], typer.Option(help="Warm-up requests per level (recorded, excluded).")]
MaxTokensOption = Annotated[
    Optional[int],
    typer.Option(help="Output token limit per request (sent as max_tokens and max_completion_tokens)."),
]
InputLenOption = Annotated[Optional[int], typer.Option(help="Synthetic prompts of this many random tokens.")]
OutputLenOption = Annotated[
    Optional[int], typer.Option(help="Ask for exactly this many output tokens (ignore_eos).")
]
GoodputOption = Annotated[Optional[str], typer.Option(help="SLOs, e.g. ttft_ms:500,tpot_ms:50.")]
