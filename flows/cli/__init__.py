"""The `infermeter` console script: its entry point (``main``: signals, the tracked stream's
early tracking writer, the quick exit), the typer app that lists the commands of
``flows.commands`` (``app``), and the help text's rendering (``helptext``: config defaults,
docstrings as prose)."""
