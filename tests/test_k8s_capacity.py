"""Scaling from zero: a worker on Kubernetes asks the cluster's autoscaler for a node for the stages that wait because no
node has room for them (`request_capacity`), with placeholder pods as the cluster-overprovisioner does.

A cluster-autoscaler adds a node only for pods Pending and Unschedulable; qosflow keeps a waiting stage in its own QoS
queue and creates its pod only once it has placed it, so on a GPU pool scaled to zero (or full) nothing asked for a node
and the stages waited for ever. Here a worker (scheduler + KubernetesBackend + its node reload and heartbeat) runs on
qosflow's API emulator (EMULATED: no cluster) with the emulator's cluster-autoscaler over one GPU node group
(`NodeGroup`): its only node is scaled down once unneeded, then a stage arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import pytest
from kubernetes import client

from qosflow.backends.base import CapacityWant, ExitKind, LaunchSpec, StageHandle
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.placement import Placement
from qosflow.core.job import Job, JobState
from qosflow.core.qos import QoSSpec
from k8s_lab import EmulatedWorker, until
from qosflow.k8s_emulator import EmulatorServer, NodeGroup, gpu_node

pytestmark = pytest.mark.timeout(120)
CAPACITY = "qosflow.dev/role=capacity-request"


def group(**kw) -> NodeGroup:
    # (scale_down_unneeded_s long until the worker has started: `scaled_to_zero` shortens it; a worker cannot start on a
    # cluster with no node)
    return NodeGroup(template=gpu_node("template", 1), **{"min": 0, "max": 2, "scale_up_delay_s": 0.3, "scale_down_unneeded_s": 600.0, **kw})


class Lab(EmulatedWorker):
    """A worker on the emulator: its scheduler (fifo), its node reload loop and its heartbeat (health, then capacity
    requests, as `QosflowWorker._health_loop` does), every 0.2 s."""

    def __init__(self, emu: EmulatorServer, **backend):
        super().__init__(emu, pool="k8s-capacity", reload_s=0.2, beat=("_sync_health", "_sync_capacity_requests"),
                         node_selector={"nvidia.com/gpu.present": "true"}, capacity_request_after_s=0.2, **backend)

    def nodes(self) -> list[str]:
        return [n.metadata.name for n in self.core.list_node().items]

    def placeholders(self) -> list:
        return self.core.list_namespaced_pod("default", label_selector=CAPACITY).items

    def all_pods(self) -> list:
        return self.core.list_namespaced_pod("default").items

    def queue(self, name: str, gpus: int = 1) -> asyncio.Future:
        """Queue a stage; resolves to the node the scheduler gives it."""
        from qosflow.prefect.scheduler import StageEntry

        e = StageEntry(JobState(Job(name, 0.0, QoSSpec(gpus=gpus, cpu_cores=2, mem_mb=1024), duration=5.0)), name)

        async def placed() -> str:
            g = await self.sched.request(e)
            (node,) = g.placement.nodes
            return self.sched.cluster.nodes[node].name

        return asyncio.ensure_future(placed())



async def scaled_to_zero(lab: Lab) -> None:
    """The autoscaler deletes the group's only node once unneeded; the worker sees it down."""
    lab.emu.cluster.autoscaler.scale_down_unneeded_s = 0.5
    await until(lambda: lab.nodes() == [], "the GPU pool scaled to zero")
    await until(lambda: bool(lab.sched.state.down.all()), "every node down in the worker's plan")


