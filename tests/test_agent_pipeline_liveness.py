"""A pipeline run whose host goes silent is reported lost only when Prefect hears nothing of it either.

Real processes: a `qosflow agent` (virtual GPUs), a real Prefect flow run (the session's Prefect server) that the agent
runs as a pipeline run (`AgentBackend.launch_unplaced`), with Prefect's flow-run heartbeats on
(PREFECT_FLOWS_HEARTBEAT_FREQUENCY, as the worker sets it for pipeline runs on agents), and the worker's own question
to Prefect (`qosflow.prefect.worker.prefect_pipeline_liveness`, read back from /api/events/filter and the run's
state). The agent is frozen (SIGSTOP: a silent host, not a refused connection; its children run on in their own
sessions, as on the far side of a network split). Until 2026-11-27 the wait reported such a pipeline run lost once its
host was silent for `pipeline_silence_s` (60 s), and the worker marked its run Crashed while it ran on and reported to
Prefect, and dropped its queued stages.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

TOKEN = "pipeline-liveness-token-3f7a"

FLOW = """
import sys, time
from pathlib import Path
from prefect import flow
from prefect.runtime import flow_run

@flow(name="liveness-pipeline")
def pipeline(seconds: float):
    Path(sys.argv[1]).write_text(str(flow_run.id))
    time.sleep(seconds)
    return "done"

pipeline(float(sys.argv[2]))
"""


def _flow_run_id(path: Path, timeout: float = 60.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.1)
    raise AssertionError("the pipeline's flow run never started")


async def _heartbeat_seen(client, fid: str, timeout: float = 30.0) -> None:
    """Wait until the server has the run's first heartbeat (the event persister flushes every few seconds)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        page = await client.read_events(filter=EventFilter(event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                                                           resource=EventResourceFilter(id=[f"prefect.flow-run.{fid}"])), limit=1)
        if page.events:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"no heartbeat of flow run {fid} reached the server")


def _run(prefect_server: str, tmp_path: Path, *, flow_s: float, freeze_s: float, kill_first: bool = False,
         heartbeat_s: float = 30.0):
    """Launch the flow as a pipeline run through an agent, wait until Prefect has its heartbeat, optionally SIGKILL it,
    freeze the agent for `freeze_s` (or until the wait ends), and return (the wait's ExitStatus, seconds from the
    freeze to the wait's end, whether the host was seen down, the flow run's id)."""
    from prefect.client.orchestration import get_client

    from qosflow.agent.testing import AgentProcess
    from qosflow.backends.agent import AgentBackend, AgentHost
    from qosflow.prefect.worker import prefect_pipeline_liveness

    id_file = tmp_path / "flow-run-id"
    script = tmp_path / "pipeline.py"
    script.write_text(FLOW)

    async def go(agent: AgentProcess):
        be = AgentBackend([AgentHost("solo", agent.url)], TOKEN, heartbeat_s=0.3, request_timeout_s=1.0, poll_s=1.0,
                          pipelines_on="agents")
        be.pipeline_silence_s = 1.5
        be.pipeline_liveness_every_s = 1.0
        async with get_client() as client:
            asked: list = []

            async def liveness(sid: str):
                said = await prefect_pipeline_liveness(client, fid, heartbeat_s)
                asked.append((time.monotonic(), said))
                return said

            be.pipeline_liveness = liveness
            try:
                await be.inventory()
                env = {"PREFECT_API_URL": prefect_server, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
                       "PREFECT_HOME": os.environ.get("PREFECT_HOME", "")}
                h = await be.launch_unplaced("pipe-1", [sys.executable, str(script), str(id_file), str(flow_s)], env)
                assert not h.ref["launch_error"], h.ref
                waiting = asyncio.ensure_future(be.wait(h))
                fid = await asyncio.to_thread(_flow_run_id, id_file)
                await _heartbeat_seen(client, fid)
                if kill_first:
                    st = be.state["solo"]
                    pid = h.ref["parts"][0]["pid"]
                    os.killpg(pid, signal.SIGKILL)  # (the agent starts it in a session of its own)
                    assert st.up
                os.kill(agent.proc.pid, signal.SIGSTOP)
                t0 = time.monotonic()
                seen_down = False
                try:
                    while time.monotonic() - t0 < freeze_s and not waiting.done():
                        await asyncio.sleep(0.1)
                        seen_down = seen_down or not be.state["solo"].up
                finally:
                    os.kill(agent.proc.pid, signal.SIGCONT)
                status = await asyncio.wait_for(waiting, 60)
                return status, time.monotonic() - t0, seen_down, fid, asked
            finally:
                await be.aclose()

    with AgentProcess("solo", TOKEN, virtual_gpus=1, log=tmp_path / "agent.log") as agent:
        return asyncio.run(go(agent))


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_silent_hosts_pipeline_run_that_reports_to_prefect_waits_for_the_host(prefect_server, tmp_path):
    """The host is silent for 8 s (past `pipeline_silence_s`, 1.5 s here), the flow run still reports to Prefect (its
    heartbeat): its wait goes on, saying so once, and once the host answers again the run's process ends 0 there: ok.
    The old code reported it lost 1.5 s into the silence."""
    logger = logging.getLogger("qosflow.backends.agent")
    lines, level = _Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        status, _, seen_down, fid, asked = _run(prefect_server, tmp_path, flow_s=25.0, freeze_s=8.0)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert seen_down
    assert status.ok, status
    assert asked and all(isinstance(said, str) for _, said in asked), asked
    assert any("heartbeat" in said for _, said in asked), asked  # (Prefect's heartbeat event, read back, is the evidence)
    said = [line for line in lines.lines if "still reports to Prefect" in line]
    assert len(said) == 1 and "host solo has been silent" in said[0], said
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        assert c.read_flow_run(fid).state.is_completed()


