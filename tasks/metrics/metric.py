"""What a registered metric is: :class:`Metric`, the statistics of a distribution, the stages.

Pure standard library.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

#: The statistics of every full distribution, in report order.
STAT_NAMES: tuple[str, ...] = ("mean", "p50", "p90", "p95", "p99", "max")
#: The stages a metric can come from, in pipeline order.
STAGES: tuple[str, ...] = ("tokenize", "profile", "stream", "sweep", "tune", "report")

_PLACEHOLDER = re.compile(r"<[a-z_]+>")
#: What a placeholder matches: MLflow-safe key characters (tokenizers.metric_name, the
#: Prometheus names of tasks.endpoint.prometheus).
_PLACEHOLDER_VALUE = r"[A-Za-z0-9_.-]+"


@dataclass(frozen=True)
class Metric:
    """One registered metric.

    Attributes:
        name: the logged name, or a pattern with one ``<placeholder>``; for a distribution the
            base of ``<name>_<stat>``.
        unit: ``ms``, ``bytes``, ``tokens/s``, ``count``, ``fraction``, ``0/1`` ...
        stage: the stage that emits it (one of :data:`STAGES`).
        description: what it measures (DESIGN.md "Metric definitions" has the contract).
        worse: ``"higher"`` / ``"lower"``: which change is a regression; None: neutral (a
            setting echoed as a metric, a count that follows the config).
        stats: the statistics it is logged with (``<name>_<stat>``); empty = a scalar.
        slo: a goodput SLO may name it (``metric <= limit``, per request, in ms).
        comparable: a regression threshold may name it (a measured figure of the run itself;
            for a distribution, any of its stats).
    """

    name: str
    unit: str
    stage: str
    description: str
    worse: str | None = None
    stats: tuple[str, ...] = ()
    slo: bool = False
    comparable: bool = False

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"metric {self.name}: unknown stage {self.stage!r}")
        if self.worse not in ("higher", "lower", None):
            raise ValueError(f"metric {self.name}: worse must be 'higher', 'lower' or None")
        if len(_PLACEHOLDER.findall(self.name)) > 1:
            raise ValueError(f"metric {self.name}: at most one <placeholder>")

    @property
    def is_pattern(self) -> bool:
        return bool(_PLACEHOLDER.search(self.name))

    def logged_names(self) -> tuple[str, ...]:
        """The names it is logged under: ``(name,)``, or ``<name>_<stat>`` per stat."""
        if not self.stats:
            return (self.name,)
        return tuple(f"{self.name}_{stat}" for stat in self.stats)

    def matches(self, name: str) -> bool:
        """Whether ``name`` (a base name, without stat) is this metric's name or fits its pattern."""
        if not self.is_pattern:
            return name == self.name
        return _pattern_regex(self.name).fullmatch(name) is not None


@functools.cache
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    prefix, suffix = _PLACEHOLDER.split(pattern)
    return re.compile(re.escape(prefix) + _PLACEHOLDER_VALUE + re.escape(suffix))
