"""What the pods that are not qosflow's stages take on each node (docs/infrastructure.md, "Pods that are not qosflow's").

The worker's plan describes a Kubernetes node by its allocatable GPUs, cpu and memory and books qosflow's own stages
there; kube-scheduler counts every pod bound to the node: DaemonSets (the device plugin, monitoring), qosflow's own
pipeline-run pods (launched unplaced: kube-scheduler picked their node), other users' pods (a notebook holding a GPU).
A stage placed into room such a pod uses stayed Pending (Unschedulable) until `unschedulable_timeout_s`, then failed as
INFRA and ran again: GPU time and its deadline lost. Here the backend reads, with one LIST of the pods bound to a node
and not ended, what those pods request per node (`foreign_usage`), as kube-scheduler computes it (`pod_requests`); the
worker books it in its plan (`qosflow.prefect.foreign_pods`). A pod informer (`PodInformer`, the backend's `watch_pods`)
keeps the same sums from a WATCH, so that a reading is its view while the watch follows (no request, no parse).
A pod's part of a GPU (`gpu_use`: a slice of the NVIDIA shared resource, another qosflow pool's fractional stage, Alibaba
gpushare's GPU memory) is kept as that share, booked as a fraction of one GPU (`node_shares`; docs/infrastructure.md,
"Other pods' GPU shares"); where the part or the GPU is not known, a whole GPU, and the log says why.

Not counted: this pool's stage pods in the backend's namespace (the worker's plan books them already, through its own
stages and the pool's leases; a pipeline run's pod is counted, it is booked nowhere else, and so are the stage pods of
another qosflow pool, by their qosflow.dev/cluster label, or by their qosflow.dev/pool label when the two pools' clusters
have the same name) and the capacity placeholders this backend made (deleted
before the stage they stand for is launched; another worker's holds its room until that worker deletes it, and is counted
unless a stage may preempt it: `counted`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping

from qosflow.backends.kubernetes import (ANN_CAPACITY_OWNER, ANN_PLACEMENT, LABEL_CLUSTER, LABEL_ROLE, LABEL_STAGE, RBAC_MANIFEST,
                                         ROLE_CAPACITY, label_value, rbac_refusal, same_pool, stop_watch)
from qosflow.backends.kubernetes import quantity as _quantity
from qosflow.errors import SpecError

log = logging.getLogger("qosflow.backends.kubernetes")

#: a LIST of the pods bound to a node that have not ended (kube-scheduler counts the others: Pending bound, Running,
#: Unknown, terminating ones)
POD_FIELD_SELECTOR = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
ROLE_PIPELINE = "pipeline"
#: the pods are read at most this often (seconds; at the heartbeat that comes after): at 10,000 pods a reading takes the
#: worker ~0.5 s of CPU (benchmarks/bench_k8s_pod_usage.py). A backend's `pod_usage_every_s` attribute overrides it
POD_READ_S = 5.0
#: a cluster-wide LIST or a WATCH of the pods that RBAC refused (403) is tried again this long after (the backend's
#: `pod_rbac_retry_s`): an administrator who grants the missing rule should not have to restart the worker
POD_RBAC_RETRY_S = 600.0


def _rbac_retry_due(backend: Any, refused_at: float) -> bool:
    """Whether a pod read RBAC refused at `refused_at` (time.monotonic) is to be tried again now."""
    return time.monotonic() - refused_at >= float(getattr(backend, "pod_rbac_retry_s", POD_RBAC_RETRY_S))


def _namespaced_only(backend: Any) -> bool:
    """Whether the pods are read in the backend's namespace alone: its account was refused the cluster-wide LIST, and
    that was less than `pod_rbac_retry_s` ago."""
    return bool(getattr(backend, "_pods_namespaced_only", False)) and not _rbac_retry_due(
        backend, float(getattr(backend, "_pods_namespaced_at", 0.0)))

def quantity(q: Any) -> float:
    """A Kubernetes quantity ("250m", "512Mi", "1.5", "2e3", 4) in base units (`kubernetes.quantity`); unreadable (the
    API server refuses those, so another pod's cannot be): 0."""
    try:
        return _quantity(q)
    except SpecError:
        return 0.0


# ---------------------------------------------------------------------- a pod's part of a GPU (docs/infrastructure.md)
#: Alibaba's GPU sharing (AliyunContainerService gpushare-scheduler-extender and gpushare-device-plugin): a pod asks for
#: GPU memory (`aliyun.com/gpu-mem`, in the device plugin's unit, GiB by default); the scheduler extender, binding it,
#: annotates it with the device it chose (`ALIYUN_COM_GPU_MEM_IDX`), what the pod asked (`..._POD`) and that device's
#: whole memory (`..._DEV`), in the same unit: the pod takes POD/DEV of GPU IDX
GPUSHARE_RESOURCE = "aliyun.com/gpu-mem"
GPUSHARE_IDX = "ALIYUN_COM_GPU_MEM_IDX"
GPUSHARE_POD = "ALIYUN_COM_GPU_MEM_POD"
GPUSHARE_DEV = "ALIYUN_COM_GPU_MEM_DEV"
#: GPU feature discovery's node label: how many replicas (slices) of each GPU the NVIDIA device plugin's time-slicing or
#: MPS advertises (`sharing.timeSlicing.resources[].replicas`); a slice of the shared resource is 1/replicas of a GPU
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
#: a share whose device the pod does not say (the NVIDIA device plugin picks it and writes it nowhere): the plan picks
ANY_GPU = -1


@dataclass(frozen=True)
class GpuUse:
    """A pod's GPUs: `whole` GPUs; `shares`, (device, thousandths of a GPU) of a device the pod's convention names
    (`ANY_GPU`: not named); `slices` of the NVIDIA shared resource, whose fraction the node's `REPLICAS_LABEL` tells
    (`node_shares`); `note`: why some of `whole` was asked for as a share and is booked whole (its part not known)."""

    whole: int = 0
    shares: tuple[tuple[int, int], ...] = ()
    slices: int = 0
    note: str = ""


def _ceil(x: float) -> int:
    return int(math.ceil(x - 1e-9))


def _qosflow_share(pod: Mapping, k: int) -> tuple[tuple[int, int], ...] | None:
    """The shares of a qosflow stage pod (another pool's, counted) asking for `k` slices of the shared resource, as its
    placement annotation (`kubernetes.ANN_PLACEMENT`, the stage's QOSFLOW_PLACEMENT) says them: a fractional share
    (`gpu_milli` < 1000) of its GPU, or each GPU of a co-located pair, half; that plan's GPU index (on Kubernetes the
    device plugin picks the device: the index is a plan's, as this pool's own shares'). None: not such a pod."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANN_PLACEMENT)
    if not raw:
        return None
    try:
        plan = json.loads(raw)
        gpus = [int(g) for g in plan.get("gpus") or ()]
        milli = int(plan.get("gpu_milli", 1000))
    except (TypeError, ValueError, AttributeError, OverflowError):  # (an annotation is anyone's: 1e999 is JSON's infinity)
        return None
    if len(gpus) != k or not 0 < milli <= 1000:
        return None
    if milli < 1000:
        return tuple((g, milli) for g in gpus)
    if plan.get("colocated_with"):
        return tuple((g, 500) for g in gpus)
    return None


def _gpushare(pod: Mapping, mem: float, key: str) -> GpuUse:
    """A pod asking for `aliyun.com/gpu-mem` (`mem`): POD/DEV of GPU IDX (its annotations, the gpushare scheduler
    extender's); a whole GPU when they are missing (not bound by the extender) or unreadable, with the reason."""
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    try:
        idx = int(str(ann[GPUSHARE_IDX]).strip())
        dev = float(ann[GPUSHARE_DEV])
        asked = float(ann.get(GPUSHARE_POD) or mem)
        if idx < 0 or not (0 < dev < math.inf) or not (0 < asked < math.inf):  # ("nan", "inf": a ValueError reading every pod)
            raise ValueError
    except (KeyError, TypeError, ValueError):
        return GpuUse(whole=1, note=f"{key}: {GPUSHARE_RESOURCE} {mem:g} without readable {GPUSHARE_IDX}/{GPUSHARE_DEV} annotations "
                                    "(the gpushare scheduler extender writes them when it binds the pod): which GPU and what "
                                    "part of it are not known, booked as a whole GPU")
    milli = min(1000, max(1, _ceil(1000.0 * asked / dev)))
    return GpuUse(whole=1) if milli >= 1000 else GpuUse(shares=((idx, milli),))


def gpu_use(pod: Mapping, req: Mapping[str, float], gpu_resource: str, shared_resource: str) -> GpuUse:
    """What GPUs a counted pod takes (`req`: its `pod_requests`): whole ones of `gpu_resource`; of the shared resource
    (the NVIDIA device plugin's time-slicing or MPS, renamed), a qosflow stage's shares as its placement says them,
    else slices (1/replicas of a GPU each, the device not said); Alibaba gpushare's memory as the part of the device its
    annotations name (`_gpushare`)."""
    md = pod.get("metadata") or {}
    whole = _ceil(req.get(gpu_resource, 0.0))
    shares: tuple[tuple[int, int], ...] = ()
    slices = 0
    note = ""
    k = _ceil(req.get(shared_resource, 0.0))
    if k > 0:
        mine = _qosflow_share(pod, k)
        if mine is not None:
            shares += mine
        else:
            slices = k
    mem = req.get(GPUSHARE_RESOURCE, 0.0)
    if mem > 0 and gpu_resource != GPUSHARE_RESOURCE:
        g = _gpushare(pod, mem, f"{md.get('namespace', '')}/{md.get('name', '')}")
        whole += g.whole
        shares += g.shares
        note = g.note
    return GpuUse(whole, tuple(sorted(shares)), slices, note)


def slice_milli(labels: Mapping[str, str] | None) -> int | None:
    """The part of a GPU (thousandths) one slice of the shared resource is on a node with these labels: 1000 // replicas
    (at least 1: a label over 1000 made slices of 0, which the plan refused) for the node's `REPLICAS_LABEL` of 2 or
    more; None where it is missing or unreadable (the part is not known)."""
    try:
        replicas = int(str((labels or {}).get(REPLICAS_LABEL)).strip())
    except (TypeError, ValueError):
        return None
    return max(1, 1000 // replicas) if replicas >= 2 else None


def node_shares(u: "NodePodUsage", labels: Mapping[str, str] | None) -> tuple[int, tuple[tuple[int, int], ...], str]:
    """The GPUs to book on a node for `u`: (whole GPUs, shares (device or ANY_GPU, milli), why some slices are booked
    whole). Its slices of the shared resource are 1000 // replicas each (at least 1: the node's `REPLICAS_LABEL`, GPU
    feature discovery's), on a device the plan picks (the device plugin says none); without that label (or an unreadable
    one) a slice's part is not known: a whole GPU each, as before. (A pod's own reason, `u.notes`, is logged with the pod,
    `PodSums`, not here: the node's line repeated it, once more at each change of the pods there.)"""
    whole, shares, why = u.gpus, u.shares, ""
    if u.slices:
        raw = (labels or {}).get(REPLICAS_LABEL)
        milli = slice_milli(labels)
        if milli is not None:
            shares = tuple(sorted(shares + ((ANY_GPU, milli),) * u.slices))
        else:
            whole += u.slices
            said = (f"its {REPLICAS_LABEL} label is {raw!r}" if raw is not None else f"it has no {REPLICAS_LABEL} label "
                    "(GPU feature discovery writes it)")
            why = (f"{u.slices} slice(s) of the shared GPU resource booked as whole GPUs: the part of a GPU a slice is, is not "
                   f"known ({said})")
    return whole, shares, why


@dataclass(frozen=True)
class NodePodUsage:
    """What the counted pods bound to one node request together."""

    gpus: int = 0  # whole GPUs (gpu_resource; and a GPU share whose part is not known: `notes`)
    cpu: float = 0.0  # cores
    mem_mb: float = 0.0
    pods: int = 0
    names: tuple[str, ...] = ()  # (namespace/name of the first few, for messages)
    #: GPU shares: (device the pod's convention names, or ANY_GPU; thousandths of a GPU), sorted (`gpu_use`)
    shares: tuple[tuple[int, int], ...] = ()
    #: slices of the NVIDIA shared resource whose device and part the pods do not say (the node's replicas tell the part)
    slices: int = 0
    #: why a share was booked as a whole GPU (the first few)
    notes: tuple[str, ...] = ()

    def amounts(self) -> tuple[int, float, float]:
        return self.gpus, round(self.cpu, 6), round(self.mem_mb, 3)

    def gpu_amounts(self) -> tuple[int, tuple[tuple[int, int], ...], int]:
        return self.gpus, self.shares, self.slices


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


@functools.lru_cache(maxsize=16)
def _cluster_label(cluster_name: str) -> str:
    """The cluster's name as its pods' qosflow.dev/cluster label holds it (once per name: a LIST counts 10,000 pods)."""
    return label_value(cluster_name)


def preemptible(pod: Mapping, stage_priority: int | None = 0) -> bool:
    """Whether kube-scheduler would preempt `pod` to bind one of this pool's stage pods: its priority (`spec.priority`,
    which the API server's Priority admission sets from its priorityClassName, else from the class marked globalDefault,
    else 0) is lower than the stage pods' (`stage_priority`, the same admission's value for a pod without a class: 0, or
    the global default's, as the backend saw on its own stage pods; None: they may not preempt, preemptionPolicy
    Never). A class name alone says nothing: another pool's administrator may give its placeholders a class above the
    stages'. Without `spec.priority` (an API server without Priority admission) it is not."""
    p = _get(pod, "spec", "priority")
    return stage_priority is not None and isinstance(p, int) and not isinstance(p, bool) and p < stage_priority


def counted(pod: Mapping, *, namespace: str, cluster_name: str, own_placeholders: Collection[str] = (), pool: str = "",
            stage_priority: int | None = 0) -> bool:
    """Whether a pod's requests are booked as another's: bound, not ended, not a stage pod of this cluster's qosflow
    pool in `namespace` (a pipeline run's pod is counted, and so is a stage pod labelled with another cluster, or of
    another pool than `pool`, this backend's pool's key: another pool's, whose worker books it, not this one; two pools
    whose blocks have the same name tell their stage pods apart by their pool, `kubernetes.same_pool`: the exact key of
    the qosflow.dev/pool-key annotation, else, for a pod of the release before, the qosflow.dev/pool label),
    not a capacity placeholder of this cluster made by this backend
    (`own_placeholders`: its makers' ids, the qosflow.dev/capacity-owner annotation; one naming no maker, made before
    placeholders named theirs, is taken as this backend's, as it was). Another worker's placeholder on a node holds its
    room until that worker deletes it, unless kube-scheduler would preempt it for a stage (`preemptible`: its priority,
    from its `capacity_priority_class`, is below the stage pods' `stage_priority`), so it is counted then; one whose
    class is not below them (another pool's administrator chose it) is counted, and said in the log (`PodSums`). (A stage pod without the cluster label,
    made before stage pods carried it, is taken as this pool's, as it was; so is one without the pool label, and every
    one of this cluster while `pool` is "", the worker not having said its pool yet.)"""
    md = pod.get("metadata") or {}
    if not _get(pod, "spec", "nodeName") or _get(pod, "status", "phase") in ("Succeeded", "Failed"):
        return False
    labels = md.get("labels") or {}
    if md.get("namespace") == namespace:
        role, cluster = labels.get(LABEL_ROLE), labels.get(LABEL_CLUSTER)
        mine = cluster is None or cluster == _cluster_label(cluster_name)
        if LABEL_STAGE in labels and role != ROLE_PIPELINE and mine and same_pool(labels, pool, md.get("annotations")):
            return False
        if role == ROLE_CAPACITY and cluster is not None and mine:
            owner = (md.get("annotations") or {}).get(ANN_CAPACITY_OWNER)
            return bool(owner) and owner not in own_placeholders and not preemptible(pod, stage_priority)
    return True


class PodSums:
    """Per node, what the `counted` pods there request together, as pods come, change and go: the one accumulator of
    the LIST reading (`foreign_usage`, filled once) and of the pod informer (`PodInformer`, kept by a watch's events).
    Integer amounts (GPUs, nanocores, bytes), so that adding and taking away leaves no rounding behind."""

    def __init__(self, *, gpu_resource: str, shared_resource: str, namespace: str, cluster_name: str, keep_names: int = 3,
                 own_placeholders: Collection[str] = (), pool: str = "", stage_priority: int | None = 0):
        self.gpu_resource, self.shared_resource = gpu_resource, shared_resource
        self.namespace, self.cluster_name, self.keep_names = namespace, cluster_name, keep_names
        self.own_placeholders = own_placeholders  # (the backend's set of its makers' ids, read as it grows)
        self.pool = pool  # (this backend's pool's key: fixed for these sums, which are made again when it changes)
        self.stage_priority = stage_priority  # (likewise: the priority of this pool's stage pods, `preemptible`)
        #: namespace/name -> (node, amounts) of each counted pod (`_amounts`)
        self.pods: dict[str, tuple[str, tuple]] = {}
        #: node -> [GPUs, nanocores, bytes, {namespace/name: None} (in the order they came), Counter of shares, slices,
        #: {namespace/name: note}]
        self.nodes: dict[str, list] = {}
        self._view: dict[str, NodePodUsage] | None = None  # (built at the first reading after a change)

    def view(self) -> dict[str, NodePodUsage]:
        """Node name -> what the counted pods bound there request; nodes with none left out."""
        if self._view is None:
            self._view = {n: NodePodUsage(g, c / 1e9, m / 2**20, len(keys), tuple(itertools.islice(keys, self.keep_names)),
                                          tuple(sorted(shares.elements())), slices, tuple(itertools.islice(notes.values(), self.keep_names)))
                          for n, (g, c, m, keys, shares, slices, notes) in self.nodes.items() if g or c or m or shares or slices}
        return self._view

    def take(self, key: str) -> None:
        """Pod `key` (namespace/name) is gone, or no longer counted."""
        had = self.pods.pop(key, None)
        if had is None:
            return
        node, (g, c, m, shares, slices, _note) = had
        a = self.nodes[node]
        a[0] -= g
        a[1] -= c
        a[2] -= m
        a[3].pop(key, None)
        a[4].subtract(shares)
        a[4] += collections.Counter()  # (drops what is left at 0)
        a[5] -= slices
        a[6].pop(key, None)
        if not a[3]:
            del self.nodes[node]
        self._view = None

    def put(self, pod: Mapping) -> None:
        """A pod as it is now (added or changed): summed if it is counted, taken away if it no longer is."""
        md = pod.get("metadata") or {}
        key = f"{md.get('namespace', '')}/{md.get('name', '')}"
        if not counted(pod, namespace=self.namespace, cluster_name=self.cluster_name, own_placeholders=self.own_placeholders, pool=self.pool,
                       stage_priority=self.stage_priority):
            self.take(key)
            return
        if _get(pod, "spec", "priorityClassName") and (md.get("labels") or {}).get(LABEL_ROLE) == ROLE_CAPACITY and key not in self.pods:
            _say_unpreemptible(pod, self.cluster_name, self.stage_priority)
        node = pod["spec"]["nodeName"]
        amounts = _amounts(pod, self.gpu_resource, self.shared_resource)
        if self.pods.get(key) == (node, amounts):
            return  # (a status change: nothing it requests changed)
        self.take(key)
        self.pods[key] = (node, amounts)
        g, c, m, shares, slices, note = amounts
        a = self.nodes.setdefault(node, [0, 0, 0, {}, collections.Counter(), 0, {}])
        a[0] += g
        a[1] += c
        a[2] += m
        a[3][key] = None
        a[4].update(shares)
        a[5] += slices
        if note:
            a[6][key] = note
            _say_whole(key, note, self.cluster_name)
        self._view = None


#: (cluster, priority class, its value, the stages') said already: one warning per class, not per placeholder or reading
_SAID_UNPREEMPTIBLE: set[tuple] = set()
#: (cluster, pod, note) said already (`_say_whole`), the oldest forgotten past a bound
_SAID_WHOLE: "collections.OrderedDict[tuple, None]" = collections.OrderedDict()


def _say_whole(key: str, note: str, cluster_name: str) -> None:
    """Log once per pod why its GPU share is booked as a whole GPU (its convention does not say which GPU or what part)."""
    k = (cluster_name, key, note)
    if k in _SAID_WHOLE:
        return
    _SAID_WHOLE[k] = None
    while len(_SAID_WHOLE) > 4096:
        _SAID_WHOLE.popitem(last=False)
    # (a warning: under Prefect's logging configuration a qosflow.* logger's INFO is not shown, the root logger's level
    # being WARNING; said at INFO, this line never reached a worker's output)
    log.warning("Kubernetes cluster %r: pod %s", cluster_name, note)


def _say_unpreemptible(pod: Mapping, cluster_name: str, stage_priority: int | None) -> None:
    """Log once per class that a placeholder of another worker (another pool's, whose administrator set its class) has a
    priority class that does not let this pool's stages preempt it: its room is booked as taken, and how to change that."""
    md, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    cls, prio = spec.get("priorityClassName"), spec.get("priority")
    key = (cluster_name, cls, prio, stage_priority)
    if key in _SAID_UNPREEMPTIBLE:
        return
    _SAID_UNPREEMPTIBLE.add(key)
    ann = md.get("annotations") or {}
    whose = ann.get("qosflow.dev/capacity-pool") or (md.get("labels") or {}).get("qosflow.dev/pool") or "a pool of the same cluster name"
    if stage_priority is None:
        why = "this pool's stage pods may not preempt (their priority class's preemptionPolicy is Never)"
    elif prio is None:
        why = "its priority is not known (the API server set no spec.priority: no Priority admission)"
    else:
        why = f"its priority, {prio}, is not lower than this pool's stage pods' ({stage_priority})"
    log.warning("Kubernetes cluster %r: capacity placeholder %s/%s of worker %s (pool %s) has priority class %r, but %s: kube-scheduler "
                "will not preempt it for a stage, so the room it holds on node %s is booked as taken until its worker deletes it. "
                "If that pool's placeholders are meant to give way to stages, set its cluster block's capacity_priority_class to a "
                "PriorityClass whose value is below %s (the cluster-overprovisioner's: value -10, preemptionPolicy Never; "
                "`kubectl get priorityclass %s` shows this one's)", cluster_name, md.get("namespace", ""), md.get("name", ""),
                ann.get(ANN_CAPACITY_OWNER, "?"), whose, cls, why, spec.get("nodeName"),
                0 if stage_priority is None else stage_priority, cls)


def foreign_usage(pods: Iterable[Mapping], *, gpu_resource: str, shared_resource: str, namespace: str, cluster_name: str,
                  keep_names: int = 3, own_placeholders: Collection[str] = (), pool: str = "",
                  stage_priority: int | None = 0) -> dict[str, NodePodUsage]:
    """Node name -> what the counted pods bound there request (`counted`, `pod_requests`); nodes with none left out."""
    sums = PodSums(gpu_resource=gpu_resource, shared_resource=shared_resource, namespace=namespace, cluster_name=cluster_name,
                   keep_names=keep_names, own_placeholders=own_placeholders, pool=pool, stage_priority=stage_priority)
    for pod in pods:
        sums.put(pod)
    return sums.view()


def list_bound_pods(backend: Any, *, with_version: bool = False) -> Any:
    """One LIST of the pods bound to a node and not ended, in every namespace (the backend's own namespace alone if its
    account may not list pods cluster-wide: then other namespaces' pods are not seen, said once). JSON, not the client's
    models: at 10,000 pods the client's deserialization costs seconds. `with_version`: (pods, the list's resourceVersion)."""
    from kubernetes.client.exceptions import ApiException

    resp = None
    if not _namespaced_only(backend):
        again = bool(getattr(backend, "_pods_namespaced_only", False))  # (a retry after a refusal)
        try:
            resp = backend._call(backend.core.list_pod_for_all_namespaces, field_selector=POD_FIELD_SELECTOR, _preload_content=False,
                                 _doing="list the pods bound to its nodes")
        except ApiException as e:
            if e.status != 403:
                raise
            backend._pods_namespaced_only = True
            backend._pods_namespaced_at = time.monotonic()
            if not again:
                log.warning("Kubernetes cluster %r: the worker's account may not list pods in all namespaces (403): only the pods "
                            "of namespace %s are booked on their nodes; grant it list and watch on pods cluster-wide (the "
                            "ClusterRole qosflow-worker-pods of %s) so that other users' pods and DaemonSets are too (tried "
                            "again every %gs: no restart needed)", backend.cluster_name, backend.namespace, RBAC_MANIFEST,
                            float(getattr(backend, "pod_rbac_retry_s", POD_RBAC_RETRY_S)))
        else:
            if again:
                backend._pods_namespaced_only = False
                log.warning("Kubernetes cluster %r: the worker's account may now list pods in all namespaces: other "
                            "namespaces' pods are booked on their nodes again", backend.cluster_name)
    if resp is None:
        resp = backend._call(backend.core.list_namespaced_pod, backend.namespace, field_selector=POD_FIELD_SELECTOR, _preload_content=False,
                             _doing="list the pods bound to its nodes")
    body = json.loads(resp.data)
    items = body.get("items") or []
    return (items, _get(body, "metadata", "resourceVersion")) if with_version else items


def _own_placeholders(backend: Any) -> Collection[str]:
    """The ids this backend's placeholders name as their maker (`KubernetesBackend._capacity_owners`, a set it adds to)."""
    return getattr(backend, "_capacity_owners", ())


def _own_pool(backend: Any) -> str:
    """This backend's pool's key (`KubernetesBackend._pool_key`: its stage pods' qosflow.dev/pool-key annotation, and, as a
    label value, their qosflow.dev/pool label); "" while the worker has not said it."""
    pool_key = getattr(backend, "_pool_key", None)
    return pool_key() if pool_key is not None else ""


def read_foreign_usage(backend: Any) -> dict[str, NodePodUsage]:
    """`foreign_usage` of one LIST (blocking: call it in a thread); the last one's again if it is younger than
    `POD_READ_S` (the backend's `pod_usage_every_s`). The backend's pod informer (`watch_pods`) serves it instead
    while its watch follows the API (`KubernetesBackend.foreign_pod_usage`)."""
    every = float(getattr(backend, "pod_usage_every_s", POD_READ_S))
    last = getattr(backend, "_pod_usage_last", None)
    now = time.monotonic()
    if last is not None and now - last[0] < every:
        return last[1]
    pods = list_bound_pods(backend)
    backend.stats["pod_lists"] = backend.stats.get("pod_lists", 0) + 1
    usage = foreign_usage(pods, gpu_resource=backend.gpu_resource, shared_resource=backend.shared_resource,
                          namespace=backend.namespace, cluster_name=backend.cluster_name, own_placeholders=_own_placeholders(backend),
                          pool=_own_pool(backend), stage_priority=getattr(backend, "_stage_priority", 0))
    backend._pod_usage_last = (now, usage)
    return usage


# ---------------------------------------------------------------------- the pod informer (`watch_pods`)
#: timeoutSeconds of each pod WATCH request (then it is opened again from the last resourceVersion, no LIST)
POD_WATCH_TIMEOUT_S = 120


def _amounts(pod: Mapping, gpu_resource: str, shared_resource: str) -> tuple:
    """A counted pod's (whole GPUs, nanocores, bytes, GPU shares, shared-resource slices, note), `gpu_use`: integers, so
    that adding and taking away leaves no rounding behind."""
    req = pod_requests(pod)
    use = gpu_use(pod, req, gpu_resource, shared_resource)
    return use.whole, round(req.get("cpu", 0.0) * 1e9), round(req.get("memory", 0.0)), use.shares, use.slices, use.note


def _watch_class() -> Any:
    from kubernetes import watch

    class RawWatch(watch.Watch):
        """The client's Watch with the events' objects left as JSON (dicts): at 10,000 pods the models' deserialization
        is what costs (`list_bound_pods`), and only a pod's node, phase, labels and requests are read here."""

        def get_return_type(self, func: Any) -> None:  # (None: `unmarshal_event` keeps the dict; an ERROR still raises)
            return None

    return RawWatch


class PodInformer:
    """The pods bound to a node and not ended as a watch follows them (an informer: one LIST with `POD_FIELD_SELECTOR`,
    then WATCHes from its resourceVersion with bookmarks, reopened from the last version seen; a LIST again on 410 Gone
    or a broken stream), in a thread of its own: per node the summed requests of the `counted` pods, updated at each
    event (a pod that ends or leaves the selector comes as DELETED and is taken away; one whose requests or node change
    is summed again). `usage()` is then `foreign_usage` of the pods now, without a request or a parse.

    A loop of its own, not the node informer's (`KubernetesBackend._node_watch_once`): that one keeps the client's
    models under the backend's node lock and drives the node-deletion bookkeeping from its events; this one keeps JSON
    and sums. Namespaced like `list_bound_pods`: on a 403 to the cluster-wide LIST the backend's namespace alone; a 403 to
    the WATCH (an account that may list pods but not watch them) stops the informer for good (the LIST readings go on)."""

    def __init__(self, backend: Any):
        self.be = backend
        self.lock = threading.Lock()
        self.sums = self._new_sums()
        self.synced = False
        self.error: str | None = None
        self.forbidden = False
        self.forbidden_at = 0.0  # (time.monotonic) when RBAC refused the WATCH: tried again pod_rbac_retry_s after
        self.stop_ev = threading.Event()
        self.thread: threading.Thread | None = None
        self.watch: Any = None

    def _new_sums(self) -> PodSums:
        be = self.be
        return PodSums(gpu_resource=be.gpu_resource, shared_resource=be.shared_resource, namespace=be.namespace,
                       cluster_name=be.cluster_name, own_placeholders=_own_placeholders(be), pool=_own_pool(be),
                       stage_priority=getattr(be, "_stage_priority", 0))

    # -- the view
    def usage(self) -> dict[str, NodePodUsage] | None:
        """Node -> what the counted pods there request, while the watch follows the API; else None (LIST instead)."""
        with self.lock:
            return self.sums.view() if self.synced else None

    def event(self, etype: str, pod: Mapping) -> None:
        with self.lock:
            if etype == "DELETED":
                md = pod.get("metadata") or {}
                self.sums.take(f"{md.get('namespace', '')}/{md.get('name', '')}")
            else:
                self.sums.put(pod)

    def relist(self, pods: Iterable[Mapping]) -> None:
        with self.lock:
            self.sums = self._new_sums()
            for pod in pods:
                self.sums.put(pod)
            self.synced = True

    # -- the thread
    def start(self) -> None:
        if self.forbidden and _rbac_retry_due(self.be, self.forbidden_at) and not (self.thread is not None and self.thread.is_alive()):
            self.forbidden = False  # (the RBAC may have been fixed: one more try; a 403 again stops it for as long)
        if self.forbidden or self.stop_ev.is_set() or (self.thread is not None and self.thread.is_alive()):
            return
        self.thread = threading.Thread(target=self._run, name=f"qosflow-k8s-pods-{self.be.cluster_name}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_ev.set()
        self.distrust()

    def distrust(self) -> None:
        """Not served any more (the API server was found unreachable, or stopping); its watch stopped: it LISTs again."""
        with self.lock:
            self.synced = False
        stop_watch(self.watch)

    def _run(self) -> None:
        failures = 0
        while not self.stop_ev.is_set() and not self.forbidden:
            try:
                self._once()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - the heartbeat LISTs meanwhile
                failures += 1
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if why != self.error:
                    log.debug("Kubernetes cluster %r: the pod watch broke (%s); the pods are listed at the heartbeats until "
                              "it is open again", self.be.cluster_name, why)
                self.error = why
                self.stop_ev.wait(min(5.0, 0.2 * 2 ** min(failures, 5)))
            finally:
                with self.lock:
                    self.synced = False

    def _once(self) -> None:
        from kubernetes.client.exceptions import ApiException

        be = self.be
        items, rv = list_bound_pods(be, with_version=True)
        be.stats["pod_lists"] = be.stats.get("pod_lists", 0) + 1
        self.relist(items)
        del items
        if self.error is not None:
            log.debug("Kubernetes cluster %r: the pod watch follows the pods again", be.cluster_name)
            self.error = None
        every = int(getattr(be, "pod_watch_timeout_s", POD_WATCH_TIMEOUT_S))
        raw_watch = _watch_class()
        while not self.stop_ev.is_set():
            if getattr(be, "_pods_namespaced_only", False):
                if not _namespaced_only(be):
                    return  # (the cluster-wide LIST is due again: `_run` lists anew, cluster-wide if it is allowed now)
                fn, args = be.core.list_namespaced_pod, (be.namespace,)
            else:
                fn, args = be.core.list_pod_for_all_namespaces, ()
            w = self.watch = raw_watch()
            be.stats["pod_watches"] = be.stats.get("pod_watches", 0) + 1
            try:
                for ev in w.stream(fn, *args, field_selector=POD_FIELD_SELECTOR, resource_version=rv, allow_watch_bookmarks=True,
                                   timeout_seconds=every, _request_timeout=(be.api_connect_timeout_s, every + 30)):
                    obj = ev.get("object") or {}
                    rv = _get(obj, "metadata", "resourceVersion") or rv
                    if ev.get("type") == "BOOKMARK":
                        continue
                    be.stats["pod_events"] = be.stats.get("pod_events", 0) + 1
                    self.event(ev.get("type", ""), obj)
            except ApiException as e:
                if e.status == 410:  # the version is compacted: LIST again
                    be.stats["pod_watch_410"] = be.stats.get("pod_watch_410", 0) + 1
                    return
                if e.status == 403:
                    again, self.forbidden, self.forbidden_at = self.forbidden_at > 0, True, time.monotonic()
                    (log.debug if again else log.warning)(
                        "Kubernetes cluster %r: the worker's account may list pods but not watch them (403): the pods on the "
                        "nodes are listed at the heartbeats (every %g s) instead; grant it watch on pods (%s; tried again every "
                        "%gs: no restart needed)", be.cluster_name, float(getattr(be, "pod_usage_every_s", POD_READ_S)),
                        rbac_refusal(e) or RBAC_MANIFEST, float(getattr(be, "pod_rbac_retry_s", POD_RBAC_RETRY_S)))
                    return
                be.stats["pod_watch_broken"] = be.stats.get("pod_watch_broken", 0) + 1
                raise
            except Exception:
                if self.stop_ev.is_set():
                    return
                be.stats["pod_watch_broken"] = be.stats.get("pod_watch_broken", 0) + 1
                raise
            finally:
                self.watch = None
            if w._stop or not self.synced:  # (stopped: `distrust`; LIST again)
                return
