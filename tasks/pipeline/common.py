"""What every stage wrapper shares: the Prefect task options and the stage's MLflow child run.

Each task takes configs and plain values (never a live model, client or DataFrame, which
Prefect cannot hash), builds what it needs inside, measures through the plain modules, writes
its records to the work folder as it goes, and logs to MLflow under the parent run id it was
given. Measurement tasks have no cache and no retries: a retried measurement is a different
measurement.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.cache_policies import NO_CACHE

from tasks.tracking import TrackingTarget

STAGE = dict(cache_policy=NO_CACHE, retries=0)


def _scalars(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _token_counter(tokenizer):
    """Output tokens by the tokenizer, without special tokens (no BOS), per DESIGN.md."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


class StageRun:
    """A stage's child run: ended FINISHED; FAILED with the error recorded on it (an exception,
    or what :meth:`fail` said of a stage that ran to its end but measured nothing); or KILLED
    when the command was interrupted (Ctrl-C, SIGTERM: an exception that is not an
    ``Exception``). A run that did not finish logs the records it has (:meth:`keep`), so what
    was measured before the interruption is in MLflow, not only on disk."""

    def __init__(self, target: TrackingTarget, name: str, parent_run_id: str | None, tags=None):
        self.tracker = target.open()
        self.run_id = self.tracker.start_run(name, parent_run_id, {"stage": name, **(tags or {})})
        self._kept: list[Path] = []
        self._failure: str | None = None

    def fail(self, error: str) -> None:
        """End the run FAILED with ``error`` as its ``error`` tag, though no exception left the
        block (every request failed: the records are logged, the measurement is not one)."""
        self._failure = error

    def keep(self, path: Path) -> None:
        """A record file (a crash-safe journal) to log as an artifact should the stage not
        finish; a finished stage logs its own records."""
        self._kept.append(Path(path))

    def __enter__(self) -> StageRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            if self._failure:
                self.tracker.set_tags(self.run_id, {"error": self._failure[:500]})
            self.tracker.end_run(self.run_id, "FAILED" if self._failure else "FINISHED")
            return
        interrupted = not isinstance(exc, Exception)
        error = f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__
        self.tracker.set_tags(self.run_id, {"error": ("interrupted: " if interrupted else "") + error[:480]})
        self.tracker.log_text(self.run_id, "".join(traceback.format_exception(exc)), "error.txt")
        for path in self._kept:
            if path.is_file():
                self.tracker.log_artifact(self.run_id, path)
        self.tracker.end_run(self.run_id, "KILLED" if interrupted else "FAILED")


def stage_logger(name: str):
    """The Prefect run logger inside a run; a plain ``infermeter.<name>`` logger outside one
    (a plain call in a test)."""
    try:
        return get_run_logger()
    except Exception:  # outside a Prefect run
        return logging.getLogger(f"infermeter.{name}")
