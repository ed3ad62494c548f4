"""The shared packer: any profile, any layer, one layer in memory at a time.

``pack_model`` writes per-layer buffer files and a manifest atomically (all or nothing). The
source is read through the file's memory map; each buffer is built 32 MiB at a time with a
few ``np.take`` calls per window (``gather_range``), hashed on a second thread while the next
window is built, written, and handed to writeback; the layer's source pages are dropped from
this process before the next layer. Peak memory is two windows plus the pages one layer's
tensors occupy, whatever the number of layers. Compiled plans are shared by every layer of a
kind (``plan.compile_layer``). The pack is a folder output: built whole beside the output
folder and switched in with one exchange of names (``safeio.AtomicOutputs.folder``), so the
folder is the old pack or the new one at every instant, for any reader. A pack already there
is replaced only with ``force``; what replaces it is the packer's own files (the manifest,
``layer-LL.<buffer>.bin``), and any other file a user keeps in the folder is carried over
into the new one (a second name of the same file). A subfolder there is refused up front.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..errors import BadInput
from ..interrupts import deferred
from ..leftovers import is_temporary
from ..pages import drop_cached
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import (
    AtomicOutputs,
    check_free_space,
    describe_os_error,
    real,
    replacing,
    replacing_allowed,
)
from . import manifest as mf
from .gather import gather, gather_range
from .geometry import Geometry, check_layers, check_tensors, detect, model_layers, parse_layers
from .names import Binding, bind, load_names
from .plan import BufferPlan, LayerPackPlan, compile_layer, model_refs
from .profile import LayoutProfile
from .profiles import get_profile
from .q4nx import Q4nxFile

WRITE_STEP = 32 * 1024 * 1024  # bytes of a buffer built, hashed and written at a time


def layer_plan(model: Q4nxFile, profile: LayoutProfile, geo: Geometry, layer: int) -> LayerPackPlan:
    """Check the layer's tensors against the profile and compile its buffers."""
    lay = profile.layout(geo, geo.kind(layer))
    roles = lay.roles()
    check_tensors(model, geo, layer, roles)
    return compile_layer(profile, geo, layer, model_refs(model, geo, layer, roles), model.size)


def pack_buffer(
    model: Q4nxFile, bp: BufferPlan, advance: Callable[[int], None] | None = None
) -> np.ndarray:
    """One buffer's bytes, built in memory (zero where nothing is placed)."""
    buf = np.zeros(bp.size, dtype=np.uint8)
    gather(buf, bp, model.u8, advance)
    return buf


def pack_layer(
    model: Q4nxFile, plan: LayerPackPlan, names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """Every (or the named) buffer of a layer, in memory. For verification and tests."""
    wanted = set(names) if names is not None else None
    return {
        bp.name: pack_buffer(model, bp)
        for bp in plan.buffers
        if wanted is None or bp.name in wanted
    }


class _Window:
    """Two reusable ``WRITE_STEP`` arrays and a hashing thread, shared by every buffer."""

    def __init__(self, step: int = WRITE_STEP) -> None:
        self.step = step
        self.arrays = [np.empty(step, np.uint8), np.empty(step, np.uint8)]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="moepack-sha256")

    def close(self) -> None:
        with deferred():  # whole: a shutdown cut half-way leaves the worker waiting forever
            self.pool.shutdown(wait=True)


def write_buffer(
    model: Q4nxFile,
    bp: BufferPlan,
    fh: BinaryIO,
    window: _Window,
    progress: ProgressSink = NULL_PROGRESS,
) -> str:
    """Build a buffer a window at a time into ``fh``; return its sha256.

    While the main thread gathers window k+1 and writes it, the worker thread hashes window k
    (hashlib and numpy release the GIL), so hashing costs no extra wall time when the
    gather-and-write side is the slower one, and memory is two windows, not the buffer.
    Each window written is handed to the kernel's writeback at once, so the fsync at the end
    has little left to wait for and the page cache does not fill up with our output.
    """
    h = hashlib.sha256()
    pending: list[Future[None] | None] = [None, None]
    try:
        for k, lo in enumerate(range(0, bp.size, window.step)):
            hi = min(bp.size, lo + window.step)
            slot = k % 2
            earlier = pending[slot]
            if earlier is not None:
                with deferred():  # an interrupt inside a future's lock would hang the worker
                    earlier.result()  # the hash of window k-2 is done with this array
            chunk = window.arrays[slot][: hi - lo]
            gather_range(chunk, bp, model.u8, lo)
            with deferred():
                pending[slot] = window.pool.submit(h.update, chunk.data)
            fh.write(chunk.data)
            if lo:
                _write_back(fh, lo - window.step, window.step)
            progress.advance(hi - lo)
    finally:
        with deferred():
            for f in pending:
                if f is not None:
                    f.result()
    return h.hexdigest()


