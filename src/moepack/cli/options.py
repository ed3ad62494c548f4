"""Option types and option groups the commands share, so that flags look and parse the same
everywhere: one definition of ``--json``/``-q``, the measuring options of ``probe`` and
``kio``, the trace options, the NPU profile option, sizes, lists and points.

Importing this module costs only click and the small base helpers: an option that needs a
library fact (the trace formats, the read modes, the deepest queue) imports it when a command
module builds the option, so that a command's own imports stay its own."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import click

from ..blocklist import MAX_INDEX, parse_index_list
from ..errors import BadInput
from ..storage.units import parse_size

F = TypeVar("F", bound=Callable[..., Any])


def apply_options(*options: Callable[[Any], Any]) -> Callable[[F], F]:
    """One decorator for a group of options, applied in the order listed (top to bottom)."""

    def deco(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return deco


# -- every command ------------------------------------------------------------------------

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print the result as JSON for programs."
)
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bars.")


def force_option(f: F) -> F:
    """``--force``: outputs may replace files that exist (the one rule for every command that
    writes: ``safeio.replacing``, in force while the command runs). A command whose library
    function takes ``force`` itself (an NPU pack folder) is passed it as well."""
    takes = "force" in inspect.signature(f).parameters

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        force = bool(kwargs["force"] if takes else kwargs.pop("force"))
        from ..safeio import replacing

        with replacing(force):
            return f(*args, **kwargs)

    option = click.option(
        "--force", is_flag=True, help="Replace outputs that already exist (never done unasked)."
    )
    return cast(F, option(run))


# -- value types --------------------------------------------------------------------------


class SizeType(click.ParamType):
    """A byte count with an optional unit: ``4096``, ``64K``, ``2G``; with ``zero``, also
    ``0`` (what turns the option's memory off)."""

    name = "SIZE"

    def __init__(self, zero: bool = False) -> None:
        self.zero = zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        if self.zero and str(value).strip() == "0":
            return 0
        try:
            return parse_size(str(value))
        except BadInput as e:
            self.fail(e.message, param, ctx)


class PointType(click.ParamType):
    """``SIZE@QD``, e.g. ``864K@8``: a request size and a queue depth."""

    name = "SIZE@QD"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, int]:
        if isinstance(value, tuple):
            return (int(value[0]), int(value[1]))
        size_text, sep, qd_text = str(value).partition("@")
        if not sep or not qd_text.strip().isdigit() or int(qd_text) < 1:
            self.fail(
                f"want SIZE@QD with a depth of 1 or more, e.g. 864K@8; got {value!r}", param, ctx
            )
        try:
            return parse_size(size_text.strip()), int(qd_text)
        except BadInput as e:
            self.fail(f"{value!r}: {e.message}", param, ctx)


