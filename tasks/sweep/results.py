"""The sweep's results: one :class:`PointOutcome` per point (finished, failed, or skipped on
resume), the resume bookkeeping, and the sweep's headline counts. Pure: the tracking (finding
finished runs, reading their samples back) is the caller's, through plain values and callables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.metrics import SWEEP_POINT_METRICS
from tasks.sweep.figures import PointResult
from tasks.sweep.points import SweepPoint

#: The per-point figures of ``tasks.sweep.figures.point_metrics`` carried into each point's
#: result (and read back from a finished run on resume); listed in the metric registry.
SWEEP_METRICS = SWEEP_POINT_METRICS

#: The figures that are counts: read back from MLflow (floats there) as ints.
_COUNTS = frozenset({"num_samples", "num_samples_failed", "determinism_violated"})


@dataclass(frozen=True)
class PointOutcome:
    """One point of the sweep as the stage reports it.

    Attributes:
        point: the sampling parameters; point_key: its resume key (``SweepPoint.key``).
        status: ``"finished"``, ``"failed"`` (some request failed; ``error_class`` says the
            most common class) or ``"skipped"`` (already FINISHED in an earlier run; its
            figures and samples read back from that run).
        samples: one row per sample (``PointResult.sample_rows``).
        figures: the :data:`SWEEP_METRICS` values (None where missing).
        mlflow_run_id: the point's child run (None when not tracked).
        warmup: the warm-up request as a sample row (None: none made, or skipped on resume).
        determinism_note: why a deterministic point's cold output differed from its warm
            samples (``tasks.sweep.figures.determinism_note``), else None.
    """

    point: SweepPoint
    point_key: str
    status: str
    error_class: str | None
    samples: list[dict[str, Any]]
    figures: dict[str, Any]
    mlflow_run_id: str | None
    warmup: dict[str, Any] | None = None
    determinism_note: str | None = None

    @classmethod
    def measured(cls, result: PointResult, key: str, run_id: str | None) -> PointOutcome:
        """A point run now: ``finished``, or ``failed`` when any of its requests failed."""
        return cls(
            result.point,
            key,
            "failed" if result.failed else "finished",
            result.error_class,
            result.sample_rows(),
            {k: result.metrics.get(k) for k in SWEEP_METRICS},
            run_id,
            result.warmup_row(),
            result.determinism_note,
        )

    @classmethod
    def skipped(
        cls,
        point: SweepPoint,
        key: str,
        run_id: str,
        metrics: Mapping[str, float],
        samples: list[dict[str, Any]],
        determinism_note: str | None = None,
    ) -> PointOutcome:
        """A point found FINISHED in an earlier run: its logged ``metrics`` (counts as ints),
        ``samples`` and ``determinism_note`` (its tag) read back from run ``run_id``."""
        return cls(
            point, key, "skipped", None, samples, prior_figures(metrics), run_id, None, determinism_note
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry: the point's params, ``point_key``, ``status``, ``error_class``,
        ``samples``, ``warmup``, the :data:`SWEEP_METRICS` figures, ``determinism_note``,
        ``mlflow_run_id``."""
        return {
            **self.point.params(),
            "point_key": self.point_key,
            "status": self.status,
            "error_class": self.error_class,
            "samples": self.samples,
            "warmup": self.warmup,
            **{k: self.figures.get(k) for k in SWEEP_METRICS},
            "determinism_note": self.determinism_note,
            "mlflow_run_id": self.mlflow_run_id,
        }


def prior_figures(metrics: Mapping[str, float]) -> dict[str, Any]:
    """A skipped point's figures as read back from its FINISHED run (counts as ints, None
    where the run has no such metric)."""
    return {
        k: (int(metrics[k]) if k in _COUNTS else metrics[k]) if k in metrics else None for k in SWEEP_METRICS
    }


def pending_points(points: Iterable[SweepPoint], done: Mapping[SweepPoint, Any]) -> list[SweepPoint]:
    """The points still to run: each distinct point once, in order, less those in ``done``."""
    return [p for p in dict.fromkeys(points) if p not in done]


def collect_outcomes(
    points: Sequence[SweepPoint],
    keys: Mapping[SweepPoint, str],
    done: Mapping[SweepPoint, Mapping[str, Any]],
    finished: Mapping[SweepPoint, tuple[PointResult, str | None]],
    load_samples: Callable[[str], list[dict[str, Any]]],
) -> list[PointOutcome]:
    """One outcome per point of ``points`` (a repeated point repeats its outcome).

    Args:
        keys: each point's resume key.
        done: points skipped on resume -> their earlier run (``{"run_id", "metrics"}``).
        finished: points run now -> (their result, their child run id or None).
        load_samples: reads a skipped point's samples back from its run id.
    """
    out = []
    for p in points:
        if p in done:
            prior = done[p]
            out.append(
                PointOutcome.skipped(
                    p,
                    keys[p],
                    prior["run_id"],
                    prior["metrics"],
                    load_samples(prior["run_id"]),
                    (prior.get("tags") or {}).get("determinism_note"),
                )
            )
        else:
            result, run_id = finished[p]
            out.append(PointOutcome.measured(result, keys[p], run_id))
    return out


def sweep_headline(outcomes: Sequence[PointOutcome]) -> dict[str, int]:
    """The sweep's counts: points, skipped, failed, and points whose determinism was violated."""
    return {
        "sweep_points": len(outcomes),
        "sweep_points_skipped": sum(o.status == "skipped" for o in outcomes),
        "sweep_points_failed": sum(o.status == "failed" for o in outcomes),
        "sweep_determinism_violations": sum(
            int(o.figures.get("determinism_violated") or 0) for o in outcomes
        ),
    }
