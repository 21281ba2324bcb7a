"""Where qosflow finds the shared public data and keeps its own files."""

from __future__ import annotations

import os
import re
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_root() -> Path:
    return _REPO_ROOT


def shared_data() -> Path:
    """The public traces and tables (`../shared/data` beside the project root).

    Override with QOSFLOW_SHARED_DATA. The data is read in place, never copied into the project.
    """
    env = os.environ.get("QOSFLOW_SHARED_DATA")
    if env:
        return Path(env)
    return _REPO_ROOT.parent / "shared" / "data"


def data_dir() -> Path:
    """qosflow's own state (database, cluster files): QOSFLOW_HOME or the user's data directory."""
    env = os.environ.get("QOSFLOW_HOME")
    if env:
        p = Path(env)
    else:
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        p = Path(base) / "qosflow"
    p.mkdir(parents=True, exist_ok=True)
    return p


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def file_stem(name: str) -> str:
    """`name` (a stage id) as a file name's stem: characters other than letters, digits, `_`, `.` and
    `-` become `_`, at most 150 of them."""
    return _UNSAFE.sub("_", name)[:150]

