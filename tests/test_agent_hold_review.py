"""Review of b989972 (the fence hold): real agent processes, real HTTP, through AgentBackend.

The fence exists so that a host cut off from the worker does not run a stage the worker has meanwhile placed again
elsewhere. A stopping worker now asks its agents to hold that fence (`hold_fences`, the lease TTL by default). The next
worker (a worker of the same name, restarted on another machine, or another worker of the pool once the leases
expire) adopts the stages; one that cannot reach the host (a network split between it and that host) got None from
`adopt`, released the lease and ran the stage again elsewhere at once, while the host, holding its fence, ran it on:
the same stage ran twice for up to the hold (30 s by default; `--fence-after` alone bounded it to 3 s)."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time

import httpx
import pytest

from qosflow.agent.testing import AgentProcess
from qosflow.backends.agent import AgentBackend, AgentHost
from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.core.placement import Placement
from procs import alive

pytestmark = pytest.mark.timeout(120)

TOKEN = "test-token-hold-review-51c2"
H = {"Authorization": f"Bearer {TOKEN}"}


class SilentHost:
    """A host as seen from the other side of a network split: connections are taken, nothing ever answers."""

    def __init__(self, port: int):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{port}"
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_worker_that_cannot_reach_a_held_host_does_not_count_its_stage_lost_while_it_may_still_run(tmp_path):
    hold = 4.0
    silent = SilentHost(4831)
    try:
        with AgentProcess("host-h", TOKEN, port=4830, args=["--fence-after", "1"], log=tmp_path / "agent.log") as a:

            async def stopping_worker() -> int:
                be = AgentBackend([AgentHost("host-h", a.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0)
                be.fence_hold_s = hold
                try:
                    cluster = await be.inventory()
                    p = Placement("split-1", ((0, 0),), ((0, 1.0),))
                    h = await be.launch(LaunchSpec("split-1", [sys.executable, "-c", "import time; time.sleep(120)"], p, cluster))
                    return h.ref["parts"][0]["pid"]
                finally:
                    await be.aclose()  # (asks host-h to hold its fence for `hold` s)

            pid = asyncio.run(stopping_worker())

            async def next_worker():
                # the next worker sees host-h only through the split: its requests are never answered
                be = AgentBackend([AgentHost("host-h", silent.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0,
                                  request_timeout_s=0.5)
                be.fence_hold_s = hold
                try:
                    h = await be.adopt("split-1", ["host-h"])
                    if h is None:
                        # (the lease is released and the worker runs the stage again elsewhere now)
                        return None, alive(pid)
                    st = await asyncio.wait_for(be.wait(h), 60)
                    return st, alive(pid)
                finally:
                    be.fence_hold_s = 0
                    await be.aclose()

            st, running_there = asyncio.run(next_worker())
            assert not running_there, ("the next worker counted the stage lost (to run it again elsewhere) while host-h, "
                                       "holding its fence, still ran it")
            assert st is not None and st.kind is ExitKind.INFRA and "lost" in st.reason, st
            rec = httpx.get(f"{a.url}/v1/stages/split-1", headers=H).json()
            assert rec["killed_reason"].startswith("fenced"), rec
    finally:
        silent.close()


class SplitProxy:
    """A TCP path from the worker to an agent that can be cut (a network split): once cut, nothing more goes through
    either way and new connections are taken but never answered (not refused: the host is silent, not gone)."""

    def __init__(self, port: int, target_port: int):
        self.target_port = target_port
        self.cut = False
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{port}"
        self.socks: list[socket.socket] = [self.sock]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.socks.append(c)
            if self.cut:
                continue
            u = socket.create_connection(("127.0.0.1", self.target_port))
            self.socks.append(u)
            threading.Thread(target=self._pump, args=(c, u), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.cut:
                continue  # (dropped: the split)
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def test_a_step_of_the_workers_clock_does_not_end_the_wait_for_a_silent_hosts_fence(tmp_path, monkeypatch):
    """The worker counts a silent (not refused) host's stage lost only once the agent's fence has killed it. It measured
    that on its wall clock: a step forward (NTP, `date -s`) during the silence ended the wait at once, and the stage
    ran again elsewhere while its host, not yet fenced, still ran it."""
    fence = 3.0
    with AgentProcess("host-w", TOKEN, port=4834, args=["--fence-after", str(fence)], log=tmp_path / "agent.log"):
        proxy = SplitProxy(4835, 4834)
        try:

            async def worker():
                be = AgentBackend([AgentHost("host-w", proxy.url)], TOKEN, heartbeat_s=0.5, fence_after_s=fence,
                                  request_timeout_s=1.0)
                try:
                    cluster = await be.inventory()
                    await be.healthy_nodes()  # (heartbeats)
                    p = Placement("clock-1", ((0, 0),), ((0, 1.0),))
                    h = await be.launch(LaunchSpec("clock-1", [sys.executable, "-c", "import time; time.sleep(120)"], p, cluster))
                    waiting = asyncio.ensure_future(be.wait(h))
                    await asyncio.sleep(1.0)
                    proxy.cut = True
                    cut_at = asyncio.get_running_loop().time()
                    real = time.time
                    monkeypatch.setattr(time, "time", lambda: real() + 3600)  # the worker's clock is set an hour ahead
                    st = await asyncio.wait_for(waiting, 60)
                    monkeypatch.setattr(time, "time", real)
                    return st, asyncio.get_running_loop().time() - cut_at, h.ref["parts"][0]["pid"]
                finally:
                    monkeypatch.undo()
                    be.fence_hold_s = 0
                    await be.aclose()

            st, waited, pid = asyncio.run(worker())
            assert st.kind is ExitKind.INFRA and "lost" in st.reason, st
            # its last answer came at most a heartbeat and a probe before the cut: the fence fires no sooner than this
            assert waited >= fence - 0.5 - 0.25, f"the stage was counted lost {waited:.1f}s into the silence, before its {fence:g}s fence"
            deadline = time.monotonic() + 15
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not alive(pid)
        finally:
            proxy.close()


def test_a_status_check_during_a_worker_restart_does_not_end_the_fence_hold(tmp_path):
    """`qosflow agent status` (GET /v1/inventory) or a monitoring probe of /v1/health while the worker restarts ended
    the hold the stopped worker asked, and `--fence-after` killed the stages the next worker was to adopt. Only a
    worker's heartbeat (`?worker=1`, sent once a backend heartbeats) ends it."""
    with AgentProcess("host-st", TOKEN, port=4836, args=["--fence-after", "1"], log=tmp_path / "agent.log") as a:

        async def stopping_worker() -> int:
            be = AgentBackend([AgentHost("host-st", a.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0)
            be.fence_hold_s = 30.0
            try:
                cluster = await be.inventory()
                p = Placement("st-1", ((0, 0),), ((0, 1.0),))
                h = await be.launch(LaunchSpec("st-1", [sys.executable, "-c", "import time; time.sleep(120)"], p, cluster))
                return h.ref["parts"][0]["pid"]
            finally:
                await be.aclose()

        pid = asyncio.run(stopping_worker())

        async def status():  # what `qosflow agent status` does (ClusterFile.ask_agents)
            be = AgentBackend([AgentHost("host-st", a.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0)
            try:
                await be.refresh(timeout=5.0)
            finally:
                await be.aclose()

        asyncio.run(status())
        assert httpx.get(f"{a.url}/v1/health", headers=H).status_code == 200  # (a monitoring probe)
        time.sleep(4.0)  # four times the fence, no worker
        st = httpx.get(f"{a.url}/v1/stages/st-1", headers=H).json()
        assert alive(pid) and st["state"] == "running", f"a status check ended the hold: {st['killed_reason']}"

        async def next_worker():
            be = AgentBackend([AgentHost("host-st", a.url)], TOKEN, heartbeat_s=0.5, fence_after_s=1.0)
            try:
                # it adopts the stage (its lease recovery): the stage is its own from now on, fenced by its silence (the
                # hold was the stopped worker's: another worker's heartbeat does not end it)
                assert await be.adopt("st-1", ["host-st"]) is not None
                await be.inventory()  # (its heartbeats start)
                await asyncio.sleep(1.5)
            finally:
                be.fence_hold_s = 0
                await be.aclose()

        asyncio.run(next_worker())
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        st = httpx.get(f"{a.url}/v1/stages/st-1", headers=H).json()
    assert not alive(pid) and st["killed_reason"].startswith("fenced: no heartbeat"), st
