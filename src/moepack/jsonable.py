"""The JSON form of a result: what ``--json`` prints and what results embed of each other.

It belongs to the library, not the CLI, so that a result's ``to_json`` can turn the results it
holds into plain values the same way the command line does.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
from pathlib import Path
from typing import Any


def to_jsonable(obj: Any) -> Any:
    """Turn dataclasses, paths, enums and numpy values into plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "to_json"):
            return to_jsonable(obj.to_json())
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.name
    np = sys.modules.get("numpy")  # no numpy value exists before numpy is imported
    if np is not None:
        if isinstance(obj, np.ndarray):
            return to_jsonable(obj.tolist())
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            obj = float(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, bytes):
        return obj.hex()
    return obj
