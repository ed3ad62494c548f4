"""The memory holder benchmarks run under (``moepack.memhold``, where ``fit --verify`` finds
it too), importable beside the benchmarks as before.

    python benchmarks/memhold.py --leave 1.5G     # prints "held N" when ready; Ctrl-C/SIGTERM ends
"""

from __future__ import annotations

import os
import sys

from moepack.memhold import (
    CHECK_SECONDS,
    CHUNK,
    FLOOR,
    GIB,
    MemoryHold,
    hold,
    main,
    mem_available,
    parse_size,
)

__all__ = [
    "CHECK_SECONDS",
    "CHUNK",
    "FLOOR",
    "GIB",
    "MemoryHold",
    "hold",
    "main",
    "mem_available",
    "parse_size",
]

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