class ListType(click.ParamType):
    """Comma-separated values: sizes, positive whole numbers (depths) or names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.name = {"size": "SIZES", "int": "DEPTHS", "str": "NAMES"}[kind]

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> list[Any]:
        if isinstance(value, list):
            return value
        items = [v.strip() for v in str(value).split(",") if v.strip()]
        if not items:
            self.fail("give at least one value", param, ctx)
        out: list[Any] = []
        for v in items:
            if self.kind == "size":
                try:
                    out.append(parse_size(v))
                except BadInput as e:
                    self.fail(e.message, param, ctx)
            elif self.kind == "int":
                if not v.isdigit() or int(v) < 1:
                    self.fail(f"not a positive whole number: {v!r}", param, ctx)
                out.append(int(v))
            else:
                out.append(v)
        return out


class IndexListType(click.ParamType):
    """A block or layer list such as ``0-3,5``, parsed by ``moepack.blocklist`` (capped at
    ``limit`` before anything is built); ``all_word`` (e.g. ``all``) stands for ``None``."""

    name = "LIST"

    def __init__(
        self,
        item: str,
        what: str | None = None,
        unique: bool = False,
        limit: int = MAX_INDEX,
        all_word: str | None = None,
    ) -> None:
        self.item, self.what, self.unique, self.limit = item, what, unique, limit
        self.all_word = all_word

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> list[int] | None:
        if isinstance(value, list):
            return value
        text = str(value)
        if self.all_word is not None and text.strip() in ("", self.all_word):
            return None
        try:
            return parse_index_list(text, self.item, self.what, self.limit, self.unique)
        except BadInput as e:
            self.fail(e.message, param, ctx)


def count_option(
    flag: str, default: int | None, help: str | None = None, low: int = 1, dest: str | None = None
) -> Callable[[F], F]:
    """A whole-number option of at least ``low`` (its default shown when there is one)."""
    names = (flag, dest) if dest else (flag,)
    return click.option(
        *names,
        type=click.IntRange(min=low),
        default=default,
        show_default=default is not None,
        help=help,
    )


def fraction_option(flag: str, default: float, help: str) -> Callable[[F], F]:
    """A share or chance between 0 and 1."""
    return click.option(
        flag, type=click.FloatRange(0, 1), default=default, show_default=True, help=help
    )


path_in = click.Path(exists=True, dir_okay=False, path_type=Path)
# A file (or, where a command says so, a folder) that the command reads. click checks nothing:
# the library opens it and says what is wrong in one line naming it ("no such GGUF file", "is a
# folder, not a GGUF file", "is a FIFO (named pipe) …"), the same for every reader of a kind.
input_path = click.Path(path_type=Path)
path_out = click.Path(path_type=Path)
file_path = click.Path(dir_okay=False, path_type=Path)  # a file, existing or to be written
folder_path = click.Path(file_okay=False, path_type=Path)


def out_option(help: str, type: click.ParamType = path_out, dest: str = "out") -> Callable[[F], F]:
    """The required ``--out`` of a command that writes one output (a file or a folder)."""
    return click.option("--out", dest, required=True, type=type, help=help)


# -- storage: probe and kio ---------------------------------------------------------------


def mode_choice() -> click.Choice:
    """The read modes (direct, buffered, dontcache) as a choice."""
    from ..storage.modes import Mode

    return click.Choice([m.value for m in Mode])


def grid_options(sizes_help: str, depths_help: str) -> Callable[[F], F]:
    """``--sizes`` and ``--depths``: the request sizes and queue depths to measure."""
    return apply_options(
        click.option("--sizes", type=ListType("size"), help=sizes_help),
        click.option("--depths", type=ListType("int"), help=depths_help),
    )


def measure_options(
    cell_seconds: float, repeats: int, corpus: int, corpus_help: str, repeats_help: str
) -> Callable[[F], F]:
    """``--cell-seconds``, ``--repeats`` and ``--corpus-size``, with a command's defaults."""
    return apply_options(
        click.option(
            "--cell-seconds",
            type=float,
            default=cell_seconds,
            show_default=True,
            help="Time bound of each cell.",
        ),
        click.option(
            "--repeats",
            type=click.IntRange(1, 100),
            default=repeats,
            show_default=True,
            help=repeats_help,
        ),
        click.option("--corpus-size", type=SizeType(), default=corpus, help=corpus_help),
    )


# -- traces -------------------------------------------------------------------------------

DETECTED = "Input format (default: detected by magic, then extension)."


def trace_format_option(flag: str, dest: str, help: str) -> Callable[[F], F]:
    """A trace format named on the command line (``--format``, ``--from``, ``--to``)."""
    from ..trace.formats import FORMATS

    return click.option(flag, dest, type=click.Choice(sorted(FORMATS)), default=None, help=help)


def to_format_option(f: F) -> F:
    """``--to FORMAT``: a trace's output format."""
    return trace_format_option("--to", "to", "Output format (default: from OUT's extension).")(f)


def pmx_version_option(help: str) -> Callable[[F], F]:
    """``--pmx-version 1|2`` for pmxtrace output."""
    return click.option("--pmx-version", type=click.Choice(["1", "2"]), default=None, help=help)


N_EXPERT_HELP = "Experts per layer, for text traces that do not declare it (never guessed)."


def n_expert_option(help: str) -> Callable[[F], F]:
    """``--n-expert N`` for text traces that do not declare their expert count."""
    return click.option("--n-expert", type=click.IntRange(min=1), default=None, help=help)


block_map_option = click.option(
    "--block-map",
    type=IndexListType("block", "block map"),
    default=None,
    metavar="LIST",
    help="GGUF block of each trace layer, in order, e.g. 0-23 or 1,3,5 (needed when the trace "
    "covers only some MoE blocks; replaces a block map the trace records).",
)

model_option = click.option(
    "--model",
    "model_path",
    type=path_in,
    default=None,
    help="GGUF model the trace belongs to: supplies the expert count and is checked against.",
)


# -- llama.cpp: trace capture and run -----------------------------------------------------

prompt_options = apply_options(
    click.option("--prompt", "-p", multiple=True, help="A prompt (repeatable)."),
    click.option(
        "--prompt-file",
        type=path_in,
        default=None,
        help="One prompt per line, or JSONL with a 'prompt' or chat 'messages' field.",
    ),
    click.option("--chat", is_flag=True, help="Render prompts with the model's chat template."),
)


