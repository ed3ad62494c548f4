#!/usr/bin/env python3
"""Interrupt and kill the real ``moepack`` at random instants; check every outcome.

For each command (``repack`` of a split model, ``trace convert``, ``synth`` with a trace in
another folder, ``npu pack --force`` over an older pack) the destination first holds a known
*old* output, and the command (asked to replace it: ``--force``) would write a known *new*
one. Each trial restores the old state, starts the CLI as a subprocess, sends SIGINT,
SIGTERM or SIGKILL after a random delay drawn across the command's whole measured run time
(and a little past it), and checks:

- the inputs are byte-identical;
- after SIGINT/SIGTERM: exit 0 with the new output, or exit 128 + signal with one line
  ``moepack: interrupted; ...`` whose claim is true (nothing written: old; "after writing":
  new), no traceback, and no temporary left at all;
- a signal so early that the interpreter has not yet run moepack's first line (the
  signal's default action ends the process, or Python's own handler raises in ``site``):
  counted apart, and only accepted when nothing was written;
- after SIGKILL: the next run into the destination folder (a small ``trace convert`` into
  each destination folder) leaves the destination wholly old or wholly new and no
  temporary, and says so in one warning line when it removed or finished anything.

    .venv/bin/python scripts/stress_interrupts.py --trials 200          # every command
    .venv/bin/python scripts/stress_interrupts.py --trials 20 --only synth --seed 3

Exit 1 when any trial fails; the counts per command and signal are printed either way.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
PROBE = "zz-next-run.txt"


def moepack_exe() -> str:
    return str(Path(sys.executable).with_name("moepack"))


def run(*args: object, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``moepack ARGS`` to completion."""
    proc = subprocess.run(
        [moepack_exe(), *map(str, args)], capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"moepack {' '.join(map(str, args))} failed: {proc.stderr.strip()}")
    return proc


def is_temporary(name: str) -> bool:
    return ".moepack-" in name and (name.endswith("-tmp") or name.endswith("-journal"))


