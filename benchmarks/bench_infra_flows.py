"""Stage functions for benchmarks/bench_infra.py's worker measurements (imported by the stage processes)."""

from __future__ import annotations

import json
import os
import time

from qosflow.prefect.tasks import qos_flow, qos_task


@qos_task(gpus=1, cpu_cores=1, expected_duration=5)
def bench_stage(marker: str, i: int, secs: float, barrier: int = 0) -> str:
    t0 = time.time()
    with open(marker, "a") as f:
        f.write(json.dumps({"stage": i, "node": os.environ.get("QOSFLOW_NODE"), "attempt": os.environ.get("QOSFLOW_STAGE_ID"), "t": t0}) + "\n")
    if barrier:  # wait (up to 120 s) until `barrier` stages run, so that they all overlap
        end = time.time() + 120
        while time.time() < end:
            with open(marker) as f:
                if sum(1 for _ in f) >= barrier:
                    break
            time.sleep(0.05)
    time.sleep(secs)
    return os.environ.get("QOSFLOW_NODE", "")


@qos_flow(name="bench-infra-worker")
def bench_pipeline(marker: str, n: int, secs: float, barrier: int = 0) -> list:
    futs = [bench_stage.submit(marker, i, secs, barrier) for i in range(n)]
    return [f.result() for f in futs]
