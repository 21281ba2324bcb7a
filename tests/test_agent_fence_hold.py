"""A worker that stops (a restart, an upgrade) while stages run on agents started with --fence-after, as
docs/infrastructure.md recommends (`--fence-after 3`). Real agent processes, real HTTP, through AgentBackend.

The docs promise that a stage running on a host agent keeps running when the worker stops, and that the worker
started again adopts it. Seen on 2026-11-28 with `qosflow worker start --cluster-file lab.yaml` and two agents with
`--fence-after 3`: 3.5 s after the worker stopped both agents killed its stages (`fenced: no heartbeat from the
worker for 3.5s (> 3s)`), so every worker restart cost every running stage its training time. The stopping worker
(its backend's `aclose`) now asks the agents of the stages it leaves running to hold their silence fence for
`fence_hold_s` (the lease TTL); the next worker's first heartbeat ends the hold, and the fence works as before."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from qosflow.agent.testing import AgentProcess
from qosflow.backends.agent import AgentBackend, AgentHost
from qosflow.backends.base import LaunchSpec
from qosflow.core.placement import Placement
from procs import alive

pytestmark = pytest.mark.timeout(90)

TOKEN = "test-token-hold-38fe"
H = {"Authorization": f"Bearer {TOKEN}"}


def _backend(agent: AgentProcess, **kw) -> AgentBackend:
    return AgentBackend([AgentHost(agent.name, agent.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0, **kw)


def test_a_stopping_workers_stages_are_not_fenced_and_the_next_worker_adopts_them(tmp_path):
    with AgentProcess("host-h", TOKEN, args=["--fence-after", "1"], log=tmp_path / "agent.log") as a:

        async def first_worker() -> int:
            be = _backend(a)
            be.fence_hold_s = 20.0
            try:
                cluster = await be.inventory()
                p = Placement("held-1", ((0, 0),), ((0, 1.0),))
                h = await be.launch(LaunchSpec("held-1", [sys.executable, "-c", "import time; time.sleep(120)"], p, cluster))
                waiting = asyncio.ensure_future(be.wait(h))  # (the worker follows its stage until it stops)
                await asyncio.sleep(1.0)
                return h.ref["parts"][0]["pid"]
            finally:
                await be.aclose()  # the worker stops: its stage keeps running, for the next worker
                await asyncio.sleep(1.0)  # (its wait, still running, saw its connection close)
                assert not waiting.done(), "the stopping worker's wait reported the stage's end"
                waiting.cancel()

        pid = asyncio.run(first_worker())
        time.sleep(4.0)  # no worker: four times the agent's --fence-after
        st = httpx.get(f"{a.url}/v1/stages/held-1", headers=H).json()
        assert alive(pid) and st["state"] == "running", f"the stopped worker's stage was fenced: {st['killed_reason']}"

        async def next_worker():
            be = _backend(a)
            try:
                h = await be.adopt("held-1", ["host-h"])
                assert h is not None
                await be.healthy_nodes()  # (its heartbeats start: the hold ends)
                await asyncio.sleep(1.0)
                return h
            finally:
                be.fence_hold_s = 0  # (this one goes without holding: the fence is back)
                await be.aclose()

        asyncio.run(next_worker())
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        st = httpx.get(f"{a.url}/v1/stages/held-1", headers=H).json()
    assert not alive(pid) and st["killed_reason"].startswith("fenced: no heartbeat from the worker"), st


def test_a_backend_that_runs_nothing_holds_no_fence(tmp_path):
    """`qosflow agent status` and the demo's checks close a backend too: they run no stage, and hold nothing."""
    with AgentProcess("host-n", TOKEN, args=["--fence-after", "1"], log=tmp_path / "agent.log") as a:
        with httpx.Client(base_url=a.url, headers=H, timeout=10) as c:
            r = c.post("/v1/stages", json={"stage_id": "other-1", "command": [sys.executable, "-c", "import time; time.sleep(120)"]})
            pid = r.json()["pid"]

            async def status():
                be = _backend(a)
                try:
                    await be.refresh(timeout=5.0)
                finally:
                    await be.aclose()

            asyncio.run(status())
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not alive(pid), "a status check held the agent's fence"