def test_a_stage_on_a_pool_scaled_to_zero_gets_a_node_through_its_placeholder_and_runs_there():
    async def go():
        g = group()
        with EmulatorServer([g.node("gpu-pool-first")], autoscaler=g) as emu:
            async with Lab(emu, request_capacity=True) as lab:
                await scaled_to_zero(lab)
                waiting = lab.queue("a")
                await until(lambda: len(lab.placeholders()) == 1, "a placeholder pod for the waiting stage")
                (ph,) = lab.placeholders()
                assert ph.metadata.labels["qosflow.dev/capacity-for"] == "a"
                assert ph.metadata.labels["app.kubernetes.io/managed-by"] == "qosflow"
                assert "qosflow.dev/stage-id" not in ph.metadata.labels  # (no stage's selector matches it)
                assert ph.metadata.annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "true"
                c = ph.spec.containers[0]
                assert c.image == "registry.k8s.io/pause:3.9"
                assert c.resources.requests == {"cpu": "2000m", "memory": "1024Mi", "nvidia.com/gpu": "1"}
                assert c.resources.limits == {"nvidia.com/gpu": "1"}
                assert ph.spec.node_selector == {"nvidia.com/gpu.present": "true"}
                assert any(t.key == "nvidia.com/gpu" and t.effect == "NoSchedule" for t in ph.spec.tolerations)
                # the autoscaler adds a node for it; the worker plans on it and places the stage there
                node = await asyncio.wait_for(waiting, 20)
                log = emu.state()["autoscaler"]["log"]
                ups = [x for x in log if x["action"] == "scale-up"]
                assert [x["node"] for x in ups] == [node] and ups[0]["pods"] == [ph.metadata.name], log
                assert node != "gpu-pool-first"
                # placed: its placeholder is deleted before its Job is created, so that the stage's pod gets the node
                # (one GPU: with the placeholder still there it would be Unschedulable)
                h = await lab.launch("a", 0.3)
                assert lab.placeholders() == []
                st = await lab.be.wait(h)
                assert st.kind is ExitKind.OK, st
                assert lab.pod_node("a") == node
                assert lab.be.stats["capacity_requested"] == 1 and lab.be.stats["capacity_dropped"] == 1, lab.be.stats
                lab.sched.release("a")
                # the node, unneeded again, is scaled down
                await until(lambda: lab.nodes() == [], "the new node scaled down once unneeded")
                assert lab.placeholders() == []

    asyncio.run(go())


def test_without_request_capacity_nothing_asks_for_a_node_and_the_stage_waits():
    """The behaviour before (and still the default): the stage waits in the QoS queue, no pod is created, the
    autoscaler sees nothing to scale up for."""
    async def go():
        g = group()
        with EmulatorServer([g.node("gpu-pool-first")], autoscaler=g) as emu:
            async with Lab(emu) as lab:
                await scaled_to_zero(lab)
                waiting = lab.queue("a")
                await asyncio.sleep(2.0)  # (ten times capacity_request_after_s, six times the scale-up delay)
                assert not waiting.done()
                assert lab.all_pods() == [] and lab.nodes() == []
                assert [x["action"] for x in emu.state()["autoscaler"]["log"]] == ["scale-down"]
                lab.sched.drop("a")
                with contextlib.suppress(Exception):
                    await waiting

    asyncio.run(go())


def test_a_placeholder_goes_when_its_stage_is_cancelled_and_a_dead_worker_s_are_cleaned_up_at_start():
    async def go():
        g = group(scale_up_delay_s=600.0)  # (no node comes: the stage is cancelled while it waits)
        with EmulatorServer([g.node("gpu-pool-first")], autoscaler=g) as emu:
            core = client.CoreV1Api(emu.api_client())
            # a placeholder a worker left when it died
            dead = KubernetesBackend(namespace="default", api_client=emu.api_client(), node_selector={"nvidia.com/gpu.present": "true"})
            try:
                left = dead.capacity_request_manifest(CapacityWant("ghost", "ghost", gpus=1, cpu_cores=1))
            finally:
                await dead.aclose()
            await asyncio.to_thread(core.create_namespaced_pod, "default", left)
            async with Lab(emu, request_capacity=True) as lab:
                await until(lambda: lab.placeholders() == [] and lab.be.stats["capacity_left_deleted"] == 1,
                            "the dead worker's placeholder deleted at the first sync")
                await scaled_to_zero(lab)
                waiting = lab.queue("a")
                await until(lambda: [p.metadata.labels["qosflow.dev/capacity-for"] for p in lab.placeholders()] == ["a"],
                            "a placeholder for the waiting stage")
                lab.sched.drop("a", "flow run cancelled")  # (what the worker does when its flow run is cancelled)
                with contextlib.suppress(Exception):
                    await waiting
                await until(lambda: lab.placeholders() == [] and lab.be.stats["capacity_dropped"] == 1,
                            "the placeholder deleted once its stage left the queue", timeout=5)

    asyncio.run(go())


