"""qosflow.procgroup with real processes: a group whose leader exits while members run on."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from procs import alive
from qosflow.procgroup import stop_group

pytestmark = pytest.mark.timeout(60)


def _leader(script: str, tmp_path) -> tuple[subprocess.Popen, int]:
    """A session leader running `sh -c script`; the pid of the child it leaves (the script echoes `$!` first)."""
    out = tmp_path / "pid"
    proc = subprocess.Popen(["sh", "-c", f"{script}"], stdout=open(out, "w"), stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 10
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int(out.read_text().split()[0])
    while _comm(child) != "sleep" and time.monotonic() < deadline:  # (its subshell's trap has run: it exec'd sleep)
        time.sleep(0.02)
    return proc, child


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


@pytest.fixture
def reaper():
    left: list[int] = []
    yield left
    for pid in left:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_stop_group_ends_the_members_of_a_leader_that_exited(tmp_path, reaper):
    """The leader (`sh -c 'sleep 600 &'`) exited and was reaped by a poll(): stop_group returned at once
    and the sleep, still in the group, ran on (a stage's DataLoader workers, a shell's background child)."""
    proc, child = _leader("sleep 600 & echo $!", tmp_path)
    reaper.append(child)
    proc.wait(10)
    assert alive(child)
    stop_group(proc, 0)
    assert _gone(child)


@pytest.mark.parametrize("grace", [0, 2.0])
def test_stop_group_ends_the_members_of_a_leader_that_exited_unreaped(tmp_path, reaper, grace):
    """The same with the leader exited but not reaped yet (a zombie: nobody polled it)."""
    proc, child = _leader("sleep 600 & echo $!", tmp_path)
    reaper.append(child)
    deadline = time.monotonic() + 10
    while alive(proc.pid) and time.monotonic() < deadline:  # (a zombie: exited, not reaped)
        time.sleep(0.02)
    assert proc.returncode is None and alive(child)
    stop_group(proc, grace)
    assert _gone(child)
    assert proc.returncode == 0  # reaped, last


def test_a_member_that_outlives_its_leaders_sigterm_is_killed_after_the_grace(tmp_path, reaper):
    """SIGTERM ends the leader at once, a member ignores it: the stop returned when the leader had
    exited, the member ran on. Now the grace is for the whole group, then SIGKILL."""
    proc, child = _leader("(trap '' TERM; exec sleep 600) & echo $!; wait", tmp_path)
    reaper.append(child)
    t0 = time.monotonic()
    stop_group(proc, 1.0)
    assert _gone(child, 2.0)
    assert time.monotonic() - t0 >= 0.9  # it had its grace
    assert proc.returncode == -signal.SIGTERM


def test_poll_group_ends_the_rest_of_the_group_before_it_reaps_the_leader(tmp_path, reaper):
    from qosflow.procgroup import group_members, poll_group

    proc, child = _leader("sleep 600 & echo $!", tmp_path)
    reaper.append(child)
    deadline = time.monotonic() + 10
    code = poll_group(proc)
    while code is None and time.monotonic() < deadline:
        time.sleep(0.02)
        code = poll_group(proc)
    assert code == 0
    assert _gone(child) and group_members(proc.pid) == []


def test_a_running_group_is_stopped_whole(tmp_path, reaper):
    proc, child = _leader("sleep 600 & echo $!; sleep 600", tmp_path)
    reaper.append(child)
    stop_group(proc, 1.0)
    assert proc.returncode == -signal.SIGTERM and _gone(child)


def test_a_reaped_leader_whose_group_is_empty_is_not_signalled(tmp_path, monkeypatch):
    """Its group id may belong to another process's group by now (pid reuse): no killpg at all."""
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait(10)
    sent = []
    monkeypatch.setattr(os, "killpg", lambda pg, sig: sent.append((pg, sig)))
    stop_group(proc, 0)
    stop_group(proc, 1.0)
    assert sent == []

