"""The Kubernetes backend's node tracking at 1,000 nodes: API requests and bytes per minute, and the slowest
heartbeat, with a LIST per heartbeat (`watch_nodes=False`, the behaviour before 2026-11-27) against the node watch
(one LIST, then a WATCH with bookmarks). Writes docs/bench/k8s_nodes.md with --write.

    python benchmarks/bench_k8s_nodes.py [--seconds 60] [--nodes 1000] [--write]

EMULATED: qosflow's Kubernetes API emulator (real wire format, the official client), not a cluster. Per mode: a
heartbeat every 2 s (`healthy_nodes`), a reading every 60 s (`list_nodes`, the worker's cluster_reload_s) and
kubelets reporting node status every 5 minutes (1,000 nodes: about 3.3 status PATCHes a second, as with node leases'
nodeStatusReportFrequency). The traffic is counted by the emulator per verb and resource (`GET /emulator/state`);
the kubelets' PATCHes are left out. An emulated node object is smaller than a real one (about 0.8 KB against 5-15 KB),
so the LIST figures of a real cluster are larger; the request counts are not.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine, write_section  # noqa: E402


def _node_traffic(emu) -> dict:
    t = emu.state()["traffic"]
    return {k: dict(v) for k, v in t.items() if k.endswith(" nodes") and not k.startswith("PATCH")}


async def _run(emu, n: int, seconds: float, watch_nodes: bool) -> dict:
    from kubernetes import client

    from qosflow.backends.kubernetes import KubernetesBackend

    be = KubernetesBackend(api_client=emu.api_client(), watch_nodes=watch_nodes)
    await be.inventory()
    if watch_nodes:
        end = time.monotonic() + 60
        while not be._node_synced and time.monotonic() < end:
            await asyncio.sleep(0.1)
    stop = threading.Event()
    core = client.CoreV1Api(emu.api_client())
    rnd = random.Random(0)

    def kubelets() -> None:
        while not stop.wait(300.0 / n):
            name = f"gpu-{rnd.randrange(n):04d}"
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            core.patch_node_status(name, {"status": {"conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now}]}})

    th = threading.Thread(target=kubelets, daemon=True)
    th.start()
    before = _node_traffic(emu)
    t0 = time.monotonic()
    beats = reads = 0
    slow = 0.0
    next_read = t0
    try:
        while time.monotonic() - t0 < seconds:
            t = time.monotonic()
            healthy = await be.healthy_nodes()
            beats += 1
            if len(healthy) != n:
                raise RuntimeError(f"{len(healthy)} healthy nodes of {n}: the view is wrong")
            if t >= next_read:
                await be.list_nodes()
                reads += 1
                next_read += 60
            slow = max(slow, time.monotonic() - t)
            await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - t)))
        elapsed = time.monotonic() - t0
        after = _node_traffic(emu)
    finally:
        stop.set()
        th.join()
        await be.aclose()
    reqs = sum(v["requests"] - before.get(k, {}).get("requests", 0) for k, v in after.items())
    byts = sum(v["bytes"] - before.get(k, {}).get("bytes", 0) for k, v in after.items())
    return {"beats": beats, "reads": reads, "elapsed": elapsed, "slowest_ms": slow * 1000,
            "req_per_min": reqs * 60 / elapsed, "mb_per_min": byts * 60 / elapsed / 1e6,
            "detail": {k: {"requests": v["requests"] - before.get(k, {}).get("requests", 0)} for k, v in after.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long each mode runs (default 60)")
    ap.add_argument("--nodes", type=int, default=1000, help="nodes of the emulated cluster (default 1000)")
    ap.add_argument("--write", action="store_true", help="write docs/bench/k8s_nodes.md")
    a = ap.parse_args()
    import httpx

    from qosflow.k8s_emulator import EmulatorServer, gpu_node

    t0 = time.monotonic()
    with EmulatorServer([gpu_node(f"gpu-{i:04d}", 8) for i in range(a.nodes)], window=100000) as emu:
        size = len(httpx.get(f"{emu.url}/api/v1/nodes/gpu-0000").content)
        old = asyncio.run(_run(emu, a.nodes, a.seconds, False))
        new = asyncio.run(_run(emu, a.nodes, a.seconds, True))
    rows = [("a LIST per heartbeat (before)", old), ("node watch (now)", new)]
    table = ["| node tracking | heartbeats | readings | API requests / min | MB / min | slowest heartbeat |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, r in rows:
        table.append(f"| {label} | {r['beats']} | {r['reads']} | {r['req_per_min']:.1f} | {r['mb_per_min']:.3f} | {r['slowest_ms']:.0f} ms |")
    ratio = new["mb_per_min"] / old["mb_per_min"] if old["mb_per_min"] else float("nan")
    md = f"""# Kubernetes node tracking at {a.nodes} nodes

- machine: {machine()}
- command: `python benchmarks/bench_k8s_nodes.py --seconds {a.seconds:g} --nodes {a.nodes} --write` ({time.monotonic() - t0:.0f} s)
- EMULATED: qosflow's Kubernetes API emulator through the official client, not a cluster; an emulated node object is
  {size} bytes (a real one 5-15 KB: a real cluster's LIST bytes are larger, its request counts the same)
- per mode: a heartbeat every 2 s, a reading of the nodes every 60 s, kubelets patching node status every 5 min
  (left out of the counts); both modes in one run, one after the other

{chr(10).join(table)}

Node traffic with the watch: {ratio:.4f} x the bytes of a LIST per heartbeat. Requests by verb and resource
(before / now): {old['detail']} / {new['detail']}.
"""
    print(md)
    if a.write:
        print("wrote", write_section("k8s_nodes", md))


if __name__ == "__main__":
    main()
