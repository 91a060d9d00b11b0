"""The stage configs: one pydantic model per stage (tokenize, profile, sweep; the stream stage's
is in :mod:`tasks.config.stream`) and the endpoint / embedded server the remote stages talk to.

Every model forbids unknown keys (``_Strict``), so a typo in a YAML file is an error that names
the field, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tasks.config.taskrunner import TASK_RUNNER_FIELD, TaskRunner

#: The seed article's probes: 'smart' vs 'smarter' share no token, 'token' vs 'tokenization'
#: splits into pieces, and Chinese costs more tokens per character than English.
DEFAULT_TOKENIZE_PROMPTS: list[str] = [
    "smart",
    "smarter",
    "token",
    "tokenization",
    "The quick brown fox jumps over the lazy dog.",
    "大语言模型的推理速度取决于预填充和解码两个阶段。",
    "def add(a, b):\n    return a + b",
]

DEFAULT_STREAM_PROMPTS: list[str] = [
    "Explain in two sentences what a KV cache is.",
    "Write a haiku about latency.",
    "List three prime numbers and say why they are prime.",
    "What is the capital of France? Answer briefly.",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TokenizeConfig(_Strict):
    """The tokenize stage: how many tokens each prompt costs under the model's tokenizer."""

    enabled: bool = Field(True, description="Run this stage.")
    prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TOKENIZE_PROMPTS),
        description="Texts to tokenize (the seed's probes by default).",
        min_length=1,
    )
    tokenizers: list[str] = Field(
        default_factory=lambda: ["model"],
        min_length=1,
        description="Tokenizers to compare: model (the model's own), cl100k_base (OpenAI, "
        "tiktoken), qwen (Qwen's BPE), hf:PATH_OR_ID, gguf:PATH. See tasks/tokenize/tokenizers.py.",
    )

    @field_validator("tokenizers")
    @classmethod
    def _tokenizer_names(cls, names: list[str]) -> list[str]:
        from tasks.tokenize.tokenizers import check_name

        for name in names:
            check_name(name)  # TokenizerError is a ValueError: one line naming the name
        if len(set(names)) != len(names):
            raise ValueError(f"tokenizers {names}: a name is given twice")
        return names


class ProfileConfig(_Strict):
    """The local profile stage: prefill and per-token decode inside a transformers model."""

    enabled: bool = Field(True, description="Run this stage.")
    model: str = Field(
        "gguf:default",
        description="Model source: gguf:default (packaged SmolLM2), gguf:PATH, hf:PATH_OR_ID, "
        "arch:NAME or arch:PATH/config.json (random weights).",
    )
    prompt_lengths: list[int] = Field(
        default_factory=lambda: [128], description="Prompt lengths in tokens.", min_length=1
    )
    batch_sizes: list[int] = Field(default_factory=lambda: [1], description="Batch sizes.", min_length=1)
    dtypes: list[Literal["float32", "bfloat16", "float16"]] | None = Field(
        None,
        description="Weights and activations dtypes; null = the model's default (float32; "
        "bfloat16 for 7B-shaped arch: presets).",
        min_length=1,
    )
    prefill_chunk_sizes: list[int] = Field(
        default_factory=lambda: [0],
        description="Chunked prefill: feed the prompt through the KV cache this many tokens "
        "at a time; 0 = the whole prompt in one forward.",
        min_length=1,
    )
    num_layers: int | None = Field(
        None, ge=1, description="arch: sources only: keep the first N layers (a slice of the shape)."
    )
    max_new_tokens: int | list[int] = Field(
        32,
        description="Decode steps per point (EOS ignored): one value, or a list to sweep it.",
    )
    repeats: int = Field(3, ge=1, description="Timed repeats per point; the median is reported.")
    warmup: int = Field(1, ge=0, description="Untimed warm-up runs per point (recorded, excluded).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when present.")
    # issue 12: the profiled per-part breakdown and the roofline, apart from the timed repeats
    breakdown: bool | None = Field(
        None,
        description="Per-part time (torch.profiler) of one prefill and breakdown_steps decode "
        "steps, and the roofline, per point; null = on in the audit (its first point), off in "
        "`infermeter profile` (--breakdown).",
    )
    breakdown_steps: int = Field(4, ge=1, description="Profiled decode steps of the breakdown.")
    task_runner: TaskRunner = TASK_RUNNER_FIELD

    @field_validator("prompt_lengths", "batch_sizes")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError("every value must be >= 1")
        return values

    @field_validator("prefill_chunk_sizes")
    @classmethod
    def _non_negative(cls, values: list[int]) -> list[int]:
        if any(v < 0 for v in values):
            raise ValueError("every value must be >= 0 (0 = no chunking)")
        return values

    @field_validator("max_new_tokens")
    @classmethod
    def _steps(cls, value: int | list[int]) -> int | list[int]:
        values = value if isinstance(value, list) else [value]
        if not values or any(v < 1 for v in values):
            raise ValueError("give one value >= 1 or a non-empty list of them")
        return value

    @property
    def max_new_tokens_values(self) -> list[int]:
        """``max_new_tokens`` as a list (one value -> [value])."""
        steps = self.max_new_tokens
        return list(steps) if isinstance(steps, list) else [steps]


