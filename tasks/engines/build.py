"""The embedded llama.cpp engine's build: portable by default, cached by its settings.

Why: pip compiles llama-cpp-python with ggml's ``GGML_NATIVE`` on, i.e. ``-march=native``. On a
CPU that advertises AMX (Sapphire Rapids and later Xeons: many cloud VMs) that turns on ggml's
AMX matmul kernels, and they fault at ``ldtilecfg`` on the first request on many of those
machines, virtualised ones above all (llama.cpp #20824 and open PR #26954; ollama #17249 and
#17006; dspy PR #10079). ``GGML_AMX_*=OFF`` changes nothing while ``GGML_NATIVE`` is on (the
compiler's ``-march=native`` defines ``__AMX_INT8__`` whatever the options say).

So the default build here (``portable``) is ``GGML_NATIVE=OFF`` with the x86-64 instruction
sets named one by one: SSE4.2, AVX, AVX2, BMI2, FMA and F16C each where this CPU has it (a VM
whose CPU model hides AVX2 gets a build that runs there), AVX-512 and AMX never. On other
architectures ggml's own default stays. ``INFERMETER_LLAMA_BUILD=native`` is the opt-in to
pip's native build (AMX where the CPU has it); README "The embedded engine's build".

pip's wheel cache is keyed by the package's version alone, not by ``CMAKE_ARGS``: a wheel built
natively earlier would be installed again whatever the new settings say. So the wheel is built
with pip's cache off, into a folder of this project's own named by the requirement and a hash
of every setting (:attr:`BuildSettings.key`), and installed from there with
``--force-reinstall``; a fresh clone on the same machine reuses it, a changed setting builds
anew. The settings installed are written beside the environment (:data:`INSTALLED_NAME`), so
``infermeter doctor`` and the tests can say what the engine is.

``python -m tasks.engines.build`` (the Makefile's install) does all of it. Standard library
only: it runs before the project's dependencies are installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The environment variable that picks the build: ``portable`` (default) or ``native``.
MODE_ENV = "INFERMETER_LLAMA_BUILD"
MODES = ("portable", "native")
#: Where the built wheels are kept: $INFERMETER_WHEEL_CACHE, else $XDG_CACHE_HOME/infermeter/wheels
#: (else ~/.cache/...): outside the clone, so a new clone on this machine reuses them.
WHEEL_CACHE_ENV = "INFERMETER_WHEEL_CACHE"
#: The file in the environment (``sys.prefix``) that records the installed engine's build.
INSTALLED_NAME = "infermeter-llama-build.json"
#: /proc/cpuinfo flag -> ggml's CMake option, for the portable build (in ggml's order).
X86_FEATURES = (
    ("sse4_2", "GGML_SSE42"),
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("bmi2", "GGML_BMI2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
)
#: Always off in the portable build: AVX-512 (not on every x86-64 CPU, and the AMX kernels
#: need it) and AMX itself.
X86_OFF = (
    "GGML_AVX_VNNI",
    "GGML_AVX512",
    "GGML_AVX512_VBMI",
    "GGML_AVX512_VNNI",
    "GGML_AVX512_BF16",
    "GGML_AMX_TILE",
    "GGML_AMX_INT8",
    "GGML_AMX_BF16",
)


class BuildError(RuntimeError):
    """The engine could not be built or installed; the message says what to do."""


@dataclass(frozen=True)
class BuildSettings:
    """What the engine is built with.

    Attributes:
        requirement: ``llama-cpp-python==X.Y.Z`` (from pyproject.toml's pin).
        mode: ``portable`` or ``native``.
        cmake_args: this project's CMake options (the portable build's; none for ``native``).
        machine: ``platform.machine()`` (x86_64, aarch64 ...).
        user_cmake_args: the ``CMAKE_ARGS`` the user set (a CUDA or BLAS build), after ours.

    (No Python version: the wheel is ``py3-none``, the engine is loaded through ctypes.)
    """

    requirement: str
    mode: str
    cmake_args: tuple[str, ...]
    machine: str
    user_cmake_args: tuple[str, ...] = ()

    @property
    def all_cmake_args(self) -> tuple[str, ...]:
        """What pip's build gets as ``CMAKE_ARGS``: ours, then the user's (CMake keeps the last
        value of an option: theirs win)."""
        return self.cmake_args + self.user_cmake_args

    @property
    def key(self) -> str:
        """16 hex digits of SHA-256 over every setting: the wheel cache's folder name."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One line: ``portable build (GGML_NATIVE=OFF; AVX2 FMA ...; no AVX-512, no AMX)``."""
        also = f"; with CMAKE_ARGS {' '.join(self.user_cmake_args)}" if self.user_cmake_args else ""
        if self.mode == "native":
            return f"native build (-march=native: every instruction set this CPU has, AMX included{also})"
        if not self.cmake_args:
            return f"ggml's default build for {self.machine}{also}"
        on = [a.split("=")[0].removeprefix("-DGGML_") for a in self.cmake_args if a.endswith("=ON")]
        return f"portable build (GGML_NATIVE=OFF; {' '.join(on) or 'no SIMD extension'}; no AVX-512, no AMX{also})"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of /proc/cpuinfo; empty elsewhere)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def llama_requirement(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """``llama-cpp-python==X.Y.Z``: pyproject.toml's pin without its extras (one source of truth).

    Raises:
        BuildError: pyproject.toml pins no llama-cpp-python version.
    """
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for dep in deps:
        found = re.fullmatch(r"llama-cpp-python(?:\[[^\]]*\])?\s*==\s*(\S+)", dep.strip())
        if found:
            return f"llama-cpp-python=={found.group(1)}"
    raise BuildError(f"{pyproject}: no pinned llama-cpp-python (llama-cpp-python[server]==X.Y.Z)")


def build_settings(
    mode: str | None = None, flags: frozenset[str] | None = None, machine: str | None = None
) -> BuildSettings:
    """The settings for ``mode`` (default: $INFERMETER_LLAMA_BUILD, else ``portable``) on this
    CPU (``flags``, ``machine``: given in tests). A ``CMAKE_ARGS`` the user set (a CUDA or
    BLAS build) comes after ours: CMake keeps the last value of an option, so theirs win, and
    they are part of the wheel's key.

    Raises:
        BuildError: an unknown mode (the message names the variable and the choices).
    """
    mode = (mode if mode is not None else os.environ.get(MODE_ENV, "")).strip() or "portable"
    if mode not in MODES:
        raise BuildError(f"{MODE_ENV}={mode!r}: use one of {', '.join(MODES)} (default portable)")
    machine = machine or platform.machine()
    args: list[str] = []
    given = shlex.split(os.environ.get("CMAKE_ARGS", ""))  # the user's own (a CUDA build ...)
    if mode == "portable" and machine.lower() in ("x86_64", "amd64"):
        flags = cpu_flags() if flags is None else flags
        args.append("-DGGML_NATIVE=OFF")
        args += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in X86_FEATURES]
        args += [f"-D{option}=OFF" for option in X86_OFF]
    return BuildSettings(llama_requirement(), mode, tuple(args), machine, tuple(given))


