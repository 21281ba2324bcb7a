"""The fence per worker: real agent processes, real HTTP (and AgentBackend where a worker's side matters).

An agent fences (kills) its stages when the worker stops heartbeating it for --fence-after, so that the worker, which
has lost the host, can run them again elsewhere without running them twice. Any request with the agent's token
counted as that heartbeat: a second worker (another pool, or a status check) that still reached the host kept a
cut-off worker's stages running while that worker ran them again elsewhere. A worker now names itself
(`X-Qosflow-Worker`); a stage is its launcher's (or its last adopter's), fenced by that worker's silence; a hold is its
asker's alone. Requests without the header keep the old behaviour for the stages launched without it."""

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

TOKEN = "test-token-owner-7a3c"
H = {"Authorization": f"Bearer {TOKEN}"}
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _client(agent: AgentProcess, worker: str | None) -> httpx.Client:
    headers = dict(H)
    if worker is not None:
        headers["X-Qosflow-Worker"] = worker
    return httpx.Client(base_url=agent.url, headers=headers, timeout=10)


def _launch(c: httpx.Client, sid: str) -> int:
    r = c.post("/v1/stages", json={"stage_id": sid, "command": SLEEP})
    assert r.status_code == 201, r.text
    return r.json()["pid"]


def _until_dead(pid: int, beat: httpx.Client | None = None, seconds: float = 8.0) -> None:
    """Wait (heartbeating with `beat`, as a live worker does) until `pid` is gone or `seconds` passed."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        if beat is not None:
            assert beat.get("/v1/health", params={"worker": "1"}).status_code == 200
        time.sleep(0.2)


def test_another_workers_heartbeats_do_not_keep_a_silent_workers_stage_running(tmp_path):
    with AgentProcess("host-o", TOKEN, args=["--fence-after", "1"], log=tmp_path / "agent.log") as a, \
            _client(a, "worker-a") as wa, _client(a, "worker-b") as wb:
        pid_a = _launch(wa, "stage-a")
        pid_b = _launch(wb, "stage-b")
        # worker-a is cut off from the host (it runs stage-a again elsewhere); worker-b still heartbeats it
        _until_dead(pid_a, beat=wb)
        assert not alive(pid_a), "worker-b's heartbeats kept cut-off worker-a's stage running"
        st = wb.get("/v1/stages/stage-a").json()
        assert st["killed_reason"].startswith("fenced: no heartbeat from the worker worker-a for"), st
        assert st["owner"] == "worker-a"
        assert alive(pid_b) and wb.get("/v1/stages/stage-b").json()["state"] == "running"
        wb.delete("/v1/stages/stage-b", params={"grace": 0})


def test_a_hold_keeps_only_its_own_workers_stages_and_ends_at_that_workers_heartbeat(tmp_path):
    with AgentProcess("host-h", TOKEN, args=["--fence-after", "1"], log=tmp_path / "agent.log") as a, \
            _client(a, "worker-a") as wa, _client(a, "worker-b") as wb:
        pid_a = _launch(wa, "held-a")
        pid_b = _launch(wb, "held-b")
        r = wa.post("/v1/fence/hold", json={"seconds": 60})
        assert r.status_code == 200 and r.json()["stages"] == 1, r.text
        # another worker's heartbeat does not end worker-a's hold (it says nothing of worker-a's stages)
        assert wb.get("/v1/health", params={"worker": "1"}).status_code == 200
        _until_dead(pid_b)  # both workers silent now
        assert not alive(pid_b), "worker-a's hold kept worker-b's stage from its fence"
        assert wa.get("/v1/stages/held-b").json()["killed_reason"].startswith("fenced: no heartbeat from the worker worker-b")
        assert alive(pid_a), "worker-a's stage was fenced during worker-a's hold"
        # worker-a heartbeats again: its hold ends, and its silence fences its stage
        assert wa.get("/v1/health", params={"worker": "1"}).status_code == 200
        _until_dead(pid_a)
        assert not alive(pid_a), "worker-a's own heartbeat did not end its hold"
        assert wb.get("/v1/stages/held-a").json()["killed_reason"].startswith("fenced: no heartbeat from the worker worker-a")


def test_an_adopted_stage_is_the_adopters_its_heartbeats_keep_it_and_its_silence_fences_it(tmp_path):
    with AgentProcess("host-ad", TOKEN, args=["--fence-after", "1"], log=tmp_path / "agent.log") as a:

        async def go():
            first = AgentBackend([AgentHost("host-ad", a.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0, worker_id="first")
            second = AgentBackend([AgentHost("host-ad", a.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0, worker_id="second")
            first.fence_hold_s = second.fence_hold_s = 0
            try:
                cluster = await first.inventory()
                h = await first.launch(LaunchSpec("ad-1", SLEEP, Placement("ad-1", ((0, 0),), ((0, 1.0),)), cluster))
                assert h.ref["launch_error"] is None, h.ref
                pid = h.ref["parts"][0]["pid"]
                got = await second.adopt("ad-1", ["host-ad"])  # (the lease expired: the second worker takes the stage)
                assert got is not None
                await second.healthy_nodes()  # (its heartbeats)
                async with httpx.AsyncClient(headers=H) as c:
                    assert (await c.get(f"{a.url}/v1/stages/ad-1")).json()["owner"] == "second"
                await first.aclose()  # the first worker is gone: the stage is not its any more
                await asyncio.sleep(3.0)  # three fences long, heartbeaten by the adopter only
                assert alive(pid), "the adopter's heartbeats did not keep its stage"
                # the first worker comes back (another process of it, heartbeating) while the adopter goes silent
                third = AgentBackend([AgentHost("host-ad", a.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0, worker_id="first")
                third.fence_hold_s = 0
                try:
                    await third.healthy_nodes()
                    await second.aclose()
                    deadline = time.monotonic() + 8
                    while alive(pid) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                finally:
                    await third.aclose()
                return pid
            finally:
                await first.aclose()
                await second.aclose()

        pid = asyncio.run(go())
        assert not alive(pid), "the first worker's heartbeats kept the stage the second worker had adopted"
        st = httpx.get(f"{a.url}/v1/stages/ad-1", headers=H).json()
        assert st["killed_reason"].startswith("fenced: no heartbeat from the worker second for"), st


def test_requests_without_a_worker_id_keep_the_old_fence_for_stages_launched_without_one(tmp_path):
    log = tmp_path / "agent.log"
    with AgentProcess("host-anon", TOKEN, args=["--fence-after", "1"], log=log) as a, \
            _client(a, None) as anon, _client(a, "worker-b") as wb:
        pid = _launch(anon, "anon-1")
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # any request keeps a stage launched without a worker id (as before)
            assert wb.get("/v1/health").status_code == 200
            assert anon.get("/v1/inventory").status_code == 200
            time.sleep(0.2)
        assert alive(pid) and wb.get("/v1/stages/anon-1").json()["owner"] is None
        _until_dead(pid)
        st = httpx.get(f"{a.url}/v1/stages/anon-1", headers=H).json()
    assert not alive(pid) and st["killed_reason"].startswith("fenced: no heartbeat from the worker for"), st
    said = [line for line in log.read_text().splitlines() if "without X-Qosflow-Worker" in line]
    assert len(said) == 1, said  # (once: not at every request of an older worker)


def test_a_malformed_worker_id_is_refused_with_what_to_send(tmp_path):
    with AgentProcess("host-bad", TOKEN, log=tmp_path / "agent.log") as a:
        r = httpx.get(f"{a.url}/v1/health", headers={**H, "X-Qosflow-Worker": "w" * 300})
    assert r.status_code == 400 and "X-Qosflow-Worker" in r.json()["detail"] and "1-200" in r.json()["detail"], r.text


def test_a_failed_gang_launch_leaves_no_stage_for_the_worker_to_hold(tmp_path):
    """A gang whose second host refuses its rank: the first rank is killed, and was left in the backend's record of the
    stages it runs (`_live`), so a stopping worker asked that agent to hold its fence for a stage that was gone."""
    with AgentProcess("gang-a", TOKEN, log=tmp_path / "a.log") as a, AgentProcess("gang-b", TOKEN, log=tmp_path / "b.log") as b:

        async def go():
            be = AgentBackend([AgentHost("gang-a", a.url), AgentHost("gang-b", b.url)], TOKEN, heartbeat_s=0.5)
            try:
                cluster = await be.inventory()
                # (rank 1 on GPU 7 of a 2-GPU host: its agent refuses the launch, 422)
                p = Placement("gang-1", ((0, 0), (1, 7)), ((0, 1.0), (1, 1.0)))
                h = await be.launch(LaunchSpec("gang-1", SLEEP, p, cluster))
                return h, {k: set(v) for k, v in be._live.items() if v}
            finally:
                be.fence_hold_s = 0
                await be.aclose()

        h, live = asyncio.run(go())
        assert h.ref["launch_error"] and "refused the launch" in h.ref["launch_error"], h.ref
        st = httpx.get(f"{a.url}/v1/stages/gang-1", headers=H).json()
        assert st["state"] == "exited" and st["killed_reason"] == "gang launch failed", st
    assert live == {}, f"the killed ranks are still counted as running: {live}"
