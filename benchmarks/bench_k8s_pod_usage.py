"""What one reading of the pods bound to the nodes costs (`qosflow.backends.k8s_usage.read_foreign_usage`: one LIST of pods
across namespaces, the JSON parsed, requests summed per node), at NODES nodes and PODS pods, on qosflow's API emulator
(EMULATED: the emulator's list and its HTTP, on this host; a real API server answers from its watch cache, and its
pods carry more fields: managedFields, status conditions). Sizes side by side in one run (1,000 and 10,000 pods on
the same nodes): compare within the run. Writes docs/bench/k8s_pod_usage.md with --write.

    python benchmarks/bench_k8s_pod_usage.py [--nodes 1000] [--pods 1000,10000] [--repeats 5] [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine, md_table, write_section  # noqa: E402

from qosflow.backends.k8s_usage import foreign_usage, read_foreign_usage  # noqa: E402
from qosflow.backends.kubernetes import KubernetesBackend  # noqa: E402
from qosflow.k8s_emulator import EmulatorServer, gpu_node  # noqa: E402


def pod(i: int, node: str) -> dict:
    kind = i % 10
    labels = {"app": f"app-{i % 50}", "pod-template-hash": "5d8f7c9b6"}
    res = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
    if kind == 0:
        res = {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1"}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"pod-{i}", "namespace": f"ns-{i % 20}", "labels": labels,
                         "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-27T10:00:00Z"}},
            "spec": {"nodeName": node, "containers": [
                {"name": "main", "image": "example.com/team/app:1.2.3", "resources": res,
                 "env": [{"name": f"VAR_{k}", "value": "x" * 20} for k in range(5)],
                 "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "initContainers": [{"name": "init", "image": "busybox:1.36", "resources": {"requests": {"cpu": "50m"}}}],
                "volumes": [{"name": "data", "emptyDir": {}}], "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
            "status": {"phase": "Running" if i % 7 else "Succeeded", "podIP": "10.0.0.1", "qosClass": "Burstable",
                       "conditions": [{"type": t, "status": "True"} for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")]}}


def measure(nodes: int, pods: int, repeats: int) -> dict:
    """One emulator of `nodes` nodes holding `pods` pods: `repeats` readings (`read_foreign_usage`), then the worker's
    own part of one (json.loads, summing) timed apart."""
    with EmulatorServer([gpu_node(f"gpu-{i:04d}", 8) for i in range(nodes)], tick_s=30.0) as emu:
        store = emu.cluster.store
        for i in range(pods):
            p = pod(i, f"gpu-{i % nodes:04d}")
            store.create("pods", p["metadata"]["namespace"], p)
        be = KubernetesBackend(namespace="default", api_client=emu.api_client(), watch_nodes=False)
        be.pod_usage_every_s = 0.0  # (every call a reading)
        times, usage = [], {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            usage = read_foreign_usage(be)
            times.append(time.perf_counter() - t0)
        resp = be.core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed",
                                                   _preload_content=False)
        size = len(resp.data)
        t0 = time.perf_counter()
        items = json.loads(resp.data)["items"]
        t_parse = time.perf_counter() - t0
        t0 = time.perf_counter()
        foreign_usage(items, gpu_resource="nvidia.com/gpu", shared_resource="nvidia.com/gpu.shared", namespace="default", cluster_name="k")
        t_sum = time.perf_counter() - t0
    return {"nodes": nodes, "pods": pods, "listed": len(items), "mib": size / 2**20, "median_ms": statistics.median(times) * 1000,
            "min_ms": min(times) * 1000, "max_ms": max(times) * 1000, "parse_ms": t_parse * 1000, "sum_ms": t_sum * 1000,
            "nodes_used": len(usage)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", default="1000,10000", help="pod counts, comma-separated, measured one after the other")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="write docs/bench/k8s_pod_usage.md")
    a = ap.parse_args()
    t0 = time.monotonic()
    runs = [measure(a.nodes, int(n), a.repeats) for n in a.pods.split(",")]
    rows = [[r["pods"], r["listed"], f"{r['mib']:.1f}", f"{r['median_ms']:.0f} ms", f"{r['min_ms']:.0f} / {r['max_ms']:.0f} ms",
             f"{r['parse_ms']:.0f} ms", f"{r['sum_ms']:.0f} ms", f"{r['median_ms'] / 5000 * 100:.1f} %"] for r in runs]
    table = md_table(["pods", "bound, not ended", "MiB of JSON", "one reading (median)", "min / max", "json.loads",
                      "summing", "wall time of readings per 5 s (emulator included)"], rows)
    big, small = runs[-1], runs[0]
    md = f"""# Kubernetes: reading the pods that are not qosflow's ({a.nodes} nodes)

- machine: {machine()}
- command: `python benchmarks/bench_k8s_pod_usage.py --nodes {a.nodes} --pods {a.pods} --repeats {a.repeats} --write` ({time.monotonic() - t0:.0f} s)
- EMULATED: qosflow's Kubernetes API emulator through the official client (its LIST and HTTP on this host), not a
  cluster; a real API server answers from its watch cache, and its pods are larger (managedFields), which multiplies
  the bytes. One reading: a LIST of the pods bound to a node and not ended, in all namespaces (JSON, not the client's
  models), and the requests summed per node (`qosflow.backends.k8s_usage.read_foreign_usage`); the worker reads them at
  its heartbeat, at most every 5 s (`POD_READ_S`). Pod counts measured one after the other in this run.

{table}

A reading at {big['pods']} pods costs {big['median_ms'] / small['median_ms']:.1f} x one at {small['pods']} pods in this run.
"""
    print(md)
    if a.write:
        print("wrote", write_section("k8s_pod_usage", md))


if __name__ == "__main__":
    main()
