"""What one reading of the pods bound to the nodes costs (`qosflow.backends.k8s_usage.read_foreign_usage`: one LIST of pods
across namespaces, the JSON parsed, requests summed per node), at NODES nodes and PODS pods, on qosflow's API emulator
(EMULATED: the emulator's list and its HTTP, on this host; a real API server answers from its watch cache, and its
pods carry more fields: managedFields, status conditions).

    python scripts/bench_k8s_pod_usage.py [NODES] [PODS] [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

from qosflow.backends.k8s_usage import read_foreign_usage
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.k8s_emulator import EmulatorServer, gpu_node


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


def main() -> None:
    nodes, pods, repeats = (int(a) for a in (sys.argv[1:] + ["1000", "10000", "5"][len(sys.argv) - 1:]))
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
        from qosflow.backends.k8s_usage import foreign_usage
        import json

        items = json.loads(resp.data)["items"]
        t_parse = time.perf_counter() - t0
        t0 = time.perf_counter()
        foreign_usage(items, gpu_resource="nvidia.com/gpu", shared_resource="nvidia.com/gpu.shared", namespace="default", cluster_name="k")
        t_sum = time.perf_counter() - t0
        print(f"{nodes} nodes, {pods} pods ({len(items)} bound and not ended, {size / 2**20:.1f} MiB of JSON): one reading "
              f"median {statistics.median(times) * 1000:.0f} ms (min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}) over {repeats}; "
              f"of which json.loads {t_parse * 1000:.0f} ms, summing {t_sum * 1000:.0f} ms; nodes with usage: {len(usage)}")


if __name__ == "__main__":
    main()
