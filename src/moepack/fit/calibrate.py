"""Compute per token for a model's shapes, measured in llama.cpp on a generated model.

A model that does not fit cannot be timed by running it, and one that is not downloaded
cannot be run at all; but a token's compute depends on the per-layer shapes and types, not on
how deep the model is or how many experts it has (a token computes its top-k). So ``fit``
generates a model with the same per-layer shapes and expert type (``checkpoint.synth``) at
two depths (2 and up to 8 layers) and few experts, runs both fully cached in llama.cpp at each thread count, and
fits ``seconds = fixed + per_layer * layers`` for decode and for prefill. Where llama.cpp's
defaults repack the experts into its faster kernels (Q4_0, Q4_K on x86), the same is timed
with the experts left in the file's mapping (``--placement experts-mapped``), as they stay
whenever moepack streams them or the model does not fit with room to repack. Prefill keeps the
target's tokens per expert: the calibration prompt is ``prompt_tokens * experts_c / experts``
tokens long, so each expert's matmul is as wide as in the real ubatch.

The result is kept under ``<cache>/fit/calib-<shape key>.json`` (per shape set, llama.cpp
version and CPU) and reused; the generated models are deleted.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..cachedir import cache_dir
from ..checkpoint.archs import ARCHS
from ..checkpoint.model import MoeModel
from ..checkpoint.synth import LLAMA_FTYPES, SynthSpec, synth_model
from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from .device import save_json
from .shapes import ModelShape, model_shape

FORMAT = "moepack-fit-calibration/2"
"""Version 2 added the placement of each timing; a calibration of version 1 is measured
again."""
OLDER = ("moepack-fit-calibration/1",)
DEFAULTS, MAPPED = "defaults", "experts-mapped"
SHALLOW = 2
DEEPEST = 64
CACHE_MULTIPLE = 4
"""The deeper calibration model is this many times the CPU's last-level cache (or the whole
model, when that is smaller): a small one is timed from the cache, where a model that needs
streaming never is (measured: 8 layers, 130 MB in a 105 MiB L3, estimated a 2.6 GB model's
decode 14-55 % too fast)."""
DEFAULT_LLC = 32 << 20
DECODE_TOKENS = 24
# ggml types moepack's synth writes directly, and the llama.cpp file type nearest each K type
_TYPES = {
    "F32": "F32",
    "F16": "F16",
    "BF16": "BF16",
    "Q8_0": "Q8_0",
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q5_0": "Q5_0",
    "Q5_1": "Q5_1",
    "Q2_K": "Q2_K",
    "Q3_K": "Q3_K_S",
    "Q4_K": "Q4_K_S",
    "Q5_K": "Q5_K_S",
    "Q6_K": "Q6_K",
}
_WORDS = "acegikmoqsuwy"  # one token each in the generated vocabulary ("▁a", "▁c", ...)


@dataclass(frozen=True)
class ThreadTimes:
    """Seconds per token at one thread count: ``fixed + per_layer * layers``."""

    threads: int
    decode_fixed: float
    decode_per_layer: float
    prefill_fixed: float
    prefill_per_layer: float
    runs: list[dict[str, float]] = field(default_factory=list)
    placement: str = DEFAULTS  # where llama.cpp kept the experts (placement.PLACEMENTS)


@dataclass(frozen=True)
class Calibration:
    key: str
    spec: dict[str, Any]
    notes: list[str]
    experts: int
    prompt_tokens: int  # the calibration prompt (the target's tokens per expert)
    layer_bytes: float  # bytes one calibration block reads per decoded token
    output_bytes: int  # the calibration model's output head
    times: list[ThreadTimes]
    llama_cpp: str
    cpu: str
    measured: str
    cached: bool = False
    repacks_experts: bool = False  # llama.cpp's defaults repack them (then MAPPED is timed)

    def at(self, threads: int, placement: str = DEFAULTS) -> ThreadTimes:
        """The measured thread count nearest ``threads`` with the experts where
        ``placement`` keeps them (llama.cpp's defaults where they are not repacked: the
        same kernels)."""
        want = placement if self.repacks_experts else DEFAULTS
        times = [t for t in self.times if t.placement == want] or self.times
        return min(times, key=lambda t: (abs(t.threads - threads), t.threads))

    def decode_seconds(self, shape: ModelShape, threads: int, placement: str = DEFAULTS) -> float:
        """Compute seconds per decoded token of ``shape`` (fully cached)."""
        t = self.at(threads, placement)
        return max(1e-6, t.decode_fixed + t.decode_per_layer * self._layers(shape))

    def prefill_seconds(self, shape: ModelShape, threads: int, placement: str = DEFAULTS) -> float:
        """Compute seconds per prompt token of ``shape`` (fully cached)."""
        t = self.at(threads, placement)
        return max(1e-7, t.prefill_fixed + t.prefill_per_layer * self._layers(shape))

    def covers(self, threads: list[int]) -> bool:
        """Whether every thread count was timed at every placement this model needs."""
        places = [DEFAULTS, MAPPED] if self.repacks_experts else [DEFAULTS]
        have = {(t.threads, t.placement) for t in self.times}
        return all((n, p) in have for n in threads for p in places)

    def _layers(self, shape: ModelShape) -> float:
        """The target's blocks in calibration blocks: the bytes its blocks read per token
        (decode streams weights from memory) over what one calibration block reads, so that
        dense blocks and wider attention the generated model lacks (a delta-net's own heads,
        a shared expert) count as what they read, plus a larger output head the same way."""
        extra = max(0, shape.output_bytes - self.output_bytes)
        return (shape.block_bytes + extra) / max(1.0, self.layer_bytes)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["format"] = FORMAT
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any], origin: str) -> Calibration:
        try:
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            body = {k: v for k, v in doc.items() if k not in ("format", "cached")}
            body["times"] = [ThreadTimes(**t) for t in body["times"]]
            return cls(**body, cached=True)
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"not a calibration fit wrote ({e})", origin) from None


def _synth_arch(gguf_arch: str) -> str | None:
    for family in ARCHS.all():
        if family.gguf_arch == gguf_arch:
            return family.name
    return None


def calibration_spec(shape: ModelShape, layers: int) -> tuple[SynthSpec, list[str]]:
    """The generated model for ``shape`` at ``layers`` deep, and what differs from it."""
    notes = []
    arch = _synth_arch(shape.architecture)
    if arch is None:
        arch = "qwen3moe"
        notes.append(f"{shape.architecture} is not generated here: calibrated as qwen3moe")
    wtype = _TYPES.get(shape.expert_type)
    if wtype is None:
        wtype = "Q4_K_S"
        notes.append(f"{shape.expert_type} is not generated here: calibrated as {wtype}")
    experts = min(shape.n_expert, max(2 * shape.top_k, 8))
    vocab = max(512, min(shape.vocab or 512, 8192))
    base = dict(
        layers=layers,
        experts=experts,
        top_k=shape.top_k,
        hidden=shape.hidden,
        expert_ffn=shape.expert_ffn,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab=vocab,
        context=2048,
        weight_type=wtype,
    )
    for candidate in (
        dict(base, arch=arch),
        dict(base, arch="qwen3moe"),
        dict(base, arch="qwen3moe", weight_type="Q8_0"),
    ):
        spec = SynthSpec(**candidate)  # type: ignore[arg-type]
        try:
            spec.validate()
        except BadInput as e:
            notes.append(f"{candidate['arch']} {candidate['weight_type']}: {e.message}")
            continue
        return spec, notes
    raise BadInput(f"no generated model has these shapes ({'; '.join(notes)})")


def last_level_cache() -> int:
    """The largest CPU cache's size in bytes (sysfs), or ``DEFAULT_LLC`` where it says none."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale > 1 else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or DEFAULT_LLC


