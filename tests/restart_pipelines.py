"""A deployed pipeline for tests/test_worker_restart.py (importable by the pipeline process the worker starts,
`restart_pipelines.deployed`, and by the stage processes the agent starts). The pipeline and its stages append
JSON lines to a marker file: {"event": "start"|"done", "stage", "pid", "t"}; the pipeline's own are stage "pipeline"."""

from __future__ import annotations

import json
import os
import time

from qosflow.prefect.tasks import qos_flow, qos_task


def _mark(marker: str, event: str, stage: str) -> None:
    with open(marker, "a") as f:
        f.write(json.dumps({"event": event, "stage": stage, "pid": os.getpid(), "attempt": os.environ.get("QOSFLOW_STAGE_ID"),
                            "t": time.time()}) + "\n")


@qos_task(gpus=1, cpu_cores=1, expected_duration=5)
def step(marker: str, name: str, secs: float) -> str:
    _mark(marker, "start", name)
    time.sleep(secs)
    _mark(marker, "done", name)
    return name


@qos_flow(name="restart-deployed")
def deployed(marker: str, secs: float = 10.0) -> list:
    _mark(marker, "start", "pipeline")
    out = [step(marker, "a", secs), step(marker, "b", 1.0)]
    _mark(marker, "done", "pipeline")
    return out