def wheel_cache() -> Path:
    """The folder of built wheels (:data:`WHEEL_CACHE_ENV`)."""
    given = os.environ.get(WHEEL_CACHE_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "infermeter" / "wheels"


def cached_wheel(settings: BuildSettings) -> Path | None:
    """The wheel built with exactly ``settings``, if one is kept."""
    folder = wheel_cache() / f"{settings.requirement.replace('==', '-')}-{settings.key}"
    wheels = sorted(folder.glob("*.whl")) if (folder / "build.json").is_file() else []
    return wheels[0] if wheels else None


def build_wheel(settings: BuildSettings) -> Path:
    """Build the wheel with ``settings`` from the source (``--no-binary``: an index of prebuilt
    wheels would hand back one built otherwise; pip's cache off, for the same reason) and keep it
    in :func:`wheel_cache`; return its path. Several
    minutes on 2 cores (README). The folder is filled in a temporary sibling and renamed, so an
    interrupted build leaves nothing that looks finished.

    Raises:
        BuildError: pip failed (its last lines are in the message).
    """
    target = wheel_cache() / f"{settings.requirement.replace('==', '-')}-{settings.key}"
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    env = {**os.environ, "CMAKE_ARGS": " ".join(settings.all_cmake_args), "FORCE_CMAKE": "1"}
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-cache-dir",
        "--no-deps",
        "--no-binary",
        "llama-cpp-python",
    ]
    started = time.monotonic()
    done = subprocess.run(
        [*command, settings.requirement, "-w", str(work)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0 or not list(work.glob("*.whl")):
        shutil.rmtree(work, ignore_errors=True)
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise BuildError(
            f"building {settings.requirement} ({settings.describe()}) failed (pip exit {done.returncode}); "
            f"it needs a C/C++ compiler and cmake (apt-get install build-essential cmake). pip said:\n{tail}"
        )
    record = {**asdict(settings), "key": settings.key, "build_s": round(time.monotonic() - started, 1)}
    (work / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    work.chmod(0o755)  # mkdtemp's 0700 would keep a shared INFERMETER_WHEEL_CACHE from others
    os.replace(work, target)
    return next(target.glob("*.whl"))


def install(settings: BuildSettings, wheel: Path) -> None:
    """Install ``wheel`` into this interpreter's environment over whatever llama-cpp-python is
    there (``--force-reinstall``: the same version built otherwise must not stay), and record
    its settings in ``sys.prefix`` / :data:`INSTALLED_NAME`.

    Raises:
        BuildError: pip failed.
    """
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--force-reinstall",
        str(wheel),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"installing {wheel} failed:\n{done.stderr[-2000:]}")
    record = {**asdict(settings), "key": settings.key, "wheel": str(wheel)}
    (Path(sys.prefix) / INSTALLED_NAME).write_text(json.dumps(record, indent=2) + "\n")


def installed_build(prefix: Path | None = None) -> dict | None:
    """What :func:`install` recorded in the environment at ``prefix`` (default: this one), or
    None (llama-cpp-python installed some other way)."""
    path = Path(prefix or sys.prefix) / INSTALLED_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def system_info() -> str:
    """The installed engine's own report of what it was compiled with
    (``llama_print_system_info``: ``CPU : SSE3 = 1 | ... | AVX2 = 1 | ...``; AMX appears as
    ``AMX_INT8 = 1`` only in a build compiled with it)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace")


def amx_features(info: str) -> list[str]:
    """The AMX entries the engine says it was built with (``["AMX_INT8"]``), from :func:`system_info`."""
    return [name for name, value in re.findall(r"(AMX\w*)\s*=\s*(\d+)", info) if value != "0"]


def main(argv: list[str]) -> int:
    """``python -m tasks.engines.build [--dry-run | --if-changed]``: build (or reuse) and install
    the engine. ``--if-changed`` (every ``make`` of an installed ``.venv``): nothing when the
    installed engine has this build's settings, else install it and run the smoke generation
    (so ``INFERMETER_LLAMA_BUILD`` set or unset takes effect on the next ``make``, not only when
    the install's stamp is stale)."""
    parser = argparse.ArgumentParser(prog="python -m tasks.engines.build", description=main.__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print the settings and the cached wheel")
    parser.add_argument("--if-changed", action="store_true", help="only where the installed build differs")
    args = parser.parse_args(argv)
    try:
        settings = build_settings()
        wheel = cached_wheel(settings)
        if args.dry_run:
            info = {**asdict(settings), "key": settings.key, "cached_wheel": str(wheel) if wheel else None}
            print(json.dumps(info, indent=2))
            return 0
        if args.if_changed and (installed_build() or {}).get("key") == settings.key:
            return 0
        if wheel is None:
            print(
                f"llama.cpp engine: compiling {settings.requirement}, {settings.describe()} "
                f"(about 4 minutes on 2 cores; once per machine: kept in {wheel_cache()})",
                flush=True,
            )
            wheel = build_wheel(settings)
        else:
            print(f"llama.cpp engine: {settings.describe()}, the wheel built before ({wheel.parent})")
        install(settings, wheel)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.if_changed:  # the engine changed under an installed .venv: does it answer?
        return subprocess.run([sys.executable, "-m", "tasks.engines.smoke"]).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
