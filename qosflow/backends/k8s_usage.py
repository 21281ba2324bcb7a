"""What the pods that are not qosflow's stages take on each node (docs/infrastructure.md, "Pods that are not qosflow's").

The worker's plan describes a Kubernetes node by its allocatable GPUs, cpu and memory and books qosflow's own stages
there; kube-scheduler counts every pod bound to the node: DaemonSets (the device plugin, monitoring), qosflow's own
pipeline-run pods (launched unplaced: kube-scheduler picked their node), other users' pods (a notebook holding a GPU).
A stage placed into room such a pod uses stayed Pending (Unschedulable) until `unschedulable_timeout_s`, then failed as
INFRA and ran again: GPU time and its deadline lost. Here the backend reads, with one LIST of the pods bound to a node
and not ended, what those pods request per node (`foreign_usage`), as kube-scheduler computes it (`pod_requests`); the
worker books it in its plan (`qosflow.prefect.foreign_pods`).

Not counted: qosflow's stage pods in the backend's namespace (the worker's plan books them already, through its own
stages and the pool's leases; a pipeline run's pod is counted, it is booked nowhere else) and this cluster's capacity
placeholders (deleted before the stage they stand for is launched).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

log = logging.getLogger("qosflow.backends.kubernetes")

#: a LIST of the pods bound to a node that have not ended (kube-scheduler counts the others: Pending bound, Running,
#: Unknown, terminating ones)
POD_FIELD_SELECTOR = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
LABEL_STAGE = "qosflow.dev/stage-id"
LABEL_ROLE = "qosflow.dev/role"
LABEL_CLUSTER = "qosflow.dev/cluster"
ROLE_PIPELINE = "pipeline"
ROLE_CAPACITY = "capacity-request"
#: the pods are read at most this often (seconds; at the heartbeat that comes after): at 10,000 pods a reading takes the
#: worker ~0.5 s of CPU (benchmarks/bench_k8s_pod_usage.py). A backend's `pod_usage_every_s` attribute overrides it
POD_READ_S = 5.0

_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_QUANTITY = re.compile(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)")


def quantity(q: Any) -> float:
    """A Kubernetes quantity ("250m", "512Mi", "1.5", "2e3", 4) in base units; unreadable (the API server refuses those): 0."""
    if isinstance(q, (int, float)):
        return float(q)
    m = _QUANTITY.fullmatch(str(q).strip())
    if not m or (m.group(2) and m.group(2) not in _SUFFIX):
        return 0.0
    return float(m.group(1)) * (_SUFFIX[m.group(2)] if m.group(2) else 1.0)


@dataclass(frozen=True)
class NodePodUsage:
    """What the counted pods bound to one node request together."""

    gpus: int = 0  # whole GPUs (gpu_resource), plus shared ones (the shared resource: which device is not said, one each)
    cpu: float = 0.0  # cores
    mem_mb: float = 0.0
    pods: int = 0
    names: tuple[str, ...] = ()  # (namespace/name of the first few, for messages)

    def amounts(self) -> tuple[int, float, float]:
        return self.gpus, round(self.cpu, 6), round(self.mem_mb, 3)


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)
    return d


def _container_requests(c: Mapping) -> dict[str, float]:
    """A container's requests; a resource with a limit and no request requests its limit (as the API server defaults it)."""
    res = c.get("resources") or {}
    merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    return {k: quantity(v) for k, v in merged.items()}


def pod_requests(pod: Mapping) -> dict[str, float]:
    """A pod's effective requests as kube-scheduler computes them: per resource, the larger of the sum over its
    containers and the largest of its init containers (a restartable init container, a sidecar, adds to both), plus
    the pod's overhead (RuntimeClass). `pod`: the API's JSON (camelCase)."""
    spec = pod.get("spec") or {}
    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        for k, v in _container_requests(c).items():
            total[k] = total.get(k, 0.0) + v
    init_max: dict[str, float] = {}
    sidecars: dict[str, float] = {}
    for c in spec.get("initContainers") or []:
        req = _container_requests(c)
        if c.get("restartPolicy") == "Always":  # a sidecar: runs with the containers and the later init containers
            for k, v in req.items():
                sidecars[k] = sidecars.get(k, 0.0) + v
            continue
        for k, v in req.items():
            init_max[k] = max(init_max.get(k, 0.0), v + sidecars.get(k, 0.0))
    for k, v in sidecars.items():
        total[k] = total.get(k, 0.0) + v
    out = dict(total)
    for k, v in init_max.items():
        out[k] = max(out.get(k, 0.0), v)
    for k, v in (spec.get("overhead") or {}).items():
        out[k] = out.get(k, 0.0) + quantity(v)
    return out


