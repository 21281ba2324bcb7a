"""An agent whose host's wall clock is stepped (NTP or chrony correcting a skewed clock, `date -s`).

The fence (--fence-after) measured the worker's silence on the wall clock: a step forward past the fence killed
every stage of the host although heartbeats came every few hundred ms (each rerun elsewhere, the killed one's
training lost), and a step back kept the fence from firing during a real silence (a network split: the stage ran
on there while the worker ran it again elsewhere). Real agent processes, real HTTP; the agent's clock is moved by
a `sitecustomize` that adds the number of seconds in a file to `time.time()`."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from qosflow.agent.testing import AgentProcess
from procs import alive

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token-clock-51d2"
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]

SKEW = textwrap.dedent(
    """
    import os, time
    _file, _real = os.environ.get("QOSFLOW_TEST_CLOCK_FILE"), time.time

    def _skewed():
        try:
            with open(_file) as f:
                return _real() + float(f.read() or 0)
        except (OSError, ValueError):
            return _real()

    if _file:
        time.time = _skewed
    """
)


@pytest.fixture
def skewed_agent(tmp_path: Path, monkeypatch):
    """An agent (--fence-after 1) whose wall clock is `time.time()` + the seconds written to the returned file."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEW)
    clock = tmp_path / "clock"
    clock.write_text("0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("QOSFLOW_TEST_CLOCK_FILE", str(clock))
    agent = AgentProcess("host-skew", TOKEN, args=["--fence-after", "1"], log=tmp_path / "agent.log").start()
    try:
        yield agent, clock
    finally:
        agent.stop()


def _launch(c: httpx.Client, stage_id: str) -> int:
    r = c.post("/v1/stages", json={"stage_id": stage_id, "command": SLEEP, "gpus": [0],
                                   "env": {"CUDA_VISIBLE_DEVICES": "0"}})
    assert r.status_code == 201, r.text
    return r.json()["pid"]


def _heartbeats(c: httpx.Client, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert c.get("/v1/health").status_code == 200
        time.sleep(0.2)


def test_a_clock_stepped_forward_does_not_fence_a_heartbeaten_agent(skewed_agent):
    agent, clock = skewed_agent
    with httpx.Client(base_url=agent.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
        pid = _launch(c, "stage-fwd")
        _heartbeats(c, 1.0)
        clock.write_text("3600")  # the host's clock is set an hour ahead between two heartbeats
        _heartbeats(c, 3.0)
        st = c.get("/v1/stages/stage-fwd").json()
        assert st["state"] == "running" and alive(pid), f"fenced while heartbeaten every 0.2 s: {st['killed_reason']}"
        assert 0 < c.get("/v1/health").json()["uptime_s"] < 600  # (not an hour: the uptime is not the wall clock's either)
        c.delete("/v1/stages/stage-fwd", params={"grace": 0})


def test_a_clock_stepped_back_still_fences_a_silent_agent(skewed_agent):
    agent, clock = skewed_agent
    with httpx.Client(base_url=agent.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
        pid = _launch(c, "stage-back")
        _heartbeats(c, 0.5)
        clock.write_text("-3600")  # an hour back, then no heartbeat (a network split)
        deadline = time.monotonic() + 6.0
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), "the stage ran on through a silence of 6 s, past the agent's 1 s fence"
        st = c.get("/v1/stages/stage-back").json()
    assert st["killed_reason"].startswith("fenced: no heartbeat from the worker"), st


SUSPEND = textwrap.dedent(
    """
    import os, time
    _file, _real = os.environ.get("QOSFLOW_TEST_SUSPEND_FILE"), time.clock_gettime

    def _boottime(clk):
        # the seconds in the file: how long the host was suspended (CLOCK_BOOTTIME counts them, CLOCK_MONOTONIC not)
        extra = 0.0
        if clk == getattr(time, "CLOCK_BOOTTIME", None):
            try:
                with open(_file) as f:
                    extra = float(f.read() or 0)
            except (OSError, ValueError):
                pass
        return _real(clk) + extra

    if _file:
        time.clock_gettime = _boottime
    """
)


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="Linux's CLOCK_BOOTTIME")
def test_a_host_that_was_suspended_fences_its_stages_as_it_wakes(tmp_path: Path, monkeypatch):
    """A host suspended (systemctl suspend, hibernation) for longer than the fence: the worker counted it lost and ran
    its stages again elsewhere. The monotonic clock does not count a suspend, so the agent saw neither a silence nor a
    freeze when it woke, and the worker's heartbeats, back at once, kept its stages running beside their reruns."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SUSPEND)
    slept = tmp_path / "slept"
    slept.write_text("0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("QOSFLOW_TEST_SUSPEND_FILE", str(slept))
    with AgentProcess("host-sleep", TOKEN, port=4833, args=["--fence-after", "2"], log=tmp_path / "agent.log") as agent, \
            httpx.Client(base_url=agent.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as c:
        pid = _launch(c, "stage-sleep")
        _heartbeats(c, 1.0)
        slept.write_text("3600")  # the host slept an hour; the worker's heartbeats come again as it wakes
        deadline = time.monotonic() + 10.0
        while alive(pid) and time.monotonic() < deadline:
            _heartbeats(c, 0.2)
        st = c.get("/v1/stages/stage-sleep").json()
        assert not alive(pid), "the stage ran on after the host woke from an hour's suspend, past its 2 s fence"
    assert st["killed_reason"].startswith("fenced"), st