def test_a_stage_the_plan_has_room_for_gets_no_placeholder_and_at_most_max_capacity_requests_are_made():
    async def go():
        g = group(scale_up_delay_s=600.0)
        with EmulatorServer([g.node("gpu-pool-first")], autoscaler=g) as emu:
            async with Lab(emu, request_capacity=True, max_capacity_requests=2) as lab:
                first = lab.queue("a")  # the only GPU
                assert await asyncio.wait_for(first, 10) == "gpu-pool-first"
                waiting = [lab.queue(n) for n in ("b", "c", "d")]
                await until(lambda: len(lab.placeholders()) == 2, "two placeholders")
                await asyncio.sleep(0.6)
                assert sorted(p.metadata.labels["qosflow.dev/capacity-for"] for p in lab.placeholders()) == ["b", "c"]  # (waited longest)
                # a stage has ended: b fits on the plan now and is placed; it is launched, its placeholder goes first, and
                # c's, not bound yet, with it: the kube-scheduler could bind it to the room b's leaves before b's pod exists
                lab.sched.release("a")
                assert await asyncio.wait_for(waiting[0], 10) == "gpu-pool-first"
                h = await lab.launch("b", 0.2)
                assert "b" not in {p.metadata.labels["qosflow.dev/capacity-for"] for p in lab.placeholders()}
                # (2: b's and c's; 3 when a heartbeat came between b's placement and its launch: it deleted b's, no longer
                # waiting, and made d's, which the launch deleted with c's, both unbound)
                assert lab.be.stats["capacity_dropped"] in (2, 3), lab.be.stats
                assert (await lab.be.wait(h)).kind is ExitKind.OK
                await until(lambda: sorted(p.metadata.labels["qosflow.dev/capacity-for"] for p in lab.placeholders()) == ["c", "d"],
                            "d's placeholder made in b's stead")
                for n, f in zip(("b", "c", "d"), waiting):
                    lab.sched.drop(n)
                    with contextlib.suppress(Exception):
                        await f
                await until(lambda: lab.placeholders() == [], "every placeholder deleted")

    asyncio.run(go())


def placeholder_nodes(core) -> dict:
    """The namespace's placeholders: {the stage each is for: the node it is bound to, or None while Pending}."""
    return {p.metadata.labels["qosflow.dev/capacity-for"]: p.spec.node_name
            for p in core.list_namespaced_pod("default", label_selector=CAPACITY).items}


def test_no_placeholder_is_made_between_a_stage_s_way_cleared_and_its_pod_bound():
    """A stage placed into the room its placeholder held: `_clear_way` deletes that placeholder and this worker's others
    not bound, then the launch creates the Job, then the job controller its pod. A heartbeat's sync in between made the
    placeholder of another waiting stage again at once, which kube-scheduler bound to the freed room first: the stage's
    pod stayed Unschedulable behind it, and failed as INFRA (seen as a rare failure of the test above). Now a sync makes
    no placeholder until the stage's pods are bound (or `unschedulable_timeout_s` has passed). EMULATED: no cluster."""
    async def go():
        with EmulatorServer([gpu_node("n", 1)]) as emu:
            be = KubernetesBackend(namespace="default", image="busybox:1.36", api_client=emu.api_client(), request_capacity=True,
                                   unschedulable_timeout_s=30.0)
            core = client.CoreV1Api(emu.api_client())
            try:
                cluster = await be.inventory()
                b, c = (CapacityWant(j, j, gpus=1, cpu_cores=1) for j in ("b", "c"))

                def placeholders() -> dict:
                    return placeholder_nodes(core)

                await be.sync_capacity_requests([b, c])
                await until(lambda: placeholders() == {"b": "n", "c": None}, "b's placeholder bound to the node, c's Pending")
                await be._clear_way("b", ["n"])  # (b placed on n: its launch begins)
                assert await asyncio.to_thread(placeholders) == {}
                await be.sync_capacity_requests([c])  # (a heartbeat before b's Job exists)
                await asyncio.sleep(0.3)  # (some controller steps: a placeholder made now would be bound to n)
                assert await asyncio.to_thread(placeholders) == {}
                emu.add_rule(selector="qosflow.dev/stage-id=b", run_s=60)
                h = await be.launch(LaunchSpec("b", ["true"], Placement("b", ((0, 0),), ((0, 1.0),)), cluster))
                await until(lambda: [p.spec.node_name for p in core.list_namespaced_pod("default", label_selector="qosflow.dev/stage-id=b").items]
                            == ["n"], "b's pod bound to n")
                await be.sync_capacity_requests([c])  # (now c's placeholder is made: Pending, no room)
                await asyncio.sleep(0.3)
                assert await asyncio.to_thread(placeholders) == {"c": None} and be._capacity_settling == {}
                await be.kill(h)
            finally:
                await be.aclose()

    asyncio.run(go())


