"""A lab admin's failures on two real agents (docs/infrastructure.md, "Bare-metal hosts"): a gang whose other host
is lost, an agent that comes back with another token, read through AgentBackend as the worker reads them."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from qosflow.agent.testing import AgentProcess
from qosflow.backends.agent import AgentBackend, AgentHost
from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.placement import Placement

pytestmark = pytest.mark.timeout(120)

TOKEN = "journey-token-5d1c"

#: a gang rank: says it started, and says so again if it gets a SIGTERM (as Prefect's engine reports `Crashed` then)
RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    d = sys.argv[1]
    rank = os.environ["QOSFLOW_GANG_RANK"]
    def term(*_):
        open(os.path.join(d, "term-" + rank), "w").write("SIGTERM")
        sys.exit(143)
    signal.signal(signal.SIGTERM, term)
    open(os.path.join(d, "start-" + rank), "w").write(str(os.getpid()))
    time.sleep(600)
    """
)


def _backend(*agents: AgentProcess, **kw) -> AgentBackend:
    kw.setdefault("heartbeat_s", 0.5)
    return AgentBackend([AgentHost(a.name, a.url) for a in agents], TOKEN, **kw)


async def _until(cond, what: str) -> None:
    """Wait until cond() holds (the test's timeout bounds it: no timed assertion)."""
    while not cond():
        await asyncio.sleep(0.05)


def test_a_gang_whose_other_host_dies_is_killed_at_once_so_it_runs_again(tmp_path: Path):
    """Two hosts run a 2-rank gang; host-b's agent is SIGKILLed. The wait says the host is lost and why (the connection
    is refused: the async client's "All connection attempts failed" hid that, so a refused host was taken for a silent
    one), and rank 0 on host-a gets SIGKILL, not SIGTERM: a Prefect engine given SIGTERM reports its flow run `Crashed`
    ("aborted by a termination signal"), and the worker then would not run the gang again once host-b is back."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with AgentProcess("host-a", TOKEN, log=tmp_path / "a.log") as a, AgentProcess("host-b", TOKEN, log=tmp_path / "b.log") as b:

        async def go():
            be = _backend(a, b)
            try:
                spec = ClusterSpec((NodeSpec("host-a", 2, virtual=True, address=a.url), NodeSpec("host-b", 2, virtual=True, address=b.url)))
                p = Placement("gang", ((0, 0), (1, 0)), ((0, 1.0), (1, 1.0)))
                handle = await be.launch(LaunchSpec("gang", [sys.executable, str(script), str(tmp_path)], p, spec))
                await _until(lambda: (tmp_path / "start-0").exists() and (tmp_path / "start-1").exists(), "both ranks started")
                b.kill(signal.SIGKILL)
                return await be.wait(handle), be.state["host-b"].refused
            finally:
                await be.aclose()

        st, refused = asyncio.run(go())
        rank0 = httpx.get(f"{a.url}/v1/stages/gang", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert st.kind is ExitKind.INFRA and "host host-b lost" in st.reason, st
    assert "connection refused" in st.reason and "is the agent running there?" in st.reason, st.reason
    assert refused  # (a refused host's stages died with its agent: no fence to wait for)
    assert rank0["state"] == "exited" and rank0["killed_reason"].startswith("gang member failed: host host-b lost"), rank0
    assert not (tmp_path / "term-0").exists(), "rank 0 got SIGTERM: its engine would report the flow run Crashed"


def test_a_down_host_whose_cause_changes_says_so_in_the_log(tmp_path: Path, caplog):
    """host-b's agent is stopped (down: connection refused), then started again on its port with another token. The
    worker's log said only the first cause, so it went on reading "connection refused" while `qosflow status` said
    "the agent rejected our token"; now the new cause is logged, with what to do."""
    caplog.set_level(logging.WARNING, logger="qosflow.backends.agent")
    with AgentProcess("host-a", TOKEN, log=tmp_path / "a.log") as a, AgentProcess("host-b", TOKEN, log=tmp_path / "b.log") as b:
        port = b.port

        async def go():
            be = _backend(a, b)
            try:
                await be.inventory()
                b.stop()
                await _until(lambda: be.state["host-b"].refused, "host-b refused")
                again = AgentProcess("host-b", "another-token", port=port, log=tmp_path / "b2.log")
                try:
                    again.start()
                    await _until(lambda: "401" in be.state["host-b"].error, "the new cause seen")
                finally:
                    again.stop()
            finally:
                await be.aclose()

        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if "host-b" in r.getMessage()]
    assert any(m.startswith("host host-b is down: no heartbeat (connection refused") for m in lines), lines
    now = [m for m in lines if "still down, now because" in m]
    assert len(now) == 1 and "rejected our token (401)" in now[0] and "same token" in now[0], lines
