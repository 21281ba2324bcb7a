"""The threads that start the stages' processes (0bffe20), with a start that hangs between fork and exec.

A stage's process is forked by a starter thread and hangs before it execs (its working directory on a dead NFS mount:
the child's chdir comes before PR_SET_PDEATHSIG is set, before its exec). Here the hang is the child's call of prctl
(`runner._prctl`, replaced in an agent process of the test's own), which waits for a file the test writes.

- The agent must still be able to exit: its starter threads were a ThreadPoolExecutor's, which the interpreter joins
  as it exits; the one whose start hung never ended, and the agent never exited (a SIGTERM, `systemctl stop`, waited
  for the dead mount).
- A child whose agent died before it set PR_SET_PDEATHSIG (which does nothing once the parent is gone) must not go on
  to run the stage when it wakes: nothing would kill it, and the worker has run the stage elsewhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from procs import alive, wait_for

pytestmark = pytest.mark.timeout(120)

AGENT = textwrap.dedent("""
    import asyncio, os, sys, time
    from pathlib import Path
    from qosflow.agent import runner as rm

    d = Path(sys.argv[1])
    real = rm._prctl()

    def hanging_prctl(option, sig):  # (in the stage's child, between fork and exec)
        (d / "child.pid").write_text(str(os.getpid()))
        end = time.monotonic() + 60
        while not (d / "release").exists() and time.monotonic() < end:
            time.sleep(0.05)
        if real is not None:
            real(option, sig)

    rm._PRCTL[:] = [hanging_prctl]

    async def main():
        r = rm.Runner(d / "w")
        asyncio.ensure_future(r.launch("hung", [sys.executable, "-c", f"open({str(d / 'ran')!r}, 'w').close()"]))
        while not (d / "child.pid").exists():
            await asyncio.sleep(0.05)
        print("hanging", flush=True)
        if sys.argv[2] == "wait":
            await asyncio.sleep(600)

    asyncio.run(main())
    print("main over", flush=True)
""")


def _agent(tmp_path, mode: str) -> subprocess.Popen:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path), mode], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "hanging"
    return p


def _child(tmp_path) -> int:
    return int((tmp_path / "child.pid").read_text())


def _cleanup(tmp_path, p: subprocess.Popen) -> None:
    (tmp_path / "release").write_text("")
    if p.poll() is None:
        p.kill()
        p.wait()
    child = _child(tmp_path)
    try:
        wait_for(lambda: not alive(child), 30, "the stage's child gone")
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_agent_exits_while_a_stages_start_hangs(tmp_path):
    p = _agent(tmp_path, "exit")
    try:
        try:
            rc = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        out = p.stdout.read() if rc is not None else ""
        assert rc == 0 and "main over" in out, "the agent's process did not exit while a stage's start hung (its starter " \
                                               "thread was joined as the interpreter exited)"
    finally:
        _cleanup(tmp_path, p)


def test_a_start_that_wakes_after_its_agent_died_does_not_run_the_stage(tmp_path):
    p = _agent(tmp_path, "wait")
    child = _child(tmp_path)
    try:
        p.kill()  # the agent dies (SIGKILL, the OOM killer) while the stage's start hangs
        p.wait()
        (tmp_path / "release").write_text("")  # the mount comes back: the start goes on
        wait_for(lambda: not alive(child), 30, "the stage's start over")
        assert not (tmp_path / "ran").exists(), "a stage's process started after its agent died and ran, unkillable"
    finally:
        _cleanup(tmp_path, p)


def test_a_start_hung_before_its_exec_does_not_hold_up_a_start_it_overlapped(tmp_path, monkeypatch):
    """Two starter threads fork at once: stage B's child is forked while stage A's start is between the creation of its
    exec-status pipe (`subprocess` reads it to its end: the exec happened, or why it failed) and its fork, so B's child
    holds a copy of that pipe's write end until it closes its fds, just before its exec. B's child hangs before that (its
    working directory on a dead NFS mount: the chdir comes first): A's start waited on for as long, its process running
    while the agent, which had no pid for it, could neither report nor kill it (a kill gives up after LAUNCH_WAIT_S and
    the worker runs the stage elsewhere). Here A's fork waits (3 s at most) for B's, and B's child hangs in prctl."""
    import asyncio

    from qosflow.agent import runner as rm

    hang_dir = tmp_path / "nfs"
    hang_dir.mkdir()
    real_prctl = rm._prctl()

    def prctl(option, sig):  # (in a stage's child, between fork and exec)
        if os.getcwd() == str(hang_dir):
            (tmp_path / "child.pid").write_text(str(os.getpid()))
            end = time.monotonic() + 30
            while not (tmp_path / "release").exists() and time.monotonic() < end:
                time.sleep(0.05)
        if real_prctl is not None:
            real_prctl(option, sig)

    monkeypatch.setattr(rm, "_PRCTL", [prctl])
    real_fork_exec, calls = subprocess._fork_exec, []

    def fork_exec(*args):
        calls.append(1)
        if len(calls) == 1:  # stage A's: its pipe is made; B forks meanwhile (unless it must wait for A)
            end = time.monotonic() + 3
            while not (tmp_path / "child.pid").exists() and time.monotonic() < end:
                time.sleep(0.02)
        return real_fork_exec(*args)

    monkeypatch.setattr(subprocess, "_fork_exec", fork_exec)

    async def go():
        r = rm.Runner(tmp_path / "w")
        a = asyncio.ensure_future(r.launch("stage-a", [sys.executable, "-c", "import time; time.sleep(60)"]))
        while not calls:
            await asyncio.sleep(0.01)
        b = asyncio.ensure_future(r.launch("stage-b", [sys.executable, "-c", "pass"], cwd=str(hang_dir)))
        try:
            done, _ = await asyncio.wait({a}, timeout=15)
            started = a in done and a.result().pid is not None
        finally:
            (tmp_path / "release").write_text("")
            await asyncio.wait({a, b}, timeout=30)
            await r.kill_all("test over", grace=0)
        return started

    try:
        started = asyncio.run(go())
    finally:
        (tmp_path / "release").write_text("")
        if (tmp_path / "child.pid").exists():
            child = _child(tmp_path)
            wait_for(lambda: not alive(child), 30, "stage B's child gone")
    assert started, "stage A's start waited for another stage's start that hung before its exec"