class EndpointConfig(_Strict):
    """Where the remote stages stream from. No base_url = the embedded llama.cpp server."""

    base_url: str | None = Field(
        None, description="OpenAI-compatible base URL (…/v1); empty = start the embedded server."
    )
    model: str | None = Field(None, description="Model name sent in requests (embedded: its alias).")
    api_key_env: str | None = Field(
        None,
        description="NAME of the environment variable holding the API key (never the key). "
        "Default: OPENAI_API_KEY when set, else no key.",
    )
    request_timeout_s: float = Field(120.0, gt=0, description="Per-request timeout in seconds.")
    tokenizer: str | None = Field(
        None,
        description="Model spec whose tokenizer counts output tokens when the server sends no "
        "usage (default: the embedded server's model, else gguf:default).",
    )
    ca_bundle: Path | None = Field(
        None,
        description="PEM file of the CA certificates that sign an https endpoint's certificate "
        "(a private CA), trusted instead of the system store by every path to the endpoint. "
        "The alternative: SSL_CERT_FILE=PATH in the environment (used when this is empty).",
    )

    @field_validator("ca_bundle")
    @classmethod
    def _ca_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            value = value.expanduser().resolve()  # absolute: clients in other folders (Dask workers)
            if value.is_dir():  # OpenSSL reads a folder only as hashed names (c_rehash), not as a bundle
                raise ValueError(
                    f"{value} is a folder; give the PEM file of the endpoint's CA certificates (a folder "
                    "of hashed certificates: SSL_CERT_DIR=PATH in the environment)"
                )
            if not value.is_file():
                raise ValueError(f"no file at {value}; give the PEM file of the endpoint's CA certificates")
            import ssl

            try:  # what every client will do with it: a file OpenSSL cannot read fails here, once
                ssl.create_default_context(cafile=str(value))
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(
                    f"{value} holds no CA certificate OpenSSL reads (PEM expected): {exc}"
                ) from None
        return value

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not value.replace("_", "").isalnum():
            raise ValueError("must be the name of an environment variable (letters, digits, _), not a key")
        return value


class ServerConfig(_Strict):
    """The embedded server (used when endpoint.base_url is empty): llama.cpp or vLLM."""

    engine: Literal["llamacpp", "vllm"] = Field(
        "llamacpp",
        description="llamacpp (default: one request at a time, quantised GGUF) or "
        "vllm (continuous batching, /metrics; its own .venv-vllm: `make vllm`).",
    )
    model: str = Field(
        "gguf:default",
        description="GGUF model: gguf:default or gguf:PATH (vllm serves its Hugging Face conversion).",
    )
    n_ctx: int = Field(2048, ge=128, description="Context window in tokens (vllm: --max-model-len).")
    n_threads: int | None = Field(None, ge=1, description="CPU threads (None = the engine's default).")
    startup_timeout_s: float = Field(120.0, gt=0, description="Seconds to wait for health.")


def _check_temperature(value: float) -> float:
    if not (0 <= value <= 2):
        raise ValueError(f"temperature {value} is outside [0, 2]; use 0 (greedy) up to 2")
    return value


def _check_top_p(value: float | None) -> float | None:
    if value is not None and not (0 < value <= 1):
        raise ValueError(f"top_p {value} is outside (0, 1]; use e.g. 0.9 or 1.0 (off)")
    return value


