"""Front ends for the result objects: rich renderers, one module per domain.

Computation modules return frozen dataclasses of raw numbers; the modules in
this package turn them into rich tables and panels. `to_json` is the third
view of the same object, shared by every command's `--json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from enum import Enum
from typing import Any


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, tuples, NumPy scalars and arrays as plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Enum):
        return obj.value
    if hasattr(obj, "tolist"):  # NumPy arrays and scalars, torch tensors
        return to_jsonable(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN or infinity: null, as JavaScript's JSON.stringify
    return obj


def to_json(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), indent=2)