def snapshot(folders: list[Path]) -> dict[str, str]:
    """sha256 of every file under ``folders`` (temporaries and the probe excluded)."""
    state = {}
    for top in folders:
        for path in sorted(top.rglob("*")):
            if path.is_file() and path.name != PROBE and not is_temporary(path.name):
                rel = str(path.relative_to(top.parent))
                state[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def temporaries(folders: list[Path]) -> list[str]:
    return sorted(
        p.name for top in folders if top.is_dir() for p in top.iterdir() if is_temporary(p.name)
    )


@dataclass
class Scenario:
    """One command whose destination goes from a known old to a known new output."""

    name: str
    root: Path
    inputs: list[Path]
    dests: list[Path]  # destination folders
    command: list[str]
    make_old: Callable[[], None]
    # where the command's temporaries live besides ``dests``: a folder output (a pack) is
    # built beside its folder, so its leftovers are in the folder holding it
    beside: list[Path] = field(default_factory=list)
    old: dict[str, str] = field(default_factory=dict)
    new: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def places(self) -> list[Path]:
        """Every folder the command writes into: where the next run goes, and where no
        temporary may be left."""
        return self.dests + self.beside

    @property
    def saved(self) -> Path:
        return self.root / "saved-old"

    def prepare(self) -> None:
        """Write the old output, remember it, then measure and remember the new one."""
        for d in self.dests:
            d.mkdir(parents=True, exist_ok=True)
        self.make_old()
        self.old = snapshot(self.dests)
        shutil.rmtree(self.saved, ignore_errors=True)
        self.saved.mkdir()
        for d in self.dests:
            shutil.copytree(d, self.saved / d.name)
        times = []
        for _ in range(2):
            self.restore()
            t0 = time.perf_counter()
            run(*self.command)
            times.append(time.perf_counter() - t0)
            new = snapshot(self.dests)
            if self.new and new != self.new:
                raise RuntimeError(f"{self.name}: the new output is not deterministic")
            self.new = new
        if self.new == self.old:
            raise RuntimeError(f"{self.name}: old and new outputs are the same")
        self.seconds = max(times)

    def restore(self) -> None:
        for d in self.dests:
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(self.saved / d.name, d)


def scenarios(root: Path, only: set[str] | None) -> list[Scenario]:
    """The four commands, each with its inputs built here (small synthetic models)."""
    inp = root / "inputs"
    inp.mkdir(parents=True, exist_ok=True)
    want = only or {"repack", "convert", "synth", "npu-pack"}
    out: list[Scenario] = []
    run(
        "synth",
        "--out",
        inp / "probe.gguf",
        "--trace-out",
        inp / "probe.moetrace",
        "--tokens",
        "64",
        "-q",
    )
    if want & {"repack", "convert"}:
        run(
            "synth",
            "--out",
            inp / "m.gguf",
            "--trace-out",
            inp / "t.moetrace",
            "--split-max-size",
            "3000000",
            "--layers",
            "4",
            "--tokens",
            "20000",
            "-q",
        )
        run(
            "trace",
            "synth",
            inp / "t2.moetrace",
            "--layers",
            "4",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--tokens",
            "20000",
            "-q",
        )
        run(
            "plan",
            sorted(inp.glob("m-*-of-*.gguf"))[0],
            "--trace",
            inp / "t.moetrace",
            "--out",
            inp / "p.moeplan",
        )
    shards = sorted(inp.glob("m-*-of-*.gguf"))
    if "repack" in want:
        d = root / "repack" / "out"
        args = ["repack", shards[0], "--plan", inp / "p.moeplan", "--out", d / "r.gguf", "-q"]
        out.append(
            Scenario(
                "repack",
                d.parent,
                shards + [inp / "p.moeplan"],
                [d],
                list(map(str, [*args, "--force"])),  # over the old output: asked for
                lambda a=args: run(*a, "--keep-header"),
            )
        )
    if "convert" in want:
        d = root / "convert" / "out"
        args = ["trace", "convert", inp / "t.moetrace", d / "t.pmxtrace", "-q"]
        old = ["trace", "convert", inp / "t2.moetrace", d / "t.pmxtrace", "-q"]
        out.append(
            Scenario(
                "convert",
                d.parent,
                [inp / "t.moetrace", inp / "t2.moetrace"],
                [d],
                list(map(str, [*args, "--force"])),
                lambda a=old: run(*a),
            )
        )
    if "synth" in want:
        m, t = root / "synth" / "models", root / "synth" / "traces"
        args = [
            "synth",
            "--out",
            m / "s.gguf",
            "--trace-out",
            t / "s.pmxtrace",
            "--split-max-size",
            "2000000",
            "--tokens",
            "20000",
            "-q",
        ]
        out.append(
            Scenario(
                "synth",
                m.parent,
                [],
                [m, t],
                list(map(str, [*args, "--seed", "2", "--force"])),
                lambda a=args: run(*a, "--seed", "1"),
            )
        )
    if "npu-pack" in want:
        run("npu", "synth", inp / "new.q4nx", "--layers", "0", "--seed", "0", "-q")
        run("npu", "synth", inp / "old.q4nx", "--layers", "0-1", "--seed", "1", "-q")
        d = root / "npu" / "pack"
        args = ["npu", "pack", inp / "new.q4nx", "--out", d, "--force", "-q"]
        out.append(
            Scenario(
                "npu-pack",
                d.parent,
                [inp / "new.q4nx"],
                [d],
                list(map(str, args)),
                lambda: run("npu", "pack", inp / "old.q4nx", "--out", d, "--force", "-q"),
                beside=[d.parent],
            )
        )
    return out


PACKAGE = str(Path(importlib.util.find_spec("moepack").origin or "").parent)  # type: ignore[union-attr]


def before_moepack(rc: int, sig: int, err: str) -> bool:
    """The signal came while the interpreter was starting, before moepack's first line ran
    (nothing can have been written): its default action ended the process silently, or
    Python's own SIGINT handler raised in ``site`` or while finding ``moepack.entry``."""
    if rc == -sig and not err:
        return True
    frames = [ln for ln in err.splitlines() if ln.lstrip().startswith('File "')]
    return (
        sig == signal.SIGINT
        and rc in (1, -signal.SIGINT)
        and err.rstrip().endswith("KeyboardInterrupt")
        and not any(f'File "{PACKAGE}/' in ln for ln in frames)
    )


def digest_inputs(paths: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def trial(sc: Scenario, sig: signal.Signals, delay: float, probe_src: Path) -> tuple[str, str]:
    """One interrupted run; returns (outcome, failure or "")."""
    sc.restore()
    before = digest_inputs(sc.inputs)
    proc = subprocess.Popen(
        [moepack_exe(), *sc.command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    time.sleep(delay)
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
    try:
        _out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "hung", "did not exit within 120 s of the signal"
    rc = proc.returncode
    problems = []
    if digest_inputs(sc.inputs) != before:
        problems.append("an input changed")
    if "Traceback" in err and not before_moepack(rc, sig, err):
        problems.append(f"traceback: {err.strip().splitlines()[-1]}")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    state = snapshot(sc.dests)
    outcome = "?"
    if sig == signal.SIGKILL and rc == -signal.SIGKILL:
        left = temporaries(sc.places)
        mixed = state not in (sc.old, sc.new)
        warned = []
        failed = []
        for d in sc.places:  # the next run into each destination folder
            probe = run("trace", "convert", probe_src, d / PROBE, "-q", check=False)
            (d / PROBE).unlink(missing_ok=True)
            warned += [ln for ln in probe.stderr.splitlines() if ln.startswith("moepack: warning:")]
            if probe.returncode != 0:
                failed.append(probe.stderr.strip())
        after = snapshot(sc.dests)
        if failed:
            problems.append(f"the next run failed: {failed}")
        if after == sc.old:
            outcome = "killed: old"
        elif after == sc.new:
            outcome = "killed: new" + (" (finished by the next run)" if mixed else "")
        else:
            problems.append("after the next run the destination is neither old nor new")
        if temporaries(sc.places):
            problems.append(f"temporaries survived the next run: {temporaries(sc.places)}")
        if left and not 1 <= len(warned) <= len(sc.places):
            problems.append(f"the next runs removed {left} without a warning line each")
        if left:
            outcome += ", leftovers swept"
    elif before_moepack(rc, sig, err) and state == sc.old and not temporaries(sc.places):
        outcome = "stopped while Python started: old"
    elif rc == 0:
        outcome = "finished"
        if state != sc.new:
            problems.append("exit 0 but the destination is not the new output")
        if temporaries(sc.places):
            problems.append(f"temporaries left: {temporaries(sc.places)}")
    elif sig != signal.SIGKILL and rc == 128 + sig:
        if len(lines) != 1 or not lines[0].startswith("moepack: interrupted"):
            problems.append(f"not one 'interrupted' line: {err!r}")
        said_nothing = bool(lines) and lines[0] == "moepack: interrupted; no output was written"
        if said_nothing and state != sc.old:
            problems.append("said nothing was written, but the destination changed")
        if not said_nothing and state != sc.new:
            problems.append(f"said {lines[:1]} but the destination is not the new output")
        if temporaries(sc.places):
            problems.append(f"temporaries left: {temporaries(sc.places)}")
        outcome = "interrupted: old" if said_nothing else "interrupted: new (said so)"
    else:
        problems.append(f"exit code {rc}: {err.strip()[-300:]!r}")
    return outcome, "; ".join(problems)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200, help="instants per command")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", action="append", help="repack, convert, synth or npu-pack")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    root = args.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / f"moepack-stress-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    failures = run_all(root, args.trials, args.seed, set(args.only) if args.only else None)
    if args.workdir is None and not failures:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


def run_all(root: Path, trials: int, seed: int, only: set[str] | None) -> list[str]:
    """Every trial of every scenario; prints counts, returns the failures."""
    rng = random.Random(seed)
    failures: list[str] = []
    for sc in scenarios(root, only):
        sc.prepare()
        print(f"{sc.name}: one run takes {sc.seconds:.2f} s; {trials} trials", flush=True)
        counts: Counter[tuple[str, str]] = Counter()
        for i in range(trials):
            sig = SIGNALS[i % len(SIGNALS)]
            delay = rng.uniform(0.0, sc.seconds * 1.1)
            outcome, problem = trial(sc, sig, delay, root / "inputs" / "probe.moetrace")
            counts[(sig.name, outcome)] += 1
            if problem:
                failures.append(f"{sc.name} {sig.name} at {delay:.3f} s: {problem}")
                print(f"  FAIL {failures[-1]}", flush=True)
        for (sig_name, outcome), n in sorted(counts.items()):
            print(f"  {sig_name:8} {outcome:45} {n:4}")
    print(f"{len(failures)} failure(s)")
    return failures


if __name__ == "__main__":
    sys.exit(main())
