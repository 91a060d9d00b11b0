"""The experiment configuration: one set of pydantic models that YAML files, the CLI and the
Prefect UI all speak.

Every model forbids unknown keys, so a typo in a YAML file is an error that names the field,
not a silently ignored setting. The flows take these models as their parameters, so Prefect
renders them as a typed form.

- :mod:`tasks.config.stages`: one model per stage, the endpoint and the embedded server;
  :mod:`tasks.config.stream`: the stream stage's.
- :mod:`tasks.config.flows`: what a flow run takes (audit, standalone flows), tracking and
  the regression verdict's settings.
- :mod:`tasks.config.loading`: YAML -> model, and one-line error messages.

Every public name is re-exported here: ``from tasks.config import X`` is the import to use.
"""

from tasks.config.flows import (
    AuditConfig,
    CapacityConfig,
    CapacityFlowConfig,
    ProfileFlowConfig,
    RegressionConfig,
    StreamFlowConfig,
    SweepFlowConfig,
    TokenizeFlowConfig,
)
from tasks.config.loading import ConfigError, describe_validation_error, load_config
from tasks.config.stages import (
    DEFAULT_STREAM_PROMPTS,
    DEFAULT_TOKENIZE_PROMPTS,
    EndpointConfig,
    ProfileConfig,
    ServerConfig,
    SweepConfig,
    SweepPointConfig,
    TokenizeConfig,
    TrackingConfig,
)
from tasks.config.stream import StreamConfig
from tasks.config.tune import TuneConfig, TuneFlowConfig

__all__ = [
    "DEFAULT_STREAM_PROMPTS",
    "DEFAULT_TOKENIZE_PROMPTS",
    "AuditConfig",
    "CapacityConfig",
    "CapacityFlowConfig",
    "ConfigError",
    "EndpointConfig",
    "ProfileConfig",
    "ProfileFlowConfig",
    "RegressionConfig",
    "ServerConfig",
    "StreamConfig",
    "StreamFlowConfig",
    "SweepConfig",
    "SweepFlowConfig",
    "SweepPointConfig",
    "TokenizeConfig",
    "TokenizeFlowConfig",
    "TrackingConfig",
    "TuneConfig",
    "TuneFlowConfig",
    "describe_validation_error",
    "load_config",
]
