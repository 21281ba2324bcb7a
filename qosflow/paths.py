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
    # 0700, as the XDG base-directory spec asks of a data directory a program creates: it holds the
    # lease and predictor database (the stages' commands) and cluster files. An existing one keeps its mode
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    return p


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def pipeline_output_dir() -> Path:
    """Where a worker's pipeline processes that outlive it write their output (`LocalBackend.output_file`), and
    whence the lease store's sweep removes old ones."""
    return data_dir() / "pipeline-output"


def file_stem(name: str) -> str:
    """`name` (a stage id) as a file name's stem, one per name: a name of at most 150 letters, digits,
    `_`, `.` and `-` is its own stem; any other has those characters kept (others become `_`, at most
    130 of them), then `~` and a hash of the whole name. Replacing characters alone gave `a/b` and
    `a_b` (or two long ids alike in their first 150 characters) the same stem, so the agent gave those
    stages one log and one progress file: each read the other's output, and pruning one deleted the
    other's files. No name left as it is contains `~`, so a hashed stem is never another name's."""
    safe = _UNSAFE.sub("_", name)
    if safe == name and len(name) <= 150:
        return name
    import hashlib

    return f"{safe[:130]}~{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"

