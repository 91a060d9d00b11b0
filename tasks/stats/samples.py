"""The samples behind a run's headline figures, kept so that a later run can be judged against
them (:mod:`tasks.stats.verdict`).

A run's samples come in *groups* (``stream``: the requests of the stream stage's first level;
``profile``: the timed repeats of the profile stage's first point), each a list of *units*
(a unit is one independent start: a stream repeat, a run; the between-unit spread is the
run-to-run noise) holding *clusters* (one request, one timed repeat: the draws of a bootstrap)
with, per *family* (``ttft_ms``, ``itl_ms`` ...), the cluster's values: one TTFT per request,
all of a request's ITL gaps, all of a repeat's decode steps. Families of one cluster belong
together (a request's output tokens and its E2E are resampled as a pair).

On disk (``samples.parquet`` on the audit's parent run, :func:`frame` / :func:`from_rows`): one
row per value, columns ``group``, ``unit``, ``cluster``, ``family``, ``value``.

Pure standard library: no numpy, no polars.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: The per-request families of the ``stream`` group, from a request record's fields of the same
#: name (``itl_ms`` a list; only where the client saw the decode, as the level's ITL figures).
STREAM_FAMILIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "output_tokens")
#: The per-repeat families of the ``profile`` group.
PROFILE_FAMILIES = ("prefill_ms", "decode_ms")


@dataclass(frozen=True)
class Unit:
    """One independent start's samples of one group.

    Attributes:
        clusters: per family, one tuple of values per cluster; every family has the same number
            of clusters, in the same order (an empty tuple: the cluster has none, e.g. no TPOT for
            a one-token answer).
    """

    clusters: Mapping[str, tuple[tuple[float, ...], ...]]

    @property
    def size(self) -> int:
        """The number of clusters (requests, repeats)."""
        return len(next(iter(self.clusters.values()), ()))

    def count(self, family: str) -> int:
        """How many values of ``family`` the unit holds."""
        return sum(len(values) for values in self.clusters.get(family, ()))


#: A run's samples: group -> its units.
Samples = dict[str, list[Unit]]


def _get(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, Mapping) else getattr(record, name, None)


def _succeeded(record: Any) -> bool:
    error = _get(record, "error_class") or _get(record, "error")
    return not error and _get(record, "ttft_ms") is not None


def stream_units(records: Iterable[Any]) -> list[Unit]:
    """The ``stream`` group of a level's records (``RequestRecord`` or their JSON dicts): one unit
    per ``repeat`` (0 when records carry none), one cluster per successful measured request."""
    by_repeat: dict[int, list[Any]] = {}
    for record in records:
        if not _get(record, "warmup") and _succeeded(record):
            by_repeat.setdefault(int(_get(record, "repeat") or 0), []).append(record)
    units = []
    for repeat in sorted(by_repeat):
        clusters: dict[str, list[tuple[float, ...]]] = {family: [] for family in STREAM_FAMILIES}
        for record in by_repeat[repeat]:
            for family in STREAM_FAMILIES:
                value = _get(record, family)
                if family == "itl_ms":
                    seen = _get(record, "decode_unobserved") is None
                    clusters[family].append(tuple(float(v) for v in value or ()) if seen else ())
                else:
                    clusters[family].append(() if value is None else (float(value),))
        units.append(Unit({family: tuple(values) for family, values in clusters.items()}))
    return units


def profile_units(point: Mapping[str, Any]) -> list[Unit]:
    """The ``profile`` group of one profile point (``PointMeasurement.to_dict()``): one unit, one
    cluster per timed repeat (its prefill time, its decode step times); [] without repeats."""
    prefill = point.get("prefill_ms_runs") or ()
    decode = point.get("decode_ms_runs") or ()
    if not prefill or len(decode) != len(prefill):
        return []
    return [
        Unit(
            {
                "prefill_ms": tuple((float(v),) for v in prefill),
                "decode_ms": tuple(tuple(float(v) for v in steps) for steps in decode),
            }
        )
    ]


def rows(samples: Samples) -> list[dict[str, Any]]:
    """The long table of :func:`from_rows`: ``{"group", "unit", "cluster", "family", "value"}``,
    one row per value; a cluster without values of a family gives one row with value None (so
    that the unit keeps its size)."""
    return [
        {"group": group, "unit": u, "cluster": c, "family": family, "value": value}
        for group, units in samples.items()
        for u, unit in enumerate(units)
        for family, clusters in unit.clusters.items()
        for c, values in enumerate(clusters)
        for value in (values or (None,))
    ]


def from_rows(table: Iterable[Mapping[str, Any]]) -> Samples:
    """Samples back from :func:`rows`' table (rows in any order).

    Raises:
        ValueError: a row lacks a column, or its unit / cluster is not a number >= 0.
    """
    cells: dict[tuple[str, int], dict[str, dict[int, list[float]]]] = {}
    for row in table:
        try:
            key, cluster, family = (
                (str(row["group"]), int(row["unit"])),
                int(row["cluster"]),
                str(row["family"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"samples: a row without group / unit / cluster / family: {row!r}") from exc
        if key[1] < 0 or cluster < 0:
            raise ValueError(f"samples: negative unit or cluster in {row!r}")
        values = cells.setdefault(key, {}).setdefault(family, {}).setdefault(cluster, [])
        if row.get("value") is not None:
            values.append(float(row["value"]))
    out: Samples = {}
    for group, unit in sorted(cells):
        by_family = cells[(group, unit)]
        size = 1 + max(c for clusters in by_family.values() for c in clusters)
        clusters = {
            family: tuple(tuple(by_family[family].get(c, ())) for c in range(size))
            for family in sorted(by_family)
        }
        out.setdefault(group, []).append(Unit(clusters))
    return out
