"""The llama-cpp-python ``./dev`` installs: llama.cpp compiled for this CPU, cached by moepack.

llama-cpp-python compiles llama.cpp when it is installed. Built for the CPU it runs on
(``-DGGML_NATIVE=ON``: ``-march=native``, so AVX-512 and VNNI where the CPU has them; AMX left
out, ``NO_AMX``) its kernels use the CPU's widest instructions instead of the portable build's
AVX2 (``benchmarks/bench_build.py`` compares the two, ``docs/run.md``). But pip caches a wheel
it built by the source alone, and would hand a wheel compiled for one CPU to another, where it
dies of an illegal instruction. So the wheel is built with pip's cache off and kept in
moepack's cache (``cachedir``: ``llama-wheels/``), in a folder named by a digest of everything
the build depends on: the package pinned in pyproject.toml, ``CMAKE_ARGS``, the CPU's feature
flags (``/proc/cpuinfo``), the C and C++ compilers' versions, ``CFLAGS``/``CXXFLAGS``/
``LDFLAGS`` and the machine. Another CPU, compiler or flag set is another folder; a key is
built once, by one process at a time.

A user's own ``CMAKE_ARGS`` win (their build, cached under their key); without them x86-64
gets the native build and other machines the portable one, and a native build that fails falls
back to the portable one (and is not tried again for that key). Standard library only:
``./dev`` runs it before moepack is installed (``python -m moepack.llamabuild wheel`` prints
the wheel's path, building it if needed; ``key`` prints the key's digest).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from .cachedir import cache_dir

NATIVE_ARGS = "-DGGML_NATIVE=ON"
PORTABLE_ARGS = "-DGGML_NATIVE=OFF"
NATIVE_MACHINES = ("x86_64", "amd64")
"""Where ``./dev`` builds native: x86-64, whose portable build stops at AVX2; elsewhere (not
tried here) the portable build, as before."""
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""On a CPU with AMX, ``-march=native`` compiles ggml's AMX buffer type, which takes at load
the 2-D matrices of the types it has kernels for (Q4_0, Q4_K, Q8_0, Q6_K, …), and in
llama-cpp-python 0.3.36's llama.cpp its kernels crash (SIGSEGV in ``ggml_backend_amx_mul_mat``
at the first token, with llama-cpp-python alone, on this machine's Xeon; llama.cpp's issue
20824 reports the same). So the native build leaves AMX out: an explicit ``-mno-`` outranks
``-march=native`` whatever their order."""
FLAG_VARS = ("CFLAGS", "CXXFLAGS", "LDFLAGS")
"""The environment CMake folds into its first configure: part of the key."""
CPUINFO = Path("/proc/cpuinfo")
BUILD_INFO = "build.json"
FAILED = "FAILED"


class BuildFailed(RuntimeError):
    """pip could not build the wheel (its output's tail is the message)."""


