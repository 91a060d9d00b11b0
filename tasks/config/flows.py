"""The configs a whole flow run takes: one per standalone flow, the audit's, and the run-level
settings (MLflow tracking, the regression verdict) they share.
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator

from tasks import metrics
from tasks.config.stages import (
    EndpointConfig,
    ProfileConfig,
    ServerConfig,
    SweepConfig,
    TokenizeConfig,
    TrackingConfig,
    _Strict,
)
from tasks.config.stream import StreamConfig


class RegressionConfig(_Strict):
    """How an audit is judged against its baseline (see tasks/report/regression.py for the rule)."""

    enabled: bool = Field(True, description="Compare with a baseline when one exists.")
    baseline_run_id: str | None = Field(
        None,
        description="MLflow run id(s) pinned as baseline, comma-separated; empty = the audit "
        "history's runs since its last change point (same endpoint, model and workload).",
    )
    baseline_last_n: int = Field(
        10, ge=1, description="At most N audits since the last change point form the baseline."
    )
    thresholds_pct: dict[str, float] = Field(
        default_factory=lambda: dict(metrics.DEFAULT_THRESHOLDS_PCT),
        description="Allowed change per metric in percent: +15 = latency may grow 15 %, "
        "-10 = throughput may drop 10 %.",
    )
    confidence: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="Confidence of each change's interval; 1 - confidence is the family-wise "
        "false-alarm rate across the judged metrics (Holm).",
    )
    fail_on_regression: bool = Field(False, description="End the flow run Failed on a regression.")
    force_baseline: bool = Field(
        False,
        description="Judge even against a baseline whose workload differs (prompt lengths, "
        "max_tokens, concurrency, model file, engine); default: no verdict, 'incomparable'.",
    )

    @field_validator("thresholds_pct")
    @classmethod
    def _known_metrics(cls, thresholds: dict[str, float]) -> dict[str, float]:
        for metric, value in thresholds.items():
            if not metrics.is_known_metric(metric):
                raise ValueError(
                    f"unknown metric {metric!r}; use a headline metric such as "
                    "ttft_ms_p50, tpot_ms_mean, decode_tokens_per_s"
                )
            if value == 0 or not math.isfinite(value):
                raise ValueError(f"threshold for {metric} must be a non-zero percentage")
        return thresholds


# flow configs
class StreamFlowConfig(_Strict):
    """The remote stream stage alone (`infermeter stream`): the stage plus where it streams from."""

    name: str = Field("stream", min_length=1, description="Run name shown in MLflow and Prefect.")
    stream: StreamConfig = Field(default_factory=StreamConfig)
    endpoint: EndpointConfig = Field(default_factory=lambda: EndpointConfig())
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig())


class CapacityConfig(_Strict):
    """The capacity search (``tasks.stream.capacity``): its SLOs are ``stream.goodput``."""

    target: float = Field(0.95, gt=0, le=1, description="Goodput fraction a rate must reach (0-1].")
    tolerance_pct: float = Field(
        5.0, gt=0, lt=100, description="Stop when the bracket is within this % of its upper end."
    )
    max_levels: int = Field(8, ge=2, description="Most levels in all (synchronous and saturation included).")


class CapacityFlowConfig(_Strict):
    """`infermeter capacity`: the highest request rate whose goodput fraction meets the target.
    Each level is a stream level (``stream``: requests per level, warm-up, prompts, SLOs in
    ``goodput``); ``stream.max_concurrency`` and ``stream.request_rate`` are set by the search."""

    name: str = Field("capacity", min_length=1, description="Run name shown in MLflow and Prefect.")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    stream: StreamConfig = Field(
        default_factory=lambda: StreamConfig(num_requests=20, goodput={"ttft_ms": 2000, "tpot_ms": 300})
    )
    endpoint: EndpointConfig = Field(default_factory=lambda: EndpointConfig())
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig())


class SweepFlowConfig(_Strict):
    """The sampling sweep alone (`infermeter sweep`): the sweep plus where it runs."""

    name: str = Field("sweep", min_length=1, description="Run name shown in MLflow and Prefect.")
    sweep: SweepConfig = Field(default_factory=SweepConfig)
    endpoint: EndpointConfig = Field(default_factory=lambda: EndpointConfig())
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig())
    resume: bool = Field(True, description="Skip points already FINISHED in MLflow (same params + endpoint).")


class ProfileFlowConfig(_Strict):
    """The local profile stage alone (`infermeter profile`): the stage plus tracking. The
    parent run's params are the ``profile.*`` and ``tracking.*`` fields (not the name)."""

    name: str = Field("profile", min_length=1, description="Run name shown in MLflow and Prefect.")
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig())


class TokenizeFlowConfig(_Strict):
    """The tokenize stage alone (`infermeter tokenize`): the stage, the model whose tokenizer is
    ``model``, and tracking. The parent run's params are the tokenize fields, unprefixed."""

    name: str = Field("tokenize", min_length=1, description="Run name shown in MLflow and Prefect.")
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    model: str = Field(
        "gguf:default",
        min_length=1,
        description="Model source whose tokenizer is the tokenizer named `model` (see profile.model).",
    )
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig())


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
    regression: RegressionConfig = Field(default_factory=RegressionConfig)
    schedule_cron: str | None = Field(
        None,
        description="Cron schedule for the served audit deployment (e.g. '0 3 * * *' "
        "nightly); empty = no schedule.",
    )

    @field_validator("schedule_cron")
    @classmethod
    def _cron(cls, value: str | None) -> str | None:
        if value:
            from datetime import datetime

            from cronsim import CronSim, CronSimError

            try:
                CronSim(value, datetime(2026, 1, 1))
            except CronSimError as exc:
                raise ValueError(f"not a cron string ({exc}); e.g. '0 3 * * *' for 03:00 daily") from None
        return value