def test_a_pipeline_run_that_completes_while_its_host_is_silent_ends_ok(prefect_server, tmp_path):
    """The flow run completes while its host is still silent: its wait reports it ok from its Prefect state (Completed),
    without waiting for the host. The old code reported it lost (and the worker's view was a crash)."""
    status, took, seen_down, fid, asked = _run(prefect_server, tmp_path, flow_s=6.0, freeze_s=40.0)
    assert seen_down
    assert status.ok, status
    from qosflow.backends.base import ExitStatus

    last = asked[-1][1] if asked else None
    assert isinstance(last, ExitStatus) and last.ok and "ended Completed while its host was silent" in last.reason, asked
    assert "ended Completed while its host was silent" in status.reason, status  # (the wait passes it on; it said "")
    assert took < 30, took  # (ended by Prefect's word, not by the host's return at 40 s)


def test_a_pipeline_run_gone_with_its_silent_host_is_still_reported_lost(prefect_server, tmp_path):
    """The run's process is killed (no final state reported), then its host goes silent: Prefect hears nothing more of
    it either, so once its last heartbeat is older than 2.5 heartbeats (4 s heartbeats here: 10 s) its wait reports it
    lost, saying that the run no longer reports to Prefect."""
    from qosflow.backends.base import ExitKind

    status, took, seen_down, fid, asked = _run(prefect_server, tmp_path, flow_s=120.0, freeze_s=60.0, kill_first=True,
                                               heartbeat_s=4.0)
    assert seen_down
    assert status.kind is ExitKind.INFRA and "lost" in status.reason and "no longer reports to Prefect" in status.reason, status
    assert any(isinstance(said, str) for _, said in asked), asked  # (alive by its recent heartbeat at first)
    assert asked[-1][1] is None, asked
    assert took < 45, took


