"""The sampling sweep: what temperature / top_p / top_k / seed do to the output, and to speed.

A point is one combination of sampling parameters; it gets N samples of the same prompt, sample
i with ``seed + i``. The package:

- ``points``: :class:`SweepPoint` (parameters, resume key), :func:`grid`,
  :func:`points_from_config`.
- ``figures``: a point's figures from its samples (identical fraction, distinct-n over the
  model tokenizer's tokens, lengths, TTFT / E2E means, determinism violated);
  :class:`PointResult`.
- ``remote``: :func:`run_points` against an OpenAI-compatible endpoint through the stream
  client (every point concurrently, at most ``max_concurrency`` requests in flight across the
  sweep).
- ``local``: :func:`run_point_local` in transformers (``generate``, sample i drawn with its own
  ``torch.Generator`` seeded ``seed + i``), :func:`local_identity`.
- ``results``: :class:`PointOutcome` (a point as the stage reports it; ``to_dict()`` is its JSON
  entry), the resume bookkeeping, the headline counts.

TTFT / ITL / E2E of every sample come from ``tasks.stream.timing`` (the remote one through the
stream client). Imports only the standard library, the stream package, and (for the local
target) torch and transformers; never prefect or mlflow.
"""

from tasks.sweep.figures import (
    PointResult,
    distinct_n,
    finish_point,
    identical_fraction,
    point_metrics,
)
from tasks.sweep.local import local_identity, run_point_local
from tasks.sweep.points import SweepPoint, grid, points_from_config
from tasks.sweep.remote import run_points
from tasks.sweep.results import (
    SWEEP_METRICS,
    PointOutcome,
    collect_outcomes,
    pending_points,
    prior_figures,
    sweep_headline,
)

__all__ = [
    "SWEEP_METRICS",
    "PointOutcome",
    "PointResult",
    "SweepPoint",
    "collect_outcomes",
    "distinct_n",
    "finish_point",
    "grid",
    "identical_fraction",
    "local_identity",
    "pending_points",
    "point_metrics",
    "points_from_config",
    "prior_figures",
    "run_point_local",
    "run_points",
    "sweep_headline",
]
