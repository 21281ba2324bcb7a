"""A stage whose command cannot start on its host: real agent processes, real HTTP, through AgentBackend.

The worker starts every stage with its own interpreter's path (`<worker's sys.executable> -m prefect.engine`). On a
host whose qosflow lives at another path (another venv, pyenv or conda prefix than the worker's host) every stage
failed "No such file or directory". And the error of a working directory that does not exist read as if the
command were missing ("cannot start 'python3': [Errno 2] No such file or directory: '/srv/x'")."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from qosflow.agent.testing import AgentProcess
from qosflow.backends.agent import AgentBackend, AgentHost
from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.core.placement import Placement

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token-commands-0b7e"


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent")
    a = AgentProcess("host-c", TOKEN, virtual_gpus=1, log=d / "agent.log").start()
    yield a
    a.stop()


def _run(agent: AgentProcess, stage_id: str, command: list[str], cwd: str | None = None):
    async def go():
        be = AgentBackend([AgentHost(agent.name, agent.url)], TOKEN, heartbeat_s=1.0)
        try:
            cluster = await be.inventory()
            p = Placement(stage_id, ((0, 0),), ((0, 1.0),))
            h = await be.launch(LaunchSpec(stage_id, command, p, cluster, cwd=cwd))
            return await asyncio.wait_for(be.wait(h), 30)
        finally:
            await be.aclose()

    return asyncio.run(go())


def test_a_host_without_the_workers_interpreter_runs_the_stage_with_the_agents(agent, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    # the worker's interpreter, as the worker's host has it: a path this host does not have
    monkeypatch.setattr(sys, "executable", "/opt/worker-venv/bin/python3")
    st = _run(agent, "py-1", [sys.executable, "-c", f"import sys; open({str(marker)!r}, 'w').write(sys.executable)"])
    assert st.kind is ExitKind.OK, st.reason
    assert marker.read_text() and marker.read_text() != "/opt/worker-venv/bin/python3"
    log = httpx.get(f"{agent.url}/v1/stages/py-1/logs", params={"follow": False}, headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert "/opt/worker-venv/bin/python3 (the worker's interpreter) does not exist on this host; running the stage with the agent's interpreter" in log


def test_another_missing_program_is_not_replaced_and_says_what_is_missing(agent, tmp_path):
    st = _run(agent, "py-2", ["/opt/tools/bin/python3", "-c", "pass"])  # not the worker's interpreter: no fallback
    assert st.kind is ExitKind.USER
    assert "/opt/tools/bin/python3 does not exist on this host" in st.reason and "`command` job variable" in st.reason, st.reason
    assert "on host host-c" in st.reason
    st = _run(agent, "cmd-1", ["trainx-nosuch", "--epochs", "3"])
    assert st.kind is ExitKind.USER and "'trainx-nosuch' is not on this host's PATH" in st.reason, st.reason


def test_a_working_directory_that_does_not_exist_is_named_as_such(agent, tmp_path):
    missing = tmp_path / "no-such-dir"
    st = _run(agent, "cwd-1", [sys.executable, "-c", "pass"], cwd=str(missing))
    assert st.kind is ExitKind.USER
    assert f"its working directory {missing} does not exist on this host" in st.reason, st.reason
    assert "cannot start" not in st.reason.split("working directory")[0], st.reason


def test_a_workers_interpreter_path_that_exists_but_cannot_run_is_not_replaced(agent, tmp_path, monkeypatch):
    """The fallback is for a path this host does not have. A file that is there but cannot be executed (no x bit: a
    broken install) was run with the agent's interpreter instead, and the log said it "does not exist on this host"."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o644)
    marker = tmp_path / "ran"
    monkeypatch.setattr(sys, "executable", str(fake))
    st = _run(agent, "py-exists-1", [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"])
    log = httpx.get(f"{agent.url}/v1/stages/py-exists-1/logs", params={"follow": False},
                    headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert not marker.exists() and st.kind is not ExitKind.OK, "another interpreter ran the stage"
    assert "does not exist on this host" not in log, log
    assert "cannot be executed" in log, log
