"""Ending a process group: a stage, a local Prefect server, a profiled function. Each is started in a
session of its own (`start_new_session=True`), so its pid is also its process group's id and a signal
to the group reaches what it started (`sh -c`'s children, DataLoader workers, a launcher's ranks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send `sig` to the process group `pgid`; False when there is no such group any more
    (ProcessLookupError) or none of its processes may be signalled by us (PermissionError): what is
    gone needs no killing, and a kill on a cleanup path must not raise."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(proc: subprocess.Popen, grace: float, *, reap_s: float = 5.0) -> None:
    """End the group of `proc` (a session leader) if `proc` still runs: SIGTERM and up to `grace` seconds
    to exit, then (or at once, with `grace` <= 0) SIGKILL, and up to `reap_s` seconds to reap it."""
    if proc.poll() is not None:
        return
    if grace > 0 and kill_group(proc.pid, signal.SIGTERM):
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(reap_s)
