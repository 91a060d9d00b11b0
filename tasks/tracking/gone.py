"""Whether an MLflow client error means the tracking server is gone (the tracker's journal
takes over then) rather than a request it refused."""

from __future__ import annotations


def server_gone(exc: BaseException) -> bool:
    """Whether an MLflow client error means the server is not there (refused, timed out, or
    still 5xx after the retries) rather than a request it refused (4xx: raised as before)."""
    import re

    from mlflow.exceptions import MlflowException

    text = str(exc)
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.startswith(
        ("requests", "urllib3")
    ):
        return True
    return isinstance(exc, MlflowException) and bool(
        re.search(r"failed with (timeout )?exception|error code 5\d\d|too many 5\d\d", text)
    )
