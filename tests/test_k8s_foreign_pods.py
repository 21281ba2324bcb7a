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
                    n = lab.be.stats["pod_readings"]
                    await until(lambda: lab.be.stats["pod_readings"] > n, "another reading of the pods")
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
    ended = {**pod, "metadata": {"name": "p-ended", "namespace": "users"}, "status": {"phase": "Succeeded"}}
    unbound = {**pod, "metadata": {"name": "p-pending", "namespace": "users"}, "spec": {**pod["spec"], "nodeName": None}}
    other_ns_stage = {**stage, "metadata": {**stage["metadata"], "namespace": "team-b"}}  # (another pool's: not booked by this plan)
    got = foreign_usage([pod, stage, pipeline, placeholder, ended, unbound, other_ns_stage], gpu_resource="nvidia.com/gpu",
                        shared_resource="nvidia.com/gpu.shared", namespace="default", cluster_name="k")
    assert got["n1"].pods == 3
    assert got["n1"].gpus == 1
    assert abs(got["n1"].cpu - (3.1 + 0.25 + 4)) < 1e-9


def test_another_pools_stage_pods_in_the_same_namespace_are_booked_and_this_clusters_are_not():
    """Two qosflow pools (two cluster blocks) on the same nodes in one namespace: each books the other's stage pods (their
    pods carry their cluster's label), not its own (the plan books those). Before, every stage pod of the namespace was
    left out, so each pool placed stages into the room the other's held. A placeholder of this cluster is recognised by
    its label value even when the cluster's name is not one (it was compared with the name: counted as another's)."""

    def pod(name: str, labels: dict) -> dict:
        return {"metadata": {"name": name, "namespace": "ml", "labels": labels},
                "spec": {"nodeName": "n1", "containers": [{"resources": {"requests": {"cpu": "2", "nvidia.com/gpu": "1"}}}]},
                "status": {"phase": "Running"}}

    mine = pod("s1", {"qosflow.dev/stage-id": "s1", "qosflow.dev/cluster": "Lab-GPUs"})
    theirs = pod("s2", {"qosflow.dev/stage-id": "s2", "qosflow.dev/cluster": "vision-lab"})
    unlabelled = pod("s3", {"qosflow.dev/stage-id": "s3"})  # (made before stage pods carried the label: taken as this pool's)
    my_placeholder = pod("c1", {"qosflow.dev/role": "capacity-request", "qosflow.dev/cluster": "Lab-GPUs"})
    their_placeholder = pod("c2", {"qosflow.dev/role": "capacity-request", "qosflow.dev/cluster": "vision-lab"})
    got = foreign_usage([mine, theirs, unlabelled, my_placeholder, their_placeholder], gpu_resource="nvidia.com/gpu",
                        shared_resource="nvidia.com/gpu.shared", namespace="ml", cluster_name="Lab GPUs")
    assert got["n1"].pods == 2 and got["n1"].gpus == 2, got
    assert sorted(got["n1"].names) == ["ml/c2", "ml/s2"], got["n1"].names


