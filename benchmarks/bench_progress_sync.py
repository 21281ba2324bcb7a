"""What copying running stages' progress from agent hosts costs the worker (`AgentBackend.sync_progress`).

    QOSFLOW_SHARED_DATA=... python benchmarks/bench_progress_sync.py [--stages 64] [--rounds 20]

Two real `qosflow agent start` processes on 127.0.0.1; `--stages` stages split between them, each a shell
loop appending a progress line (the JSON `qosflow.report_progress` writes) to its QOSFLOW_PROGRESS_FILE
every 0.1 s -- a stage reporting 10 steps a second. The worker side copies every stage's new lines once per
round, as its progress loop does every QOSFLOW_PROGRESS_SYNC_SECONDS (2 s), here every 0.5 s, in two ways
on alternate rounds of the same run: `sync_progress` (one POST /v1/progress per host for all its stages)
and, for reference, one GET /v1/stages/{id}/progress per stage. Measured per round: wall time and the
CPU time of this (worker) process; then again after the stages stopped (nothing new to copy).
Prints a Markdown paragraph and table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import logging  # noqa: E402

from qosflow.agent.testing import AgentProcess  # noqa: E402
from qosflow.backends.agent import AgentBackend, AgentHost  # noqa: E402
from qosflow.backends.base import LaunchSpec  # noqa: E402
from qosflow.core.placement import Placement  # noqa: E402

logging.getLogger("qosflow.backends.agent").setLevel(logging.ERROR)  # the agents' --fence-after advice
TOKEN = "bench-progress-token"
LOOP = ('i=0; while [ $i -lt 100000 ]; do i=$((i+1)); '
        'echo "{\\"t\\":$(date +%s.%N),\\"step\\":$i,\\"total\\":100000,\\"pid\\":$$}" >> "$QOSFLOW_PROGRESS_FILE"; sleep 0.1; done')


async def per_stage(be: AgentBackend, handles: list) -> None:
    """The reference: one request per stage (GET /v1/stages/{id}/progress), as the first version did."""

    async def one(h) -> None:
        part = h.ref["parts"][0]
        host = be.state[part["host"]]
        r = await be._client(host).get(f"{host.url}/v1/stages/{part['stage_id']}/progress", params={"offset": be._progress.size(h.stage_id)})
        be._progress.append(h.stage_id, r.content)

    await asyncio.gather(*(one(h) for h in handles))


async def measure(n_stages: int, rounds: int, every_s: float) -> dict:
    """Rounds alternate between the two ways of copying (same stages, same run), first while the stages
    report, then after they stopped (nothing new to copy)."""
    with AgentProcess("prog-a", TOKEN, virtual_gpus=8) as a, AgentProcess("prog-b", TOKEN, virtual_gpus=8) as b:
        be = AgentBackend([AgentHost(a.name, a.url), AgentHost(b.name, b.url)], TOKEN, heartbeat_s=2.0)
        try:
            cluster = await be.inventory()
            handles = []
            for i in range(n_stages):
                node = i % 2
                p = Placement(f"s{i}", ((node, (i // 2) % 8),), ((node, 0.1),))
                handles.append(await be.launch(LaunchSpec(f"s{i}", ["sh", "-c", LOOP], p, cluster)))
            await asyncio.sleep(1.0)
            await be.sync_progress(handles)  # the first copy holds what accumulated at start-up
            ways = {"batched": be.sync_progress, "per stage": lambda hs: per_stage(be, hs)}

            async def rounds_of() -> dict:
                out = {k: ([], [], 0) for k in ways}
                for i in range(2 * rounds):
                    k = list(ways)[i % 2]
                    await asyncio.sleep(every_s)
                    size0 = sum(be._progress.size(h.stage_id) for h in handles)
                    w0, c0 = time.perf_counter(), time.process_time()
                    await ways[k](handles)
                    walls, cpus, copied = out[k]
                    walls.append(time.perf_counter() - w0)
                    cpus.append(time.process_time() - c0)
                    out[k] = (walls, cpus, copied + sum(be._progress.size(h.stage_id) for h in handles) - size0)
                return out

            busy = await rounds_of()
            for h in handles:
                await be.kill(h, reason="benchmark done", grace=0)
            await be.sync_progress(handles)
            idle = await rounds_of()
            return {"busy": busy, "idle": idle}
        finally:
            await be.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between two copies (the worker: 2)")
    a = ap.parse_args()
    r = asyncio.run(measure(a.stages, a.rounds, a.every))
    rows = []
    for phase in ("busy", "idle"):
        for way, (walls, cpus, copied) in r[phase].items():
            rows.append((phase, way, 1000 * statistics.median(walls), 1000 * max(walls), 1000 * statistics.median(cpus), copied / max(1, len(walls))))
    cpu = {(ph, w): c for ph, w, _m, _x, c, _b in rows}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"Progress copies from agent hosts ({when}, {platform.node()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; `python benchmarks/bench_progress_sync.py --stages {a.stages} --rounds {a.rounds}`): "
          f"{a.stages} stages on two real agents, each reporting 10 steps a second; rounds every {a.every:g} s, "
          f"alternating between the two ways of copying.\n")
    print("| stages | copied | rounds | wall, median | wall, max | worker CPU, median | bytes copied per round |")
    print("|---|---|---|---|---|---|---|")
    for ph, w, wm, wx, cm, b in rows:
        label = "reporting" if ph == "busy" else "stopped (nothing new)"
        how = "one request per host (`sync_progress`)" if w == "batched" else "one request per stage"
        print(f"| {label} | {how} | {a.rounds} | {wm:.1f} ms | {wx:.1f} ms | {cm:.1f} ms | {b:.0f} |")
    print(f"\nWorker CPU per round, one request per stage / one per host: {cpu[('busy', 'per stage')] / cpu[('busy', 'batched')]:.1f} x "
          f"while the stages report, {cpu[('idle', 'per stage')] / cpu[('idle', 'batched')]:.1f} x with nothing new.")


if __name__ == "__main__":
    main()