def test_a_stage_done_or_killed_before_a_sync_looked_lets_placeholders_be_made_again():
    """The settling `_clear_way` starts ends when the stage's attempt has its pods bound. A stage that ended before a
    heartbeat's sync looked (its pod Succeeded: a short stage) left its ended pod out of the count, and a stage killed
    before its pod was bound left none: every placeholder of the backend waited for `unschedulable_timeout_s` (60 s by
    default) behind it. And a pod of an earlier attempt of the same job (qosflow.dev/job; one terminating after a kill)
    counted as the new attempt's, bound: settled before its pod existed. Now the attempt's own pods are read (its
    stage id), an ended one counts as bound, and a kill ends its settling. EMULATED: no cluster."""
    async def go():
        with EmulatorServer([gpu_node("n", 1)]) as emu:
            be = KubernetesBackend(namespace="default", image="busybox:1.36", api_client=emu.api_client(), request_capacity=True,
                                   unschedulable_timeout_s=600.0)
            core = client.CoreV1Api(emu.api_client())
            try:
                cluster = await be.inventory()
                b, c = (CapacityWant(j, j, gpus=1, cpu_cores=1) for j in ("b", "c"))

                def placeholders() -> dict:
                    return placeholder_nodes(core)

                async def c_made() -> None:
                    await be.sync_capacity_requests([c])
                    await until(lambda: "c" in placeholders(), "c's placeholder made")

                # 1. b runs and ends before a sync looks: its Succeeded pod was bound
                await be.sync_capacity_requests([b])
                await until(lambda: placeholders() == {"b": "n"}, "b's placeholder bound")
                emu.add_rule(selector="qosflow.dev/stage-id=b", run_s=0.2)
                h = await be.launch(LaunchSpec("b", ["true"], Placement("b", ((0, 0),), ((0, 1.0),)), cluster))
                assert (await be.wait(h)).ok and set(be._capacity_settling) == {"b"}
                await c_made()
                assert be._capacity_settling == {}
                await be.sync_capacity_requests([])
                await until(lambda: placeholders() == {}, "c's placeholder dropped")

                # 2. b's retry killed before its pod was bound
                be._capacity_placed.clear()
                await be.sync_capacity_requests([b])
                await until(lambda: placeholders() == {"b": "n"}, "b's placeholder bound again")
                await be._clear_way("b", ["n"], "b-r1")
                await be.kill(StageHandle("b-r1", be.name, "n", {"namespace": "default", "jobs": ["nope"], "podgroup": None, "secret": None}))
                await c_made()
                await be.sync_capacity_requests([])
                await until(lambda: placeholders() == {}, "c's placeholder dropped again")

                # 3. an earlier attempt's pod still bound (b-r2 running on n) is not the new attempt's (b-r3)
                emu.add_rule(selector="qosflow.dev/stage-id=b-r2", run_s=60)
                h2 = await be.launch(LaunchSpec("b-r2", ["true"], Placement("b", ((0, 0),), ((0, 1.0),)), cluster))
                await until(lambda: [p.spec.node_name for p in core.list_namespaced_pod("default", label_selector="qosflow.dev/stage-id=b-r2").items]
                            == ["n"], "b-r2's pod bound")
                be._capacity_settling.clear()
                await be._clear_way("b", ["n"], "b-r3")
                await be.sync_capacity_requests([c])
                await asyncio.sleep(0.3)
                assert await asyncio.to_thread(placeholders) == {} and set(be._capacity_settling) == {"b"}
                await be.kill(h2)
            finally:
                await be.aclose()

    asyncio.run(go())


