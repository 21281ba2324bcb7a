"""Stage functions for tests/test_prefect_infra.py (importable by the stage processes the agents start).

Every stage appends JSON lines to a marker file: {"event": "start"|"done", "stage", "node", "attempt", "pid", "t"},
so the tests see where each stage ran and that it finished exactly once.
"""

from __future__ import annotations

import json
import os
import time

from qosflow.prefect.tasks import qos_flow, qos_task


def _mark(marker: str, event: str, stage: str) -> dict:
    rec = {"event": event, "stage": stage, "node": os.environ.get("QOSFLOW_NODE"), "attempt": os.environ.get("QOSFLOW_STAGE_ID"),
           "pid": os.getpid(), "t": time.time()}
    with open(marker, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


@qos_task(gpus=4, cpu_cores=1, expected_duration=3)
def shard(marker: str, name: str, secs: float) -> dict:
    """A whole host (4 GPUs): two shards cannot share one host. Each waits (up to 60 s) until both run,
    so they overlap in time, which they can only do on different hosts."""
    _mark(marker, "start", name)
    end = time.time() + 60
    while time.time() < end:
        with open(marker) as f:
            if sum(1 for line in f if '"start"' in line) >= 2:
                break
        time.sleep(0.05)
    time.sleep(secs)
    return _mark(marker, "done", name)


@qos_task(gpus=1, cpu_cores=1, expected_duration=2)
def merge(marker: str, a: dict, b: dict) -> list:
    import qosflow

    _mark(marker, "start", "merge")
    for step in range(1, 4):  # progress on the agent's host, which the worker copies
        time.sleep(0.05)
        qosflow.report_progress(step, 3)
    _mark(marker, "done", "merge")
    return sorted([a["node"], b["node"]])


@qos_flow(name="infra-two-hosts")
def two_hosts(marker: str, secs: float = 1.0) -> list:
    a = shard.submit(marker, "a", secs)
    b = shard.submit(marker, "b", secs)
    return merge.submit(marker, a, b).result()


@qos_task(gpus=1, cpu_cores=1, expected_duration=8)
def long_stage(marker: str, secs: float) -> str:
    import qosflow

    _mark(marker, "start", "long")
    steps = max(1, round(secs / 0.05))
    for step in range(1, steps + 1):  # progress where it runs, which the worker copies
        time.sleep(0.05)
        qosflow.report_progress(step, steps)
    _mark(marker, "done", "long")
    return os.environ.get("QOSFLOW_NODE", "")


@qos_flow(name="infra-agent-lost")
def agent_lost(marker: str, secs: float = 6.0) -> str:
    return long_stage.submit(marker, secs).result()


@qos_task(gpus=0, cpu_cores=1, expected_duration=2, retries=0)
def bad_input(x: int) -> int:
    raise ValueError(f"bad input {x}: a user error, not retried blindly")


@qos_flow(name="infra-user-error")
def user_error() -> int:
    return bad_input.submit(7).result()


@qos_task(gpus=2, cpu_cores=1, expected_duration=8)
def gang(marker: str, name: str, secs: float) -> str:
    """Both GPUs of a 2-GPU host: a second gang waits in the QoS queue until the first ends."""
    _mark(marker, "start", name)
    time.sleep(secs)
    _mark(marker, "done", name)
    return name


@qos_flow(name="infra-two-gangs")
def two_gangs(marker: str, secs: float = 8.0) -> list:
    a = gang.submit(marker, "a", secs)
    b = gang.submit(marker, "b", secs)
    return [a.result(), b.result()]
