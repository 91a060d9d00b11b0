"""A tracked stream's tracking writer (``tasks.tracking.writer``), started as early as the
command line tells (``flows.cli.main.main``, before the CLI's own imports) and again, as a
no-op, once the stream command has read its config (``flows.commands.stream``). Standard
library only at import: it runs before anything else of the command."""

from __future__ import annotations

#: What a tracked stream's tracking writer imports ahead of its jobs (a level's plots and
#: timeline), once MLflow is in.
STREAM_WRITER_PRELOAD = ("tasks.report.plots:_pyplot", "tasks.pipeline.stream_files")


def start_stream_writer() -> None:
    """Start the process that will do a tracked stream's MLflow writes and plots
    (``tasks.tracking.writer``): its imports (MLflow, the store, matplotlib, the level files'
    modules) run while this process checks its input and the endpoint and starts Prefect. A
    second call does nothing."""
    from tasks.tracking import writer as tracking_writer

    tracking_writer.start(STREAM_WRITER_PRELOAD)


def tracked_stream(argv: list[str]) -> bool:
    """``infermeter stream ...`` that will track, as far as its command line tells (a config
    that turns tracking off leaves a writer that gets no call: it exits at once)."""
    return argv[:1] == ["stream"] and not {"--no-track", "--help", "-h"} & set(argv)
