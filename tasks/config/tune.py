"""`infermeter tune`'s config: the server configurations and the workload each one gets."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from tasks.config.flows import CapacityConfig
from tasks.config.stages import EndpointConfig, ServerConfig, TrackingConfig, _Strict
from tasks.config.stream import StreamConfig


class TuneConfig(_Strict):
    """Which server configurations to measure (``tasks.tune.grid``) and how."""

    server_params: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="A grid: server parameter -> values (e.g. max_num_seqs: [1, 4, 16]); every "
        "combination is measured. Names as the engine spells them (vLLM: EngineArgs fields; "
        "llama.cpp: llama_cpp.server settings such as n_threads, n_batch).",
    )
    configurations: list[dict[str, Any]] | None = Field(
        None,
        description="Explicit configurations instead of a grid (a list of parameter mappings).",
    )
    serve_cmd: str | None = Field(
        None,
        description="Your own server's launch command instead of the embedded engine, with "
        "{model}, {port} and {params} (e.g. 'vllm serve {model} --port {port} {params}'); "
        "it must serve /v1 on 127.0.0.1:{port}.",
    )
    max_configurations: int = Field(
        64, ge=1, description="More configurations than this need `yes` (each restarts the server)."
    )
    yes: bool = Field(False, description="Run a grid larger than max_configurations.")
    resume: bool = Field(
        True, description="Skip configurations already FINISHED in MLflow with the same settings."
    )
    repeats: int = Field(
        3,
        ge=1,
        description="Times each configuration is measured, each time a fresh server, in "
        "interleaved rounds (every configuration once per round, each round's order shuffled "
        "from stream.seed); each level's objective gets Student's t interval over the repeats "
        "and the best is named only where it is separated from the rest (tasks.tune.rule). "
        "3 is the fewest for an interval that means something; 1 names the top of one pass, "
        "untested.",
    )
    capacity: bool = Field(
        False,
        description="Run the capacity search (under stream.goodput) per configuration instead "
        "of the stream levels.",
    )

    @field_validator("serve_cmd")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is not None:
            if "{port}" not in value:
                raise ValueError("serve_cmd needs {port}: infermeter picks a free port per configuration")
            try:
                value.format(model="m", port=1, params="")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"serve_cmd: only {{model}}, {{port}} and {{params}} may be filled in ({exc})"
                ) from None
        return value


class TuneFlowConfig(_Strict):
    """`infermeter tune`: each configuration's server started, measured under ``stream`` (or the
    capacity search), stopped; then the Pareto front and the best configuration."""

    name: str = Field("tune", min_length=1, description="Run name shown in MLflow and Prefect.")
    tune: TuneConfig = Field(default_factory=TuneConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    capacity: CapacityConfig = Field(
        default_factory=CapacityConfig,
        description="The capacity search (tune.capacity); its target is also the goodput "
        "fraction a level must reach to be ranked best.",
    )
    endpoint: EndpointConfig = Field(
        default_factory=lambda: EndpointConfig(),
        description="With tune.serve_cmd: the model name sent, the key's variable, the tokenizer.",
    )
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig())
