"""Reading the `qosflow.*` labels the worker writes on a stage's flow run (placement, prediction, times).

Labels are strings set by another process, possibly by an older qosflow: a value that does not parse
reads as unknown (None), never as an error in a status view or a pipeline's bookkeeping.
"""

from __future__ import annotations

import math
from typing import Any


def label_int(x: Any) -> int | None:
    """A whole-number label (`qosflow.requested_gpus`, ...), or None when absent or unreadable."""
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def label_float(x: Any) -> float | None:
    """A number label (`qosflow.placed_at`, ...), or None when absent, unreadable or not finite."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
