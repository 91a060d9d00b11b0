"""The embedded engine works on the machine in front of it (issue 48): the installed llama.cpp
has no AMX path (its own system info and the settings it was built with), the build's
settings are read from the CPU and never hide behind a wheel built otherwise, the install's
smoke generation answers, and a server that dies while it is used is named (signal, log) by the
block that started it. Real processes throughout: the installed engine, a real server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tasks.engines import build
from tasks.engines.death import ServerDeath, ServerDiedError, server_gone
from tasks.engines.server import ServerStartError, background_server, free_port
from tasks.engines.smoke import smoke_generation

#: A CPU of 2013 (Haswell) and one that advertises AMX (Sapphire Rapids), as /proc/cpuinfo says.
HASWELL = "flags\t\t: fpu sse4_2 avx avx2 bmi2 fma f16c"
SAPPHIRE_RAPIDS = HASWELL + " avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16"
#: A VM whose CPU model hides everything past SSE4.2 (QEMU's default CPU, for one).
NO_AVX = "flags\t\t: fpu sse4_2"


def test_the_installed_engine_has_no_amx_path() -> None:
    """The engine's own account of what it was compiled with: no AMX (a build with it lists
    ``AMX_INT8 = 1``), and AVX2 where this CPU has it; the settings recorded at install are the
    portable ones. Holds on a machine without AMX too: it reads the build, not the CPU."""
    info = build.system_info()
    assert info.startswith("CPU :") and build.amx_features(info) == [], info
    assert ("AVX2 = 1" in info) == ("avx2" in build.cpu_flags()), info
    installed = build.installed_build()
    assert installed is not None, "llama-cpp-python was not installed by tasks.engines.build (make install)"
    assert installed["mode"] == "portable" and installed["requirement"] == build.llama_requirement()
    args = installed["cmake_args"]
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AMX_INT8=OFF" in args and "-DGGML_AVX512=OFF" in args


def test_amx_features_are_read_from_the_engines_words() -> None:
    native = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 |"
    assert build.amx_features(native) == ["AMX_INT8"]
    assert build.amx_features("CPU : AVX2 = 1 | AMX_INT8 = 0 |") == []


def test_the_portable_build_follows_the_cpu_and_never_turns_on_avx512_or_amx(monkeypatch) -> None:
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    amx = build.build_settings("portable", build.cpu_flags(SAPPHIRE_RAPIDS), "x86_64")
    haswell = build.build_settings("portable", build.cpu_flags(HASWELL), "x86_64")
    assert amx.cmake_args == haswell.cmake_args and amx.key == haswell.key  # the AMX CPU gets no more
    assert amx.cmake_args[0] == "-DGGML_NATIVE=OFF"
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AMX_INT8=OFF"} <= set(amx.cmake_args)
    assert all(a.endswith("=OFF") for a in amx.cmake_args if "AVX512" in a or "AMX" in a)
    assert (
        amx.describe() == "portable build (GGML_NATIVE=OFF; SSE42 AVX AVX2 BMI2 FMA F16C; no AVX-512, no AMX)"
    )
    old = build.build_settings("portable", build.cpu_flags(NO_AVX), "x86_64")
    assert {"-DGGML_SSE42=ON", "-DGGML_AVX=OFF", "-DGGML_AVX2=OFF", "-DGGML_FMA=OFF"} <= set(old.cmake_args)
    assert old.key != haswell.key  # another build, another wheel


def test_native_and_other_architectures_keep_ggmls_default_and_a_bad_mode_names_the_variable(
    monkeypatch,
) -> None:
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    native = build.build_settings("native", build.cpu_flags(SAPPHIRE_RAPIDS), "x86_64")
    assert native.cmake_args == () and native.key != build.build_settings("portable", None, "x86_64").key
    assert "AMX included" in native.describe()
    assert build.build_settings("portable", frozenset(), "aarch64").cmake_args == ()
    with pytest.raises(build.BuildError, match=r"INFERMETER_LLAMA_BUILD='fast': use one of portable, native"):
        build.build_settings("fast")


def test_the_users_own_cmake_args_come_after_ours_and_make_another_wheel(monkeypatch) -> None:
    """A CUDA or BLAS build the user asked for with CMAKE_ARGS is kept, never dropped silently."""
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    plain = build.build_settings("portable", build.cpu_flags(HASWELL), "x86_64")
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on -DGGML_AVX512=ON")
    cuda = build.build_settings("portable", build.cpu_flags(HASWELL), "x86_64")
    assert (
        cuda.all_cmake_args == (*plain.cmake_args, "-DGGML_CUDA=on", "-DGGML_AVX512=ON")
        and cuda.key != plain.key
    )
    assert cuda.describe().endswith("no AVX-512, no AMX; with CMAKE_ARGS -DGGML_CUDA=on -DGGML_AVX512=ON)")
    assert build.build_settings("native").all_cmake_args == ("-DGGML_CUDA=on", "-DGGML_AVX512=ON")


def test_a_wheel_built_with_other_settings_is_never_reused(tmp_path, monkeypatch) -> None:
    """The cache is keyed by every setting (pip's own is keyed by the version alone: a native
    wheel of the same version came back whatever CMAKE_ARGS said)."""
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setenv(build.WHEEL_CACHE_ENV, str(tmp_path))
    portable = build.build_settings("portable", build.cpu_flags(HASWELL), "x86_64")
    native = build.build_settings("native", build.cpu_flags(HASWELL), "x86_64")
    folder = tmp_path / f"llama-cpp-python-{portable.requirement.split('==')[1]}-{native.key}"
    folder.mkdir()
    (folder / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"native")
    (folder / "build.json").write_text("{}")
    assert build.cached_wheel(native) == folder / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    assert build.cached_wheel(portable) is None  # a native wheel of the same version: not this build
    half = tmp_path / f"llama-cpp-python-{portable.requirement.split('==')[1]}-{portable.key}"
    half.mkdir()
    (half / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"cut")
    assert build.cached_wheel(portable) is None  # no build.json: a build that did not finish


def test_the_requirement_is_pyprojects_pin(tmp_path) -> None:
    assert build.llama_requirement() == "llama-cpp-python==0.3.36"
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\ndependencies = ["llama-cpp-python>=0.3"]\n')
    with pytest.raises(build.BuildError, match="no pinned llama-cpp-python"):
        build.llama_requirement(bad)


def test_the_smoke_generation_answers() -> None:
    """What `make install` ends with: a real generation through the embedded server."""
    result = smoke_generation()
    assert result.text.strip() and result.completion_tokens is not None and 1 <= result.completion_tokens <= 8
    assert result.line().startswith("embedded llamacpp engine answered: ")


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


@pytest.mark.parametrize(
    ("signum", "said"),
    [
        (signal.SIGSEGV, "killed by SIGSEGV (a crash inside the engine)"),
        (
            signal.SIGKILL,
            "killed by SIGKILL (killed from outside: the kernel's out-of-memory killer, or a person)",
        ),
    ],
)
def test_a_server_that_dies_in_its_block_is_named_when_the_block_ends(signum, said, tmp_path) -> None:
    """Whatever the block did (here: nothing wrong), a server that died in it ends it with its
    signal by name and its log; the requests refused after are the death's (server_gone)."""
    port = free_port()
    log = tmp_path / "server.log"
    with pytest.raises(ServerDiedError) as caught:
        with background_server(
            "test server",
            _http_server(port),
            {},
            f"http://127.0.0.1:{port}/",
            startup_timeout_s=30,
            log_path=log,
        ) as proc:
            assert not server_gone(proc.pid)
            proc.send_signal(signum)
            deadline = time.monotonic() + 10
            while not server_gone(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server_gone(proc.pid)
    message = str(caught.value)
    assert message.startswith(f"the embedded test server (pid {proc.pid}) died ") and said in message
    assert f"its log ends ({log}):" in message
    assert caught.value.death == ServerDeath(
        "test server", proc.pid, -signum, caught.value.death.lived_s, log
    )
    assert ("infermeter doctor" in message) == (signum == signal.SIGSEGV)


def test_a_server_stopped_by_its_block_is_no_death_and_a_block_error_stays_itself(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with background_server(
        "test server", _http_server(port), {}, url, startup_timeout_s=30, log_path=tmp_path / "a.log"
    ):
        pass  # stopped by the block's end: no error
    with pytest.raises(KeyError, match="not a death"):
        with background_server(
            "test server", _http_server(port), {}, url, startup_timeout_s=30, log_path=tmp_path / "b.log"
        ):
            raise KeyError("not a death")


def test_a_server_that_crashes_at_start_says_its_signal(tmp_path) -> None:
    """Before its health answers: the signal by name, not a timeout or argparse's help."""
    crash = [
        sys.executable,
        "-c",
        "import os, signal; print('loading', flush=True); os.kill(os.getpid(), signal.SIGSEGV)",
    ]
    with pytest.raises(
        ServerStartError,
        match=r"^test server killed by SIGSEGV \(a crash inside the engine\) before it was healthy",
    ):
        with background_server(
            "test server",
            crash,
            {},
            f"http://127.0.0.1:{free_port()}/",
            startup_timeout_s=30,
            log_path=tmp_path / "c.log",
        ):
            pass


def test_server_gone_tells_a_zombie_and_a_missing_pid_from_a_live_one() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while not server_gone(child.pid) and time.monotonic() < deadline:  # exited, not yet reaped: a zombie
        time.sleep(0.02)
    assert server_gone(child.pid)
    child.wait()
    assert server_gone(child.pid) and not server_gone(None) and not server_gone(os.getpid())
