"""A pod that is not qosflow's and takes a share of a GPU is booked as that share, not as a whole GPU.

The worker books what the pods that are not its stages request on each node (tests/test_k8s_foreign_pods.py). A pod
asking for a slice of a shared GPU (the NVIDIA device plugin's time-slicing or MPS, renamed `nvidia.com/gpu.shared`;
another qosflow pool's fractional stage; Alibaba gpushare's `aliyun.com/gpu-mem`) was booked as a whole GPU each (or, for
gpushare, not at all): four notebooks holding one time-slice each (a quarter of a GPU each on a node whose GPUs have 4
replicas) kept four GPUs from qosflow's plan, and qosflow's own shared stages waited though kube-scheduler had room for
them. Now such a pod is booked as the fraction it takes, on the GPU its convention names (gpushare's
`ALIYUN_COM_GPU_MEM_IDX`, a qosflow stage's placement), or on a GPU the plan picks when the convention names none (the
NVIDIA device plugin writes nowhere which device a slice is on); where the part is not known (a node without GPU feature
discovery's `nvidia.com/gpu.replicas`, a gpushare pod the extender did not annotate) it stays a whole GPU, and the log
says why. The worker (scheduler + KubernetesBackend + heartbeat) runs on qosflow's API emulator (EMULATED: no cluster)
through the official `kubernetes` client; the other pods are created through the API as their owners would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import pytest
from kubernetes import client

from k8s_lab import EmulatedWorker, until
from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.backends.k8s_usage import ANY_GPU, NodePodUsage, foreign_usage, gpu_use, node_shares, pod_requests
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.job import Job, JobState
from qosflow.core.qos import QoSSpec
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from qosflow.prefect.cluster_table import PODS_HOLD

pytestmark = pytest.mark.timeout(90)
NODE = "gpu-a"
KW = dict(gpu_resource="nvidia.com/gpu", shared_resource="nvidia.com/gpu.shared", namespace="default", cluster_name="lab")


def pod(name: str, requests: dict, *, namespace: str = "users", annotations: dict | None = None, labels: dict | None = None,
        node: str = NODE) -> dict:
    """A pod qosflow did not make, pinned to `node`, running until deleted (a pause image); its requests as limits too
    (extended resources are asked for so)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {"app": name}, "annotations": annotations or {}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9",
                                     "resources": {"requests": {"cpu": "100m", **requests},
                                                   "limits": {k: v for k, v in requests.items() if "/" in k}}}]}}


def bound(p: dict, node: str = "n1") -> dict:
    return {**p, "spec": {**p["spec"], "nodeName": node}, "status": {"phase": "Running"}}


