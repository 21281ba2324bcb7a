"""A worker's id to its agents (`X-Qosflow-Worker`, `AgentBackend.worker_id`; dc8c784), beyond the fence itself.

- `AgentBackend.worker_id` was settable at any time ("before or after the first request"): set after a launch, the
  agent kept the stage as the old id's, which no longer heartbeat, and fenced it under the running worker.
- An agent without --fence-after kept every worker id it was sent for as long as it ran (only the fence loop forgets
  them): each `qosflow agent status` names a new one."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from qosflow.agent.app import AgentConfig, create_app
from qosflow.agent.testing import AgentProcess
from qosflow.backends.agent import AgentBackend, AgentHost
from qosflow.backends.base import LaunchSpec
from qosflow.core.placement import Placement
from qosflow.errors import QosflowError
from procs import alive

pytestmark = pytest.mark.timeout(90)

TOKEN = "test-token-worker-id-0c44"
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_renaming_a_worker_that_runs_stages_is_refused_and_its_stage_runs_on(tmp_path):
    with AgentProcess("host-rn", TOKEN, args=["--fence-after", "1"], log=tmp_path / "agent.log") as a:

        async def go():
            be = AgentBackend([AgentHost("host-rn", a.url)], TOKEN, heartbeat_s=0.3, fence_after_s=1.0, worker_id="first-id")
            be.fence_hold_s = 0
            try:
                cluster = await be.inventory()
                h = await be.launch(LaunchSpec("rn-1", SLEEP, Placement("rn-1", ((0, 0),), ((0, 1.0),)), cluster))
                assert h.ref["launch_error"] is None, h.ref
                pid = h.ref["parts"][0]["pid"]
                try:
                    be.worker_id = "lease-holder-id"
                    refused = None
                except QosflowError as exc:
                    refused = str(exc)
                await asyncio.sleep(3.0)  # three fences long, heartbeating (under whichever id it has now)
                ran_on = alive(pid)
                await be.kill(h, grace=0)
                return refused, ran_on, be.worker_id
            finally:
                await be.aclose()

        refused, ran_on, wid = asyncio.run(go())
    assert ran_on, "the stage was fenced under a worker that heartbeated all along (renamed after its launch)"
    assert refused and "rn-1" in refused and "before the first launch" in refused, refused
    assert wid == "first-id"


def test_an_agent_without_a_fence_keeps_no_worker_ids(tmp_path):
    app = create_app(AgentConfig(token=TOKEN, name="host-nf", virtual_gpus=1, force_virtual=True, workdir=tmp_path / "w"))

    async def go():
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as c:
            for i in range(50):  # (50 status checks, each a new id)
                r = await c.get("/v1/inventory", headers={"Authorization": f"Bearer {TOKEN}", "X-Qosflow-Worker": f"status-{i}"})
                assert r.status_code == 200
        return len(app.state.worker_contacts)

    assert asyncio.run(go()) == 0