def batch_option(f: F) -> F:
    """``--batch N``: the tokens of a prompt llama.cpp computes in one pass."""
    return click.option(
        "--batch",
        type=click.IntRange(min=1, max=65536),
        default=512,
        show_default=True,
        help="Prompt tokens per llama.cpp pass (its n_batch and n_ubatch): a pass reads each "
        "expert its tokens chose once, so a larger one reads a long prompt's experts fewer "
        "times, for compute buffers that grow with it (counted in --memory).",
    )(f)


def threads_batch_option(f: F) -> F:
    """``--threads-batch N``: llama.cpp's threads for passes of more than one token."""
    return click.option(
        "--threads-batch",
        type=click.IntRange(min=1),
        default=None,
        help="llama.cpp threads for passes of more than one token (prompts, drafts' "
        "verification). Default: --threads when given, else every core (such a pass reads "
        "each chosen expert once for many tokens: compute, not the disk, limits it).",
    )(f)


def threads_option(default: int | None = 2) -> Callable[[F], F]:
    """``--threads/-t N``: llama.cpp compute threads (``None``: the library chooses)."""
    return click.option(
        "--threads",
        "-t",
        type=click.IntRange(min=1),
        default=default,
        show_default=default is not None,
        help="llama.cpp compute threads."
        + (
            ""
            if default is not None
            else " Default: every core; when the model does not fit in the memory available, "
            "single-token passes run at the count the run measures faster (one fewer or "
            "every core), prompts at every core (--threads-batch)."
        ),
    )


def n_predict_option(default: int) -> Callable[[F], F]:
    """``--n-predict/-n N``: tokens to generate after each prompt."""
    return click.option(
        "--n-predict",
        "-n",
        type=click.IntRange(min=0),
        default=default,
        show_default=True,
        help="Tokens to generate after each prompt.",
    )


def engine_options(engine_help: str, qd_help: str) -> Callable[[F], F]:
    """``--engine NAME`` and ``--qd N``: a read engine and its queue depth."""
    from ..storage.engine import MAX_QUEUE_DEPTH

    return apply_options(
        click.option("--engine", default="threads", show_default=True, help=engine_help),
        click.option(
            "--qd",
            "queue_depth",
            type=click.IntRange(1, MAX_QUEUE_DEPTH),
            default=8,
            show_default=True,
            help=qd_help,
        ),
    )


def cost_depth_option(
    help: str = "Reads in flight; the cost model times requests at this depth.",
) -> Callable[[F], F]:
    """``--queue-depth`` / ``--qd`` for commands that cost reads (default 1: one at a time)."""
    from ..storage.engine import MAX_QUEUE_DEPTH

    return click.option(
        "--queue-depth",
        "--qd",
        "queue_depth",
        type=click.IntRange(1, MAX_QUEUE_DEPTH),
        default=1,
        show_default=True,
        help=help,
    )


def merge_gap_option(
    help: str = "Read through gaps of up to this many slices when cheaper.",
) -> Callable[[F], F]:
    """``--merge-gap N``: the cost model's read-through of short gaps between slices."""
    return click.option(
        "--merge-gap", type=click.IntRange(min=0), default=0, show_default=True, help=help
    )


def ctx_option(default: int, low: int, help: str) -> Callable[[F], F]:
    """``--ctx N``: the context length of the llama.cpp context."""
    return count_option("--ctx", default, help, low=low, dest="n_ctx")


# -- GGUF ---------------------------------------------------------------------------------

assume_options = apply_options(
    click.option(
        "--assume-expert",
        multiple=True,
        metavar="GLOB",
        help="Treat tensors matching GLOB as expert-axis tensors (settles ambiguous ones).",
    ),
    click.option(
        "--assume-not-expert",
        multiple=True,
        metavar="GLOB",
        help="Treat tensors matching GLOB as not carrying the expert axis.",
    ),
)


def seed_option(help: str | None = None) -> Callable[[F], F]:
    """``--seed N``: the random seed of a synthetic artefact."""
    return click.option(
        "--seed", type=click.IntRange(min=0), default=0, show_default=True, help=help
    )


# -- NPU ----------------------------------------------------------------------------------


def profile_option(help: str) -> Callable[[F], F]:
    """``--profile NAME``: an NPU layout profile (see ``npu profiles``)."""
    return click.option("--profile", default=None, help=help)


def layers_option(default: str | None, help: str) -> Callable[[F], F]:
    """``--layers LIST`` of NPU layers (sorted, each once; ``all`` = every layer)."""
    return click.option(
        "--layers",
        type=IndexListType("layer", unique=True, all_word="all"),
        default=default,
        show_default=default is not None,
        help=help,
    )
