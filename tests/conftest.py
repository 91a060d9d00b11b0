"""Session fixtures: a real MLflow SQLite store and a real Prefect API server (one for the
session), both in temporary folders, so the tests never touch the user's mlruns/ or ~/.prefect."""

import os

import pytest

import flows  # noqa: F401  (sets the offline defaults)


def _sigterm_as_ctrl_c(signum, frame):
    raise KeyboardInterrupt


def pytest_configure(config):
    """SIGTERM (a CI job's or ``timeout``'s end) as Ctrl-C: pytest then tears the session's
    fixtures down, and the servers they started (Prefect, MLflow, PostgreSQL) stop with it;
    by default a SIGTERM ends pytest at once and they outlive it."""
    import signal

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c)


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


@pytest.fixture(scope="session", autouse=True)
def shared_prefect_api(tmp_path_factory):
    """One real Prefect API for the whole session: infermeter's own local server
    (``flows.prefect_server``) on a session ``PREFECT_HOME``, named by ``PREFECT_API_URL`` in
    this process's environment, so every flow a test runs, in process or through the
    ``infermeter`` command, records into it without starting a server of its own (a command's
    temporary server on a fresh database cost 20-40 s; the suite ran 68 minutes). Tests of a
    command's own server unset ``PREFECT_API_URL`` (tests/test_prefect_server.py,
    tests/test_run_states.py). Stopped at the end, with any local server a test left behind
    under the session's temporary folder."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.prefect_server import stop_server
    from flows.shared.prefect_api import local_api_url
    from tests.prefect_home import save_template

    home = tmp_path_factory.mktemp("prefect-home")
    previous = {name: os.environ.get(name) for name in ("PREFECT_HOME", "PREFECT_API_URL")}
    os.environ.pop("PREFECT_API_URL", None)
    os.environ["PREFECT_HOME"] = str(home)
    try:
        # the environment for the commands the tests start; the settings context for the flows
        # they run here (Prefect read the environment once, when a test module imported it)
        with temporary_settings(updates={PREFECT_HOME: str(home)}, restore_defaults={PREFECT_API_URL}):
            url = local_api_url()
            os.environ["PREFECT_API_URL"] = url
            save_template(home, tmp_path_factory.getbasetemp() / "prefect-template.db")
            with temporary_settings(updates={PREFECT_API_URL: url}):
                yield url
    finally:
        for state in tmp_path_factory.getbasetemp().rglob("infermeter-prefect-server.json"):
            stop_server(state.parent)
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def prefect_server(shared_prefect_api):
    """A real Prefect API for flows run in this process: the session's (``shared_prefect_api``)."""
    yield shared_prefect_api


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("work")
    os.environ["INFERMETER_WORK_DIR"] = str(path)
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, proc, timeout_s: float, log_path) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited; log:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s; log:\n{log_path.read_text()[-3000:]}")


def _start(command, env, health_url, log_path, timeout_s=180):
    import subprocess

    log = open(log_path, "wb")
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_http(health_url, proc, timeout_s, log_path)
    except Exception:
        _stop(proc)
        raise
    return proc


def _stop(proc) -> None:
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and any workers it forked
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real `prefect server start` on a free port of 127.0.0.1; yields its API URL."""
    import sys
    from pathlib import Path

    home = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
    }  # the UI's own API calls
    env.pop("PREFECT_API_URL", None)
    prefect = str(Path(sys.executable).parent / "prefect")
    proc = _start(
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        f"http://127.0.0.1:{port}/api/health",
        home / "server.log",
    )
    yield f"http://127.0.0.1:{port}/api"
    _stop(proc)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (SQLite backend, one worker, proxied artifacts) on a free port."""
    import sys
    from pathlib import Path

    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    mlflow = str(Path(sys.executable).parent / "mlflow")
    proc = _start(
        [
            mlflow,
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        dict(os.environ),
        f"http://127.0.0.1:{port}/health",
        root / "server.log",
    )
    yield f"http://127.0.0.1:{port}", root
    _stop(proc)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL for the session (tests/cluster.py ``postgres_cluster``): yields a
    ``tests.cluster.PgCluster`` (host 127.0.0.1, port, user, password; ``.uri(db)``,
    ``.create_database(name)`` -> URI). As root it runs as ``nobody``. Stopped at the end."""
    from tests.cluster import postgres_cluster

    with postgres_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def mlflow_pg_server(postgres, tmp_path_factory):
    """A real ``mlflow server`` on the ``postgres`` fixture's database ``mlflow`` with proxied
    artifacts (``--artifacts-destination``); yields its URI ``http://127.0.0.1:PORT`` (set it
    as ``MLFLOW_TRACKING_URI`` in the test: the fixture changes no environment). Stopped at
    the end."""
    from tests.cluster import mlflow_server

    backend = postgres.create_database("mlflow")
    with mlflow_server(backend, tmp_path_factory.mktemp("mlflow-pg") / "artifacts") as uri:
        yield uri


@pytest.fixture(scope="module")
def instrument():
    """A ground-truth instrument (tests/groundtruth_server.py) of the test module's own, on a free
    port: its counters start at zero for each module that asks for it."""
    try:
        from tests import groundtruth_server as gt
    except ImportError:  # tests/ is not a package: pytest put its folder on sys.path
        import groundtruth_server as gt
    with gt.serve() as handle:
        yield handle