# ---------------------------------------------------------------------- the emulator's cluster-autoscaler alone
def _pause_pod(name: str, gpus: int, **spec) -> dict:
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "pause", "image": "registry.k8s.io/pause:3.9", "resources": {
        "requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}}}], **spec}}


def test_the_emulated_autoscaler_adds_nodes_for_unschedulable_pods_that_fit_its_template_up_to_max_and_removes_unneeded_ones():
    g = NodeGroup(template=gpu_node("template", 2), min=1, max=2, scale_up_delay_s=0.2, scale_down_unneeded_s=0.5)
    with EmulatorServer([], autoscaler=g) as emu:
        core = client.CoreV1Api(emu.api_client())

        def wait(cond, what: str, timeout: float = 10.0) -> None:
            end = time.monotonic() + timeout
            while not cond():
                assert time.monotonic() < end, f"timed out waiting until {what}"
                time.sleep(0.05)

        for i in range(3):  # 3 GPUs: two nodes of 2
            core.create_namespaced_pod("default", _pause_pod(f"p{i}", 1))
        core.create_namespaced_pod("default", _pause_pod("big", 4))  # no node of the group could hold it
        core.create_namespaced_pod("default", _pause_pod("other", 1, nodeSelector={"pool": "cpu"}))  # not the group's label
        wait(lambda: sum(p.status.phase == "Running" for p in core.list_namespaced_pod("default").items) == 3, "p0..p2 running")
        nodes = [n.metadata.name for n in core.list_node().items]
        assert len(nodes) == 2 and all(n.startswith("gpu-pool-") for n in nodes), nodes
        assert all(n.metadata.labels["emulator.qosflow.dev/node-group"] == "gpu-pool" for n in core.list_node().items)
        for name in ("big", "other"):
            pod = core.read_namespaced_pod(name, "default")
            assert pod.status.phase == "Pending" and pod.status.conditions[0].reason == "Unschedulable"
        time.sleep(1.0)  # the pause pods run on (they do not end as the emulator's other pods do), the nodes stay
        assert len(core.list_node().items) == 2
        assert all(x["action"] == "scale-up" for x in emu.state()["autoscaler"]["log"])
        for i in range(3):
            core.delete_namespaced_pod(f"p{i}", "default")
        wait(lambda: len(core.list_node().items) == 1, "scaled down to min=1")
        time.sleep(0.8)
        assert len(core.list_node().items) == 1


def test_the_emulator_cli_checks_its_autoscaler_flags():
    r = subprocess.run([sys.executable, "-m", "qosflow.k8s_emulator", "--port", "0", "--autoscale-max", "1", "--autoscale-min", "2"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--autoscale-min (2) must be at most --autoscale-max (1)" in r.stderr, r.stderr


# ---------------------------------------------------------------------- gangs wider than a node; a worker started at zero
def queue_gang(lab: Lab, name: str, gpus: int) -> asyncio.Future:
    """Queue a stage of `gpus` GPUs (2 cores, 1 GiB each); resolves to the nodes the scheduler gives it."""
    from qosflow.prefect.scheduler import StageEntry

    e = StageEntry(JobState(Job(name, 0.0, QoSSpec(gpus=gpus, cpu_cores=2 * gpus, mem_mb=1024 * gpus), duration=5.0)), name)

    async def placed() -> list[str]:
        g = await lab.sched.request(e)
        return sorted(lab.sched.cluster.nodes[n].name for n in g.placement.nodes)

    return asyncio.ensure_future(placed())


SHAPE = {"gpus": 1, "cpu": "32", "memory": "256Gi", "gpu_product": "NVIDIA-A100-SXM4-40GB", "gpu_memory_mb": 40960}


def test_a_gang_wider_than_a_node_on_a_pool_at_zero_gets_one_placeholder_per_node_and_runs_across_the_nodes_they_bring():
    """A pool of 1-GPU nodes at zero (the worker plans on two stand-ins of the declared node, down); a 2-GPU gang waits:
    two placeholders of one GPU (and half its cores and memory) each, so that the autoscaler adds two nodes (one
    placeholder of two GPUs, as before, fitted no node: nothing came)."""
    async def go():
        g = group(scale_down_unneeded_s=0.5)
        with EmulatorServer([], autoscaler=g) as emu:
            async with Lab(emu, request_capacity=True, max_capacity_requests=2, capacity_node={**SHAPE, "count": 2}) as lab:
                assert lab.sched.cluster.node_names == ("scaled-to-zero-0", "scaled-to-zero-1")
                await until(lambda: bool(lab.sched.state.down.all()), "the stand-ins down")
                waiting = queue_gang(lab, "gang", 2)
                await until(lambda: len(lab.placeholders()) == 2, "two placeholders, one per node-sized part of the gang")
                phs = sorted(lab.placeholders(), key=lambda p: p.metadata.labels["qosflow.dev/capacity-part"])
                assert [p.metadata.labels["qosflow.dev/capacity-part"] for p in phs] == ["0", "1"]
                assert all(p.metadata.labels["qosflow.dev/capacity-for"] == "gang" for p in phs)
                assert all(p.metadata.annotations["qosflow.dev/capacity-parts"] == "2" for p in phs)
                assert [p.spec.containers[0].resources.requests for p in phs] == [{"cpu": "2000m", "memory": "1024Mi", "nvidia.com/gpu": "1"}] * 2
                nodes = await asyncio.wait_for(waiting, 20)
                ups = [x for x in emu.state()["autoscaler"]["log"] if x["action"] == "scale-up"]
                assert sorted(x["node"] for x in ups) == nodes and len(nodes) == 2, (ups, nodes)
                assert sorted(lab.sched.cluster.node_names) == nodes  # (the stand-ins retired)
                h = await lab.launch("gang", 0.3)
                assert lab.placeholders() == []  # (both parts deleted before the gang's Job: its pods take their room)
                st = await lab.be.wait(h)
                assert st.kind is ExitKind.OK, st
                pods = lab.core.list_namespaced_pod("default", label_selector="qosflow.dev/stage-id=gang").items
                assert sorted(p.spec.node_name for p in pods) == nodes
                assert lab.be.stats["capacity_requested"] == 2 and lab.be.stats["capacity_dropped"] == 2, lab.be.stats
                lab.sched.release("gang")

    asyncio.run(go())


def test_max_capacity_requests_counts_pods_a_gang_takes_one_per_part_and_a_gang_wider_than_it_gets_none():
    async def go():
        g = group(scale_up_delay_s=600.0)  # (nothing comes: only the requests are looked at)
        with EmulatorServer([], autoscaler=g) as emu:
            async with Lab(emu, request_capacity=True, max_capacity_requests=2, capacity_node={**SHAPE, "count": 2}) as lab:
                await until(lambda: bool(lab.sched.state.down.all()), "the stand-ins down")
                gang = queue_gang(lab, "gang", 2)
                await until(lambda: len(lab.placeholders()) == 2, "the gang's two parts")
                one = lab.queue("one")  # waits too, but the two pods allowed are the gang's
                await asyncio.sleep(0.8)
                assert {p.metadata.labels["qosflow.dev/capacity-for"] for p in lab.placeholders()} == {"gang"}
                lab.sched.drop("gang")
                await until(lambda: [p.metadata.labels["qosflow.dev/capacity-for"] for p in lab.placeholders()] == ["one"],
                            "the gang's parts deleted, the single stage's made")
                lab.be.max_capacity_requests = 1  # (an edit: the gang, queued again, needs 2 and is skipped; "one" keeps its)
                again = queue_gang(lab, "gang2", 2)
                await asyncio.sleep(0.8)
                assert [p.metadata.labels["qosflow.dev/capacity-for"] for p in lab.placeholders()] == ["one"]
                for n, f in (("one", one), ("gang2", again), ("gang", gang)):
                    lab.sched.drop(n)
                    with contextlib.suppress(Exception):
                        await f
                await until(lambda: lab.placeholders() == [], "every placeholder deleted")

    asyncio.run(go())




def test_a_worker_started_with_the_pool_at_zero_plans_on_the_declared_node_and_runs_a_stage_once_one_is_added():
    async def go():
        g = group(scale_down_unneeded_s=0.5)
        with EmulatorServer([], autoscaler=g) as emu:
            async with Lab(emu, request_capacity=True, capacity_node=SHAPE) as lab:
                assert lab.sched.cluster.node_names == ("scaled-to-zero-0",)
                (standin,) = lab.sched.cluster.nodes
                assert (standin.gpus, standin.cpu_cores, standin.mem_mb, standin.gpu_model) == (1, 32.0, 262144.0, "a100")
                await until(lambda: bool(lab.sched.state.down.all()), "the stand-in down: nothing is placed on it")
                assert "capacity_node" in lab.be.down_reasons()["scaled-to-zero-0"]
                waiting = lab.queue("a")
                await until(lambda: len(lab.placeholders()) == 1, "a placeholder for the waiting stage")
                node = await asyncio.wait_for(waiting, 20)
                assert node.startswith("gpu-pool-") and lab.sched.cluster.node_names == (node,)  # (the stand-in retired)
                h = await lab.launch("a", 0.3)
                assert (await lab.be.wait(h)).kind is ExitKind.OK
                assert lab.pod_node("a") == node and lab.placeholders() == []
                lab.sched.release("a")
                await until(lambda: lab.nodes() == [], "the node scaled down again")
                # the worker keeps the node it knew, down (a deleted node), not the stand-in
                await until(lambda: bool(lab.sched.state.down.all()), "the node down in the plan")
                assert lab.sched.cluster.node_names == (node,)

    asyncio.run(go())


def test_no_node_and_no_declared_node_fails_saying_how_to_fix_it_and_a_bad_declared_node_names_its_key():
    from qosflow.errors import QosflowError, SpecError
    from qosflow.prefect.blocks import KubernetesGPUCluster

    async def inventory(**kw) -> str:
        be = KubernetesBackend(namespace="default", api_client=emu.api_client(), **kw)
        try:
            with pytest.raises(QosflowError) as ei:
                await be.inventory()
            return str(ei.value)
        finally:
            await be.aclose()

    with EmulatorServer([]) as emu:
        for kw in ({}, {"request_capacity": True}):
            msg = asyncio.run(inventory(**kw))
            assert "no Kubernetes node matches" in msg and "scale the GPU node pool to at least one node" in msg, msg
            assert "request_capacity on and declare the pool's node in the cluster block's capacity_node" in msg, msg
        msg = asyncio.run(inventory(capacity_node=SHAPE))
        assert "capacity_node, but request_capacity is off: turn request_capacity on" in msg, msg
    with pytest.raises(SpecError, match=r"invalid capacity_node\.gpus: 0: give a number > 0"):
        KubernetesBackend(api_client=client.ApiClient(), capacity_node={**SHAPE, "gpus": 0})
    with pytest.raises(ValueError, match=r"invalid capacity_node\.memory: missing"):
        KubernetesGPUCluster(capacity_node={"gpus": 8, "cpu": 64})
    with pytest.raises(ValueError, match=r"unknown key 'gpu'; did you mean 'gpus'"):
        KubernetesGPUCluster(capacity_node={"gpu": 8, "cpu": 64, "memory": "480Gi"})
    b = KubernetesGPUCluster(api_url="http://127.0.0.1:1", request_capacity=True, capacity_node={"gpus": 8, "cpu": 64, "memory": "480Gi"})
    assert b.make_backend().capacity_node == {"gpus": 8, "cpu": 64, "memory": "480Gi"}


def test_waiting_for_capacity_counts_a_gang_s_cores_per_node_not_only_its_free_gpus():
    """Two up nodes of 2 GPUs and 4 cores; a 4-GPU gang of 8 cores (2 per GPU). With the cores free it has room (no
    request); with 3 cores of each node taken (by CPU-only stages) its GPUs are free but not the cores to feed them: it
    waits for capacity (before, its free GPUs alone were counted: no request, and it waited for ever)."""
    from qosflow.core.cluster import ClusterSpec
    from qosflow.core.job import JobStatus
    from qosflow.policies import get_policy
    from qosflow.prefect.scheduler import QoSScheduler, StageEntry

    sched = QoSScheduler(ClusterSpec.uniform(2, 2, cpu_cores=4.0, mem_mb=8192.0), get_policy("fifo"), coda=False, clock=lambda: 100.0)
    e = StageEntry(JobState(Job("gang", 0.0, QoSSpec(gpus=4, cpu_cores=8, mem_mb=1024), duration=5.0)), "gang")
    e.ready_at, e.state.status = 0.0, JobStatus.PENDING
    loop = asyncio.new_event_loop()
    try:
        e.future = loop.create_future()
        sched.entries["gang"] = e
        assert sched.waiting_for_capacity(1.0) == []
        sched.state.cpu_free[:] = 1.0
        assert sched.waiting_for_capacity(1.0) == [e]
        sched.state.cpu_free[:] = 4.0
        sched.state.mem_free[:] = 400.0  # (its 1024 MiB split over 2 nodes: 512 each)
        assert sched.waiting_for_capacity(1.0) == [e]
    finally:
        loop.close()


def test_a_gang_s_parts_are_node_sized_from_the_declared_node_else_the_largest_node_listed():
    from qosflow.core.cluster import NodeSpec

    be = KubernetesBackend(api_client=client.ApiClient())
    want = CapacityWant("g", "g", gpus=10, cpu_cores=20, mem_mb=10_000)
    assert be.capacity_parts(want) == [(10, 20, 10_000)]  # (no node known: the whole stage in one)
    be._described = [NodeSpec("a", 2), NodeSpec("b", 4)]
    assert be.capacity_parts(want) == [(4, 8.0, 10_000 / 3), (4, 8.0, 10_000 / 3), (2, 4.0, 10_000 / 3)]
    assert be.capacity_parts(CapacityWant("s", "s", gpus=4, cpu_cores=8)) == [(4, 8, 0.0)]  # (fits on a node: one)
    assert be.capacity_parts(CapacityWant("f", "f", gpus=1, cpu_cores=1, gpu_milli=500)) == [(1, 1, 0.0)]
    be.capacity_node = {"gpus": 8, "cpu": 64, "memory": "480Gi"}
    bodies = be.capacity_request_manifests(want)
    assert [b["spec"]["containers"][0]["resources"]["requests"] for b in bodies] == [
        {"cpu": "16000m", "memory": "5000Mi", "nvidia.com/gpu": "8"}, {"cpu": "4000m", "memory": "5000Mi", "nvidia.com/gpu": "2"}]
    assert [b["metadata"]["name"][-6:] for b in bodies] == ["-cap-0", "-cap-1"]
    assert [b["metadata"]["labels"]["qosflow.dev/capacity-part"] for b in bodies] == ["0", "1"]


def test_a_placeholder_asks_for_what_its_stage_s_pod_will_on_the_node_it_brings():
    """Each placeholder part asks for the GPUs, cpu and memory the stage's pod asks for on the node the part brings, as the
    worker's placement splits the stage (cores in proportion to the GPUs on each node, memory evenly: mem/k on each of
    its k nodes; a fractional share as one slice of the shared resource). Before, a part's memory was in proportion to
    its GPUs: a 10-GPU gang on 4-GPU nodes asked for 40 %, 40 %, 20 % of its memory while its pods ask for a third each,
    so the narrow part's node could come too small for its pod."""
    from qosflow.core.cluster import ClusterSpec, NodeSpec, default_cpu_split

    def pods(be: KubernetesBackend, p: Placement, cluster: ClusterSpec) -> list[dict]:
        jobs, _ = be.manifests(LaunchSpec("s", ["true"], p, cluster))
        return sorted(([j["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]] * j["spec"]["parallelism"]
                       for j in jobs), key=str)

    be = KubernetesBackend(api_client=client.ApiClient(), capacity_node={"gpus": 4, "cpu": 64, "memory": "480Gi"})
    cluster = ClusterSpec(tuple(NodeSpec(f"n{i}", 4, cpu_cores=64, mem_mb=480 * 1024) for i in range(3)))
    gang = QoSSpec(gpus=10, cpu_cores=20, mem_mb=30_000)
    gpus = tuple((n, g) for n, k in ((0, 4), (1, 4), (2, 2)) for g in range(k))
    p = Placement("s", gpus, default_cpu_split(gang, gpus), mem_mb=30_000)
    parts = [b["spec"]["containers"][0]["resources"]["requests"]
             for b in be.capacity_request_manifests(CapacityWant("s", "s", gpus=10, cpu_cores=20, mem_mb=30_000))]
    assert sorted(([r] for r in parts), key=str) == pods(be, p, cluster), parts
    assert [r["memory"] for r in parts] == ["10000Mi"] * 3
    # a fractional share on a sharing cluster: one slice, its cores and memory, as its pod
    share = Placement("f", ((0, 0),), ((0, 2.0),), gpu_milli=250, mem_mb=3000.5)
    [ph] = be.capacity_request_manifests(CapacityWant("f", "f", gpus=1, cpu_cores=2.0, mem_mb=3000.5, gpu_milli=250))
    assert [[ph["spec"]["containers"][0]["resources"]["requests"]]] == pods(be, share, cluster)
    assert ph["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu.shared"] == "1"


def test_a_gang_wider_than_the_nodes_left_after_a_scale_down_waits_for_the_declared_group_instead_of_being_refused():
    """One 1-GPU node listed (the others scaled down), `capacity_node` of 1 GPU, `count` 2: a 2-GPU gang fits the group
    the pool may become (`Backend.may_become`), so it waits and asks for capacity, and runs once the autoscaler's node is
    listed; before, it was refused at once ("can never be placed"). Without request_capacity it is refused as before,
    and a gang wider than `count` nodes still is."""
    from qosflow.core.cluster import PlacementError

    async def go():
        g = group()
        with EmulatorServer([g.node("gpu-pool-first")], autoscaler=g) as emu:
            async with Lab(emu, request_capacity=True, max_capacity_requests=2, capacity_node={**SHAPE, "count": 2}) as lab:
                assert lab.sched.cluster.node_names == ("gpu-pool-first",)
                too_wide = queue_gang(lab, "three", 3)
                with pytest.raises(PlacementError, match="can never be placed"):
                    await asyncio.wait_for(too_wide, 5)
                waiting = queue_gang(lab, "gang", 2)
                nodes = await asyncio.wait_for(waiting, 20)
                assert len(nodes) == 2 and "gpu-pool-first" in nodes, nodes
                ups = [x for x in emu.state()["autoscaler"]["log"] if x["action"] == "scale-up"]
                assert len(ups) == 1, ups
                h = await lab.launch("gang", 0.3)
                assert (await lab.be.wait(h)).kind is ExitKind.OK
                lab.sched.release("gang")
            async with Lab(emu, request_capacity=False, capacity_node={**SHAPE, "count": 3}) as lab:  # (3 would hold it)
                refused = queue_gang(lab, "gang-b", 3)
                with pytest.raises(PlacementError, match="can never be placed"):
                    await asyncio.wait_for(refused, 5)

    asyncio.run(go())