def test_another_workers_placeholder_holds_its_room_unless_a_stage_may_preempt_it():
    """Several workers on one pool each make placeholders for their own waiting stages (qosflow.dev/capacity-owner
    names the maker). This backend's are deleted before the stage they stand for is launched, so they are not booked;
    another worker's, once bound, hold their room until that worker deletes them: they are booked, as kube-scheduler
    counts them, unless their priority (the API server's, from their `capacity_priority_class`) is below the stages'
    (0 here): kube-scheduler preempts them for a stage. A class that is not below (another pool's administrator's
    choice), or a priority not known, does not let a stage take the room: booked. One naming no maker (made by an older
    version) is taken as this backend's, as before."""

    def placeholder(name: str, owner: str | None, priority_class: str | None = None, priority: int | None = None) -> dict:
        ann = {"qosflow.dev/capacity-for": name} | ({"qosflow.dev/capacity-owner": owner} if owner else {})
        spec = {"nodeName": "n1", "containers": [{"resources": {"requests": {"cpu": "4", "nvidia.com/gpu": "2"}}}]}
        if priority_class:
            spec["priorityClassName"] = priority_class
        if priority is not None:
            spec["priority"] = priority
        return {"metadata": {"name": name, "namespace": "ml", "annotations": ann,
                             "labels": {"qosflow.dev/role": "capacity-request", "qosflow.dev/cluster": "lab"}},
                "spec": spec, "status": {"phase": "Running"}}

    pods = [placeholder("c-mine", "w1#h:1:a"), placeholder("c-old", None), placeholder("c-peer", "w2#h:2:b"),
            placeholder("c-peer-low", "w2#h:2:b", priority_class="qosflow-capacity", priority=-10)]
    kw = dict(gpu_resource="nvidia.com/gpu", shared_resource="nvidia.com/gpu.shared", namespace="ml", cluster_name="lab")
    got = foreign_usage(pods, own_placeholders={"w1#h:1:a"}, **kw)
    assert got["n1"].names == ("ml/c-peer",) and got["n1"].gpus == 2 and got["n1"].cpu == 4, got
    # the pod informer books them the same way, and drops the peer's when it is deleted
    from qosflow.backends.k8s_usage import PodSums

    sums = PodSums(own_placeholders={"w1#h:1:a"}, **kw)
    for p in pods:
        sums.put(p)
    assert {n: u.amounts() for n, u in sums.view().items()} == {n: u.amounts() for n, u in got.items()}
    sums.take("ml/c-peer")
    assert sums.view() == {}
    # every maker this backend had (its first id, then the worker's holder id) is its own
    assert foreign_usage(pods[:1], own_placeholders={"kubernetes-backend#h:1:x", "w1#h:1:a"}, **kw) == {}
    # a class at the stages' priority or above, or a priority not known (no Priority admission), holds its room
    for high in (placeholder("c-high", "w2#h:2:b", "theirs", priority=0), placeholder("c-high", "w2#h:2:b", "theirs", priority=1000),
                 placeholder("c-high", "w2#h:2:b", "theirs")):
        assert foreign_usage([high], own_placeholders={"w1#h:1:a"}, **kw)["n1"].gpus == 2, high
    # stage pods of priority 2000 (a globalDefault class) preempt one of 1000; stage pods that may not preempt, none
    assert foreign_usage([high], own_placeholders={"w1#h:1:a"}, stage_priority=2000, **kw)["n1"].gpus == 2  # (priority not known)
    assert foreign_usage([placeholder("c-high", "w2#h:2:b", "theirs", priority=1000)], stage_priority=2000, **kw) == {}
    assert foreign_usage([pods[3]], stage_priority=None, **kw)["n1"].gpus == 2


def test_stage_pods_carry_their_clusters_label():
    """What the test above reads: a stage's Jobs and their pods carry qosflow.dev/cluster (the name as a label value)."""
    from qosflow.core.cluster import ClusterSpec, NodeSpec
    from qosflow.core.placement import Placement

    cluster = ClusterSpec((NodeSpec("n0", 4, virtual=True), NodeSpec("n1", 4, virtual=True)))
    be = KubernetesBackend(api_client=client.ApiClient(), image="img:1", cluster_name="Lab GPUs")
    for p in (Placement("one", ((0, 0),)), Placement("gang", ((0, 0), (0, 1), (1, 0)), ((0, 2.0), (1, 1.0)))):
        jobs, _ = be.manifests(LaunchSpec(f"st-{p.job_id}", ["true"], p, cluster))
        assert jobs
        for m in jobs:
            assert m["metadata"]["labels"]["qosflow.dev/cluster"] == "Lab-GPUs"
            assert m["spec"]["template"]["metadata"]["labels"]["qosflow.dev/cluster"] == "Lab-GPUs"


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


# ---------------------------------------------------------------------- the pod informer (`watch_pods`)
def _pinned(pod: dict, node: str) -> dict:
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return pod


def _amounts(usage: dict) -> dict:
    return {n: (u.amounts(), u.pods) for n, u in usage.items()}