def counted(pod: Mapping, *, namespace: str, cluster_name: str) -> bool:
    """Whether a pod's requests are booked as another's: bound, not ended, not a stage pod of qosflow in `namespace`
    (a pipeline run's pod is counted), not a capacity placeholder of this cluster."""
    md = pod.get("metadata") or {}
    if not _get(pod, "spec", "nodeName") or _get(pod, "status", "phase") in ("Succeeded", "Failed"):
        return False
    labels = md.get("labels") or {}
    if md.get("namespace") == namespace:
        role = labels.get(LABEL_ROLE)
        if LABEL_STAGE in labels and role != ROLE_PIPELINE:
            return False
        if role == ROLE_CAPACITY and labels.get(LABEL_CLUSTER) == cluster_name:
            return False
    return True


def foreign_usage(pods: Iterable[Mapping], *, gpu_resource: str, shared_resource: str, namespace: str, cluster_name: str,
                  keep_names: int = 3) -> dict[str, NodePodUsage]:
    """Node name -> what the counted pods bound there request (`counted`, `pod_requests`); nodes with none left out."""
    acc: dict[str, list] = {}
    for pod in pods:
        if not counted(pod, namespace=namespace, cluster_name=cluster_name):
            continue
        req = pod_requests(pod)
        node = pod["spec"]["nodeName"]
        a = acc.setdefault(node, [0, 0.0, 0.0, 0, []])
        a[0] += int(math.ceil(req.get(gpu_resource, 0.0) - 1e-9)) + int(math.ceil(req.get(shared_resource, 0.0) - 1e-9))
        a[1] += req.get("cpu", 0.0)
        a[2] += req.get("memory", 0.0) / 2**20
        a[3] += 1
        if len(a[4]) < keep_names:
            md = pod.get("metadata") or {}
            a[4].append(f"{md.get('namespace', '')}/{md.get('name', '')}")
    return {n: NodePodUsage(g, c, m, k, tuple(names)) for n, (g, c, m, k, names) in acc.items() if g or c > 1e-9 or m > 1e-6}


def list_bound_pods(backend: Any) -> list[dict]:
    """One LIST of the pods bound to a node and not ended, in every namespace (the backend's own namespace alone if its
    account may not list pods cluster-wide: then other namespaces' pods are not seen, said once). JSON, not the client's
    models: at 10,000 pods the client's deserialization costs seconds."""
    from kubernetes.client.exceptions import ApiException

    if not getattr(backend, "_pods_namespaced_only", False):
        try:
            resp = backend._call(backend.core.list_pod_for_all_namespaces, field_selector=POD_FIELD_SELECTOR, _preload_content=False,
                                 _doing="list the pods bound to its nodes")
            return json.loads(resp.data).get("items") or []
        except ApiException as e:
            if e.status != 403:
                raise
            backend._pods_namespaced_only = True
            log.warning("Kubernetes cluster %r: the worker's account may not list pods in all namespaces (403): only the pods of "
                        "namespace %s are booked on their nodes; grant it list on pods cluster-wide so that other users' pods "
                        "and DaemonSets are too", backend.cluster_name, backend.namespace)
    resp = backend._call(backend.core.list_namespaced_pod, backend.namespace, field_selector=POD_FIELD_SELECTOR, _preload_content=False,
                         _doing="list the pods bound to its nodes")
    return json.loads(resp.data).get("items") or []


def read_foreign_usage(backend: Any) -> dict[str, NodePodUsage]:
    """`foreign_usage` of one LIST (blocking: call it in a thread); the last one's again if it is younger than
    `POD_READ_S` (the backend's `pod_usage_every_s`)."""
    every = float(getattr(backend, "pod_usage_every_s", POD_READ_S))
    last = getattr(backend, "_pod_usage_last", None)
    now = time.monotonic()
    if last is not None and now - last[0] < every:
        return last[1]
    pods = list_bound_pods(backend)
    backend.stats["pod_lists"] = backend.stats.get("pod_lists", 0) + 1
    usage = foreign_usage(pods, gpu_resource=backend.gpu_resource, shared_resource=backend.shared_resource,
                          namespace=backend.namespace, cluster_name=backend.cluster_name)
    backend._pod_usage_last = (now, usage)
    return usage