def _check_top_k(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise ValueError(f"top_k {value} is negative; use 0 (off), 1 (greedy) or more")
    return value


class SweepPointConfig(_Strict):
    """One explicit sweep point. Unset fields: top_p / top_k not sent (the target's default),
    seed = the sweep's base seed, max_tokens = the sweep's."""

    temperature: float = Field(..., description="Sampling temperature, [0, 2].")
    top_p: float | None = Field(None, description="Nucleus mass, (0, 1]; None = not sent.")
    top_k: int | None = Field(None, description="Top-k, >= 0 (0 = off); None = not sent.")
    seed: int | None = Field(None, description="Base seed of this point (sample i: seed + i).")
    max_tokens: int | None = Field(None, ge=1, description="max_completion_tokens per sample.")
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="Extra request-body fields (e.g. min_p, repeat_penalty)."
    )

    @field_validator("temperature", "top_p", "top_k")
    @classmethod
    def _sampling_value(cls, value, info: ValidationInfo):
        check = {"temperature": _check_temperature, "top_p": _check_top_p, "top_k": _check_top_k}
        return check[info.field_name](value)


class SweepConfig(_Strict):
    """The sampling sweep: a grid over temperature x top_p (x top_k), or an explicit list of
    points; N samples per point (sample i uses seed + i)."""

    enabled: bool = Field(True, description="Run this stage.")
    prompt: str = Field(
        "Write one sentence about the sea.", min_length=1, description="The prompt every sample gets."
    )
    temperature: list[float] = Field(
        default_factory=lambda: [0.0, 0.7, 1.2],
        min_length=1,
        description="Temperatures of the grid, each in [0, 2] (0 = greedy).",
    )
    top_p: list[float] = Field(
        default_factory=lambda: [0.9, 1.0],
        min_length=1,
        description="top_p values of the grid, each in (0, 1] (1.0 = off).",
    )
    top_k: list[int] = Field(
        default_factory=list, description="Top-k values (0 = off); empty = not sent (the target's default)."
    )
    points: list[SweepPointConfig] = Field(
        default_factory=list, description="Explicit points; when given they replace the grid."
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra request-body fields sent with every grid point (e.g. min_p).",
    )
    samples: int = Field(3, description="Samples per point (>= 1); sample i uses seed + i.")
    warmup: int = Field(
        1,
        ge=0,
        le=1,
        description="Warm-up request per point before its samples (endpoint target; recorded, "
        "excluded from the figures; its cold output is compared with the warm samples).",
    )
    seed: int = Field(0, description="Base seed.")
    max_tokens: int = Field(32, ge=1, description="max_completion_tokens per sample.")
    max_concurrency: int = Field(
        1,
        ge=1,
        description="Requests in flight at once across the whole sweep; points run "
        "concurrently within it (the embedded llama.cpp server answers one at a time).",
    )
    target: Literal["endpoint", "local"] = Field(
        "endpoint",
        description="endpoint = the configured / embedded server; local = "
        "transformers generate on local_model with the same parameters.",
    )
    local_model: str = Field("gguf:default", description="Model spec for target local.")
    distribution: bool = Field(
        True,
        description="Target local: the sampler's view (top-20 next tokens per temperature, the "
        "nucleus top_p keeps, entropy) at the first distribution_steps decode steps of the prompt.",
    )
    distribution_steps: int = Field(
        3, ge=1, le=64, description="Decode steps of the sampler's view (greedy path; 1..64)."
    )
    task_runner: TaskRunner = TASK_RUNNER_FIELD

    @field_validator("temperature", "top_p", "top_k")
    @classmethod
    def _sampling_values(cls, values: list, info: ValidationInfo) -> list:
        check = {"temperature": _check_temperature, "top_p": _check_top_p, "top_k": _check_top_k}
        return [check[info.field_name](v) for v in values]

    @field_validator("samples")
    @classmethod
    def _samples(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"samples {value} is below 1; give at least 1 sample per point")
        return value


class TrackingConfig(_Strict):
    """MLflow tracking. The URI comes from MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db."""

    enabled: bool = Field(True, description="Record the run in MLflow.")
    experiment: str = Field("infermeter", min_length=1, description="MLflow experiment name.")
