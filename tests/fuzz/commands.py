"""Every command's path arguments, each with a valid value, and the hostile paths tried in
each one's place.

``TEMPLATES`` holds one working command line per command, written with placeholders:
``{param=kind}`` is an input (``kind`` names a seed, ``seeds.py``), ``{param=>name}`` an
output file and ``{param=>>name}`` an output (or scratch) folder, made fresh in the run's own
folder; ``[[...]]`` marks an optional part. ``param`` is the click parameter's name. ``path_parameters`` lists, from the CLI itself,
every option and argument of type path; ``uncovered`` is each of them no template names (a
new command or option must be added here, so the harness keeps covering every path).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LLAMA_SECONDS = 120  # llama.cpp commands load a model in a worker: slower, still bounded

# fmt: off
TEMPLATES: dict[str, str] = {
    "advise": "advise {model=gguf} {trace=moetrace} [[--surface {surface_path=surface}]]",
    "analyse": "analyse {model=gguf} {trace=moetrace} [[--surface {surface_path=surface}]] "
               "--layouts identity,reorder --plan {plan_path=moeplan} "
               "[[--coact-plot {coact_plot=>coact.png}]] [[--plot {plot_path=>speedup.png}]]",
    "check-dropin": "check-dropin {original=gguf} {candidate=gguf} [[--text {text_file=text}]] "
                    "--tokens 8 --window 4 -q",
    "compare": "compare {reference=gguf} {candidate=repacked} -q",
    "demo": "demo --dir {folder=>>demo} --no-llama -q",
    "engines": "engines {path=>>probe-here} --no-bindings",
    "fit": "fit {model=gguf} [[--trace {trace=moetrace}]] --memory 8G -t 1 -q",
    "inspect": "inspect {model=gguf}",
    "kio": "kio {directory=>>kio} --sizes 64K --depths 1 --engines pread --modes buffered "
           "--cell-seconds 0.01 --repeats 1 --corpus-size 1M -q",
    "npu inspect": "npu inspect {model=q4nx} --profile seed-2026-09 "
                   "[[--write-names {write_names=>names.json}]]",
    "npu map": "npu map --profile seed-2026-09 --layer 3 [[--model {model=q4nx}]]",
    "npu pack": "npu pack {model=q4nx} --out {out_dir=>>pack} --profile seed-2026-09 "
                "[[--names {names=names}]] -q",
    "npu synth": "npu synth {out=>n.q4nx} --geometry scaled --layers 3 -q",
    "npu txn decode": "npu txn decode {file=txn}",
    "npu unpack": "npu unpack {pack_dir=pack} --out {out=>u.q4nx} "
                  "[[--check {check_model=q4nx}]] -q",
    "npu verify": "npu verify --dump {dump=dump} --model {model=q4nx} --layer 3 --profile auto "
                  "--locate 2 --mismatches 2 -q",
    "plan": "plan {model=gguf} --trace {trace_path=moetrace} --out {out=>p.moeplan} "
            "[[--map {map_path=>map.png}]] [[--search --surface {surface_path=surface}]]",
    "predict": "predict {trace=moetrace} [[--model {model_path=gguf}]]",
    "probe": "probe {target=gguf} --engine pread --mode buffered --sizes 4K --depths 1 "
             "--cell-seconds 0.01 --repeats 1 [[--out {out=>probe.json}]] "
             "[[--png {png=>probe.png}]] -q",
    "repack": "repack {model=gguf} --plan {plan_path=moeplan} --out {out=>r.gguf} -q",
    "replay": "replay {source=gguf} {trace=moetrace} --slots 4 "
              "[[--layout reorder --plan {plan_path=moeplan}]] "
              "[[--sweep lru --sweep-slots 2,4 --plot {plot_path=>sweep.png}]] -q",
    "run": "run {model=gguf} [[--prompt-file {prompt_file=prompts}]] "
           "[[--trace {trace_out=>run.moetrace}]] "
           "[[--prefetch --lookahead cross-layer --lookahead-trace {lookahead_trace=moetrace}]] "
           "[[--draft-model {draft_model=gguf}]] --prompt hi --n-predict 1",
    "serve": "serve {model=gguf} --port 0 -t 1 [[--trace-out {trace_out=>serve.moetrace}]] "
             "[[--prefetch --lookahead cross-layer --lookahead-trace {lookahead_trace=moetrace}]] "
             "[[--draft-model {draft_model=gguf}]]",
    "store build": "store build {model=gguf} --out {out=>s.moestore} "
                   "[[--plan {plan_path=moeplan}]] [[--precision {precision_path=moeprec}]] -q",
    "store info": "store info {store=store}",
    "store precision": "store precision {model=gguf} --trace {trace_path=moetrace} --budget 60% "
                       "--types Q8_0,Q4_0 --out {out=>q.moeprec}",
    "store verify": "store verify {store=store} {model=gguf} -q",
    "surface convert": "surface convert {src=surface} {dest=>c.json} --to potatomaxx",
    "surface plot": "surface plot {src=surface} {png=>s.png}",
    "surface show": "surface show {file=surface} --at 64K@4",
    "survey": "survey {configs=config} [[--surface {surface_path=surface}]]",
    "synth": "synth --out {out=>m.gguf} [[--trace-out {trace_out=>m.moetrace}]] "
             "[[--prompts-out {prompts_out=>m.jsonl} --routing '']] --layers 1 --experts 4 "
             "--top-k 2 --hidden 32 --expert-ffn 32 --heads 1 --kv-heads 1 --head-dim 32 "
             "--vocab 300 --prompts 2 --prompt-tokens 8 -q",
    "trace capture": "trace capture {model=gguf} --out {out=>cap.moetrace} "
                     "[[--prompt-file {prompt_file=prompts}]] --prompt hi -q",
    "trace convert": "trace convert {src=moetrace} {dst=>c.pmxtrace} "
                     "[[--model {model_path=gguf}]]",
    "trace info": "trace info {trace=moetrace} [[--model {model_path=gguf}]]",
    "trace stats": "trace stats {trace=moetrace} [[--model {model_path=gguf}]] "
                   "[[--plot {plot_dir=>>stats}]]",
    "trace synth": "trace synth {out=>t.moetrace} --model {model_path=gguf} --tokens 16",
    "verify": "verify {original=gguf} {repacked=repacked} [[--plan {plan_path=moeplan}]] -q",
}
# fmt: on
LLAMA_COMMANDS = {"check-dropin", "fit", "run", "serve", "trace capture"}
SERVERS = {"serve"}
"""Commands that run until stopped: the harness stops a valid one with SIGTERM after
``SERVE_SECONDS`` (the one line it then prints and its 143 are how a server ends)."""
SERVE_SECONDS = 15
_GROUP = re.compile(r"\[\[(.*?)\]\]")
_SLOT = re.compile(r"\{(?P<param>\w+)=(?P<out>>{0,2})(?P<value>[^}]*)\}")


@dataclass(frozen=True)
class Slot:
    """One path argument of one command line."""

    command: str
    param: str
    role: str  # "input", "output" (a file) or "folder" (an output or scratch folder)
    value: str  # the seed's kind (input) or the file / folder name (output)

    @property
    def key(self) -> str:
        return f"{self.command} {self.param}"


def slots(command: str) -> list[Slot]:
    out = []
    for m in _SLOT.finditer(TEMPLATES[command]):
        role = {"": "input", ">": "output", ">>": "folder"}[m["out"]]
        out.append(Slot(command, m["param"], role, m["value"]))
    return out


def is_output_folder(slot: Slot) -> bool:
    """A folder the command writes its outputs into (not a scratch folder it measures in)."""
    return slot.role == "folder" and slot.param not in SCRATCH


SCRATCH = ("path", "directory")  # engines' and kio's folders: scratch, nothing kept


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` (relative name -> bytes): what a run left there."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def all_slots() -> list[Slot]:
    return [s for c in TEMPLATES for s in slots(c)]


def seconds_for(command: str, default: int) -> int:
    return LLAMA_SECONDS if command in LLAMA_COMMANDS else default


def argv(
    command: str,
    seeds: dict[str, Path],
    run: Path,
    override: dict[str, str] | None = None,
    lean: str | None = None,
) -> list[str]:
    """The template of ``command`` made concrete: inputs from ``seeds``, outputs in ``run``,
    ``override`` (param -> path) in place of any slot's value; ``lean`` (a param) leaves out
    the optional ``[[...]]`` groups that do not hold it (the quick pass: no plots it does not
    test)."""
    override = override or {}
    made: list[str] = []
    text = TEMPLATES[command]
    if lean is not None:  # only the optional groups that hold the slot under test
        text = _GROUP.sub(lambda g: g[1] if "{" + lean + "=" in g[1] else "", text)
    text = _GROUP.sub(lambda g: g[1], text)

    def fill(m: re.Match[str]) -> str:
        if m["param"] in override:
            return "\0" + override[m["param"]] + "\0"
        if m["out"] == "":
            return "\0" + str(seeds[m["value"]]) + "\0"
        path = run / m["value"]
        if m["out"] == ">>" and m["param"] in SCRATCH:
            path.mkdir(exist_ok=True)  # a scratch folder that must exist
        return "\0" + str(path) + "\0"

    text = _SLOT.sub(fill, text)
    # split on spaces outside the filled-in paths (which may hold spaces and newlines)
    for i, part in enumerate(text.split("\0")):
        if i % 2:
            made.append(part)
        else:
            made.extend("" if w == "''" else w for w in part.split())
    return made


PATH_OR_URL = {"fit model"}
"""Arguments that take a file's path or a URL, so are typed as text: paths all the same."""


