"""A stage that resumes at step 40 of 100 and reports its progress, for the backends' progress tests
(tests/test_agent.py, tests/test_k8s_backend.py): it reports steps 41-60, waits for a gate file, then
reports 61-100. `run_resumed_stage` launches it on a backend and copies its progress while it runs."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from qosflow.backends.base import LaunchSpec
from qosflow.core.placement import Placement
from qosflow.placement_api import read_progress, read_resumed


def code(gate: Path) -> str:
    return ("import os, time, qosflow\n"
            "print('training starts', flush=True)\n"
            "qosflow.report_resumed(40, 100)\n"
            "for s in range(41, 61): qosflow.report_progress(s, 100); time.sleep(0.01)\n"
            f"while not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
            "for s in range(61, 101): qosflow.report_progress(s, 100)\n"
            "print('done', flush=True)\n")


async def run_resumed_stage(be: Any, gate: Path, *, cores: float = 1.0, timeout: float = 30.0) -> dict[str, Any]:
    """Launch the stage as `prog-1`; copy its progress (`sync_progress`) until step 60 shows, open the gate,
    wait for its end and copy once more. What the copy said at each point, and the handle and exit."""
    cluster = await be.inventory()
    h = await be.launch(LaunchSpec("prog-1", [sys.executable, "-c", code(gate)], Placement("prog", ((0, 0),), ((0, cores),)), cluster))
    copy = be.progress_file("prog-1")
    deadline, mid = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        await be.sync_progress([h])
        mid = read_progress(copy)
        if mid and mid["step"] == 60:
            break
        await asyncio.sleep(0.05)
    resumed = read_resumed(copy)
    gate.write_text("")
    status = await be.wait(h)
    await be.sync_progress([h])
    return {"handle": h, "copy": copy, "mid": mid, "resumed": resumed, "status": status, "last": read_progress(copy),
            "lines": open(copy).read().splitlines()}