def test_the_pod_informer_follows_creations_changes_endings_and_deletions_across_namespaces_as_a_list_reads_them():
    """Old code: every reading LISTed (and parsed) all the cluster's bound pods. Now one LIST, then a WATCH (field
    selector, bookmarks): its view equals a fresh LIST's reading after each change, and the readings make no request.
    (On the emulator before this change, a pod's phase becoming Succeeded did not reach a watch whose field selector it
    left: the API server sends DELETED.)"""
    from qosflow.backends.k8s_usage import list_bound_pods

    async def go():
        with EmulatorServer([gpu_node("gpu-a", 4, cpu="16", memory="64Gi"), gpu_node("gpu-b", 4, cpu="16", memory="64Gi")]) as emu:
            be = KubernetesBackend(api_client=emu.api_client(), namespace="default")
            core = client.CoreV1Api(emu.api_client())
            for ns in ("users", "team-b", "kube-system"):
                core.create_namespace({"metadata": {"name": ns}})

            def fresh() -> dict:  # (a LIST reading, as without the informer)
                return _amounts(foreign_usage(list_bound_pods(be), gpu_resource=be.gpu_resource, shared_resource=be.shared_resource,
                                              namespace=be.namespace, cluster_name=be.cluster_name))

            async def same(what: str) -> None:
                async def check() -> bool:
                    return _amounts(await be.foreign_pod_usage()) == await asyncio.to_thread(fresh)

                end = asyncio.get_running_loop().time() + 10
                while not await check():
                    assert asyncio.get_running_loop().time() < end, f"the informer's view after {what}: {_amounts(await be.foreign_pod_usage())} != {fresh()}"
                    await asyncio.sleep(0.05)

            try:
                core.create_namespaced_pod("users", _pinned(foreign_pod("early", gpus=1, cpu="2"), "gpu-a"))
                await be.foreign_pod_usage()  # (the first reading LISTs, and starts the informer)
                await until(lambda: be._pod_informer.synced and emu.state()["watches"]["by_resource"].get("pods", 0) >= 1, "the pod watch is open")
                await same("the first LIST")
                pods = [("users", "nb-1", "gpu-a", 2, "4"), ("team-b", "nb-2", "gpu-b", 1, "1500m"), ("kube-system", "ds-a", "gpu-a", 0, "100m"),
                        ("kube-system", "ds-b", "gpu-b", 0, "100m"), ("default", "not-a-stage", "gpu-b", 0, "3")]
                for ns, name, node, gpus, cpu in pods:
                    core.create_namespaced_pod(ns, _pinned(foreign_pod(name, ns, gpus=gpus, cpu=cpu), node))
                await until(lambda: all(core.read_namespaced_pod(n, ns).status.phase == "Running" for ns, n, *_ in pods), "the pods run")
                got = await be.foreign_pod_usage()
                assert got["gpu-a"].pods == 3 and got["gpu-a"].gpus == 3 and got["gpu-b"].pods == 3, _amounts(got)
                # requests changed (a resize, through replace)
                p = core.read_namespaced_pod("nb-2", "team-b")
                p.spec.containers[0].resources.requests = {"cpu": "6", "memory": "8Gi"}
                core.replace_namespaced_pod("nb-2", "team-b", p)
                await until(lambda: asyncio.run(be.foreign_pod_usage())["gpu-b"].cpu == 6 + 0.1 + 3, "nb-2's new request seen")
                # a pod that ends (Succeeded): left out of the selector, DELETED on the watch
                p = core.read_namespaced_pod("ds-a", "kube-system")
                p.status.phase = "Succeeded"
                core.replace_namespaced_pod_status("ds-a", "kube-system", p)
                await until(lambda: asyncio.run(be.foreign_pod_usage())["gpu-a"].pods == 2, "ds-a's end seen")
                await same("a pod succeeded")
                core.delete_namespaced_pod("nb-1", "users")
                await until(lambda: asyncio.run(be.foreign_pod_usage())["gpu-a"].gpus == 1, "nb-1's deletion seen")
                await same("a pod deleted")
                for _ in range(20):  # (heartbeats: served from the view)
                    await be.foreign_pod_usage()
                assert be._pod_informer.synced
                # the backend's own LISTs: the first reading's and the informer's (`same` LISTs on its own, uncounted)
                assert be.stats["pod_lists"] == 2 and be.stats["pod_events"] >= 7, be.stats
            finally:
                await be.aclose()
            await until(lambda: not be._pod_informer.thread.is_alive(), "the pod watch stopped with the backend")

    asyncio.run(go())


def test_the_pod_informer_lists_again_on_410_and_the_readings_list_while_it_is_broken():
    async def go():
        with emulator() as emu:
            be = KubernetesBackend(api_client=emu.api_client(), namespace="default")
            core = client.CoreV1Api(emu.api_client())
            core.create_namespace({"metadata": {"name": "users"}})
            try:
                assert await be.foreign_pod_usage() == {}
                await until(lambda: be._pod_informer.synced and emu.state()["watches"]["by_resource"].get("pods", 0) >= 1, "the pod watch is open")
                # the watch's version is compacted (as etcd does): 410 Gone, a LIST, and a watch from there
                core.create_namespaced_config_map("default", {"metadata": {"name": "after-the-watch"}})
                await asyncio.to_thread(emu.compact)
                core.create_namespaced_pod("users", foreign_pod("nb", gpus=1, cpu="2"))
                await until(lambda: be.stats["pod_watch_410"] >= 1 and be.stats["pod_lists"] >= 3, "the pod watch listed again")
                await until(lambda: NODE in asyncio.run(be.foreign_pod_usage()), "the pod seen after the 410")
                assert (await be.foreign_pod_usage())[NODE].amounts() == (1, 2.0, 1024.0)
                # the informer stopped (as while broken): each reading LISTs, at most every pod_usage_every_s
                be._pod_informer.stop()
                await until(lambda: not be._pod_informer.thread.is_alive(), "the pod watch stopped")
                be.pod_usage_every_s = 0.0
                n = be.stats["pod_lists"]
                core.delete_namespaced_pod("nb", "users")
                assert await be.foreign_pod_usage() == {}
                assert be.stats["pod_lists"] == n + 1
            finally:
                await be.aclose()

    asyncio.run(go())


