"""`infermeter doctor` (issue 48, item 2): every check runs on the real parts (the embedded
engine's generation, the session's Prefect API, a real MLflow store), each failure names its
fix and makes the exit 1, and a check that breaks is a failed check, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tasks.doctor import Check, run_checks
from tasks.doctor.checks import proxy
from tasks.engines.loopback import keep_loopback_off_proxies

BIN = Path(sys.executable).parent / "infermeter"
NAMES = [
    "CPU",
    "memory",
    "disk",
    "ports",
    "proxy",
    "default model",
    "engine build",
    "engine answers",
    "MLflow store",
    "Prefect API",
    "vLLM environment",
]


def _doctor(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "doctor.json"
    done = subprocess.run(
        [str(BIN), "doctor", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    return done, json.loads(out.read_text()) if out.exists() else {}


def test_doctor_checks_everything_here_and_passes(tmp_path, mlflow_store) -> None:
    done, result = _doctor(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    checks = {c["name"]: c for c in result["checks"]}
    assert list(checks) == NAMES and result["failed"] == 0
    assert {c["status"] for c in checks.values()} <= {"ok", "warn", "skip"}
    assert checks["engine build"]["status"] == "ok" and checks["engine build"]["detail"].endswith("no AMX")
    assert checks["engine answers"]["status"] == "ok" and " tokens in " in checks["engine answers"]["detail"]
    assert checks["Prefect API"]["detail"] == f"{os.environ['PREFECT_API_URL']}: answers, takes writes"
    assert checks["MLflow store"]["detail"].startswith(os.environ["MLFLOW_TRACKING_URI"])
    assert "engine answers" in done.stdout and "fail" not in done.stdout.split("\n")[-2]


def test_a_store_that_cannot_be_opened_fails_with_its_fix_and_exit_1(tmp_path) -> None:
    done, result = _doctor(tmp_path, "--skip-engine", env={"MLFLOW_TRACKING_URI": "htp:/oops"})
    assert done.returncode == 1, done.stdout + done.stderr
    (store,) = [c for c in result["checks"] if c["name"] == "MLflow store"]
    assert (
        store["status"] == "fail" and "'htp' is not a tracking store scheme MLflow knows" in store["detail"]
    )
    assert store["fix"].startswith("set MLFLOW_TRACKING_URI") and "Traceback" not in done.stderr
    assert "engine answers" not in [c["name"] for c in result["checks"]] and result["failed"] == 1


def test_a_proxy_without_loopback_in_no_proxy_is_a_warning_with_its_fix(monkeypatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert proxy().status == "ok"
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    warned = proxy()
    assert warned.status == "warn" and warned.fix.startswith("export NO_PROXY=127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "internal.example, 127.0.0.1")
    assert proxy().status == "warn"  # localhost still goes to the proxy
    keep_loopback_off_proxies()  # what every entry point does (flows/__init__.py)
    assert os.environ["NO_PROXY"] == os.environ["no_proxy"] == "internal.example,127.0.0.1,localhost,::1"
    assert proxy().status == "ok"


def test_loopback_is_added_to_no_proxy_only_where_a_proxy_is_set() -> None:
    environ = {"NO_PROXY": "a.example"}
    keep_loopback_off_proxies(environ)
    assert environ == {"NO_PROXY": "a.example"}
    environ = {"http_proxy": "http://p:3128", "NO_PROXY": "a.example,localhost"}
    keep_loopback_off_proxies(environ)
    assert environ["NO_PROXY"] == environ["no_proxy"] == "a.example,localhost,127.0.0.1,::1"
    # the lower-case spelling wins where set, even empty, as urllib (httpx, requests) and the
    # stream client read it: not the two lists joined, which bypassed hosts neither tool would
    environ = {"http_proxy": "http://p:3128", "no_proxy": "b.example", "NO_PROXY": "a.example"}
    keep_loopback_off_proxies(environ)
    assert environ["NO_PROXY"] == environ["no_proxy"] == "b.example,127.0.0.1,localhost,::1"
    environ = {"HTTPS_PROXY": "http://p:3128", "no_proxy": "", "NO_PROXY": "endpoint.test"}
    keep_loopback_off_proxies(environ)
    assert environ["NO_PROXY"] == environ["no_proxy"] == "127.0.0.1,localhost,::1"


def test_a_check_that_breaks_is_a_failed_check_and_the_others_still_run() -> None:
    def broken() -> Check:
        raise OSError("no such thing")

    seen: list[str] = []
    results = run_checks(
        [("broken", broken), ("fine", lambda: Check("fine", "ok", "yes"))], lambda r: seen.append(r.name)
    )
    assert results == [
        Check("broken", "fail", "the check itself failed: OSError: no such thing", "report it"),
        Check("fine", "ok", "yes"),
    ]
    assert seen == ["broken", "fine"]
