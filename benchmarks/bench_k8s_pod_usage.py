"""What one reading of the pods bound to the nodes costs, the LIST reading (`qosflow.backends.k8s_usage.read_foreign_usage`:
one LIST of pods across namespaces, the JSON parsed, requests summed per node) against the pod informer's
(`k8s_usage.PodInformer`, `watch_pods`: the view its watch keeps), and what the informer's thread spends following a
churn of pod changes (creations, resizes, pods ending, deletions at CHURN a second), at NODES nodes and PODS pods, on
qosflow's API emulator (EMULATED: the emulator's list, watch and HTTP, on this host; a real API server answers from its
watch cache, and its pods carry more fields: managedFields, status conditions). Sizes and both readings side by side
in one run: compare within the run. Writes docs/bench/k8s_pod_usage.md with --write.

    python benchmarks/bench_k8s_pod_usage.py [--nodes 1000] [--pods 1000,10000] [--repeats 5] [--churn 100] [--churn-s 5] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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


def thread_cpu_s(t: threading.Thread) -> float:
    """CPU seconds a running thread has used (Linux: its own clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def churn(be: KubernetesBackend, nodes: int, pods: int, rate: float, seconds: float) -> dict:
    """`rate` pod changes a second for `seconds` through the API (a quarter each: a pod created, a pod's requests changed,
    a pod ended (Succeeded), a pod deleted), while the informer follows; its thread's CPU over that time, how many events
    it took, and how long after the last change its view equals a fresh LIST reading."""
    core = be.core
    inf = be._pod_informer
    ops = itertools.cycle(("create", "resize", "end", "delete"))
    fresh_i = itertools.count(pods)
    victims = (i for i in range(pods) if i % 7)  # (pods of the initial set, Running ones)
    events0, cpu0 = be.stats["pod_events"], thread_cpu_s(inf.thread)

    def change(op: str, i: int) -> None:
        if op == "create":
            p = pod(i, f"gpu-{i % nodes:04d}")
            p["status"]["phase"] = "Running"
            core.create_namespaced_pod(p["metadata"]["namespace"], p)
            return
        name, ns = f"pod-{i}", f"ns-{i % 20}"
        if op == "resize":
            core.patch_namespaced_pod(name, ns, {"spec": {"containers": [dict(pod(i, "")["spec"]["containers"][0],
                                                                               resources={"requests": {"cpu": "2", "memory": "1Gi"}})]}})
        elif op == "end":
            core.patch_namespaced_pod_status(name, ns, {"status": {"phase": "Succeeded"}})
        else:
            core.delete_namespaced_pod(name, ns)

    # (several clients at once: one request to the emulator takes ~45 ms here, whoever sends it)
    pool = ThreadPoolExecutor(16)
    futures = []
    t0 = time.perf_counter()
    n = 0
    while (now := time.perf_counter() - t0) < seconds:
        if n > now * rate:
            time.sleep(min(0.005, n / rate - now))
            continue
        op = next(ops)
        futures.append(pool.submit(change, op, next(fresh_i) if op == "create" else next(victims)))
        n += 1
    for f in futures:
        f.result()
    pool.shutdown()
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    want = {k: v.amounts() for k, v in read_fresh(be).items()}
    while {k: v.amounts() for k, v in (inf.usage() or {}).items()} != want:
        if time.perf_counter() - t1 > 30:
            raise SystemExit("the informer's view never matched the LIST reading after the churn")
        time.sleep(0.002)
    caught_up = time.perf_counter() - t1
    return {"changes": n, "rate": n / wall, "events": be.stats["pod_events"] - events0,
            "cpu_s": thread_cpu_s(inf.thread) - cpu0, "wall_s": wall, "caught_up_ms": caught_up * 1000}


def read_fresh(be: KubernetesBackend) -> dict:
    from qosflow.backends.k8s_usage import list_bound_pods

    return foreign_usage(list_bound_pods(be), gpu_resource=be.gpu_resource, shared_resource=be.shared_resource,
                         namespace=be.namespace, cluster_name=be.cluster_name)


def measure(nodes: int, pods: int, repeats: int, rate: float = 100.0, churn_s: float = 5.0) -> dict:
    """One emulator of `nodes` nodes holding `pods` pods: `repeats` LIST readings (`read_foreign_usage`), the worker's
    own part of one (json.loads, summing) timed apart; then the pod informer on the same pods: its LIST, `repeats`
    readings of its view (after a change: the view rebuilt; unchanged: as it is), and a churn of `rate` changes/s."""
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
        parses, sums = [], []
        for _ in range(repeats):  # (medians: the emulator's threads share this process)
            t0 = time.perf_counter()
            items = json.loads(resp.data)["items"]
            parses.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            foreign_usage(items, gpu_resource="nvidia.com/gpu", shared_resource="nvidia.com/gpu.shared", namespace="default", cluster_name="k")
            sums.append(time.perf_counter() - t0)
        t_parse, t_sum = statistics.median(parses), statistics.median(sums)
        # the informer, on the same pods
        be.watch_pods = True
        inf = be._pod_informer
        asyncio.run(be.foreign_pod_usage())  # (a LIST reading; the informer starts)
        t0 = time.perf_counter()
        while not inf.synced:
            time.sleep(0.005)
        t_sync = time.perf_counter() - t0
        assert {k: v.amounts() for k, v in inf.usage().items()} == {k: v.amounts() for k, v in usage.items()}
        rebuilt, cached = [], []
        lists = be.stats["pod_lists"]
        for _ in range(max(repeats, 20)):
            with inf.lock:
                inf.sums._view = None  # (as after an event)
            t0 = time.perf_counter()
            inf.usage()
            rebuilt.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            inf.usage()
            cached.append(time.perf_counter() - t0)
        asyncio.run(be.foreign_pod_usage())  # (through the backend as the heartbeat reads it: served from the view)
        assert be.stats["pod_lists"] == lists
        ch = churn(be, nodes, pods, rate, churn_s)
        assert be.stats["pod_lists"] == lists, "the informer listed again during the churn"
        asyncio.run(be.aclose())
    return {"nodes": nodes, "pods": pods, "listed": len(items), "mib": size / 2**20, "median_ms": statistics.median(times) * 1000,
            "min_ms": min(times) * 1000, "max_ms": max(times) * 1000, "parse_ms": t_parse * 1000, "sum_ms": t_sum * 1000,
            "nodes_used": len(usage), "sync_ms": t_sync * 1000, "view_rebuilt_ms": statistics.median(rebuilt) * 1000,
            "view_ms": statistics.median(cached) * 1000, **{f"churn_{k}": v for k, v in ch.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", default="1000,10000", help="pod counts, comma-separated, measured one after the other")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--churn", type=float, default=100.0, help="pod changes a second while the informer follows")
    ap.add_argument("--churn-s", type=float, default=5.0, help="seconds of churn")
    ap.add_argument("--write", action="store_true", help="write docs/bench/k8s_pod_usage.md")
    a = ap.parse_args()
    t0 = time.monotonic()
    runs = [measure(a.nodes, int(n), a.repeats, a.churn, a.churn_s) for n in a.pods.split(",")]
    rows = [[r["pods"], r["listed"], f"{r['mib']:.1f}", f"{r['median_ms']:.0f} ms", f"{r['min_ms']:.0f} / {r['max_ms']:.0f} ms",
             f"{r['parse_ms']:.0f} ms", f"{r['sum_ms']:.0f} ms", f"{r['median_ms'] / 5000 * 100:.1f} %"] for r in runs]
    table = md_table(["pods", "bound, not ended", "MiB of JSON", "one reading (median)", "min / max", "json.loads",
                      "summing", "wall time of readings per 5 s (emulator included)"], rows)
    big, small = runs[-1], runs[0]
    rows2 = [[r["pods"], f"{r['median_ms']:.0f} ms", f"{r['parse_ms'] + r['sum_ms']:.0f} ms", f"{r['view_rebuilt_ms']:.2f} ms",
              f"{r['view_ms'] * 1000:.1f} µs", f"{r['sync_ms']:.0f} ms"] for r in runs]
    table2 = md_table(["pods", "LIST reading (median, wall)", "of which the worker's parse + sums", "informer reading, view rebuilt after a change",
                       "informer reading, no change", "informer's first LIST to synced"], rows2)
    rows3 = [[r["pods"], f"{r['churn_changes']} in {r['churn_wall_s']:.1f} s ({r['churn_rate']:.0f}/s)", r["churn_events"],
              f"{r['churn_cpu_s'] * 1000:.0f} ms ({r['churn_cpu_s'] / r['churn_wall_s'] * 100:.1f} % of a core)",
              f"{r['churn_cpu_s'] / max(r['churn_events'], 1) * 1e6:.0f} µs", f"{r['churn_caught_up_ms']:.0f} ms"] for r in runs]
    table3 = md_table(["pods", "changes (through the API)", "events taken", "informer thread CPU", "per event",
                       "caught up after the last change (LIST included)"], rows3)
    md = f"""# Kubernetes: reading the pods that are not qosflow's ({a.nodes} nodes)

- machine: {machine()}
- command: `python benchmarks/bench_k8s_pod_usage.py --nodes {a.nodes} --pods {a.pods} --repeats {a.repeats} --churn {a.churn:g} --churn-s {a.churn_s:g} --write` ({time.monotonic() - t0:.0f} s)
- EMULATED: qosflow's Kubernetes API emulator through the official client (its LIST and HTTP on this host), not a
  cluster; a real API server answers from its watch cache, and its pods are larger (managedFields), which multiplies
  the bytes. One reading: a LIST of the pods bound to a node and not ended, in all namespaces (JSON, not the client's
  models), and the requests summed per node (`qosflow.backends.k8s_usage.read_foreign_usage`); the worker reads them at
  its heartbeat, at most every 5 s (`POD_READ_S`). Pod counts measured one after the other in this run.

{table}

A reading at {big['pods']} pods costs {big['median_ms'] / small['median_ms']:.1f} x one at {small['pods']} pods in this run.

## The LIST reading against the pod informer's (`watch_pods`, the default)

The informer (`qosflow.backends.k8s_usage.PodInformer`) LISTs once, then WATCHes (same field selector, bookmarks) and
keeps per node the sum of the counted pods' requests, changed at each event; a heartbeat's reading is its view (rebuilt
as `NodePodUsage`s after a change, else as it is): no request, no parse. Same emulator and pods as the rows above, one
after the other in this run; the informer's reading is `PodInformer.usage()` (median of {max(a.repeats, 20)}), what
`foreign_pod_usage` returns without a thread or a request while the watch follows.

{table2}

A churn of {a.churn:g} pod changes a second for {a.churn_s:g} s (a quarter each: created, requests changed, ended as
Succeeded, deleted; each through the API, as their owners would), while the informer follows: what its thread spends
(its own CPU clock: reading the stream, json.loads of each event, the requests summed again), and how long after the
last change its view equals a LIST's reading (an upper bound: that LIST is timed in it). No LIST by the informer
during the churn.

{table3}

At {big['pods']} pods the LIST reading takes {big['median_ms']:.0f} ms of wall time every {5:g} s (POD_READ_S), of which
{big['parse_ms'] + big['sum_ms']:.0f} ms of the worker's CPU; the informer's reading {big['view_rebuilt_ms']:.2f} ms after a change,
and following {big['churn_rate']:.0f} changes/s costs its thread {big['churn_cpu_s'] / big['churn_wall_s'] * 100:.1f} % of a core.
"""
    print(md)
    if a.write:
        print("wrote", write_section("k8s_pod_usage", md))


if __name__ == "__main__":
    main()