def _write_back(fh: BinaryIO, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` to disk and let its cached pages go."""
    try:
        fh.flush()
        drop_cached(fh.fileno(), offset, length)
    except OSError:  # only a cost: the pages stay cached
        pass


def layer_span(plan: LayerPackPlan) -> tuple[int, int]:
    refs = list(plan.tensors.values())
    return min(r.start for r in refs), max(r.start + r.nbytes for r in refs)


@dataclass
class PackedBuffer:
    layer: int
    kind: str
    buffer: str
    file: str
    size: int
    sha256: str
    placements: int
    weakest: str


@dataclass(kw_only=True)
class PackResult:
    model: str
    out_dir: str
    profile: str
    geometry: str
    layers: list[int]
    buffers: list[PackedBuffer]
    total_bytes: int
    manifest: str
    unplaced: dict[str, str] = field(default_factory=dict)


def _check_out_dir(out_dir: Path, force: bool, targets: list[str]) -> None:
    """Refuse what the pack may not replace: a file where the folder goes, a missing parent,
    without ``force`` a pack or any file this pack would write, and a subfolder (a pack
    folder is replaced whole; a subfolder could not be carried over)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput("output path exists and is not a folder", out_dir)
    if not out_dir.exists():
        parent = out_dir.parent if str(out_dir.parent) else Path(".")
        if parent.exists() and not parent.is_dir():
            raise BadInput(f"{str(parent)!r} is a file, not a folder", out_dir)
        if not parent.is_dir():  # only the pack folder itself is created, as in every output
            raise BadInput(f"output folder {str(parent)!r} does not exist", out_dir)
        if not os.access(parent, os.W_OK):
            raise BadInput(f"output folder {str(parent)!r} is not writable", out_dir)
        return
    here = real(Path.cwd())
    if real(out_dir) == here or real(out_dir) in here.parents:
        raise BadInput(
            "the pack folder holds the current folder: a pack folder is replaced whole; run "
            "from outside it",
            out_dir,
        )
    if os.path.ismount(out_dir) or real(out_dir) == real(real(out_dir).parent):
        raise BadInput(
            "the pack folder is a mount point: a pack is switched in by renaming its folder; "
            "pack into a folder inside it",
            out_dir,
        )
    if not os.access(real(out_dir).parent, os.W_OK):
        raise BadInput(
            f"the folder holding the pack ({str(real(out_dir).parent)!r}) is not writable: a "
            "pack is built beside its folder and switched in whole",
            out_dir,
        )
    try:
        entries = sorted(os.listdir(out_dir))
    except OSError as e:
        raise describe_os_error(e, out_dir) from None
    folders = [n for n in entries if (out_dir / n).is_dir() and not (out_dir / n).is_symlink()]
    if folders:
        raise BadInput(
            f"the pack folder holds a folder ({folders[0]!r}): a pack folder is replaced whole "
            "and only files are carried over; move it out",
            out_dir,
        )
    if force:
        return
    if mf.MANIFEST in entries:
        raise BadInput(
            "folder already holds a pack (manifest.json); pass `force` to replace it", out_dir
        )
    clash = [t for t in targets if t in entries]
    if clash:
        shown = ", ".join(clash[:5]) + (f" and {len(clash) - 5} more" if len(clash) > 5 else "")
        raise BadInput(
            f"packing would overwrite {len(clash)} existing file(s) ({shown}); "
            "pass `force` to replace them",
            out_dir,
        )


def is_carried_over(name: str) -> bool:
    """A file of the old pack folder that goes on into the new one: not the packer's own
    (the manifest, ``layer-LL.<buffer>.bin``), not a moepack temporary."""
    return name != mf.MANIFEST and not mf.is_buffer_file(name) and not is_temporary(name)


def pack_model(
    model_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    profile: str | None = None,
    layers: str | Sequence[int] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    force: bool = False,
    names: str | os.PathLike[str] | None = None,
) -> PackResult:
    """Pack ``layers`` of a ``.q4nx`` with a profile into ``out_dir`` (buffers + manifest).
    ``names``: a names file binding roles to the file's own tensor names (``names.py``).
    A pack already there is replaced only with ``force`` (or inside ``safeio.replacing``)."""
    force = force or replacing_allowed()
    prof = get_profile(profile)
    out = Path(out_dir)
    binding = load_names(names) if names is not None else None
    with Q4nxFile(model_path) as model:
        if binding is not None:
            bind(model, binding)
        geo = detect(model)
        chosen = parse_layers(layers, model_layers(model))
        # every bad tensor of every chosen layer is reported before anything is written
        check_layers(model, geo, {x: prof.layout(geo, geo.kind(x)).roles() for x in chosen})
        buffers = [
            (layer, b) for layer in chosen for b in prof.layout(geo, geo.kind(layer)).buffers
        ]
        total = sum(b.size for _, b in buffers)
        targets = [mf.buffer_file(layer, b.name) for layer, b in buffers] + [mf.MANIFEST]
        _check_out_dir(out, force, targets)
        # a symlink to a pack folder: the folder it names is replaced, the link stays
        dest = real(out) if out.exists() else out
        check_free_space(
            dest.parent if str(dest.parent) else Path("."),
            total + 1024 * 1024,
            f"packing {len(chosen)} layer(s)",
        )
        with replacing(force):
            return _pack(model, prof, geo, chosen, out, dest, total, progress, binding)


def _pack(
    model: Q4nxFile,
    prof: LayoutProfile,
    geo: Geometry,
    chosen: list[int],
    out: Path,
    dest: Path,
    total: int,
    progress: ProgressSink,
    binding: Binding | None = None,
) -> PackResult:
    """Write the buffers and the manifest into a new folder that replaces ``dest`` whole
    (``out`` is the name the caller gave it): it holds the old pack or the new one."""
    written: list[PackedBuffer] = []
    layers_doc = []
    unplaced: dict[str, str] = {}
    progress.start(f"packing {len(chosen)} layer(s) with {prof.name}", total)
    window = _Window()
    try:
        with AtomicOutputs(inputs=[model.path]) as outs:
            stage = outs.folder(dest, carry_over=is_carried_over)
            for layer in chosen:
                plan = layer_plan(model, prof, geo, layer)
                docs = []
                for bp in plan.buffers:
                    name = mf.buffer_file(layer, bp.name)
                    with open(stage / name, "xb") as fh:
                        sha = write_buffer(model, bp, fh, window, progress)
                    docs.append(mf.buffer_json(bp, layer, sha, plan.layout.digest(bp.name)))
                    weakest = max(
                        (p.status for p in bp.placements), key=lambda s: s.rank, default=None
                    )
                    written.append(
                        PackedBuffer(
                            layer,
                            plan.kind.value,
                            bp.name,
                            name,
                            bp.size,
                            sha,
                            len(bp.placements),
                            weakest.value if weakest else "-",
                        )
                    )
                layers_doc.append(mf.layer_json(plan, model, docs))
                for role, why in plan.layout.unplaced.items():
                    unplaced[geo.name_of(role, layer)] = why
                model.drop_pages(*layer_span(plan))
                del plan
            doc = mf.manifest_json(prof, model, geo.name, layers_doc)
            if binding is not None:  # the file's own names for the roles it was packed by
                doc["model"]["tensor_binding"] = binding.to_json()
            with open(stage / mf.MANIFEST, "xb") as fh:
                fh.write(json.dumps(doc, indent=1).encode())
    except OSError as e:
        raise describe_os_error(e, out) from None
    finally:
        window.close()
        progress.finish()
    return PackResult(
        model=str(model.path),
        out_dir=str(out),
        profile=prof.name,
        geometry=geo.name,
        layers=chosen,
        buffers=written,
        total_bytes=total,
        manifest=str(out / mf.MANIFEST),
        unplaced=unplaced,
    )
