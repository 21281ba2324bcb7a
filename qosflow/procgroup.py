"""Ending a process group: a stage, a local Prefect server, a profiled function. Each is started in a
session of its own (`start_new_session=True`), so its pid is also its process group's id and a signal
to the group reaches what it started (`sh -c`'s children, DataLoader workers, a launcher's ranks).

**A group whose leader has exited.** The members of a group do not end with its leader: a stage's
DataLoader workers or a shell's `cmd &` child run on after the main process exited. So a stop signals
the group also when its leader is gone. That has a hazard, whoever signals (`killpg` or a kill per
member found in /proc): Linux keeps a pid number in use while any process has it as its pid, process
group id or session id, so while the leader is unreaped (running, or a zombie) or any member lives,
the group's id names that group and no other. But once the leader is reaped and the last member has
exited, the number is free and is given again (`pid_max` is 32768 on many machines), possibly to a
process that leads a group or session of its own (another stage started with `start_new_session`,
anyone's `setsid`): a late signal to the old id would hit that one. Hence:

* the group is signalled *before* its leader is reaped, while the leader's zombie holds the id:
  `stop_group` waits for the leader without reaping it (`waitid(WNOWAIT)`) and reaps it last, and
  `poll_group`, for callers that poll, ends the rest of the group before it reaps an exited leader;
* a leader reaped earlier (a caller's `proc.poll()`) leaves a window: `stop_group` then signals the
  group only if processes remain in it that are members of the leader's session (`sid == pgid`, as
  `start_new_session` made them), which is the group unless it emptied after the reap and its id was
  given to a new session since. Callers that poll use `poll_group`, so that nothing is left to stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send `sig` to the process group `pgid`; False when there is no such group any more
    (ProcessLookupError) or none of its processes may be signalled by us (PermissionError): what is
    gone needs no killing, and a kill on a cleanup path must not raise. (Safe while the group's leader
    is unreaped, or just after: see the module's docstring.)"""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat from the process's state on (field 3 of proc(5) at index 0): its
    command name, which may hold spaces and parentheses, cut off; None when there is no such process
    (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode("utf-8", "replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out) of process group `pgid` that belong to session `pgid`, i.e.
    what a session leader of pid `pgid` started (Linux /proc; empty elsewhere)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for e in entries:
        if not e.isdigit():
            continue
        f = stat_fields(e)
        try:
            state, pgrp, session = f[0], int(f[2]), int(f[3])
        except (TypeError, IndexError, ValueError):  # (TypeError: gone meanwhile)
            continue
        if pgrp == pgid and session == pgid and state not in ("Z", "X"):
            out.append(int(e))
    return out


def _leader_exited(proc: subprocess.Popen) -> bool:
    """Whether `proc`, unreaped, has exited; it stays unreaped (a zombie holding the group's id)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere (os.wait, a SIGCHLD handler): gone
        return True


def poll_group(proc: subprocess.Popen) -> int | None:
    """`proc.poll()` for a session leader whose group must not outlive it (a container's processes end
    with its main process): None while it runs; once it has exited, what is left of its group is
    SIGKILLed while its zombie still holds the group's id, then it is reaped and its code returned."""
    if proc.returncode is not None:
        return proc.returncode
    if not _leader_exited(proc):
        return None
    kill_group(proc.pid, signal.SIGKILL)
    return proc.wait()


def stop_group(proc: subprocess.Popen, grace: float, *, reap_s: float = 5.0) -> None:
    """End the group of `proc` (a session leader): SIGTERM and up to `grace` seconds for the leader and
    its members to exit, then (or at once, with `grace` <= 0) SIGKILL, and up to `reap_s` seconds to
    reap the leader. A leader that has exited does not end the stop early: the members it left running
    (DataLoader workers, a shell's background child) are stopped too. The leader is reaped last.

    A leader reaped before this call (a caller's `proc.poll()`): its group is signalled only while
    members of its session remain (see the module's docstring for why not blindly)."""
    if proc.returncode is not None:
        if not group_members(proc.pid):
            return
        steps = ((signal.SIGTERM, grace), (signal.SIGKILL, reap_s)) if grace > 0 else ((signal.SIGKILL, reap_s),)
        for sig, wait in steps:
            if not kill_group(proc.pid, sig):
                return
            deadline = time.monotonic() + wait
            while group_members(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if not group_members(proc.pid):
                return
        return
    if grace > 0 and kill_group(proc.pid, signal.SIGTERM):
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not (_leader_exited(proc) and not group_members(proc.pid)):
            time.sleep(0.02)
    # the leader, unreaped, holds the group's id: one SIGKILL for whatever of the group is left
    kill_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(reap_s)