def path_parameters() -> list[str]:
    """``"<command> <param>"`` for every option and argument of type path in the CLI (and
    the ``PATH_OR_URL`` ones)."""
    import click

    from moepack.cli.main import cli

    found: list[str] = []

    def walk(group: click.Group, prefix: list[str], ctx: click.Context) -> None:
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            if isinstance(cmd, click.Group):
                walk(cmd, [*prefix, name], ctx)
            elif cmd is not None:
                for p in cmd.params:
                    key = f"{' '.join([*prefix, name])} {p.name}"
                    if isinstance(p.type, click.Path | click.File) or key in PATH_OR_URL:
                        found.append(key)

    walk(cli, [], click.Context(cli))
    return found


def uncovered() -> list[str]:
    """Path parameters of the CLI that no template fills."""
    have = {s.key for s in all_slots()}
    return [k for k in path_parameters() if k not in have]


# ---------------------------------------------------------------- hostile paths
DEAD_PID = 4_000_000_000  # beyond pid_t: no process can own it


def _ext(value: str, seeds: dict[str, Path]) -> str:
    path = seeds.get(value, Path(value))
    return "".join(path.suffixes[-1:])


def specials(slot: Slot, seeds: dict[str, Path], run: Path) -> list[tuple[str, Path]]:
    """(name, path) of each hostile path for ``slot``, made inside ``run`` (a fresh folder):
    paths that are not regular files, names a console could take for markup (``[/x]``, a
    folder named ``[``), names with a newline, symlinks to ``/dev/zero`` and to themselves."""
    ext = _ext(slot.value, seeds)
    fifo = run / f"fifo{ext}"
    os.mkfifo(fifo)
    # /dev/zero itself only where it is read: an output written over a device node by rename
    # replaces the node (run as root, that once left /dev/zero a regular file)
    zero = Path("/dev/zero") if slot.role == "input" else private_zero(run / f"zero-node{ext}")
    zero_link = run / f"zero{ext}"
    zero_link.symlink_to(zero)
    loop = run / f"loop{ext}"
    loop.symlink_to(loop.name)
    bracket = run / "["
    bracket.mkdir()
    markup = bracket / f"x]{ext}"  # the path holds "[/x]"
    out: list[tuple[str, Path]] = [
        ("fifo", fifo),
        ("dev-zero", zero),
        ("zero-link", zero_link),
        ("loop", loop),
        ("newline", run / f"new\nline{ext}"),
        ("markup", markup),
    ]
    if slot.role == "input":
        src = seeds[slot.value]
        if src.is_dir():
            shutil.copytree(src, markup)
            (run / "a-file").write_bytes(b"x")
            out += [("a-file", run / "a-file"), ("missing", run / "missing")]
        else:
            shutil.copyfile(src, markup)
            folder = run / f"folder{ext}"
            folder.mkdir()
            out += [("folder", folder), ("missing", run / f"missing{ext}")]
    elif slot.role == "output":
        folder = run / f"folder{ext}"
        folder.mkdir()
        out += [("folder", folder), ("no-parent", run / "no-such-folder" / f"x{ext}")]
    else:
        (run / "a-file").write_bytes(b"x")
        out += [("a-file", run / "a-file"), ("no-parent", run / "no-such-folder" / "x")]
    return out


