"""A launch whose exec hangs (its command or working directory on a dead NFS mount).

The agent started a stage's process on its event loop (fork, then exec, waited for synchronously): an exec that hung
froze the whole agent, which answered no heartbeat meanwhile, and the worker took the host for lost. The process is now
started by a thread; a kill that comes meanwhile still kills the stage once it has started. The agent runs in this
process (its app over httpx's ASGI transport); the hanging exec is the agent's Popen held until the test lets it go."""

from __future__ import annotations

import asyncio
import sys
import threading

import httpx
import pytest

from qosflow.agent import runner as runner_mod
from qosflow.agent.app import AgentConfig, create_app
from procs import alive

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token-hang-9e1b"
H = {"Authorization": f"Bearer {TOKEN}", "X-Qosflow-Worker": "w1"}
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)", "hang-me"]


@pytest.fixture
def hanging_exec(monkeypatch):
    """The agent's Popen (`runner._StartedPopen`) of a command with the word hang-me blocks until `release` is set (at most 10 s): `entered` once
    it blocks, `over` once it goes on."""
    real = runner_mod._StartedPopen  # (the Popen the agent starts a stage's process with)
    entered, release, over = threading.Event(), threading.Event(), threading.Event()

    class HangingPopen(real):  # type: ignore[misc, valid-type]
        def __init__(self, args, *a, **kw):
            if "hang-me" in list(args):
                entered.set()
                release.wait(10)
                over.set()
            super().__init__(args, *a, **kw)

    monkeypatch.setattr(runner_mod, "_StartedPopen", HangingPopen)
    yield entered, release, over
    release.set()


def _agent(tmp_path):
    return create_app(AgentConfig(token=TOKEN, name="host-nfs", virtual_gpus=1, force_virtual=True, workdir=tmp_path / "w"))


def test_the_agent_answers_heartbeats_while_a_launchs_exec_hangs(tmp_path, hanging_exec):
    entered, release, over = hanging_exec
    app = _agent(tmp_path)

    async def go():
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent", headers=H, timeout=30) as c:
            launch = asyncio.ensure_future(c.post("/v1/stages", json={"stage_id": "nfs-1", "command": SLEEP}))
            await asyncio.to_thread(entered.wait, 10)  # (the exec hangs now)
            health = await c.get("/v1/health", params={"worker": "1"})
            answered_while_hanging = not over.is_set() and not launch.done()
            release.set()
            r = await launch
            pid = r.json()["pid"]
            await c.delete("/v1/stages/nfs-1", params={"grace": 0})
            return health, answered_while_hanging, r, pid

    health, answered_while_hanging, r, pid = asyncio.run(go())
    assert health.status_code == 200 and answered_while_hanging, "the agent answered no heartbeat while a launch's exec hung"
    assert r.status_code == 201 and r.json()["state"] == "running", r.text
    assert not alive(pid)


def test_a_kill_that_gives_up_waiting_for_a_hanging_start_still_kills_the_stage_once_it_starts(tmp_path, hanging_exec, monkeypatch):
    """The worker asks for the kill of a launch that timed out; the agent waits LAUNCH_WAIT_S for the start, answers,
    and kills the stage when its exec finally returns (it must not run beside its rerun elsewhere)."""
    entered, release, over = hanging_exec
    monkeypatch.setattr(runner_mod, "LAUNCH_WAIT_S", 0.3, raising=False)
    app = _agent(tmp_path)

    async def go():
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent", headers=H, timeout=30) as c:
            launch = asyncio.ensure_future(c.post("/v1/stages", json={"stage_id": "nfs-2", "command": SLEEP}))
            await asyncio.to_thread(entered.wait, 10)
            killed = await c.delete("/v1/stages/nfs-2", params={"reason": "gang launch failed", "grace": 0})
            still_starting = not over.is_set() and not launch.done()
            release.set()
            r = await launch
            st = await c.get("/v1/stages/nfs-2/wait", params={"timeout": 10})
            return killed, still_starting, r, st.json()

    killed, still_starting, r, st = asyncio.run(go())
    assert killed.status_code == 200 and still_starting, killed.text
    assert r.status_code == 201, r.text
    assert st["state"] == "exited" and st["killed_reason"] == "gang launch failed" and st["signal"] == "SIGKILL", st
    assert not alive(r.json()["pid"])


def test_the_agent_stops_without_waiting_for_a_hanging_start_and_the_stage_is_killed_once_it_starts(tmp_path, hanging_exec,
                                                                                                      monkeypatch):
    """The agent stopping kills its stages (`kill_all`): for one whose start hung, that kill waited LAUNCH_WAIT_S (a
    minute) before the agent could stop. It now waits STOP_START_WAIT_S, then marks the stage, killed as soon as its
    start returns."""
    entered, release, over = hanging_exec
    monkeypatch.setattr(runner_mod, "LAUNCH_WAIT_S", 3600.0)
    monkeypatch.setattr(runner_mod, "STOP_START_WAIT_S", 0.5, raising=False)
    app = _agent(tmp_path)

    async def go():
        life = app.router.lifespan_context(app)
        await life.__aenter__()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent", headers=H, timeout=30) as c:
            launch = asyncio.ensure_future(c.post("/v1/stages", json={"stage_id": "nfs-3", "command": SLEEP}))
            await asyncio.to_thread(entered.wait, 10)
            stop = asyncio.ensure_future(life.__aexit__(None, None, None))
            done, _ = await asyncio.wait({stop}, timeout=5)  # (the hanging start ends after 10 s at most)
            release.set()
            r = await launch
            await stop
            st = app.state.runner.stages["nfs-3"]
            await app.state.runner.wait(st, 10)
            return stop in done, r, st.status()

    stopped, r, st = asyncio.run(go())
    assert stopped, "the agent's stop waited for a stage's hanging start"
    assert r.status_code == 201, r.text
    assert st["state"] == "exited" and st["signal"] == "SIGKILL" and st["killed_reason"] == "agent shutting down", st
    assert not alive(r.json()["pid"])
