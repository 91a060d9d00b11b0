"""The configs a whole flow run takes: one per standalone flow, the audit's, and the run-level
settings (MLflow tracking, the regression verdict) they share.
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

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
    max_error_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="An audit whose stream error rate (failed / measured requests), at any level, "
        "exceeds this fraction is failed: exit 1, its first errors named, never a baseline.",
    )
    thresholds_pct: dict[str, float] = Field(
        default_factory=lambda: dict(metrics.DEFAULT_THRESHOLDS_PCT),
        description="Allowed change per metric in percent, merged with the defaults (an entry "
        "overrides or adds one): +15 = a latency may grow 15 %, -10 = a throughput may drop "
        "10 %; a throughput's may be written as a magnitude (10), its sign taken from the metric.",
    )
    confidence: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="Confidence of each change's interval; 1 - confidence is the family-wise "
        "false-alarm rate across the judged metrics (Holm).",
    )
    run_spread_prior_pct: float = Field(
        5.0,
        ge=0.1,
        le=50,
        description="The guessed run-to-run spread (percent: whole audits of one endpoint differ "
        "by about this much) before the history has shown its own; see the README's verdict "
        "section for when to change it.",
    )
    run_spread_prior_runs: float = Field(
        3.0,
        gt=0,
        le=1000,
        description="How many audits' worth of evidence the guessed spread counts as: the "
        "history's audits outweigh it once they are more.",
    )
    min_baseline_audits: int = Field(
        3,
        ge=1,
        le=50,  # the audit search reads the newest 50 (tasks.report.baseline)
        description="Audits of the same endpoint, model and workload needed before a verdict; "
        "fewer: 'building a baseline: N of M' (exit 0, no verdict).",
    )
    fail_on_regression: bool = Field(False, description="End the flow run Failed on a regression.")
    force_baseline: bool = Field(
        False,
        description="Judge even against a baseline whose workload differs (prompt lengths, "
        "max_tokens, concurrency, model file, engine); default: no verdict, 'incomparable'.",
    )

    @field_validator("baseline_run_id")
    @classmethod
    def _run_ids(cls, value: str | None) -> str | None:
        """Comma-separated run ids, none of them empty (``","`` is a typo, never "no baseline");
        blank is unset (the history's runs)."""
        if value is None or not value.strip():
            return None
        ids = [part.strip() for part in value.split(",")]
        if not any(ids):
            raise ValueError(f"no run id in {value!r}; give one or more MLflow run ids, comma-separated")
        for position, run_id in enumerate(ids, 1):
            if not run_id:
                raise ValueError(
                    f"item {position} of {value!r} is empty; give MLflow run ids, comma-separated, "
                    f"without empty items (e.g. {','.join(i for i in ids if i)})"
                )
        return ",".join(ids)

    @field_validator("thresholds_pct")
    @classmethod
    def _known_metrics(cls, thresholds: dict[str, float]) -> dict[str, float]:
        """The user's entries checked, signed as the verdict takes them (+ where a rise is
        worse, - where a drop is), over the defaults (:data:`tasks.metrics.DEFAULT_THRESHOLDS_PCT`)."""
        signed: dict[str, float] = {}
        for metric, value in thresholds.items():
            signed[metric] = signed_threshold(metric, value)
        return {**metrics.DEFAULT_THRESHOLDS_PCT, **signed}


def signed_threshold(metric: str, value: float) -> float:
    """A threshold as the verdict takes it (``tasks.report.regression``): + for a metric whose
    rise is worse, - for one whose drop is worse; a positive magnitude of the latter gets its
    minus sign here.

    Raises:
        ValueError: an unknown metric, zero or not finite, or a sign contrary to the metric's
            worse direction (``ttft_ms_p50: -15``): the message names the metric and the fix.
    """
    if not metrics.is_known_metric(metric):
        raise ValueError(
            f"unknown metric {metric!r}; use a headline metric such as ttft_ms_p50, tpot_ms_mean, "
            "decode_tokens_per_s"
        )
    if value == 0 or not math.isfinite(value):
        raise ValueError(
            f"threshold for {metric} must be a non-zero percentage, e.g. {metric}: "
            f"{_example(metric)} (got {value:g})"
        )
    worse = metrics.worse_direction(metric)
    if worse == "lower":  # a drop is worse: -10, or its magnitude 10
        if abs(value) >= 100:  # a figure cannot drop by 100 % or more: it would never regress
            raise ValueError(
                f"threshold for {metric} is {value:g}, but a drop of {abs(value):g} % or more cannot "
                f"happen: give a drop below 100, e.g. {metric}: -10"
            )
        return -abs(value)
    if worse == "higher" and value < 0:
        raise ValueError(
            f"threshold for {metric} is {value:g}, but {metric} is worse when it grows: write "
            f"{metric}: {-value:g} (it may grow {-value:g} % before it counts as a regression)"
        )
    return value


def _example(metric: str) -> str:
    return "-10" if metrics.worse_direction(metric) == "lower" else "15"


# flow configs
class StreamFlowConfig(_Strict):
    """The remote stream stage alone (`infermeter stream`): the stage plus where it streams from."""

    name: str = Field("stream", min_length=1, description="Run name shown in MLflow and Prefect.")
    stream: StreamConfig = Field(default_factory=StreamConfig)
    endpoint: EndpointConfig = Field(default_factory=lambda: EndpointConfig())
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig())

    @model_validator(mode="after")
    def _burstiness(self) -> StreamFlowConfig:
        _check_burstiness(self.stream)
        return self


def _check_burstiness(stream: StreamConfig) -> None:
    """A flow whose levels are ``stream.request_rate``: a burstiness that cannot apply is refused
    (:meth:`StreamConfig.burstiness_unused`), never ignored without a word."""
    unused = stream.burstiness_unused() if stream.enabled else None
    if unused:
        raise ValueError(unused)


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

    @model_validator(mode="after")
    def _burstiness(self) -> AuditConfig:
        _check_burstiness(self.stream)
        return self

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
