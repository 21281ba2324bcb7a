"""qosflow's environment variables, read one way: a bad value is an error naming the variable."""

from __future__ import annotations

import math
import os

from qosflow.errors import QosflowError

_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def env_flag(name: str, default: bool = True) -> bool:
    """A switch: 1/true/on/yes or 0/false/off/no (any case); unset or empty gives `default`."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise QosflowError(f"environment variable {name}={os.environ[name]!r}: expected one of {', '.join(_ON)} or {', '.join(_OFF)}")


def env_number(name: str, default: float, *, minimum: float = 0.0, integer: bool = False) -> float:
    """A number >= `minimum` (a whole one if `integer`); unset or empty gives `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum or (integer and not value.is_integer()):
        kind = "a whole number" if integer else "a number"
        raise QosflowError(f"environment variable {name}={raw!r}: expected {kind} >= {minimum:g}; unset it for the default ({default:g})")
    return int(value) if integer else value
