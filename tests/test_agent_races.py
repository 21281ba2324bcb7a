"""A kill that reaches an agent while the stage it names is being started. Real agent process, real HTTP.

A worker whose launch timed out on a busy or frozen agent asks that agent to kill the stage at once (a gang starts
whole or not at all; `AgentBackend.launch`). When the agent answers again it serves both requests together, and the
DELETE ran while the launch awaited its process's start: `os.killpg(None)` raised, the DELETE answered 500, and the
stage ran on (marked with the kill's reason) while the worker ran it again elsewhere, on a GPU it took for free."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import httpx
import pytest

from qosflow.agent.testing import AgentProcess
from procs import alive

pytestmark = pytest.mark.timeout(90)

TOKEN = "test-token-races-4d8a"
H = {"Authorization": f"Bearer {TOKEN}"}


def test_a_kill_served_with_the_launch_it_follows_kills_the_stage(tmp_path):
    with AgentProcess("host-r", TOKEN, log=tmp_path / "agent.log") as a:
        for i in range(3):
            sid = f"race-{i}"
            answers: dict[str, object] = {}

            def call(what: str, method: str, url: str, **kw) -> None:
                try:
                    answers[what] = httpx.request(method, url, headers=H, timeout=20, **kw)
                except httpx.HTTPError as exc:  # pragma: no cover - reported by the asserts
                    answers[what] = exc

            os.kill(a.proc.pid, signal.SIGSTOP)  # the agent's host is busy: requests queue up
            try:
                post = threading.Thread(target=call, args=("post", "POST", f"{a.url}/v1/stages"), kwargs={"json": {
                    "stage_id": sid, "command": [sys.executable, "-c", "import time; time.sleep(120)"]}})
                post.start()
                time.sleep(0.3)
                kill = threading.Thread(target=call, args=("kill", "DELETE", f"{a.url}/v1/stages/{sid}"),
                                        kwargs={"params": {"reason": "gang launch failed", "grace": 0}})
                kill.start()
                time.sleep(0.3)
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            post.join(30)
            kill.join(30)
            assert isinstance(answers["post"], httpx.Response) and answers["post"].status_code == 201, answers["post"]
            pid = answers["post"].json()["pid"]
            r = answers["kill"]
            assert isinstance(r, httpx.Response) and r.status_code == 200, getattr(r, "text", r)
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            st = httpx.get(f"{a.url}/v1/stages/{sid}", headers=H).json()
            assert not alive(pid), f"the stage asked to be killed runs on: {st}"
            assert st["state"] == "exited" and st["killed_reason"] == "gang launch failed", st


def test_the_ranks_of_a_gang_whose_launch_failed_get_no_sigterm(tmp_path):
    """A gang over two hosts whose launch fails on one (here the agent refuses a GPU index it does not have; a
    timeout on a frozen host ends the same way) is stopped on the other at once. The rank there got SIGTERM and 5 s
    of grace: its Prefect engine, given a SIGTERM, reports the flow run Crashed, while the worker runs the same flow
    run again as the next attempt (an infrastructure failure), so the rerun ran under a run already ended Crashed.
    It gets SIGKILL, as the ranks of a gang that lost a host do."""
    import asyncio

    from qosflow.backends.agent import AgentBackend, AgentHost
    from qosflow.backends.base import ExitKind, LaunchSpec
    from qosflow.core.cluster import ClusterSpec, NodeSpec
    from qosflow.core.placement import Placement

    termed = tmp_path / "got-sigterm"
    started = tmp_path / "started"
    rank = (f"import signal, time, pathlib\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(termed)!r}).write_text('x'), exit(143)))\n"
            f"pathlib.Path({str(started)!r}).write_text('x')\n"
            f"time.sleep(120)\n")
    with AgentProcess("host-g", TOKEN, virtual_gpus=2, log=tmp_path / "g.log") as g, \
            AgentProcess("host-h", TOKEN, virtual_gpus=1, log=tmp_path / "h.log") as h:

        async def go():
            be = AgentBackend([AgentHost(g.name, g.url), AgentHost(h.name, h.url)], TOKEN, heartbeat_s=1.0)
            try:
                # the worker's view of host-h is stale: it places rank 1 on a GPU 1 host-h does not have (422)
                spec = ClusterSpec((NodeSpec("host-g", 2, virtual=True, address=g.url), NodeSpec("host-h", 2, virtual=True, address=h.url)))
                p = Placement("gang-1", ((0, 0), (1, 1)), ((0, 1.0), (1, 1.0)))
                handle = await be.launch(LaunchSpec("gang-1", [sys.executable, "-c", rank], p, spec))
                return await asyncio.wait_for(be.wait(handle), 30)
            finally:
                await be.aclose()

        st = asyncio.run(go())
        r = httpx.get(f"{g.url}/v1/stages/gang-1", headers=H).json()
    assert st.kind is ExitKind.INFRA and "launch failed" in st.reason and "HTTP 422" in st.reason, st
    assert r["state"] == "exited" and r["killed_reason"] == "gang launch failed", r
    assert not termed.exists() and r["signal"] == "SIGKILL", r
