"""Pods that are not qosflow's stages, on a shared Kubernetes cluster: the worker books what they request on their nodes.

Before, the worker's plan described a node by its allocatable GPUs/cpu/memory and booked qosflow's own stages only; a
pod of another user (a notebook holding GPUs), a DaemonSet's or a pipeline run's took room the plan still counted free,
a stage was placed there and its pod stayed Pending (Unschedulable) until it failed as INFRA and ran again. Here a
worker (scheduler + KubernetesBackend + its heartbeat's `_sync_health`, every 0.2 s) runs on qosflow's API emulator
(EMULATED: no cluster); the other pods are created straight through the API, as their owners would.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from kubernetes import client

from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.backends.k8s_usage import foreign_usage, pod_requests
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.job import Job, JobState
from qosflow.core.qos import QoSSpec
from k8s_lab import EmulatedWorker, until
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from qosflow.prefect.cluster_table import PODS_HOLD, node_usage

pytestmark = pytest.mark.timeout(90)
NODE = "gpu-a"


def foreign_pod(name: str, namespace: str = "users", *, gpus: int = 0, cpu: str = "4", memory: str = "1Gi",
                labels: dict | None = None) -> dict:
    """A pod qosflow did not make (a notebook, a DaemonSet's), pinned to NODE, running until deleted (a pause image)."""
    res: dict = {"requests": {"cpu": cpu, "memory": memory}}
    if gpus:
        res["limits"] = {"nvidia.com/gpu": str(gpus)}  # (its GPU request defaults to the limit)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels or {"app": name}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE},
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9", "resources": res}]}}


class Lab(EmulatedWorker):
    """A worker on one node of 4 GPUs and 8 cpu: its scheduler (fifo) and its heartbeat's health reading every 0.2 s."""

    def __init__(self, emu: EmulatorServer):
        super().__init__(emu, pool="k8s-foreign-pods", beat=("_sync_health",), unschedulable_timeout_s=2.0)

    def make_backend(self) -> KubernetesBackend:
        be = super().make_backend()
        be.pod_usage_every_s = 0.0  # (read at every heartbeat here: POD_READ_S otherwise)
        return be

    def create(self, pod: dict) -> None:
        with contextlib.suppress(client.exceptions.ApiException):
            self.core.create_namespace({"metadata": {"name": pod["metadata"]["namespace"]}})
        self.core.create_namespaced_pod(pod["metadata"]["namespace"], pod)

    def running(self, name: str, namespace: str = "users") -> bool:
        p = self.core.read_namespaced_pod(name, namespace)
        return p.status.phase == "Running" and bool(p.spec.node_name)

    def held(self) -> tuple[int, float, float]:
        """What the plan books on NODE for the pods that are not stages: (GPUs, cores, MiB)."""
        p = self.sched.state.allocs.get(PODS_HOLD + NODE)
        return (0, 0.0, 0.0) if p is None else (len(p.gpus), round(p.cpu_cores, 3), round(p.mem_mb, 1))

    def queue(self, name: str, gpus: int, cpu: float = 2.0) -> asyncio.Future:
        """Queue a stage; resolves to its grant."""
        from qosflow.prefect.scheduler import StageEntry

        e = StageEntry(JobState(Job(name, 0.0, QoSSpec(gpus=gpus, cpu_cores=cpu, mem_mb=1024), duration=5.0)), name)
        return asyncio.ensure_future(self.sched.request(e))

    async def run(self, name: str, run_s: float = 0.3):
        """Launch a placed stage as the worker does, wait for it, give its slot back; its exit status."""
        self.emu.add_rule(selector=f"qosflow.dev/stage-id={name}", run_s=run_s)
        p = self.sched.entries[name].grant.placement
        h = await self.be.launch(LaunchSpec(name, ["true"], p, self.sched.cluster))
        st = await self.be.wait(h)
        self.sched.release(name, ok=st.kind is ExitKind.OK)
        return st


def emulator() -> EmulatorServer:
    return EmulatorServer([gpu_node(NODE, 4, cpu="8", memory="32Gi")])


def test_a_stage_waits_for_the_gpus_another_users_pod_holds_and_one_that_fits_beside_it_runs_at_once():
    async def go():
        with emulator() as emu:
            async with Lab(emu) as lab:
                lab.create(foreign_pod("notebook", gpus=2, cpu="4"))
                await until(lambda: lab.running("notebook"), "the notebook pod runs on the node")
                await until(lambda: lab.held() == (2, 4.0, 1024.0), "the notebook's 2 GPUs, 4 cores and 1 GiB booked in the plan")
                assert lab.be.stats["pod_lists"] >= 1
                # not a stage: the cluster table counts no stage there, the node's GPUs show in use
                (u,) = node_usage(lab.sched.state)
                assert (u.stages, u.allocated, u.cpu_free) == (0, 2, 4.0)
                small = lab.queue("small", gpus=2)
                await asyncio.wait_for(small, 5)  # 2 GPUs and 2 cores fit beside the notebook: at once
                big = lab.queue("big", gpus=4)
                st = await lab.run("small")
                assert st.kind is ExitKind.OK, st  # (its pod was bound: not Unschedulable, not an INFRA failure)
                await asyncio.sleep(0.6)
                assert not big.done(), "a stage of 4 GPUs was placed on a node whose 2 GPUs another user's pod holds"
                lab.core.delete_namespaced_pod("notebook", "users")
                await asyncio.wait_for(big, 10)  # the pod is gone: its hold with it, and the stage is placed
                assert lab.held() == (0, 0.0, 0.0)
                st = await lab.run("big")
                assert st.kind is ExitKind.OK, st

    asyncio.run(go())


def test_a_daemonsets_pod_and_a_pipeline_runs_pod_are_booked_and_qosflows_own_stage_pods_are_not_counted_twice():
    async def go():
        with emulator() as emu:
            async with Lab(emu) as lab:
                lab.create(foreign_pod("nvidia-dcgm-exporter-x1", "kube-system", cpu="100m", memory="128Mi",
                                       labels={"app": "dcgm", "controller-revision-hash": "1"}))
                await until(lambda: lab.held() == (0, 0.1, 128.0), "the DaemonSet pod's 100m cpu and 128 MiB booked")
                # a pipeline run's pod (launched unplaced: kube-scheduler picked the node, the only one here)
                emu.add_rule(selector="qosflow.dev/stage-id=pipe-1", run_s=60)
                ph = await lab.be.launch_unplaced("pipe-1", ["true"], {})
                await until(lambda: lab.held() == (0, 0.35, 640.0), "the pipeline run's 250m cpu and 512 MiB booked too")
                # a stage of qosflow's own (placed and booked by the plan): its pod is not booked again
                g = await asyncio.wait_for(lab.queue("stage-1", gpus=1, cpu=3.0), 5)
                emu.add_rule(selector="qosflow.dev/stage-id=stage-1", run_s=60)
                sh = await lab.be.launch(LaunchSpec("stage-1", ["true"], g.placement, lab.sched.cluster))
                await until(lambda: any(p.status.phase == "Running" for p in
                                        lab.core.list_namespaced_pod("default", label_selector="qosflow.dev/stage-id=stage-1").items),
                            "the stage's pod runs")
                for _ in range(3):  # (some heartbeats with the stage's pod running)
                    n = lab.be.stats["pod_lists"]
                    await until(lambda: lab.be.stats["pod_lists"] > n, "another reading of the pods")
                assert lab.held() == (0, 0.35, 640.0)
                assert abs(float(lab.sched.state.cpu_free[0]) - (8 - 3 - 0.35)) < 1e-6
                (u,) = node_usage(lab.sched.state)
                assert u.stages == 1
                # the pipeline run ends: its part of the hold goes
                await lab.be.kill(ph)
                await until(lambda: lab.held() == (0, 0.1, 128.0), "the ended pipeline run's cpu given back")
                await lab.be.kill(sh)

    asyncio.run(go())


def test_effective_requests_as_kube_scheduler_counts_them_and_what_is_left_out():
    pod = {"metadata": {"name": "p", "namespace": "users"}, "spec": {
        "nodeName": "n1",
        "containers": [{"resources": {"limits": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"}}},  # requests = limits
                       {"resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "2"}}}],
        "initContainers": [{"resources": {"requests": {"cpu": "3", "memory": "512Mi"}}},
                           {"restartPolicy": "Always", "resources": {"requests": {"cpu": "250m"}}}],  # a sidecar
        "overhead": {"cpu": "100m", "memory": "64Mi"}}, "status": {"phase": "Running"}}
    req = pod_requests(pod)
    assert req["nvidia.com/gpu"] == 1
    assert abs(req["cpu"] - (3 + 0.1)) < 1e-9  # max(1 + 0.5 + 0.25, 3) + overhead
    assert req["memory"] == 2**30 + 64 * 2**20
    stage = {"metadata": {"name": "s", "namespace": "default", "labels": {"qosflow.dev/stage-id": "s"}},
             "spec": {"nodeName": "n1", "containers": [{"resources": {"requests": {"cpu": "4"}}}]}, "status": {"phase": "Running"}}
    pipeline = {"metadata": {"name": "r", "namespace": "default", "labels": {"qosflow.dev/stage-id": "r", "qosflow.dev/role": "pipeline"}},
                "spec": {"nodeName": "n1", "containers": [{"resources": {"requests": {"cpu": "250m"}}}]}, "status": {"phase": "Running"}}
    placeholder = {"metadata": {"name": "c", "namespace": "default", "labels": {"qosflow.dev/role": "capacity-request", "qosflow.dev/cluster": "k"}},
                   "spec": {"nodeName": "n1", "containers": [{"resources": {"requests": {"cpu": "4"}}}]}, "status": {"phase": "Running"}}
    ended = {**pod, "status": {"phase": "Succeeded"}}
    unbound = {**pod, "spec": {**pod["spec"], "nodeName": None}}
    other_ns_stage = {**stage, "metadata": {**stage["metadata"], "namespace": "team-b"}}  # (another pool's: not booked by this plan)
    got = foreign_usage([pod, stage, pipeline, placeholder, ended, unbound, other_ns_stage], gpu_resource="nvidia.com/gpu",
                        shared_resource="nvidia.com/gpu.shared", namespace="default", cluster_name="k")
    assert got["n1"].pods == 3
    assert got["n1"].gpus == 1
    assert abs(got["n1"].cpu - (3.1 + 0.25 + 4)) < 1e-9


def test_the_holds_follow_the_readings_book_what_fits_now_and_the_rest_later():
    from qosflow.backends.k8s_usage import NodePodUsage
    from qosflow.core.cluster import ClusterSpec, NodeSpec
    from qosflow.core.placement import Placement
    from qosflow.policies import get_policy
    from qosflow.prefect.foreign_pods import book_foreign_pods
    from qosflow.prefect.scheduler import QoSScheduler

    sched = QoSScheduler(ClusterSpec((NodeSpec("n0", 4, cpu_cores=8, mem_mb=32768), NodeSpec("n1", 4, cpu_cores=8, mem_mb=32768))),
                         get_policy("fifo"), coda=False)
    st, booked = sched.state, {}
    # a stage of the plan holds 3 GPUs and 6 cores of n0: a pod asking 2 GPUs and 4 cores there gets what is left
    assert sched.hold("lease:x", Placement("lease:x", ((0, 0), (0, 1), (0, 2)), ((0, 6.0),)), QoSSpec(gpus=3, cpu_cores=6))
    st.set_node_down(1, True)  # (n1 down: booked all the same, for when it is back)
    book_foreign_pods(sched, {"n0": NodePodUsage(2, 4.0, 1024.0, 1), "n1": NodePodUsage(1, 1.0, 0.0, 1)}, booked)
    p0, p1 = st.allocs[PODS_HOLD + "n0"], st.allocs[PODS_HOLD + "n1"]
    assert (len(p0.gpus), p0.cpu_cores) == (1, 2.0)
    assert (len(p1.gpus), p1.cpu_cores) == (1, 1.0) and bool(st.down[1])
    st.check_invariants()
    sched.unhold("lease:x")  # the stage ends: the next reading books the pod's whole request
    book_foreign_pods(sched, {"n0": NodePodUsage(2, 4.0, 1024.0, 1), "n1": NodePodUsage(1, 1.0, 0.0, 1)}, booked)
    p0 = st.allocs[PODS_HOLD + "n0"]
    assert (len(p0.gpus), p0.cpu_cores, p0.mem_mb) == (2, 4.0, 1024.0)
    assert st.allocs[PODS_HOLD + "n1"] is p1  # (unchanged: not booked again)
    # the pods end: their holds go, and the scheduler is told to look again
    assert book_foreign_pods(sched, {}, booked)
    assert not any(k.startswith(PODS_HOLD) for k in st.allocs) and booked == {}
    assert float(st.cpu_free[0]) == 8.0 and int(st.empty[0]) == 4
    st.check_invariants()
