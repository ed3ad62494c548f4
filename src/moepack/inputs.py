"""Opening what a user hands in: regular files only, reads capped, JSON bounded.

Every reader goes through these, so the same three hazards are closed once: a path that is
not a regular file (a FIFO blocks a reader forever, ``/dev/zero`` never ends), a header that
makes a reader read or allocate more than the file could justify, and JSON nested deep enough
to exhaust Python's recursion limit or carrying integers too large for numpy.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BadInput
from .safeio import os_error_text

# JSON documents moepack reads (plans, surfaces, headers, manifests) are a few MiB at most;
# real ones nest 4 or 5 levels. The limits leave generous room and stop hostile inputs.
MAX_JSON_BYTES = 256 << 20
MAX_JSON_DEPTH = 64
# Integers a JSON document may hold: anything beyond int64 has no meaning in any of them.
INT64_MAX = (1 << 63) - 1
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def regular_file(path: str | os.PathLike[str], what: str) -> os.stat_result:
    """The ``stat`` of ``path`` if it is a regular file (symlinks followed), else ``BadInput``
    saying what it is instead; ``what`` names the expected file, e.g. "plan file"."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise BadInput(f"no such {what}", p) from None
    except OSError as e:
        raise BadInput(f"cannot read the {what}: {os_error_text(e)}", p) from None
    if stat.S_ISDIR(st.st_mode):
        raise BadInput(f"is a folder, not a {what}", p)
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise BadInput(f"is {kind}, not a {what} (moepack reads regular files only)", p)
    return st


def read_capped(path: str | os.PathLike[str], what: str, limit: int) -> bytes:
    """The whole of a regular file that may be at most ``limit`` bytes long (a plan, a surface,
    a TXN stream): refused before reading when larger, so a wrong file cannot fill memory."""
    p = Path(path)
    st = regular_file(p, what)
    if st.st_size > limit:
        raise BadInput(f"{st.st_size:,} bytes is more than a {what} may hold ({limit:,} bytes)", p)
    try:
        with open(p, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        raise BadInput(f"cannot read the {what}: {os_error_text(e)}", p) from None
    if len(data) > limit:  # grew while we looked
        raise BadInput(f"more than a {what} may hold ({limit:,} bytes)", p)
    return data


def json_depth(data: bytes) -> int:
    """How deeply ``data``'s arrays and objects nest (brackets inside strings ignored);
    linear time, no recursion."""
    bare = _STRING.sub(b'""', data)
    b = np.frombuffer(bare, dtype=np.uint8)
    if b.size == 0:
        return 0
    step = (
        (b == ord("[")).astype(np.int32)
        + (b == ord("{"))
        - (b == ord("]")).astype(np.int32)
        - (b == ord("}"))
    )
    return int(np.cumsum(step).max(initial=0))


def _parse_int(text: str) -> int:
    value = int(text) if len(text.lstrip("-")) <= 19 else None
    if value is None or not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueError(f"integer {text[:24]}{'…' if len(text) > 24 else ''} is out of range")
    return value


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def load_json(
    data: bytes | str,
    path: str | os.PathLike[str] | None,
    what: str,
    *,
    pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    allow_nan: bool = False,
    int64_only: bool = True,
) -> Any:
    """Parse a JSON document a user supplied, or raise one-line ``BadInput`` naming ``path``.

    Bounded: at most ``max_bytes`` long and ``max_depth`` deep (checked before parsing, so
    the parser never recurses past it), every integer within int64; NaN and Infinity are
    refused unless ``allow_nan``; ``int64_only=False`` leaves integer ranges to a caller that
    checks them itself (Python's own 4,300-digit limit still applies). ``pairs_hook`` is json's ``object_pairs_hook`` (e.g. to
    refuse duplicate keys by raising ``ValueError``). ``what`` names the document in messages.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise BadInput(f"{what} is {len(raw):,} bytes, more than {max_bytes:,}", path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{what} is not UTF-8 text (byte {e.start:,})", path) from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise BadInput(
            f"{what} is nested too deeply ({depth:,} levels; at most {max_depth} are allowed)",
            path,
        )
    try:
        return json.loads(
            text,
            object_pairs_hook=pairs_hook,
            parse_int=_parse_int if int64_only else None,
            parse_constant=None if allow_nan else _reject_constant,
        )
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}" if "\n" in text else f"column {e.colno}"
        raise BadInput(f"{what} is not valid JSON, corrupt at {where}: {e.msg}", path) from None
    except (ValueError, RecursionError) as e:
        raise BadInput(f"{what} is not valid JSON: {e}", path) from None
