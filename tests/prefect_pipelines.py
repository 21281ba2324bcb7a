"""Stage functions for tests/test_prefect_e2e.py (importable by the stage processes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from qosflow.prefect.tasks import qos_flow, qos_task


def _seen() -> dict:
    import qosflow

    p = qosflow.placement()
    return {
        "t0": time.time(),
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "QOSFLOW_NODE", "QOSFLOW_VIRTUAL_GPUS", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")},
        "affinity": sorted(os.sched_getaffinity(0)),
        "placement": {"node": p.node, "gpus": list(p.gpus), "cpu_cores": p.cpu_cores, "cpuset": list(p.cpuset), "placed": p.placed},
    }


@qos_task(gpus=0, cpu_cores=1, expected_duration=5, priority="guaranteed")
def load(n: int) -> dict:
    s = _seen()
    data = list(range(n))
    s["t1"] = time.time()
    return {"data": data, "seen": [("load", s)]}


@qos_task(gpus=1, cpu_cores=2, expected_duration=5, shareable=True, gpu_mem_mb=1000)
def train(d: dict) -> dict:
    s = _seen()
    import qosflow

    for i in range(5):
        qosflow.report_progress(i + 1, 5)
    s["t1"] = time.time()
    return {"model": sum(d["data"]), "seen": d["seen"] + [("train", s)]}


@qos_task(gpus=1, cpu_cores=1, expected_duration=5)
def evaluate(m: dict) -> dict:
    s = _seen()
    s["t1"] = time.time()
    return {"score": m["model"], "seen": m["seen"] + [("evaluate", s)]}


@qos_flow(name="e2e-three-stage", deadline=300, priority="guaranteed", plan={"load": [], "train": ["load"], "evaluate": ["train"]})
def three_stage(n: int = 10) -> dict:
    return evaluate.submit(train.submit(load.submit(n))).result()


@qos_task(gpus=1, cpu_cores=1, expected_duration=5, retries=1, retry_delay_seconds=0)
def flaky(marker: str) -> str:
    path = Path(marker)
    if not path.exists():
        path.write_text("failed once")
        raise RuntimeError("flaky stage: first attempt fails on purpose")
    return "ok on retry"


@qos_task(gpus=0, cpu_cores=1, expected_duration=5, retries=0)
def broken() -> None:
    raise ValueError("broken stage: always fails")


@qos_task(gpus=0, cpu_cores=1, expected_duration=5)
def sibling(x: int) -> int:
    return x * 2


@qos_flow(name="e2e-failures")
def failures(marker: str) -> dict:
    a = flaky.submit(marker)
    b = broken.submit()
    c = sibling.submit(21)
    out = {"flaky": a.result(), "sibling": c.result()}
    b.result()  # raises: the pipeline fails, after the others completed
    return out


@qos_task(gpus=1, cpu_cores=1, expected_duration=60)
def sleeper(path: str) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)
