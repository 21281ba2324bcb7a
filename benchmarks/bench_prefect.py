"""Prefect integration benchmarks (issue 5), written to docs/bench/prefect.md.

1. `@qos_task` overhead per call over a plain `@task`, both running locally in one flow (target <= 20 ms).
2. Placement latency: a placeable stage run starts within 1 s (median) of becoming ready, against
   Prefect's own process worker on the same machine, same server, same polling interval.
   "Ready" is the flow run's creation (the pipeline dispatched it). For both workers we measure
   created -> process launched (the qosflow worker's QoS queue and placement included) and
   created -> flow run Running (the engine in the new process reported in; adds Python start-up).

    python benchmarks/bench_prefect.py [--n 12] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import machine, md_table, write_section  # noqa: E402


def overhead(calls: int) -> dict:
    from prefect import flow, task

    from qosflow.prefect.tasks import qos_task

    def work(x):
        return x + 1

    plain = task(work, name="plain")
    qos = qos_task(work, name="qos", gpus=1, cpu_cores=2, expected_duration=1, priority="guaranteed")

    @flow(name="bench-overhead")
    def run(n: int):
        out = {}
        for label, t in (("plain", plain), ("qos", qos), ("plain2", plain), ("qos2", qos)):
            ts = []
            for i in range(n):
                t0 = time.perf_counter()
                t(i)
                ts.append(time.perf_counter() - t0)
            out[label] = ts
        return out

    r = run(calls)
    p = statistics.median(r["plain"] + r["plain2"])
    q = statistics.median(r["qos"] + r["qos2"])
    return {"plain_ms": p * 1e3, "qos_ms": q * 1e3, "overhead_ms": (q - p) * 1e3, "calls": calls}


def latency(n: int) -> dict:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PREFECT_WORKER_QUERY_SECONDS"] = "0.5"  # the process worker polls as often as qosflow's fast poll
    from qosflow.prefect.local import LocalServer

    home = tempfile.mkdtemp(prefix="qosflow-bench-")
    os.environ["QOSFLOW_HOME"] = os.path.join(home, "qosflow")
    srv = LocalServer(home, ui=False).start()
    srv.apply_env()
    try:
        return asyncio.run(_latency(n))
    finally:
        srv.stop()


async def _deploy(client, pool: str, job_variables: dict | None):
    flow_id = await client.create_flow_from_name("bench-noop")
    return await client.create_deployment(flow_id=flow_id, name=pool, work_pool_name=pool, entrypoint="bench_prefect_flows.noop", job_variables=job_variables or {})


async def _measure(client, dep_id, n: int, launched_of=None) -> list[dict]:
    """Create n runs one at a time; for each: when its pid appeared (polled every 50 ms), when it ran."""
    out = []
    for i in range(n):
        fr = await client.create_flow_run_from_deployment(dep_id)
        created = fr.created.timestamp()
        pid_seen = None
        while True:
            cur = await client.read_flow_run(fr.id)
            if pid_seen is None and cur.infrastructure_pid:
                pid_seen = time.time()
            if cur.state and cur.state.is_final():
                break
            await asyncio.sleep(0.05)
        run = cur.start_time.timestamp() if cur.start_time else None
        rec = {"ready_to_pid": (pid_seen or float("nan")) - created, "ready_to_running": (run - created) if run else float("nan"), "ok": cur.state.is_completed()}
        if launched_of is not None:
            for _ in range(100):
                t = launched_of(str(fr.id))
                if t is not None:
                    rec["ready_to_launch"] = t["launched"] - created
                    rec["ready_to_placed"] = t["placed"] - created
                    rec["queued_to_placed"] = t["placed"] - t["queued"]
                    break
                await asyncio.sleep(0.1)
        out.append(rec)
        await asyncio.sleep(0.3)
    return out


async def _latency(n: int) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    await setup_pool("bench-qos", cluster=BareMetalGPUCluster.virtual(2, 4, cpu_cores=16), policy=QoSPolicy(policy="qosflow"), stream_output=False)
    res = {}
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name="bench-process", type="process", base_job_template=ProcessWorker.get_default_base_job_template()))
        dep_q = await _deploy(client, "bench-qos", {"gpus": 1, "cpu_cores": 1, "expected_duration": 5, "priority": "guaranteed"})
        dep_p = await _deploy(client, "bench-process", {"stream_output": False})

        # qosflow worker (in a thread with its own loop)
        wt = WorkerThread("bench-qos").wait_ready(120)

        def launched_q(fid):
            for r in wt.worker.records:
                if r["flow_run_id"] == fid:
                    return r
            return None

        res["qosflow"] = await _measure(client, dep_q, n, launched_q)
        wt.stop()

        # Prefect's process worker, same machine/server/poll interval; "launched" = when it set the pid
        launched_p: dict[str, float] = {}
        stop = threading.Event()

        def run_process_worker():
            async def main():
                w = ProcessWorker(work_pool_name="bench-process", create_pool_if_not_found=False)
                task = asyncio.create_task(w.start(printer=lambda *a, **k: None))
                while not stop.is_set():
                    await asyncio.sleep(0.1)
                task.cancel()
            asyncio.run(main())

        th = threading.Thread(target=run_process_worker, daemon=True)
        th.start()
        await asyncio.sleep(3)

        async def watch_pid(fid):
            return None

        def launched_from_pid(fid):
            return launched_p.get(fid)

        out = await _measure(client, dep_p, n)
        res["process"] = out
        stop.set()
        th.join(30)
    return res


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def p90(xs):
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    t0 = time.time()
    load0 = os.getloadavg()[0]
    ov = overhead(a.calls)
    lat = latency(a.n)
    load1 = os.getloadavg()[0]
    q, p = lat["qosflow"], lat["process"]
    rows = [
        ["`@qos_task` call, local (median of %d)" % (2 * ov["calls"]), "<= 20 ms over `@task`", f"{ov['qos_ms']:.2f} ms vs {ov['plain_ms']:.2f} ms: **+{ov['overhead_ms']:.2f} ms**", "met" if ov["overhead_ms"] <= 20 else "NOT met"],
        ["ready -> process launched, qosflow worker (its own timestamps; median / p90)", "<= 1 s", f"{med([r.get('ready_to_launch', float('nan')) for r in q]):.2f} s / {p90([r.get('ready_to_launch', float('nan')) for r in q]):.2f} s", "met" if med([r.get('ready_to_launch', float('nan')) for r in q]) <= 1 else "NOT met"],
        ["  of which: in the QoS queue (worker has it -> placed)", "-", f"{med([r.get('queued_to_placed', float('nan')) for r in q]) * 1e3:.1f} ms / {p90([r.get('queued_to_placed', float('nan')) for r in q]) * 1e3:.1f} ms", ""],
        ["ready -> pid visible in the API, qosflow worker", "-", f"{med([r['ready_to_pid'] for r in q]):.2f} s / {p90([r['ready_to_pid'] for r in q]):.2f} s", "same method for both workers"],
        ["ready -> pid visible in the API, Prefect process worker (reference)", "-", f"{med([r['ready_to_pid'] for r in p]):.2f} s / {p90([r['ready_to_pid'] for r in p]):.2f} s", "pid polled every 50 ms"],
        ["ready -> flow run Running, qosflow worker", "-", f"{med([r['ready_to_running'] for r in q]):.2f} s / {p90([r['ready_to_running'] for r in q]):.2f} s", "includes Python + Prefect start-up"],
        ["ready -> flow run Running, Prefect process worker", "-", f"{med([r['ready_to_running'] for r in p]):.2f} s / {p90([r['ready_to_running'] for r in p]):.2f} s", ""],
    ]
    ratio = med([r['ready_to_running'] for r in q]) / med([r['ready_to_running'] for r in p])
    md = f"""# Prefect integration benchmarks (issue 5)