class _PlainLab(Lab):
    def make_backend(self) -> KubernetesBackend:  # (pod_usage_every_s left at POD_READ_S, as the worker has it)
        return EmulatedWorker.make_backend(self)


@pytest.mark.parametrize("watch_pods", [True, False])
def test_the_worker_books_a_new_foreign_pod_within_a_second_with_the_pod_informer(watch_pods):
    """Old code (and `watch_pods=False`): the pods were LISTed at most every POD_READ_S (5 s), so a pod bound just after a
    reading was booked up to 5 s later, while a stage could be placed into its room. With the informer: at the next
    heartbeat after its event."""

    async def go():
        with emulator() as emu:
            async with _PlainLab(emu) as lab:  # (pod_usage_every_s as the worker has it, POD_READ_S)
                lab.be.watch_pods = watch_pods
                await until(lambda: lab.be.stats.get("pod_lists", 0) >= 1, "a first reading")
                if watch_pods:  # (old code: no informer, nothing to wait for)
                    await until(lambda: getattr(getattr(lab.be, "_pod_informer", None), "synced", True), "the pod informer listed")
                await asyncio.sleep(0.5)
                lab.create(foreign_pod("notebook", gpus=2, cpu="4"))
                await until(lambda: lab.running("notebook"), "the notebook pod runs on the node")
                if watch_pods:
                    await until(lambda: lab.held() == (2, 4.0, 1024.0), "the notebook booked within 1 s", timeout=1.0)
                else:  # (the last LIST reading is younger than POD_READ_S: the pod is not booked yet)
                    await asyncio.sleep(1.0)
                    assert lab.held() == (0, 0.0, 0.0)
                    await until(lambda: lab.held() == (2, 4.0, 1024.0), "the notebook booked at the next LIST reading", timeout=6.0)

    asyncio.run(go())


def test_an_account_that_may_list_pods_but_not_watch_them_is_read_by_lists(caplog):
    """RBAC that grants list on pods but not watch: the informer's WATCH gets 403. It stops for good (it would get 403
    again), says once what to grant, and the heartbeats' readings LIST instead (at most every pod_usage_every_s),
    following the pods as before."""
    import logging

    async def go():
        with emulator() as emu:
            emu.add_fault(r"^/api/v1/pods$", method="GET", status=403, count=1000, query=r"(^|&)watch=(true|1)")
            be = KubernetesBackend(api_client=emu.api_client(), namespace="default")
            be.pod_usage_every_s = 0.0
            core = client.CoreV1Api(emu.api_client())
            core.create_namespace({"metadata": {"name": "users"}})
            try:
                core.create_namespaced_pod("users", foreign_pod("nb", gpus=1, cpu="2"))
                await until(lambda: core.read_namespaced_pod("nb", "users").status.phase == "Running", "the pod runs")
                assert (await be.foreign_pod_usage())[NODE].amounts() == (1, 2.0, 1024.0)  # (a LIST; the informer starts)
                await until(lambda: be._pod_informer.forbidden, "the informer told it may not watch")
                await until(lambda: not be._pod_informer.thread.is_alive(), "the informer's thread ended")
                assert be._pod_informer.usage() is None
                n = be.stats["pod_lists"]
                core.create_namespaced_pod("users", foreign_pod("nb-2", gpus=2, cpu="1"))
                await until(lambda: core.read_namespaced_pod("nb-2", "users").status.phase == "Running", "the second pod runs")
                assert (await be.foreign_pod_usage())[NODE].amounts() == (3, 3.0, 2048.0)
                core.delete_namespaced_pod("nb", "users")
                assert (await be.foreign_pod_usage())[NODE].amounts() == (2, 1.0, 1024.0)
                assert be.stats["pod_lists"] == n + 2  # (each reading listed)
                be._pod_informer.start()  # (the next readings start it again: refused for good)
                assert not be._pod_informer.thread.is_alive()
            finally:
                await be.aclose()

    with caplog.at_level(logging.WARNING, logger="qosflow.backends.kubernetes"):
        asyncio.run(go())
    said = [r.getMessage() for r in caplog.records if "may list pods but not watch them" in r.getMessage()]
    assert len(said) == 1 and "grant it watch on pods" in said[0], said