def private_zero(path: Path) -> Path:
    """A character device node like /dev/zero, of our own (a FIFO where nodes cannot be made
    without root): what an output slot gets in place of /dev/zero."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 5))
    except PermissionError:
        os.mkfifo(path)
    return path


def devices_intact() -> str | None:
    """Why the machine's /dev/zero or /dev/null is no longer a character device (a run wrote
    over it), or None. The harness stops at once rather than go on."""
    for dev in ("/dev/zero", "/dev/null"):
        if not stat.S_ISCHR(os.lstat(dev).st_mode):
            return f"{dev} is no longer a character device"
    return None


def hostile_leftovers(folder: Path) -> list[str]:
    """Plant what a killed run (or anyone) could leave in an output folder: a FIFO and a
    symlink to /dev/zero named like commit journals, a temporary claiming an impossible pid,
    a temporary whose name holds a newline. Returns their names."""
    names = [
        f".moepack-commit.{DEAD_PID}-1-00aa.moepack-journal",
        f".moepack-commit.{DEAD_PID}-1-00bb.moepack-journal",
        ".x.99999999999999999999-1-ab.moepack-tmp",
        f".new\nline.gguf.{DEAD_PID}-1-00cc.moepack-tmp",
    ]
    os.mkfifo(folder / names[0])
    (folder / names[1]).symlink_to("/dev/zero")
    (folder / names[2]).write_bytes(b"x")
    (folder / names[3]).write_bytes(b"y")
    return names


Builder = Callable[[dict[str, Path], Path, dict[str, str]], list[str]]
