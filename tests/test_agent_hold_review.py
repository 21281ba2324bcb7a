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
