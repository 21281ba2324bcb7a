"""An agent's fence (--fence-after) kills its stages, not its pipeline runs (role pipeline).

A pipeline run launched through an agent (`pipelines_on: agents`) is never rerun elsewhere: the next
worker adopts it. The fence killed it with the stages, so a worker restart or a network split longer
than the fence ended every pipeline run of the host Crashed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from qosflow.agent.testing import AgentProcess
from procs import alive

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token-fence-9c1e"
ROLE = "qosflow.dev/role"
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def _client(agent: AgentProcess) -> httpx.Client:
    return httpx.Client(base_url=agent.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)


def _launch(c: httpx.Client, stage_id: str, labels: dict[str, str], gpus: list[int]) -> int:
    r = c.post("/v1/stages", json={"stage_id": stage_id, "command": SLEEP, "labels": labels, "gpus": gpus,
                                   "env": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}})
    assert r.status_code == 201, r.text
    return r.json()["pid"]


def _wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def _launch_both(c: httpx.Client) -> tuple[int, int]:
    stage = _launch(c, "stage-1-a0", {"qosflow.dev/stage": "train"}, [0])
    pipeline = _launch(c, "flowrun-1", {ROLE: "pipeline"}, [])
    assert alive(stage) and alive(pipeline)
    return stage, pipeline


def _cleanup(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_fence_without_heartbeats_kills_the_stage_and_leaves_the_pipeline_run(tmp_path: Path):
    log = tmp_path / "agent.log"
    pids: list[int] = []
    with AgentProcess("host-f", TOKEN, virtual_gpus=1, args=["--fence-after", "1"], log=log) as a, _client(a) as c:
        try:
            stage, pipeline = _launch_both(c)
            pids += [stage, pipeline]
            # no request at all from here (each one is a heartbeat): the fence fires ~1 s after the launches
            assert _wait_dead(stage, 6), "the fence did not kill the stage"
            time.sleep(1.5)  # the fence ticks on with only the pipeline run left: it stays
            assert alive(pipeline), "the fence killed the pipeline run"
            st = c.get("/v1/stages/stage-1-a0").json()
            assert st["state"] == "exited" and st["signal"] == "SIGKILL", st
            assert st["killed_reason"].startswith("fenced: no heartbeat from the worker"), st
            pl = c.get("/v1/stages/flowrun-1").json()
            assert pl["state"] == "running" and pl["killed_reason"] is None, pl
            text = log.read_text()
            assert "fenced: no heartbeat from the worker" in text, text
            assert ("killed 1 stage(s); 1 pipeline run(s) left running: they are adopted by the next worker") in text, text
            assert text.count("fenced:") == 1, text  # once: a host with only pipeline runs is not fenced tick after tick
            # the pipeline run still ends when asked to (the worker cancelling it), and with the agent
            r = c.delete("/v1/stages/flowrun-1", params={"reason": "cancelled", "grace": 0})
            assert r.status_code == 200 and r.json()["state"] == "exited", r.text
            assert not alive(pipeline)
        finally:
            _cleanup(pids)


def test_a_frozen_agent_fences_its_stage_not_its_pipeline_run(tmp_path: Path):
    log = tmp_path / "agent.log"
    pids: list[int] = []
    with AgentProcess("host-z", TOKEN, virtual_gpus=1, args=["--fence-after", "1"], log=log) as a, _client(a) as c:
        try:
            stage, pipeline = _launch_both(c)
            pids += [stage, pipeline]
            a.kill(signal.SIGSTOP)  # the agent (not its children: their own sessions) is frozen
            try:
                time.sleep(2.0)
            finally:
                a.kill(signal.SIGCONT)
            assert _wait_dead(stage, 6), "the woken agent did not fence the stage"
            st = c.get("/v1/stages/stage-1-a0").json()
            assert st["killed_reason"].startswith("fenced: the agent was frozen"), st
            time.sleep(0.5)
            assert alive(pipeline), "the frozen agent's fence killed the pipeline run"
            assert c.get("/v1/stages/flowrun-1").json()["state"] == "running"
            assert "left running: they are adopted by the next worker" in log.read_text()
            a.stop()  # the agent stopping still ends its pipeline runs (they die with their agent, as documented)
            assert _wait_dead(pipeline, 5)
        finally:
            _cleanup(pids)


def test_runner_kill_all_spares_pipelines_for_a_fence_only(tmp_path: Path):
    from qosflow.agent.runner import ROLE_LABEL, Runner
    from qosflow.backends.agent import PIPELINE_ROLE_LABEL
    from qosflow.backends.base import AGENT_STOPPING

    assert ROLE_LABEL == PIPELINE_ROLE_LABEL  # the agent reads the label the worker sets

    async def go():
        r = Runner(tmp_path / "work")
        stage = await r.launch("s", SLEEP, labels={"x": "y"})
        pipe = await r.launch("p", SLEEP, labels={ROLE_LABEL: "pipeline"})
        try:
            assert [s.stage_id for s in r.fenceable()] == ["s"]
            await r.kill_all("fenced: test")
            assert not stage.running and stage.killed_reason == "fenced: test"
            assert pipe.running and pipe.killed_reason is None
            await r.kill_all(AGENT_STOPPING, grace=0)
            assert not pipe.running and pipe.killed_reason == AGENT_STOPPING
        finally:
            await r.kill_all("test over", grace=0)

    asyncio.run(go())
