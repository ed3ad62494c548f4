"""The llama-cpp-python wheel ``./dev`` installs: its cache key, whose CMAKE_ARGS, one build
per key outside pip's cache, and the portable fallback. Builds run real ``pip wheel`` on a
tiny project whose in-tree build backend records each build (compiling llama.cpp takes
minutes; the project stands in for the package, pip and the cache are the real ones)."""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from moepack import llamabuild
from moepack.llamabuild import (
    FAILED,
    NATIVE_ARGS,
    PORTABLE_ARGS,
    BuildFailed,
    BuildKey,
    build_wheel,
    cached_wheel,
    chosen_key,
    cpu_flags,
    default_cmake_args,
    llama_requirement,
    wheel_for_here,
)

REPO = Path(__file__).resolve().parents[1]

BACKEND = """
import os, zipfile

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    args = os.environ.get("CMAKE_ARGS", "")
    with open(os.environ["TINY_BUILD_LOG"], "a") as log:
        log.write(args + "\\n")
    if os.environ.get("TINY_FAIL_ON") and os.environ["TINY_FAIL_ON"] in args:
        raise SystemExit("tiny: this build fails with " + args)
    name = "llama_cpp_python-1.0-py3-none-any.whl"
    info = "llama_cpp_python-1.0.dist-info/"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        z.writestr("tinypkg/__init__.py", "CMAKE_ARGS = %r\\n" % args)
        z.writestr(info + "METADATA", "Metadata-Version: 2.1\\nName: llama-cpp-python\\nVersion: 1.0\\n")
        z.writestr(info + "WHEEL", "Wheel-Version: 1.0\\nGenerator: tiny\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n")
        z.writestr(info + "RECORD", "")
    return name
"""


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A project in llama-cpp-python's name that pip builds in a second through its own
    backend; each build's CMAKE_ARGS is appended to the log, and the wheel's ``tinypkg``
    says them."""
    project = tmp_path / "tinyproject"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "tinybackend"\nbackend-path = ["."]\n'
        '[project]\nname = "llama-cpp-python"\nversion = "1.0"\n'
    )
    (project / "tinybackend.py").write_text(BACKEND)
    log = tmp_path / "builds.log"
    monkeypatch.setenv("TINY_BUILD_LOG", str(log))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    return str(project), log


def builds(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def key_of(requirement: str, args: str) -> BuildKey:
    return BuildKey(requirement, args, "x86_64", "avx2 fma", "cc 12", "c++ 12")


def test_the_key_changes_with_every_input_and_only_then() -> None:
    key = key_of("llama-cpp-python==0.3.36", NATIVE_ARGS)
    assert key.digest == key_of("llama-cpp-python==0.3.36", NATIVE_ARGS).digest
    others = [
        replace(key, requirement="llama-cpp-python==0.3.37"),
        replace(key, cmake_args=PORTABLE_ARGS),
        replace(key, machine="aarch64"),
        replace(key, cpu_flags="avx2 avx512f fma"),
        replace(key, cc="cc 13"),
        replace(key, cxx="c++ 13"),
        replace(key, flags_env="CFLAGS=-O2"),
    ]
    assert len({key.digest, *(k.digest for k in others)}) == 1 + len(others)
    folder = key.folder(Path("/cache"))
    assert folder.parent == Path("/cache/llama-wheels")
    assert folder.name == f"llama-cpp-python-0.3.36-{key.digest}"


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    """A /proc/cpuinfo of two processors with these flags."""
    path = tmp_path / f"cpuinfo-{flags.replace(' ', '-')}"
    path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return path


@pytest.mark.skipif(
    platform.machine().lower() not in llamabuild.NATIVE_MACHINES, reason="x86-64 builds native"
)
def test_another_cpu_gets_its_own_build_never_this_ones(
    tiny: tuple[str, Path], tmp_path: Path
) -> None:
    project, log = tiny
    root = tmp_path / "moepack-cache"
    avx2 = cpuinfo(tmp_path, "fpu sse2 avx avx2 fma")
    avx512 = cpuinfo(tmp_path, "fpu sse2 avx avx2 fma avx512f avx512_vnni")
    first = wheel_for_here(project, root, cpuinfo=avx2)
    assert builds(log) == [NATIVE_ARGS]
    assert wheel_for_here(project, root, cpuinfo=avx2) == first  # the same CPU: cached
    assert builds(log) == [NATIVE_ARGS]
    # a CPU with other flags (the same cache, compilers and CMAKE_ARGS) compiles its own
    other = wheel_for_here(project, root, cpuinfo=avx512)
    assert other.parent != first.parent and builds(log) == [NATIVE_ARGS, NATIVE_ARGS]
    assert (
        chosen_key(project, root, avx512).cpu_flags == "avx avx2 avx512_vnni avx512f fma fpu sse2"
    )
    # and one with AMX gets the native build with AMX left out, under yet another key
    amx = wheel_for_here(project, root, cpuinfo=cpuinfo(tmp_path, "avx512f amx_tile amx_int8"))
    assert amx.parent not in (first.parent, other.parent)
    assert "-mno-amx-int8" in builds(log)[-1] and builds(log)[-1].startswith(NATIVE_ARGS)


def test_a_users_cmake_args_win_else_native_on_x86_64_only() -> None:
    user = {"CMAKE_ARGS": "-DGGML_BLAS=ON"}
    assert default_cmake_args("x86_64", user, "avx2 amx_tile") == "-DGGML_BLAS=ON"
    assert default_cmake_args("x86_64", {"CMAKE_ARGS": "  "}, "avx2") == NATIVE_ARGS
    assert default_cmake_args("x86_64", {}, "avx2 avx512f") == NATIVE_ARGS
    assert default_cmake_args("AMD64", {}, "avx2") == NATIVE_ARGS
    assert default_cmake_args("aarch64", {}, "asimd") == PORTABLE_ARGS


def test_the_native_build_leaves_amx_out_on_a_cpu_with_amx() -> None:
    args = shlex.split(default_cmake_args("x86_64", {}, "avx512f amx_bf16 amx_int8 amx_tile"))
    assert args[0] == NATIVE_ARGS
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1].split() for a in args[1:]}
    for var in ("-DCMAKE_C_FLAGS", "-DCMAKE_CXX_FLAGS"):
        assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(flags[var])
    # an explicit -mno- outranks -march=native in either order: the AMX kernels are not built
    cc = shutil.which("gcc")
    if cc:
        for order in (["-march=native", *flags["-DCMAKE_C_FLAGS"]],
                      [*flags["-DCMAKE_C_FLAGS"], "-march=native"]):  # fmt: skip
            macros = subprocess.run([cc, *order, "-dM", "-E", "-x", "c", os.devnull],
                                    capture_output=True, text=True, check=True).stdout  # fmt: skip
            assert "__AMX_INT8__" not in macros and "__AMX_TILE__" not in macros


def test_cpu_flags_are_the_cpuinfo_flags_sorted(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: sse avx512f avx2\n\nprocessor\t: 1\nflags\t\t: sse avx512f avx2\n"
    )
    assert cpu_flags(info) == "avx2 avx512f sse"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert cpu_flags(arm) == "asimd fp sve"


def test_the_requirement_is_the_pyproject_pin(tmp_path: Path) -> None:
    assert llama_requirement(REPO / "pyproject.toml").startswith("llama-cpp-python==")
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\nname = "x"\n[project.optional-dependencies]\nllama = ["numpy"]\n')
    with pytest.raises(ValueError, match="no llama-cpp-python"):
        llama_requirement(bad)


def test_a_wheel_is_built_once_per_key_and_never_into_pips_cache(
    tiny: tuple[str, Path], tmp_path: Path
) -> None:
    project, log = tiny
    root = tmp_path / "moepack-cache"
    native = BuildKey.here(project, NATIVE_ARGS)
    wheel = build_wheel(native, root)
    assert (
        wheel.parent == native.folder(root)
        and wheel.name == "llama_cpp_python-1.0-py3-none-any.whl"
    )
    assert builds(log) == [NATIVE_ARGS]
    assert build_wheel(native, root) == wheel  # the second time from the cache
    assert builds(log) == [NATIVE_ARGS]
    portable = build_wheel(BuildKey.here(project, PORTABLE_ARGS), root)
    assert portable != wheel and builds(log) == [NATIVE_ARGS, PORTABLE_ARGS]
    assert not list((tmp_path / "pip-cache").rglob("*.whl"))
    # the build of each key is the one installed: its CMAKE_ARGS are in the wheel
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True)  # fmt: skip
    assert (target / "tinypkg" / "__init__.py").read_text() == f"CMAKE_ARGS = {NATIVE_ARGS!r}\n"


@pytest.mark.skipif(
    platform.machine().lower() not in llamabuild.NATIVE_MACHINES, reason="x86-64 builds native"
)
def test_a_failed_native_build_falls_back_to_portable_once(
    tiny: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, log = tiny
    root = tmp_path / "moepack-cache"
    monkeypatch.setenv("TINY_FAIL_ON", "NATIVE=ON")
    lines: list[str] = []
    wheel = wheel_for_here(project, root, log=lines.append)
    native = default_cmake_args()  # this CPU's native build (without AMX where it has AMX)
    assert native.startswith(NATIVE_ARGS) and builds(log) == [native, PORTABLE_ARGS]
    assert wheel.parent == BuildKey.here(project, PORTABLE_ARGS).folder(root)
    native_folder = BuildKey.here(project, native).folder(root)
    assert "this build fails" in (native_folder / FAILED).read_text()
    assert cached_wheel(native_folder) is None
    assert any("native build failed" in line for line in lines)
    # later installs go straight to the portable wheel: no second failing compile
    assert chosen_key(project, root).cmake_args == PORTABLE_ARGS
    assert wheel_for_here(project, root) == wheel
    assert builds(log) == [native, PORTABLE_ARGS]


@pytest.mark.skipif(
    platform.machine().lower() not in llamabuild.NATIVE_MACHINES, reason="x86-64 builds native"
)
def test_where_the_portable_build_fails_too_the_next_run_tries_native_again(
    tiny: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # both builds failing is no verdict on the native one (no network, no compiler)
    project, log = tiny
    root = tmp_path / "moepack-cache"
    monkeypatch.setenv("TINY_FAIL_ON", "-DGGML_NATIVE=O")
    with pytest.raises(BuildFailed, match="GGML_NATIVE=OFF"):
        wheel_for_here(project, root)
    native = default_cmake_args()
    assert builds(log) == [native, PORTABLE_ARGS]
    assert not (BuildKey.here(project, native).folder(root) / FAILED).exists()
    monkeypatch.delenv("TINY_FAIL_ON")
    wheel = wheel_for_here(project, root)
    assert builds(log) == [native, PORTABLE_ARGS, native]
    assert wheel.parent == BuildKey.here(project, native).folder(root)


def test_a_users_failing_build_is_an_error_not_a_fallback(
    tiny: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, log = tiny
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_NATIVE=ON -DGGML_BLAS=ON")
    monkeypatch.setenv("TINY_FAIL_ON", "BLAS")
    with pytest.raises(BuildFailed, match="this build fails"):
        wheel_for_here(project, tmp_path / "c")
    assert builds(log) == ["-DGGML_NATIVE=ON -DGGML_BLAS=ON"]
    key = BuildKey.here(project, "-DGGML_NATIVE=ON -DGGML_BLAS=ON")
    assert cached_wheel(key.folder(tmp_path / "c")) is None
    assert not list((tmp_path / "c" / "llama-wheels").glob("*.tmp-*"))


def test_a_killed_builds_temporary_is_swept(tiny: tuple[str, Path], tmp_path: Path) -> None:
    project, _log = tiny
    root = tmp_path / "c"
    key = BuildKey.here(project, PORTABLE_ARGS)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = key.folder(root).with_name(f"{key.folder(root).name}.tmp-{dead.pid}")
    stale.mkdir(parents=True)
    (stale / "half.whl").write_bytes(b"x")
    ours = key.folder(root).with_name(f"{key.folder(root).name}.tmp-{os.getppid()}")
    ours.mkdir()  # a live process's build in progress is left alone
    build_wheel(key, root)
    assert not stale.exists() and ours.exists()


def test_a_second_build_of_a_key_waits_for_the_first_and_takes_its_wheel(
    tiny: tuple[str, Path], tmp_path: Path
) -> None:
    project, log = tiny
    root = tmp_path / "c"
    key = BuildKey.here(project, PORTABLE_ARGS)
    folder = key.folder(root)
    folder.parent.mkdir(parents=True)
    # another process building this key: it holds the key's lock
    with open(folder.with_name(folder.name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        code = (
            "import sys; from pathlib import Path; from moepack.llamabuild import BuildKey, "
            "build_wheel; key = BuildKey(*sys.argv[1:8]); "
            "print(build_wheel(key, Path(sys.argv[8]), log=lambda s: print(s, file=sys.stderr, "
            "flush=True)))"
        )
        args = [key.requirement, key.cmake_args, key.machine, key.cpu_flags, key.cc, key.cxx,
                key.flags_env]  # fmt: skip
        waiter = subprocess.Popen([sys.executable, "-c", code, *args, str(root)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert waiter.stderr is not None
        assert "waiting for another process's build" in waiter.stderr.readline()
        # the other process finishes its build: its wheel and build.json in place
        done = folder.with_name(folder.name + ".done")
        done.mkdir()
        (done / "llama_cpp_python-1.0-py3-none-any.whl").write_bytes(b"built elsewhere")
        (done / llamabuild.BUILD_INFO).write_text("{}")
        done.rename(folder)
        fcntl.flock(held, fcntl.LOCK_UN)
        out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err
    assert Path(out.strip()) == folder / "llama_cpp_python-1.0-py3-none-any.whl"
    assert builds(log) == []  # no second compile


def test_the_command_prints_the_wheel_and_the_key(tiny: tuple[str, Path], tmp_path: Path) -> None:
    project, log = tiny
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\n[project.optional-dependencies]\n'
        f'llama = ["llama-cpp-python @ file://{project}"]\n'
    )
    env = dict(os.environ, MOEPACK_CACHE_DIR=str(tmp_path / "c"), CMAKE_ARGS="-DX=1")
    run = [sys.executable, "-m", "moepack.llamabuild"]
    key = subprocess.run([*run, "key", "--pyproject", str(pyproject)], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    out = subprocess.run([*run, "wheel", "--pyproject", str(pyproject)], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    wheel = Path(out.stdout.strip())
    assert wheel.is_file() and wheel.parent.name.endswith(key)
    assert "compiling" in out.stderr and builds(log) == ["-DX=1"]


FEATURES = """
import json
from moepack.llama.runtime import ggml_backend as g
print(json.dumps(sorted(g.cpu_features())))
"""


def test_the_installed_llama_cpp_is_the_build_for_this_cpu() -> None:
    # the venv ./dev made: its llama-cpp-python is a wheel from moepack's cache whose key is
    # this CPU's, and a native build has the CPU's own instruction sets (AMX where left out)
    try:
        dist = importlib.metadata.distribution("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llama-cpp-python is not installed")
    url = json.loads(dist.read_text("direct_url.json") or "null")
    if not url or not url.get("url", "").startswith("file://"):
        pytest.skip("llama-cpp-python was not installed from a wheel file (not by ./dev)")
    info = Path(unquote(urlparse(url["url"]).path)).parent / llamabuild.BUILD_INFO
    if not info.is_file():
        pytest.skip(f"llama-cpp-python was not installed from moepack's cache ({url['url']})")
    built = json.loads(info.read_text())
    assert built["machine"] == platform.machine() and built["cpu_flags"] == cpu_flags()
    if not built["cmake_args"].startswith(NATIVE_ARGS):
        return
    # in a child: ggml's library starts threads that would take signals later tests send
    out = subprocess.run([sys.executable, "-c", FEATURES], capture_output=True, text=True,
                         check=True)  # fmt: skip
    features, flags = set(json.loads(out.stdout)), set(cpu_flags().split())
    for feature, flag in (("AVX2", "avx2"), ("AVX512", "avx512f"), ("AVX512_VNNI", "avx512_vnni"),
                          ("AVX512_BF16", "avx512_bf16"), ("AVX_VNNI", "avx_vnni")):  # fmt: skip
        assert (feature in features) == (flag in flags), feature
    if llamabuild.NO_AMX in built["cmake_args"]:
        assert "AMX_INT8" not in features
