"""The agent's fence loop is never held up by one slow kill.

The fence loop awaited each silent worker's kills in turn. A kill can take long: a stage whose process does not die at
SIGKILL at once (uninterruptible sleep: a hung GPU driver call, a dead NFS mount) is waited on 5 s, and a stage whose
process is still being started (its exec hangs) 60 s. Meanwhile the loop did not tick, and its next tick took the
time it had been held up for the agent being frozen: every stage on the host was fenced, also those of the workers that
were heartbeating all along. The agent runs in this process (its app over httpx's ASGI transport); the slow kill is
`Runner.kill_all` held for one stage until the test lets it go."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from qosflow.agent.app import AgentConfig, create_app, fence_clock

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token-fence-loop-51d2"
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
FENCE = 1.0


def _client(app, worker: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent", timeout=30,
                             headers={"Authorization": f"Bearer {TOKEN}", "X-Qosflow-Worker": worker})


def test_a_slow_fence_kill_does_not_fence_the_stages_of_a_heartbeating_worker(tmp_path):
    app = create_app(AgentConfig(token=TOKEN, name="host-slow", virtual_gpus=2, force_virtual=True, workdir=tmp_path / "w",
                                 fence_after_s=FENCE))
    runner = app.state.runner
    real = runner.kill_all
    entered, release = asyncio.Event(), asyncio.Event()

    async def kill_all(reason, grace=2.0, **kw):
        if any(s.stage_id == "stuck" for s in kw.get("only") or ()):
            entered.set()
            await release.wait()  # (its process does not die yet)
        await real(reason, grace, **kw)

    runner.kill_all = kill_all

    async def go():
        async with app.router.lifespan_context(app), _client(app, "worker-live") as live:
            # worker-gone launched "stuck" and went silent; worker-live runs "busy" and heartbeats throughout
            stuck = await runner.launch("stuck", SLEEP, owner="worker-gone", owner_since=fence_clock())
            r = await live.post("/v1/stages", json={"stage_id": "busy", "command": SLEEP})
            assert r.status_code == 201, r.text
            busy = runner.stages["busy"]
            try:

                async def beat(n: int) -> None:
                    for _ in range(n):
                        assert (await live.get("/v1/health", params={"worker": "1"})).status_code == 200
                        await asyncio.sleep(0.1)

                while not entered.is_set():  # (the fence of worker-gone's stage has begun)
                    await beat(1)
                await beat(int(3 * FENCE / 0.1))  # its kill takes three fences long
                release.set()
                await beat(int(3 * FENCE / 0.1))  # and worker-live heartbeats on
                return stuck.status(), busy.status()
            finally:
                release.set()
                await real("test over", 0)

    stuck, busy = asyncio.run(go())
    assert stuck["killed_reason"].startswith("fenced: no heartbeat from the worker worker-gone"), stuck
    assert busy["state"] == "running" and busy["killed_reason"] is None, \
        f"the stage of a worker that heartbeated all along was fenced: {busy}"


def test_a_worker_that_goes_silent_during_a_slow_fence_kill_is_fenced(tmp_path):
    app = create_app(AgentConfig(token=TOKEN, name="host-slow2", virtual_gpus=2, force_virtual=True, workdir=tmp_path / "w",
                                 fence_after_s=FENCE))
    runner = app.state.runner
    real = runner.kill_all
    entered, release = asyncio.Event(), asyncio.Event()

    async def kill_all(reason, grace=2.0, **kw):
        if any(s.stage_id == "stuck" for s in kw.get("only") or ()):
            entered.set()
            await release.wait()
        await real(reason, grace, **kw)

    runner.kill_all = kill_all

    async def go():
        async with app.router.lifespan_context(app), _client(app, "worker-b") as wb:
            await runner.launch("stuck", SLEEP, owner="worker-a", owner_since=fence_clock())
            r = await wb.post("/v1/stages", json={"stage_id": "later", "command": SLEEP})
            assert r.status_code == 201, r.text
            later = runner.stages["later"]
            try:
                while not entered.is_set():  # worker-b heartbeats until worker-a's stage is being fenced...
                    assert (await wb.get("/v1/health", params={"worker": "1"})).status_code == 200
                    await asyncio.sleep(0.1)
                await runner.wait(later, 10 * FENCE)  # ...then goes silent: its stage must be fenced all the same
                return later.status()
            finally:
                release.set()
                await real("test over", 0)

    later = asyncio.run(go())
    assert later["state"] == "exited" and (later["killed_reason"] or "").startswith("fenced: no heartbeat from the worker worker-b"), \
        f"a slow kill of another worker's stage kept this one from its fence: {later}"
