"""What a tune run will measure, settled before anything starts: the configurations, their
flags (judged by the engine's parser), and each one's resume key."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.config import TuneFlowConfig
from tasks.engines.server import check_engine, vllm_python
from tasks.tune.grid import (
    Configuration,
    check_count,
    configuration_key,
    configurations,
    engine_flags,
    expand,
    generic_flags,
)


@dataclass(frozen=True)
class Planned:
    """A configuration and its ``tune_key``."""

    configuration: Configuration
    key: str


def key_context(config: TuneFlowConfig) -> dict:
    """Everything besides the parameters that shapes a configuration's measurement: the
    server (engine or command, model, context, threads), the workload, the search."""
    context = {
        "server": config.tune.serve_cmd or config.server.model_dump(exclude={"startup_timeout_s"}),
        "model": config.endpoint.model if config.tune.serve_cmd else config.server.model,
        "stream": config.stream.model_dump(mode="json"),
        "capacity": config.capacity.model_dump(mode="json") if config.tune.capacity else None,
    }
    return context


def plan(config: TuneFlowConfig) -> list[Planned]:
    """The configurations in order, each with its flags and key.

    Raises:
        TuneInputError: an empty grid, both a grid and a list, too many without ``yes``, a
            parameter the engine's parser refuses (named).
        ServerStartError / EngineNotInstalledError: an unknown engine, vLLM not installed.
    """
    tune = config.tune
    param_sets = expand(tune.server_params, tune.configurations)
    check_count(len(param_sets), tune.max_configurations, tune.yes)
    if tune.serve_cmd:
        flags = [generic_flags(params) for params in param_sets]
    else:
        engine = config.server.engine
        check_engine(engine)
        flags = engine_flags(engine, param_sets, vllm_python() if engine == "vllm" else None)
    context = key_context(config)
    return [
        Planned(conf, configuration_key(conf.params, context)) for conf in configurations(param_sets, flags)
    ]