def calibration_depths(shape: ModelShape, llc: int | None = None) -> tuple[int, int]:
    """Two depths far enough apart that the per-layer slope stands above run-to-run noise,
    the deeper one ``CACHE_MULTIPLE`` times the last-level cache (a layer of ``max(2k, 8)``
    experts) so its weights come from memory, as the target's do."""
    experts = min(shape.n_expert, max(2 * shape.top_k, 8))
    layer = experts * shape.bytes_per_expert + shape.dense_bytes / max(1, shape.blocks)
    target = min(shape.file_bytes, CACHE_MULTIPLE * (llc or last_level_cache()))
    return SHALLOW, max(SHALLOW + 2, min(DEEPEST, math.ceil(target / max(1.0, layer))))


def calibration_path(key: str) -> Path:
    return cache_dir() / "fit" / f"calib-{key}.json"


def _identity() -> tuple[str, str]:
    try:
        import llama_cpp

        version = str(getattr(llama_cpp, "__version__", "?"))
    except Exception:
        version = "not installed"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return version, f"{cpu} x{os.cpu_count()}"


def cpu_name() -> str:
    """The CPU a calibration (and the overlap shares) were measured on."""
    return _identity()[1]


def filler_text(tokens: int) -> str:
    """About ``tokens`` tokens of text: one-letter words, one token each in a generated
    vocabulary and in most real ones."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(max(1, tokens - 1)))


def _fit_line(xs: tuple[int, int], ys: tuple[float, float]) -> tuple[float, float]:
    """``(fixed, per_layer)`` through two points; a noisy negative part is folded into the
    other so neither goes below zero."""
    per = (ys[1] - ys[0]) / (xs[1] - xs[0])
    if per <= 0:
        return 0.0, ys[1] / xs[1]
    fixed = ys[0] - per * xs[0]
    if fixed < 0:
        return 0.0, ys[1] / xs[1]
    return fixed, per


def run_calibration(
    shape: ModelShape,
    threads: list[int],
    prompt_tokens: int,
    repeats: int = 3,
    progress: ProgressSink = NULL_PROGRESS,
) -> Calibration:
    """Generate the calibration models, time them in llama.cpp, fit the line."""
    depths = calibration_depths(shape)
    specs = [calibration_spec(shape, n) for n in depths]
    notes = specs[0][1]
    spec0 = specs[0][0]
    n_prompt = max(8, min(512, round(prompt_tokens * spec0.experts / max(1, shape.n_expert))))
    folder = Path(tempfile.mkdtemp(prefix="moepack-fit-calib-"))
    try:
        paths = []
        for spec, _ in specs:
            if spec.weight_type in LLAMA_FTYPES:
                from ..checkpoint.synth import llama_cpp_available

                if not llama_cpp_available():
                    raise BadInput("calibration needs llama.cpp (pip install 'moepack[llama]')")
            path = folder / f"calib-{spec.layers}.gguf"
            synth_model(path, spec, progress=progress)
            paths.append(path)
        with MoeModel(paths[0]) as m:
            cshape = model_shape(m)
        layer_bytes = cshape.block_bytes / depths[0]
        text, cont = filler_text(n_prompt), filler_text(DECODE_TOKENS + 1)
        times = []
        counts = sorted(set(threads))
        repacks = False
        for placement in (DEFAULTS, MAPPED):
            if placement == MAPPED and not repacks:
                break  # the experts stay mapped by default: one placement times both
            what = "compute" if placement == DEFAULTS else "compute, the experts mapped"
            progress.start(f"calibrating {what} in llama.cpp", len(counts) * len(paths) * repeats)
            for t in counts:
                times.append(_time_one(paths, depths, t, placement, text, cont, repeats, progress))
                repacks = repacks or bool(times[-1].runs[0].get("repacked_experts"))
            progress.finish()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    version, cpu = _identity()
    return Calibration(
        key=shape.shape_key(),
        spec={k: v for k, v in asdict(spec0).items() if k != "layers"},
        notes=notes,
        experts=spec0.experts,
        prompt_tokens=n_prompt,
        layer_bytes=layer_bytes,
        output_bytes=cshape.output_bytes,
        times=times,
        llama_cpp=version,
        cpu=cpu,
        measured=datetime.now(UTC).isoformat(timespec="seconds"),
        repacks_experts=repacks,
    )


def _time_one(
    paths: list[Path],
    depths: tuple[int, int],
    threads: int,
    placement: str,
    text: str,
    cont: str,
    repeats: int,
    progress: ProgressSink,
) -> ThreadTimes:
    """Both depths at ``threads`` with the experts where ``placement`` keeps them, fully
    cached, the best of ``repeats`` runs; the line through them."""
    from ..llama.runtime.run import RunOptions, run_model

    decode: list[float] = []
    prefill: list[float] = []
    runs: list[dict[str, float]] = []
    for layers, path in zip(depths, paths, strict=True):
        best_d = best_p = float("inf")
        repacked = 0
        tokens = 0
        for _ in range(repeats):
            opts = RunOptions(
                n_predict=DECODE_TOKENS,
                threads=threads,
                n_ctx=1024,
                batch=512,
                prefetch=None,
                placement=placement,
            )
            r = run_model(path, text, opts, continuation=cont)
            d, p = r.decode, r.prefill
            if d.tokens and d.seconds > 0:
                best_d = min(best_d, d.seconds / d.tokens)
            if p.tokens and p.seconds > 0:
                best_p = min(best_p, p.seconds / p.tokens)
            repacked = len((r.weights or {}).get("repacked_experts") or [])
            tokens = r.prefill.tokens
            progress.advance(1)
        runs.append(
            {
                "layers": layers,
                "decode_s": best_d,
                "prefill_s": best_p,
                "prefill_tokens": tokens,
                "repacked_experts": repacked,
            }
        )
        decode.append(best_d)
        prefill.append(best_p)
    df, dp = _fit_line(depths, (decode[0], decode[1]))
    pf, pp = _fit_line(depths, (prefill[0], prefill[1]))
    return ThreadTimes(threads, df, dp, pf, pp, runs, placement)


def calibration(
    shape: ModelShape,
    threads: list[int],
    prompt_tokens: int,
    progress: ProgressSink = NULL_PROGRESS,
    repeats: int = 3,
) -> Calibration:
    """The cached calibration for ``shape``'s shape set when it covers ``threads`` (and this
    llama.cpp and CPU), else a new one, cached."""
    version, cpu = _identity()
    key = f"{shape.shape_key()}-p{prompt_tokens}-e{shape.n_expert}-d{calibration_depths(shape)[1]}"
    path = calibration_path(key)
    if path.exists():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BadInput(f"unreadable calibration ({e}); delete it", path) from None
        if not (isinstance(doc, dict) and doc.get("format") in OLDER):
            cal = Calibration.from_json(doc, str(path))
            if cal.covers(threads) and cal.llama_cpp == version and cal.cpu == cpu:
                return cal
            threads = sorted({t.threads for t in cal.times} | set(threads))
    cal = run_calibration(shape, threads, prompt_tokens, repeats, progress)
    cal = Calibration(**{**asdict(cal), "key": key, "times": cal.times})
    save_json(path, cal.to_json())
    return cal
