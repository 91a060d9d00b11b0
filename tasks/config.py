"""The experiment configuration: one set of pydantic models that YAML files, the CLI and the
Prefect UI all speak.

Every model forbids unknown keys, so a typo in a YAML file is an error that names the field,
not a silently ignored setting. The flows take these models as their parameters, so Prefect
renders them as a typed form.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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
    batch_sizes: list[int] = Field(
        default_factory=lambda: [1], description="Batch sizes.", min_length=1
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and activations dtype."
    )
    max_new_tokens: int = Field(32, ge=1, description="Decode steps per point (EOS ignored).")
    repeats: int = Field(3, ge=1, description="Timed repeats per point; the median is reported.")
    warmup: int = Field(1, ge=0, description="Untimed warm-up runs per point (recorded, excluded).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when present.")

    @field_validator("prompt_lengths", "batch_sizes")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError("every value must be >= 1")
        return values


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

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not value.replace("_", "").isalnum():
            raise ValueError(
                "must be the name of an environment variable (letters, digits, _), not a key"
            )
        return value


class ServerConfig(_Strict):
    """The embedded llama.cpp server (used when endpoint.base_url is empty)."""

    model: str = Field("gguf:default", description="GGUF model: gguf:default or gguf:PATH.")
    n_ctx: int = Field(2048, ge=128, description="Context window in tokens.")
    n_threads: int | None = Field(None, ge=1, description="CPU threads (None = llama.cpp default).")
    startup_timeout_s: float = Field(120.0, gt=0, description="Seconds to wait for health.")


class StreamConfig(_Strict):
    """The remote stream stage: TTFT / ITL / TPOT / E2E under a concurrency sweep."""

    enabled: bool = Field(True, description="Run this stage.")
    prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_STREAM_PROMPTS), min_length=1,
        description="Chat prompts, used round-robin.",
    )
    max_tokens: int = Field(64, ge=1, description="max_completion_tokens per request.")
    max_concurrency: list[int] = Field(
        default_factory=lambda: [1, 4], min_length=1, description="Concurrency levels."
    )
    num_requests: int = Field(8, ge=1, description="Measured requests per level.")
    warmup: int = Field(1, ge=0, description="Warm-up requests before each level (excluded).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature for load requests.")
    goodput: dict[str, float] = Field(
        default_factory=dict,
        description="SLOs for goodput, e.g. {ttft_ms: 500, tpot_ms: 50} (metric <= value).",
    )

    @field_validator("max_concurrency")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError("every concurrency must be >= 1")
        return values

    @field_validator("goodput")
    @classmethod
    def _slo_names(cls, slos: dict[str, float]) -> dict[str, float]:
        allowed = {"ttft_ms", "tpot_ms", "e2e_ms", "itl_ms"}
        for name, value in slos.items():
            if name not in allowed:
                raise ValueError(f"unknown SLO {name!r}; use one of {sorted(allowed)}")
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a positive number of milliseconds")
        return slos


class SweepConfig(_Strict):
    """The sampling sweep: a grid over temperature x top_p, N samples per point."""

    enabled: bool = Field(True, description="Run this stage.")
    prompt: str = Field(
        "Write one sentence about the sea.", min_length=1, description="The prompt every sample gets."
    )
    temperature: list[float] = Field(default_factory=lambda: [0.0, 0.7, 1.2], min_length=1)
    top_p: list[float] = Field(default_factory=lambda: [0.9, 1.0], min_length=1)
    samples: int = Field(3, ge=1, description="Samples per point; sample i uses seed + i.")
    seed: int = Field(0, description="Base seed.")
    max_tokens: int = Field(32, ge=1, description="max_completion_tokens per sample.")
    max_concurrency: int = Field(1, ge=1, description="Samples in flight at once.")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, values: list[float]) -> list[float]:
        if any(not (0 <= v <= 2) for v in values):
            raise ValueError("temperature values must lie in [0, 2]")
        return values

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, values: list[float]) -> list[float]:
        if any(not (0 < v <= 1) for v in values):
            raise ValueError("top_p values must lie in (0, 1]")
        return values


class TrackingConfig(_Strict):
    """MLflow tracking. The URI comes from MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db."""

    enabled: bool = Field(True, description="Record the run in MLflow.")
    experiment: str = Field("infermeter", min_length=1, description="MLflow experiment name.")


class AuditConfig(_Strict):
    """The whole audit: four measuring stages, then the report."""

    name: str = Field("audit", min_length=1, description="Run name shown in MLflow and Prefect.")
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    sweep: SweepConfig = Field(default_factory=SweepConfig)
    endpoint: EndpointConfig = Field(default_factory=EndpointConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the fix."""


def describe_validation_error(error: ValidationError, source: str = "config") -> str:
    """One line naming the first bad field, what is wrong and (where the model says) the fix."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown key (check the spelling; see configs/default.yaml for the fields)"
    more = len(error.errors()) - 1
    suffix = f" (+{more} more)" if more else ""
    return f"{source}: {where}: {message}{suffix}"


def load_config(path: str | Path | None = None, model: type[BaseModel] = AuditConfig) -> Any:
    """Read and validate a YAML config (None = the built-in defaults).

    Raises:
        ConfigError: the file is missing, is not YAML mapping, or a field is invalid; the
            message is one line that names the file and the field.
    """
    if path is None:
        return model()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of stage names to settings")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, str(path))) from None
