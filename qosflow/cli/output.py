"""Output paths of the CLI commands, checked before the work starts: a long run whose results cannot be
written would otherwise end in a traceback, with the results lost."""

from __future__ import annotations

import json
from pathlib import Path

from qosflow.errors import QosflowError


def check_output_file(path: Path, option: str = "--json") -> None:
    """Fail now if `path` cannot be written (a directory, an unwritable or missing place)."""
    if path.is_dir():
        raise QosflowError(f"{option} {path}: is a directory; give a file name, e.g. {path / 'out.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a", encoding="utf-8"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise _unwritable(option, path, exc, "a path in a writable directory") from None


def check_output_dir(path: Path, option: str = "--out") -> None:
    """Fail now if `path` cannot be made a directory we can write files in."""
    if path.exists() and not path.is_dir():
        raise QosflowError(f"{option} {path}: is a file, not a directory; give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".qosflow-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise _unwritable(option, path, exc, "a writable directory") from None


def write_json_file(path: Path, data: dict, option: str = "--json") -> Path:
    """The one JSON writer of the CLI commands (results of simulate, pack, predict eval, profile)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise _unwritable(option, path, exc, "a path in a writable directory") from None
    return path


def _unwritable(option: str, path: Path, exc: OSError, give: str) -> QosflowError:
    return QosflowError(f"{option} {path}: cannot write there ({exc.strerror or exc}); give {give}")
