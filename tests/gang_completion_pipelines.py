"""Stage functions for tests/test_gang_completion.py (importable by the stage processes): 8-GPU gangs that run on two
4-GPU hosts, one rank per host, whose ranks end at different times or print."""

from __future__ import annotations

import json
import os
import sys
import time

from qosflow.prefect.tasks import qos_flow, qos_task


def _mark(marker: str, event: str, **more) -> None:
    import qosflow

    rank = os.environ.get("QOSFLOW_GANG_RANK", "")
    with open(marker, "a") as f:
        f.write(json.dumps({"event": event, "rank": rank, "node": qosflow.placement().node, "t": time.time(), **more}) + "\n")


def _slow_polls() -> None:
    """Rank 0: its engine's wait for the other ranks reads the run every 30 s instead of 0.5 s, so that it is still
    asleep when its gang is stopped (the SIGTERM path). (The wait's module runs as `__main__`: its globals are reached
    through the function it installed.)"""
    from prefect.flow_engine import FlowRunEngine

    FlowRunEngine.handle_success.__globals__["GANG_WAIT_POLL_S"] = 30.0


def _after_rank_0_returned(marker: str, timeout: float = 120.0) -> None:
    """Rank 1: wait until rank 0's function has returned (its `end` mark), so that rank 1's end comes `late` seconds
    after rank 0 is in its wait whatever the time each rank's start took (a loaded machine: rank 0's engine starts
    seconds after rank 1, and a rank 1 sleeping from its own start may end before rank 0 returned)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(marker) as f:
                if any(json.loads(x).get("event") == "end" and json.loads(x).get("rank") == "0" for x in f if x.strip()):
                    return
        except OSError:
            pass
        time.sleep(0.1)


@qos_task(gpus=8, gang=True, cpu_cores=1, expected_duration=3)
def ranks_end_apart(marker: str, late: float = 3.0, late_fails: bool = False, sigterm_path: bool = False,
                    late_killed: bool = False) -> str:
    """Rank 0 returns at once; rank 1 `late` seconds after rank 0 returned, raising if `late_fails` (or SIGKILLing
    itself if `late_killed`)."""
    rank = os.environ.get("QOSFLOW_GANG_RANK", "")
    _mark(marker, "start")
    if rank == "0":
        if sigterm_path:
            _slow_polls()
        _mark(marker, "end")
        return "rank 0"
    _after_rank_0_returned(marker)
    time.sleep(late)
    if late_killed:
        _mark(marker, "killed")
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if late_fails:
        _mark(marker, "raise")
        raise ValueError(f"rank {rank} failed late")
    _mark(marker, "end")
    return f"rank {rank}"


@qos_flow(name="gang-ranks-end-apart")
def ranks_end_apart_pipeline(marker: str, late: float = 3.0, late_fails: bool = False, sigterm_path: bool = False,
                             late_killed: bool = False) -> str:
    return ranks_end_apart(marker, late, late_fails, sigterm_path, late_killed)


@qos_task(gpus=8, gang=True, cpu_cores=1, expected_duration=3)
def ranks_print(marker: str, token: str) -> str:
    """Every rank prints to stdout and stderr, and starts a process that prints (its output is the rank's own)."""
    import subprocess

    rank = os.environ.get("QOSFLOW_GANG_RANK", "")
    _mark(marker, "start")
    print(f"hello from rank {rank} {token}")
    print(f"warning from rank {rank} {token}", file=sys.stderr)
    subprocess.run(["sh", "-c", f"echo child of rank {rank} {token}"], check=True)
    return f"rank {rank}"


@qos_flow(name="gang-ranks-print")
def ranks_print_pipeline(marker: str, token: str) -> str:
    return ranks_print(marker, token)


@qos_task(gpus=1, cpu_cores=1, expected_duration=2)
def one_host(marker: str) -> str:
    _mark(marker, "end", gang_rank_loaded="qosflow.prefect.gang_rank" in sys.modules or any(
        getattr(m, "__spec__", None) is not None and getattr(m.__spec__, "name", "") == "qosflow.prefect.gang_rank"
        for m in list(sys.modules.values())), size=os.environ.get("QOSFLOW_GANG_SIZE"))
    return "one host"


@qos_flow(name="gang-one-host")
def one_host_pipeline(marker: str) -> str:
    return one_host(marker)
