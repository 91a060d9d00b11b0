"""Session fixtures: a real MLflow SQLite store and a real (temporary) Prefect server, both in
temporary folders, so the tests never touch the user's mlruns/ or ~/.prefect."""

import os

import pytest

import flows  # noqa: F401  (sets the offline defaults)


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory):
    """A fresh SQLite MLflow store; MLFLOW_TRACKING_URI points at it for the session."""
    root = tmp_path_factory.mktemp("mlruns")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    yield root, uri
    if previous is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = previous


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """Prefect's test harness: a real temporary Prefect server and database for the session."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("work")
    os.environ["INFERMETER_WORK_DIR"] = str(path)
    return path