def llama_requirement(pyproject: Path) -> str:
    """The llama-cpp-python pin of the ``llama`` extra (one source: pyproject.toml)."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    for req in data["project"]["optional-dependencies"]["llama"]:
        if req.replace("_", "-").lower().startswith("llama-cpp-python"):
            return str(req)
    raise ValueError(f"{pyproject}: no llama-cpp-python in the llama extra")


def cpu_flags(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's feature flags, sorted (x86 ``flags``, Arm ``Features``), or the processor's
    name where there is no cpuinfo."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or "unknown"
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return " ".join(sorted(set(value.split())))
    return platform.processor() or "unknown"


def compiler_version(command: str) -> str:
    """The first line of ``command --version`` (CMake's compiler), or ``none``."""
    try:
        out = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    lines = out.stdout.strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else "none"


def user_cmake_args(env: dict[str, str] | None = None) -> str:
    """The user's own ``CMAKE_ARGS`` ('' when unset or blank)."""
    return (os.environ if env is None else env).get("CMAKE_ARGS", "").strip()


def native_args(flags: str) -> str:
    """The native build for a CPU of these feature flags (AMX left out where it has AMX)."""
    if {"amx_tile", "amx_int8"} & set(flags.split()):
        return f'{NATIVE_ARGS} "-DCMAKE_C_FLAGS={NO_AMX}" "-DCMAKE_CXX_FLAGS={NO_AMX}"'
    return NATIVE_ARGS


def default_cmake_args(
    machine: str | None = None, env: dict[str, str] | None = None, flags: str | None = None
) -> str:
    """The user's ``CMAKE_ARGS`` when set and not blank, else the native build on x86-64 and
    the portable one elsewhere."""
    user = user_cmake_args(env)
    if user:
        return user
    m = (machine or platform.machine()).lower()
    return (
        native_args(cpu_flags() if flags is None else flags)
        if m in NATIVE_MACHINES
        else PORTABLE_ARGS
    )


@dataclass(frozen=True)
class BuildKey:
    """Everything a llama.cpp build depends on, beyond the source the pin names."""

    requirement: str
    cmake_args: str
    machine: str
    cpu_flags: str
    cc: str
    cxx: str
    flags_env: str = ""

    @classmethod
    def here(cls, requirement: str, cmake_args: str, cpuinfo: Path = CPUINFO) -> BuildKey:
        """The key of building ``requirement`` with ``cmake_args`` on this machine (its CPU's
        flags read from ``cpuinfo``), with the compilers CMake would take (``CC`` / ``CXX``,
        else ``cc`` / ``c++``)."""
        return cls(
            requirement=requirement,
            cmake_args=cmake_args,
            machine=platform.machine(),
            cpu_flags=cpu_flags(cpuinfo),
            cc=compiler_version(os.environ.get("CC") or "cc"),
            cxx=compiler_version(os.environ.get("CXX") or "c++"),
            flags_env=" ".join(f"{v}={os.environ[v]}" for v in FLAG_VARS if os.environ.get(v)),
        )

    @property
    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def folder(self, root: Path) -> Path:
        """Where this key's wheel lives under ``root`` (moepack's cache)."""
        name = re.sub(r"[^A-Za-z0-9.]+", "-", self.requirement).strip("-")[-48:]
        return root / "llama-wheels" / f"{name}-{self.digest}"


def cached_wheel(folder: Path) -> Path | None:
    """The wheel a finished build left in ``folder`` (None: not built yet)."""
    wheels = sorted(folder.glob("*.whl")) if (folder / BUILD_INFO).is_file() else []
    return wheels[0] if len(wheels) == 1 else None


def _sweep(folder: Path) -> None:
    """Remove the temporaries of builds whose process is gone (killed mid-build)."""
    for tmp in folder.parent.glob(folder.name + ".tmp-*"):
        try:
            os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


@contextmanager
def _one_build_at_a_time(folder: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold the key's lock: a second ``./dev`` (another worktree's venv) waits for the first
    one's wheel instead of compiling the same build beside it."""
    lock = folder.with_name(folder.name + ".lock")
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process's build of this key ({lock})")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_wheel(
    key: BuildKey,
    root: Path,
    python: str = sys.executable,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The wheel of ``key`` in ``root``, built with ``pip wheel --no-cache-dir`` unless a
    finished build is there. The build goes to a temporary folder beside its destination,
    renamed into place when complete, so a killed build leaves no half-wheel behind."""
    say = log or (lambda _line: None)
    folder = key.folder(root)
    found = cached_wheel(folder)
    if found is not None:
        return found
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _one_build_at_a_time(folder, say):
        found = cached_wheel(folder)  # built by the process we waited for
        if found is not None:
            return found
        _sweep(folder)
        say(f"compiling {key.requirement} with CMAKE_ARGS={key.cmake_args} (once for this CPU, "
            f"compiler and flags: ~6-10 min) into {folder}")  # fmt: skip
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            env = dict(os.environ, CMAKE_ARGS=key.cmake_args)
            cmd = [python, "-m", "pip", "wheel", "--no-cache-dir", "--no-deps", "-q",
                   "-w", str(tmp), key.requirement]  # fmt: skip
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wheels = list(tmp.glob("*.whl"))
            if proc.returncode != 0 or len(wheels) != 1:
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
                raise BuildFailed(
                    f"pip wheel {key.requirement} (CMAKE_ARGS={key.cmake_args}):\n{tail}"
                )
            info = json.dumps(asdict(key), indent=1) + "\n"
            (tmp / BUILD_INFO).write_text(info, encoding="utf-8")
            shutil.rmtree(folder, ignore_errors=True)  # a failed build's marker, no wheel
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    found = cached_wheel(folder)
    assert found is not None
    return found


def chosen_key(requirement: str, root: Path, cpuinfo: Path = CPUINFO) -> BuildKey:
    """The build this machine gets: ``default_cmake_args``' key, or the portable one where the
    native build failed here before (its folder holds ``FAILED``; delete the folder to try
    again)."""
    key = BuildKey.here(requirement, default_cmake_args(flags=cpu_flags(cpuinfo)), cpuinfo)
    if _fallible(key) and (key.folder(root) / FAILED).is_file():
        return BuildKey.here(requirement, PORTABLE_ARGS, cpuinfo)
    return key


def _fallible(key: BuildKey) -> bool:
    """Whether a failed build of ``key`` falls back to the portable one: moepack's own native
    choice, never the user's ``CMAKE_ARGS``."""
    return not user_cmake_args() and key.cmake_args != PORTABLE_ARGS


def wheel_for_here(
    requirement: str,
    root: Path | None = None,
    python: str = sys.executable,
    log: Callable[[str], None] | None = None,
    cpuinfo: Path = CPUINFO,
) -> Path:
    """This machine's wheel of ``requirement`` (``chosen_key``, built once per key). A native
    build that fails is marked so, and the portable one is built instead."""
    say = log or (lambda _line: None)
    root = cache_dir() if root is None else root
    key = chosen_key(requirement, root, cpuinfo)
    try:
        return build_wheel(key, root, python, say)
    except BuildFailed as e:
        if not _fallible(key):
            raise
        say("the native build failed; building the portable one")
        wheel = build_wheel(BuildKey.here(requirement, PORTABLE_ARGS, cpuinfo), root, python, say)
        # marked only now: where the portable build fails too (no network, no compiler), the
        # next run tries the native one again
        folder = key.folder(root)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / FAILED).write_text(str(e) + "\n", encoding="utf-8")
        say(f"the native build's output: {folder / FAILED} (delete {folder} to try it again)")
        return wheel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moepack.llamabuild", description=__doc__)
    ap.add_argument("action", choices=("wheel", "key"),
                    help="wheel: build if needed, print its path; key: print the key's digest")  # fmt: skip
    ap.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    ap.add_argument("--cache", type=Path, default=None, help="default: moepack's cache folder")
    args = ap.parse_args(argv)
    requirement = llama_requirement(args.pyproject)
    if args.action == "key":
        print(chosen_key(requirement, cache_dir() if args.cache is None else args.cache).digest)
        return 0

    def log(line: str) -> None:
        print(f"dev: {line}", file=sys.stderr, flush=True)

    try:
        print(wheel_for_here(requirement, args.cache, log=log))
    except BuildFailed as e:
        print(f"dev: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