def test_the_worker_leaves_a_silent_hosts_pipeline_run_that_reports_to_prefect_running(prefect_server, tmp_path):
    """End to end: a `qosflow worker` process (pipeline runs on host `pipes`, a CPU-only agent; stages on host `gpu`),
    a deployed pipeline whose stage runs 25 s. The worker launches the pipeline run with Prefect's heartbeats on (every
    30 s); `pipes` then goes silent for ~12 s, past the worker's QOSFLOW_PIPELINE_SILENCE_SECONDS (3 s here): the worker
    says the host is silent but the run still reports to Prefect, does not mark it Crashed (nor drop its stages), and
    the pipeline completes with its stages, each run once. The old code marked it Crashed ~4 s into the silence."""
    from contextlib import ExitStack

    from prefect.client.orchestration import get_client
    from procs import stop_groups
    from test_agent_pipelines import HERE, ran_once
    from test_k8s_pipelines import final_state, run_pipeline, wait_for
    from test_worker_restart import pipeline_started_and_stage_running, wait_log

    from qosflow.agent.testing import AgentProcess
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.local import setup_pool

    pool = "agent-pipe-silent"
    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = pypath
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": pypath, "QOSFLOW_LEASE_TTL_SECONDS": "6",
           "QOSFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'leases.db'}", "QOSFLOW_PIPELINE_SILENCE_SECONDS": "3"}
    from types import SimpleNamespace

    lab = SimpleNamespace(marker=tmp_path / "marks.jsonl", wlog=tmp_path / "worker.log", procs=[])
    with ExitStack() as stack:
        pipes = stack.enter_context(AgentProcess("pipes", TOKEN, virtual_gpus=0, args=["--cpu-cores", "2"],
                                                 log=tmp_path / "agent-pipes.log"))
        gpu = stack.enter_context(AgentProcess("gpu", TOKEN, virtual_gpus=2, args=["--cpu-cores", "4"], log=tmp_path / "agent-gpu.log"))
        (tmp_path / "token").write_text(TOKEN + "\n")
        cluster = tmp_path / "agents.yaml"
        cluster.write_text("name: silent\ntoken_file: token\nheartbeat_s: 2\ngpus_per_host: 2\npipelines_on: pipes\nhosts:\n"
                           f"  - {{name: pipes, agent_url: '{pipes.url}', gpus: 0}}\n  - {{name: gpu, agent_url: '{gpu.url}'}}\n")
        asyncio.run(setup_pool(pool, policy=QoSPolicy(policy="fifo"), stream_output=False, cluster_file=str(cluster),
                               env={"PYTHONPATH": pypath}))
        w = subprocess.Popen([sys.executable, "-m", "qosflow", "worker", "start", "--pool", pool, "--name", "silent-w"], env=env,
                             stdout=open(lab.wlog, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        lab.procs.append(w)
        try:
            wait_log(lab.wlog, "qosflow worker:", w)
            fid = run_pipeline(pool, lab.marker, 25.0)
            pid = pipeline_started_and_stage_running(lab, w, fid)
            assert b"PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30\0" in Path(f"/proc/{pid}/environ").read_bytes()
            with get_client(sync_client=True) as c:
                from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

                wait_for("no heartbeat of the pipeline run reached the server", lambda: c.read_events(filter=EventFilter(
                    event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                    resource=EventResourceFilter(id=[f"prefect.flow-run.{fid}"])), limit=1).events, lab, 30)
            os.kill(pipes.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                wait_log(lab.wlog, f"but pipeline run {fid} still reports to Prefect", w, timeout=30)
                while time.monotonic() - t0 < 12:
                    time.sleep(0.2)
                text = lab.wlog.read_text(errors="replace")
                assert "is marked Crashed" not in text, text[-4000:]
                with get_client(sync_client=True) as c:
                    assert c.read_flow_run(fid).state.is_running()
            finally:
                os.kill(pipes.proc.pid, signal.SIGCONT)
            st = final_state(fid, lab, 120)
            text = lab.wlog.read_text(errors="replace")
            assert st.is_completed(), f"{st.name}: {st.message}\n{text[-4000:]}"
            assert "is marked Crashed" not in text and "leaves the QoS queue" not in text, text[-4000:]
            ran_once(lab)
        finally:
            stop_groups(lab.procs)