Machine: {machine()}.
Command: `python benchmarks/bench_prefect.py --n {a.n} --calls {a.calls}` ({time.time() - t0:.0f} s).
Load average (1 min) before/after: {load0:.2f} / {load1:.2f} on {os.cpu_count()} cores, shared with other developers' work.
No GPU: the qosflow pool's cluster is 2 hosts x 4 **virtual** GPUs; stages run for real on the CPU.

{md_table(["measure", "target", "result", ""], rows)}

qosflow / process worker (medians): ready -> pid visible **{med([r['ready_to_pid'] for r in q]) / med([r['ready_to_pid'] for r in p]):.2f}x**, ready -> Running **{ratio:.2f}x**. Runs completed: qosflow {sum(r['ok'] for r in q)}/{len(q)}, process {sum(r['ok'] for r in p)}/{len(p)}.

How it was measured:

* Overhead: one flow calls a plain `@task` and an equivalent `@qos_task` (gpus=1, no pool: the stage runs
  in-process) {ov['calls']} times each, interleaved twice; medians per call.
* Latency: one local Prefect server (SQLite); a trivial flow deployed on a `qosflow` pool (job variables gpus=1,
  cpu_cores=1, policy `qosflow`, cluster 2x4 virtual GPUs, so every run is placeable) and on a `process` pool.
  Runs are created one at a time ({a.n} each). Both workers poll every 0.5 s (`PREFECT_WORKER_QUERY_SECONDS=0.5`
  for the process worker; the qosflow worker's own fast poll, `QOSFLOW_WORKER_POLL_SECONDS`, default 0.5 s).
  "Launched" is the worker's own timestamp for qosflow (after the QoS queue, the policy round and the placement);
  for the process worker it is when the run's `infrastructure_pid` appears (polled every 50 ms, so up to ~50 ms late).
"""
    path = write_section("prefect", md)
    print(md)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
