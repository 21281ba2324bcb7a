"""What the worker's log says when the agent of a host that runs a stage is killed (two real agents, a real worker,
the session's real Prefect server): read by an operator of a small cluster to learn what happened to the stage.

Seen on 2026-11-28 with `qosflow worker start --cluster-file lab.yaml` and two `qosflow agent start`:

    host lab-1 is down: no heartbeat (connection refused at http://127.0.0.1:4501 (is the agent running there?))
    stage long_stage: infrastructure failure (host lab-1 lost: ...); retry 1/3 on another slot
    host lab-1 is down (...): no new stage goes there; no stage of this worker was running on it
    re-placed long_stage on lab-2 (...) after 13.01s in the QoS queue; ...

The stage *was* running on lab-1 (its wait saw the refused connection first and placed it again before the
heartbeat round marked the host down), and the retry waited no time in the QoS queue (13 s is the first attempt's
queue wait plus its run). Both lines are written by qosflow/prefect/worker.py: the host's line now says that no stage
runs there *now*, and a retry's wait counts from its previous attempt's end."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent
TOKEN = "agent-worker-log-token-6a0b"
POOL = "agent-worker-log"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def lost_stage_log(prefect_server, tmp_path_factory):
    """Run one stage on a 2-host agent cluster, SIGKILL the agent of its host, and return the worker's log lines."""
    from qosflow.agent.testing import AgentProcess
    from qosflow.prefect.blocks import QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    d = tmp_path_factory.mktemp("wlog")
    pypath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    old_pypath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pypath
    lines = _Lines()
    for name in ("prefect", "qosflow"):
        logging.getLogger(name).addHandler(lines)
    agents = {}
    try:
        for name in ("host-a", "host-b"):
            agents[name] = AgentProcess(name, TOKEN, virtual_gpus=2, args=["--fence-after", "1.5"], log=d / f"{name}.log").start()
        (d / "token").write_text(TOKEN + "\n")
        os.chmod(d / "token", 0o600)
        cluster = d / "lab.yaml"
        hosts = "".join(f"  - {{name: {n}, agent_url: '{a.url}'}}\n" for n, a in agents.items())
        cluster.write_text(f"name: lab\ntoken_file: token\nheartbeat_s: 1\nfence_after_s: 1.5\ngpus_per_host: 2\nhosts:\n{hosts}")
        asyncio.run(setup_pool(POOL, policy=QoSPolicy(policy="fifo"), stream_output=False, cluster_file=str(cluster),
                               env={"PYTHONPATH": pypath}))
        w = WorkerThread(POOL).wait_ready(120)
        os.environ["QOSFLOW_POOL"] = POOL
        try:
            import infra_pipelines as ip

            marker = d / "lost.jsonl"
            out: dict = {}
            th = threading.Thread(target=lambda: out.setdefault("r", ip.agent_lost(str(marker), 12.0)), daemon=True)
            th.start()
            deadline = time.monotonic() + 120
            while not (marker.exists() and marker.read_text().strip()):
                assert time.monotonic() < deadline and th.is_alive(), "the stage never started"
                time.sleep(0.1)
            import json

            victim = json.loads(marker.read_text().splitlines()[0])["node"]
            time.sleep(5.0)  # (the stage has run a while on its host when the host is lost)
            agents[victim].kill(signal.SIGKILL)
            th.join(180)
            assert out.get("r") and out["r"] != victim, out
            yield victim, list(lines.lines)
        finally:
            os.environ.pop("QOSFLOW_POOL", None)
            w.stop()
    finally:
        for name in ("prefect", "qosflow"):
            logging.getLogger(name).removeHandler(lines)
        if old_pypath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pypath
        for a in agents.values():
            a.stop()


def test_the_host_down_line_does_not_say_no_stage_ran_there(lost_stage_log):
    victim, lines = lost_stage_log
    down = [x for x in lines if x.startswith(f"host {victim} is down (")]
    assert down, lines
    assert not any("no stage of this worker was running on it" in x for x in down), down


def test_a_retry_says_how_long_it_waited_itself(lost_stage_log):
    victim, lines = lost_stage_log
    [line] = [x for x in lines if x.startswith("re-placed long")]
    waited = float(re.search(r"after ([0-9.]+)s in the QoS queue", line).group(1))
    assert waited < 3.0, line  # (the stage ran 5 s on the lost host before the kill, and was placed again at once)