def gpushare(name: str, gib: int, idx: int | None, dev: int = 40) -> dict:
    """A pod of Alibaba's gpushare: `gib` GiB of GPU memory; annotated, as the scheduler extender does when it binds
    it, with the device `idx` and that device's memory `dev` (None: not annotated)."""
    ann = {} if idx is None else {"ALIYUN_COM_GPU_MEM_IDX": str(idx), "ALIYUN_COM_GPU_MEM_POD": str(gib),
                                  "ALIYUN_COM_GPU_MEM_DEV": str(dev), "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}
    return pod(name, {"aliyun.com/gpu-mem": str(gib)}, annotations=ann)


def other_pools_share(name: str, gpu: int, milli: int, *, colocated: bool = False) -> dict:
    """A fractional stage of another qosflow pool (its cluster label says so) as qosflow's backend makes its pod: one
    slice of the shared resource, its placement annotated (QOSFLOW_PLACEMENT)."""
    plan = {"job_id": name, "node": NODE, "nodes": [NODE], "gpus": [gpu], "gpu_milli": milli, "cpu_cores": 1.0,
            "colocated_with": ["peer"] if colocated else []}
    return pod(name, {"nvidia.com/gpu.shared": "1"}, namespace="default",
               labels={"qosflow.dev/stage-id": name, "qosflow.dev/cluster": "vision-lab", "app.kubernetes.io/managed-by": "qosflow"},
               annotations={"qosflow.dev/stage-id": name, "qosflow.dev/placement": json.dumps(plan)})


# ---------------------------------------------------------------------- each convention, read from the pod
def test_each_conventions_share_is_read_from_the_pod():
    def use(p: dict):
        return gpu_use(p, pod_requests(p), "nvidia.com/gpu", "nvidia.com/gpu.shared")

    # NVIDIA time-slicing/MPS (renamed): slices, whose part the node's replicas label tells, on a device not said
    u = use(pod("ts", {"nvidia.com/gpu.shared": "2"}))
    assert (u.whole, u.shares, u.slices, u.note) == (0, (), 2, "")
    # another qosflow pool's fractional stage: its placement's share of its plan's GPU; a co-located one: half
    u = use(other_pools_share("s1", 2, 250))
    assert (u.whole, u.shares, u.slices) == (0, ((2, 250),), 0)
    assert use(other_pools_share("s2", 1, 1000, colocated=True)).shares == ((1, 500),)
    # gpushare: POD/DEV of device IDX (10 of 40 GiB: a quarter of GPU 1); all of a device: whole
    u = use(gpushare("gs", 10, 1))
    assert (u.whole, u.shares, u.note) == (0, ((1, 250),), "")
    assert use(gpushare("gs", 40, 0)).whole == 1 and use(gpushare("gs", 40, 0)).shares == ()
    # not annotated by the extender (or unreadable): which GPU and how much are not known: a whole GPU, and why
    u = use(gpushare("gs-unbound", 10, None))
    assert (u.whole, u.shares) == (1, ()) and "ALIYUN_COM_GPU_MEM_IDX" in u.note and "whole GPU" in u.note, u.note
    bad = gpushare("gs-bad", 10, 1)
    bad["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"] = "0,1"
    assert use(bad).whole == 1
    # whole GPUs as before
    assert use(pod("nb", {"nvidia.com/gpu": "2"})).whole == 2
    # summed per node, as the pod informer and a LIST reading both do
    got = foreign_usage([bound(pod("ts", {"nvidia.com/gpu.shared": "1"})), bound(gpushare("g1", 20, 0)), bound(gpushare("g2", 20, 0)),
                         bound(other_pools_share("s1", 3, 500)), bound(pod("nb", {"nvidia.com/gpu": "1"})),
                         bound(gpushare("gs-unbound", 10, None))], **KW)
    n1 = got["n1"]
    assert (n1.gpus, n1.slices, n1.shares, n1.pods) == (2, 1, ((0, 500), (0, 500), (3, 500)), 6), n1
    assert len(n1.notes) == 1 and "users/gs-unbound" in n1.notes[0]


def test_a_slice_is_booked_as_its_part_of_a_gpu_where_the_node_says_its_replicas_and_whole_where_not():
    u = NodePodUsage(gpus=1, slices=3, shares=((2, 500),))
    assert node_shares(u, {"nvidia.com/gpu.replicas": "4"}) == (1, ((ANY_GPU, 250),) * 3 + ((2, 500),), "")
    whole, shares, why = node_shares(u, {})
    assert (whole, shares) == (4, ((2, 500),)) and "no nvidia.com/gpu.replicas label" in why, why
    whole, shares, why = node_shares(u, {"nvidia.com/gpu.replicas": "many"})
    assert whole == 4 and "'many'" in why


def test_the_plan_books_each_share_on_its_gpu_and_packs_the_shares_whose_gpu_is_not_said():
    from qosflow.core.cluster import ClusterSpec, NodeSpec
    from qosflow.policies import get_policy
    from qosflow.prefect.foreign_pods import book_foreign_pods
    from qosflow.prefect.scheduler import QoSScheduler

    spec = ClusterSpec((NodeSpec("n0", 4, cpu_cores=8, mem_mb=32768, labels={"nvidia.com/gpu.replicas": "4"}),))
    sched = QoSScheduler(spec, get_policy("fifo"), coda=False)
    st, booked = sched.state, {}
    usage = {"n0": NodePodUsage(gpus=1, cpu=1.0, pods=5, shares=((2, 500), (2, 250)), slices=2)}
    book_foreign_pods(sched, usage, booked)
    st.check_invariants()
    holds = {k: p for k, p in st.allocs.items() if k.startswith(PODS_HOLD)}
    shares = sorted((p.gpus[0][1], p.gpu_milli) for k, p in holds.items() if "/share" in k)
    whole = holds[PODS_HOLD + "n0"]
    # the named shares on GPU 2; the whole GPU on an empty one (0); the two slices (a quarter each) packed: the first
    # on GPU 2 (a quarter left there), the second on an empty GPU (1)
    assert shares == [(1, 250), (2, 250), (2, 250), (2, 500)], shares
    assert whole.gpus == ((0, 0),) and whole.cpu_cores == 1.0
    assert int(st.milli_free[0, 2]) == 0 and int(st.empty[0]) == 1
    # unchanged readings book nothing again; a pod gone gives its share back
    before = dict(st.allocs)
    assert not book_foreign_pods(sched, usage, booked) and st.allocs == before
    assert book_foreign_pods(sched, {"n0": NodePodUsage(gpus=1, cpu=1.0, pods=4, shares=((2, 500),), slices=2)}, booked)
    assert int(st.milli_free[0, 2]) == 0 and sum(1 for k in st.allocs if "/share" in k) == 3
    st.check_invariants()
    # a named GPU that holds a stage of the plan: the share goes to another GPU with room
    assert book_foreign_pods(sched, {}, booked) and not any(k.startswith(PODS_HOLD) for k in st.allocs) and booked == {}
    from qosflow.core.placement import Placement

    assert sched.hold("lease:x", Placement("lease:x", ((0, 1),), ((0, 1.0),)), QoSSpec(gpus=1, cpu_cores=1))
    book_foreign_pods(sched, {"n0": NodePodUsage(pods=1, shares=((1, 500),))}, booked)
    [(k, p)] = [(k, p) for k, p in st.allocs.items() if "/share" in k]
    assert p.gpus[0][1] != 1 and p.gpu_milli == 500
    st.check_invariants()


# ---------------------------------------------------------------------- on the emulator, with the worker's heartbeat
class Lab(EmulatedWorker):
    def __init__(self, emu: EmulatorServer):
        super().__init__(emu, pool="k8s-foreign-shares", beat=("_sync_health",), unschedulable_timeout_s=2.0)

    def make_backend(self) -> KubernetesBackend:
        be = super().make_backend()
        be.pod_usage_every_s = 0.0
        return be

    def create(self, p: dict) -> None:
        with contextlib.suppress(client.exceptions.ApiException):
            self.core.create_namespace({"metadata": {"name": p["metadata"]["namespace"]}})
        self.core.create_namespaced_pod(p["metadata"]["namespace"], p)

    def running(self, name: str, namespace: str = "users") -> bool:
        p = self.core.read_namespaced_pod(name, namespace)
        return p.status.phase == "Running" and bool(p.spec.node_name)

    def shares(self) -> list[tuple[int, int]]:
        """The plan's holds of GPU shares for the pods that are not stages: (GPU, milli), sorted."""
        return sorted((p.gpus[0][1], p.gpu_milli) for k, p in self.sched.state.allocs.items() if k.startswith(PODS_HOLD) and "/share" in k)

    def whole(self) -> int:
        p = self.sched.state.allocs.get(PODS_HOLD + NODE)
        return 0 if p is None else len(p.gpus)

    def queue(self, name: str, gpus: int = 1, gpu_milli: int = 1000) -> asyncio.Future:
        from qosflow.prefect.scheduler import StageEntry

        e = StageEntry(JobState(Job(name, 0.0, QoSSpec(gpus=gpus, gpu_milli=gpu_milli, cpu_cores=0.5), duration=5.0)), name)
        return asyncio.ensure_future(self.sched.request(e))

    async def run(self, name: str):
        self.emu.add_rule(selector=f"qosflow.dev/stage-id={name}", run_s=0.3)
        p = self.sched.entries[name].grant.placement
        st = await self.be.wait(await self.be.launch(LaunchSpec(name, ["true"], p, self.sched.cluster)))
        self.sched.release(name, ok=st.kind is ExitKind.OK)
        return st


def test_time_slices_of_other_pods_take_their_part_and_a_shared_stage_runs_beside_them(caplog):
    """A node of 4 GPUs whose device plugin time-slices them 4 ways (16 slices of nvidia.com/gpu.shared). Four notebooks
    hold one slice each: the plan books a quarter of a GPU for each, packed on one GPU (before: 4 whole GPUs, the node
    full), so three half-GPU stages of qosflow's are placed at once and their pods bind (kube-scheduler: 4 + 1 of 16
    slices at a time). The notebooks gone, their shares go with them."""

    async def go():
        with EmulatorServer([gpu_node(NODE, 4, cpu="16", memory="64Gi", replicas=4)]) as emu:
            async with Lab(emu) as lab:
                for k in range(4):
                    lab.create(pod(f"nb-{k}", {"nvidia.com/gpu.shared": "1"}))
                await until(lambda: all(lab.running(f"nb-{k}") for k in range(4)), "the notebooks run")
                await until(lambda: len(lab.shares()) == 4 and all(m == 250 for _, m in lab.shares()),
                            "the 4 slices booked as a quarter of a GPU each")
                assert len({g for g, _ in lab.shares()}) == 1 and lab.whole() == 0  # (packed on one GPU; no whole GPU booked)
                assert int(lab.sched.state.empty[0]) == 3
                grants = [await asyncio.wait_for(lab.queue(f"half-{k}", gpu_milli=500), 5) for k in range(3)]
                assert all(g.placement.gpu_milli == 500 for g in grants)
                for k in range(3):
                    st = await lab.run(f"half-{k}")
                    assert st.kind is ExitKind.OK, st  # (bound: the node's slices had room, not Unschedulable)
                for k in range(4):
                    lab.core.delete_namespaced_pod(f"nb-{k}", "users")
                await until(lambda: lab.shares() == [], "the notebooks' shares given back")
                assert int(lab.sched.state.empty[0]) == 4

    asyncio.run(go())


def test_gpushare_pods_take_their_part_of_the_gpu_their_annotation_names(caplog):
    """Alibaba gpushare pods (aliyun.com/gpu-mem) on a node of 4 GPUs of 40 GiB: two of 20 GiB on GPU 0 fill it, one of
    10 GiB on GPU 1 takes a quarter of it; 2 GPUs stay whole and empty: a 2-GPU stage is placed at once, a 3-GPU one
    waits. Before, gpu-mem was not counted at all (the 3-GPU stage was placed onto GPUs the pods used). One that the
    extender did not annotate is booked as a whole GPU, and the log says why."""

    async def go():
        node = gpu_node(NODE, 4, cpu="16", memory="64Gi")
        node["status"]["allocatable"]["aliyun.com/gpu-mem"] = "160"
        with EmulatorServer([node]) as emu:
            async with Lab(emu) as lab:
                for name, gib, idx in (("gs-a", 20, 0), ("gs-b", 20, 0), ("gs-c", 10, 1)):
                    lab.create(gpushare(name, gib, idx))
                await until(lambda: lab.shares() == [(0, 500), (0, 500), (1, 250)], "the gpushare pods' parts booked on their GPUs")
                assert lab.whole() == 0 and int(lab.sched.state.empty[0]) == 2
                two = await asyncio.wait_for(lab.queue("two", gpus=2), 5)
                assert sorted(g for _, g in two.placement.gpus) == [2, 3]
                lab.sched.release("two", ok=True)
                three = lab.queue("three", gpus=3)
                await asyncio.sleep(0.6)
                assert not three.done(), "a 3-GPU stage was placed on a node where gpushare pods use 2 of its 4 GPUs"
                lab.core.delete_namespaced_pod("gs-c", "users")
                await asyncio.wait_for(three, 10)  # GPU 1 free again: 3 whole GPUs
                lab.sched.release("three", ok=True)
                with caplog.at_level(logging.INFO, logger="qosflow.backends.kubernetes"):
                    lab.create(gpushare("gs-unannotated", 10, None))
                    await until(lambda: lab.whole() == 1, "the pod the extender did not annotate booked as a whole GPU")
                said = [r.getMessage() for r in caplog.records if "gs-unannotated" in r.getMessage()]
                assert said and "which GPU and what part of it are not known, booked as a whole GPU" in said[0], said

    asyncio.run(go())


def test_another_pools_shared_stage_and_a_node_without_replicas_label(caplog):
    """Another qosflow pool's half-GPU stage on GPU 3 of its plan is booked as half of GPU 3. On a node whose GPU
    feature discovery did not label its replicas, a notebook's slice is booked as a whole GPU (its part is not known),
    and the log says why."""

    async def go():
        plain = gpu_node(NODE, 4, cpu="16", memory="64Gi", replicas=4)
        del plain["metadata"]["labels"]["nvidia.com/gpu.replicas"]
        with EmulatorServer([plain]) as emu:
            async with Lab(emu) as lab:
                lab.create(other_pools_share("their-stage", 3, 500))
                await until(lambda: lab.shares() == [(3, 500)], "the other pool's share booked on its GPU")
                with caplog.at_level(logging.INFO, logger="qosflow.prefect.worker"):
                    lab.create(pod("nb", {"nvidia.com/gpu.shared": "1"}))
                    await until(lambda: lab.whole() == 1, "the slice booked as a whole GPU")
                assert lab.shares() == [(3, 500)]
                said = [r.getMessage() for r in caplog.records if "nvidia.com/gpu.replicas" in r.getMessage()]
                assert said and f"node {NODE}" in said[0] and "booked as whole GPUs" in said[0], said

    asyncio.run(go())


# ---------------------------------------------------------------------- what the log says, and edge values
def _plan(*nodes):
    from qosflow.core.cluster import ClusterSpec
    from qosflow.policies import get_policy
    from qosflow.prefect.scheduler import QoSScheduler

    return QoSScheduler(ClusterSpec(tuple(nodes)), get_policy("fifo"), coda=False)


def test_a_share_booked_whole_is_said_once_as_a_warning_that_a_worker_shows(caplog):
    """Why a share is booked as a whole GPU is said at WARNING: a Prefect worker's logging configuration leaves the root
    logger (and so every qosflow.* logger) at WARNING, and these lines, said at INFO, never reached a worker's output.
    Once per node (and label value), not again at each new count of slices there (a line per notebook started or
    stopped); once per pod, and not repeated in the node's line."""
    from qosflow.core.cluster import NodeSpec
    from qosflow.prefect.foreign_pods import book_foreign_pods

    sched, booked = _plan(NodeSpec("said-n0", 4, cpu_cores=8, mem_mb=32768), NodeSpec("said-n1", 4, cpu_cores=8, mem_mb=32768)), {}
    with caplog.at_level(logging.WARNING, logger="qosflow"):  # (a worker's level: Prefect's root logger's)
        for k in (1, 2, 1, 3):  # (notebooks on a node without the replicas label come and go)
            book_foreign_pods(sched, {"said-n0": NodePodUsage(pods=k, slices=k)}, booked)
        pods = [bound(gpushare("gs-said-1", 10, None), "said-n1")]
        book_foreign_pods(sched, foreign_usage(pods, **KW), booked)
        book_foreign_pods(sched, foreign_usage(pods + [bound(gpushare("gs-said-2", 10, None), "said-n1")], **KW), booked)
    node = [r for r in caplog.records if "said-n0" in r.getMessage()]
    assert len(node) == 1 and node[0].levelno == logging.WARNING and "nvidia.com/gpu.replicas" in node[0].getMessage(), \
        [r.getMessage() for r in node]
    for name in ("gs-said-1", "gs-said-2"):
        said = [r for r in caplog.records if name in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING and "booked as a whole GPU" in said[0].getMessage(), \
            [r.getMessage() for r in said]
    assert len(sched.state.allocs[PODS_HOLD + "said-n1"].gpus) == 2


def test_slices_of_a_node_with_more_than_1000_replicas_are_booked():
    """A slice is 1000 // replicas thousandths of a GPU, at least 1: over 1000 replicas it was 0, which the plan refuses
    (a share of nothing), and the node's slices were not booked at all (the room they take left to the plan)."""
    from qosflow.core.cluster import NodeSpec
    from qosflow.prefect.foreign_pods import book_foreign_pods

    u = NodePodUsage(pods=2, slices=2)
    assert node_shares(u, {"nvidia.com/gpu.replicas": "2000"}) == (0, ((ANY_GPU, 1),) * 2, "")
    sched, booked = _plan(NodeSpec("many", 1, cpu_cores=8, mem_mb=32768, labels={"nvidia.com/gpu.replicas": "2000"})), {}
    book_foreign_pods(sched, {"many": u}, booked)
    assert sorted(p.gpu_milli for k, p in sched.state.allocs.items() if "/share" in k) == [1, 1]
    assert booked["many"][0] == booked["many"][1]  # (all of it booked: not tried again at each heartbeat)
    sched.state.check_invariants()


def test_an_unreadable_share_annotation_does_not_stop_the_reading_of_every_pod():
    """The annotations read are anyone's to write: a gpushare pod's device memory "nan" or "inf", a placement whose
    gpu_milli or GPU is 1e999 (JSON's infinity) raised (ValueError, OverflowError) out of the reading of all the pods: the
    pod informer broke at every LIST, the heartbeat's LIST reading failed, and the holds of every node stayed as they were.
    Now such a pod is read as its convention's unreadable case (gpushare: a whole GPU, and why; a placement: slices)."""
    nan, inf = gpushare("gs-nan", 10, 0, dev="nan"), gpushare("gs-inf", 10, 0)
    inf["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_POD"] = "inf"
    big_milli, big_gpu = other_pools_share("s-milli", 1, 250), other_pools_share("s-gpu", 1, 250)
    for p, key, value in ((big_milli, "gpu_milli", 1e999), (big_gpu, "gpus", [1e999])):
        plan = json.loads(p["metadata"]["annotations"]["qosflow.dev/placement"])
        plan[key] = value
        p["metadata"]["annotations"]["qosflow.dev/placement"] = json.dumps(plan)
    got = foreign_usage([bound(p) for p in (nan, inf, big_milli, big_gpu, gpushare("gs-ok", 10, 1))], **KW)["n1"]
    assert (got.gpus, got.shares, got.slices, got.pods) == (2, ((1, 250),), 2, 5), got


def test_a_stage_under_a_slice_is_booked_as_a_slice_so_the_plan_never_places_more_pods_than_slices_free():
    """A shared stage's pod asks for one slice of nvidia.com/gpu.shared whatever its gpu_milli, and kube-scheduler counts
    slices. A 1-GPU node time-sliced 4 ways with 3 slices held by other pods: two stages of 100 thousandths were both
    placed (the plan booked 100 each), while one slice was free: the second pod stayed Unschedulable (found by the
    review of the foreign-share booking). The worker now books a stage under a slice at a slice (`_at_least_a_slice`,
    `KubernetesBackend.least_share_milli`): one is placed, the other waits."""
    import types

    from qosflow.backends.k8s_usage import NodePodUsage
    from qosflow.core.cluster import NodeSpec
    from qosflow.core.qos import QoSSpec
    from qosflow.prefect.foreign_pods import book_foreign_pods
    from qosflow.prefect.scheduler import StageEntry
    from qosflow.prefect.worker import _at_least_a_slice

    labels = {"nvidia.com/gpu.replicas": "4"}
    sched = _plan(NodeSpec("n0", 1, cpu_cores=8, mem_mb=32768, labels=labels))
    be = types.SimpleNamespace(shares_gpus=True)
    be.least_share_milli = lambda cluster: KubernetesBackend.least_share_milli(be, cluster)
    asked = QoSSpec(gpus=1, gpu_milli=100, cpu_cores=0.5)
    spec, why = _at_least_a_slice(asked, be, sched.cluster)
    assert spec.gpu_milli == 250 and "one slice" in why and "250/1000" in why, why
    # the larger slice where nodes differ; no label, no sharing, a stage of a slice or more, whole GPUs: unchanged
    two = _plan(NodeSpec("a", 1, labels={"nvidia.com/gpu.replicas": "8"}), NodeSpec("b", 1, labels=labels), NodeSpec("c", 1))
    assert _at_least_a_slice(asked, be, two.cluster)[0].gpu_milli == 250
    assert _at_least_a_slice(asked, be, _plan(NodeSpec("c", 1)).cluster) == (asked, "")
    assert _at_least_a_slice(QoSSpec(gpus=1, gpu_milli=300), be, sched.cluster)[0].gpu_milli == 300
    assert _at_least_a_slice(QoSSpec(gpus=2), be, sched.cluster) == (QoSSpec(gpus=2), "")
    off = types.SimpleNamespace(shares_gpus=False)
    off.least_share_milli = lambda cluster: KubernetesBackend.least_share_milli(off, cluster)
    assert _at_least_a_slice(asked, off, sched.cluster) == (asked, "")

    async def go():
        sched.start()
        book_foreign_pods(sched, {"n0": NodePodUsage(cpu=0.3, pods=3, slices=3)}, {})
        fs = [asyncio.ensure_future(sched.request(StageEntry(JobState(Job(f"s{k}", 0.0, spec, duration=5.0)), f"s{k}")))
              for k in range(2)]
        await until(lambda: sum(f.done() for f in fs) >= 1, "one stage placed")
        await asyncio.sleep(0.3)  # (a round or two more: the second must still wait)
        assert sum(f.done() for f in fs) == 1, "two stages placed beside 3 foreign slices of a 4-slice GPU"
        for f in fs:
            f.cancel()
        await sched.stop()

    asyncio.run(go())


def test_a_node_without_gpus_gets_no_warning_about_gpu_shares_booked_whole(caplog):
    """A node of 0 GPUs in the plan (a CPU-only node, or one whose device plugin advertises no GPU now) whose pods ask for
    slices of the shared resource was warned about ('... slice(s) of the shared GPU resource booked as whole GPUs'),
    though no GPU can be booked there, whole or shared: no warning; its pods' cores are booked. A GPU node without the
    replicas label is still warned about."""
    from qosflow.core.cluster import NodeSpec
    from qosflow.prefect.foreign_pods import book_foreign_pods

    sched, booked = _plan(NodeSpec("cpu-only-0", 0, cpu_cores=8, mem_mb=32768), NodeSpec("gpu-nolabel-0", 2, cpu_cores=8, mem_mb=32768)), {}
    with caplog.at_level(logging.WARNING, logger="qosflow"):
        book_foreign_pods(sched, {"cpu-only-0": NodePodUsage(cpu=1.0, pods=2, slices=2),
                                  "gpu-nolabel-0": NodePodUsage(cpu=1.0, pods=1, slices=1)}, booked)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in said if "cpu-only-0" in m], said
    assert [m for m in said if "gpu-nolabel-0" in m and "booked as whole GPUs" in m], said
    hold = sched.state.allocs[PODS_HOLD + "cpu-only-0"]
    assert hold.gpus == () and hold.cpu_cores == 1.0
    sched.state.check_invariants()
