"""The samples behind an audit's headline as a file (``samples.parquet`` on its parent run,
:data:`tasks.report.baseline.SAMPLES_ARTIFACT`): one row per value, written by the audit and read
back when a later audit is judged against it."""

from __future__ import annotations

from pathlib import Path

from tasks.stats.samples import Samples, from_rows, rows


def write_samples(samples: Samples, path: Path) -> Path:
    """Samples as :data:`SAMPLES_ARTIFACT` (one row per value, ``tasks.stats.samples.rows``)."""
    import polars as pl

    schema = {
        "group": pl.String,
        "unit": pl.Int32,
        "cluster": pl.Int32,
        "family": pl.String,
        "value": pl.Float64,
    }
    pl.DataFrame(rows(samples), schema=schema).write_parquet(path)
    return path


def read_samples(path: Path) -> Samples:
    """Samples back from :func:`write_samples`' file.

    Raises:
        ValueError: not such a file (polars' errors, a missing column).
    """
    import polars as pl

    try:
        return from_rows(pl.read_parquet(path).to_dicts())
    except (pl.exceptions.PolarsError, KeyError) as exc:
        raise ValueError(f"{path.name}: not a samples file ({exc})") from exc
