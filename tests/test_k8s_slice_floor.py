"""The floor of a shared stage on Kubernetes is the slice of the node it lands on, not the largest slice of all nodes.

A fractional stage's pod asks for one slice of the NVIDIA device plugin's shared resource whatever its gpu_milli, and
kube-scheduler counts it as one slice of the node it lands on: 1000 // replicas thousandths of a GPU there (the node's
nvidia.com/gpu.replicas label). The worker books a stage under a slice at a slice (`_at_least_a_slice`), and that slice
was the largest of all nodes' (`KubernetesBackend.least_share_milli(cluster)`): on a mixed cluster (a node of 4
replicas, one of 2) a stage on the node of smaller slices was booked the larger one. The other direction over-commits:
the floor is taken when the stage is queued, so a node of LARGER slices that joins later (an autoscaled node, a pool
scaled from zero whose stand-ins say no replicas) is booked the smaller slice, and the plan puts more shared stages there
than it has slices (the last pods Unschedulable until `unschedulable_timeout_s`, then INFRA failures).

`least_share_milli(cluster, node)` says one node's slice (the old call, without a node, is unchanged: the largest). The
booking per node is the scheduler's: it books a placed shared stage at its node's floor from what the stage asked
(`QoSScheduler.share_floor`, which the worker sets from the backend's `least_share_milli(cluster, node)`)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.job import Job, JobState
from qosflow.core.qos import QoSSpec

pytestmark = pytest.mark.timeout(60)


def node(name: str, replicas: int | None, gpus: int = 1) -> NodeSpec:
    return NodeSpec(name, gpus, cpu_cores=16, mem_mb=65536, labels={"nvidia.com/gpu.replicas": str(replicas)} if replicas else {})


def backend(sharing: str = "time-slicing") -> KubernetesBackend:
    return KubernetesBackend(api_client=client.ApiClient(), image="img:1", gpu_sharing=sharing)


def test_the_floor_of_one_node_is_its_own_slice():
    """Per node: its own slice (by index or name); a node without the label, or GPUs not shared: 0; a node not in the
    cluster: a KeyError naming it and the nodes. Without a node, as before: the largest slice of the nodes that say it."""
    cluster = ClusterSpec((node("four", 4), node("two", 2), node("plain", None)))
    be = backend()
    assert [be.least_share_milli(cluster, i) for i in range(3)] == [250, 500, 0]
    assert be.least_share_milli(cluster, "four") == 250 and be.least_share_milli(cluster, "two") == 500
    assert be.least_share_milli(cluster) == 500  # (the old call: the one floor no node is above)
    assert backend("none").least_share_milli(cluster, 0) == 0
    with pytest.raises(KeyError, match="no node 'gone' in the cluster.*four, two, plain"):
        be.least_share_milli(cluster, "gone")


def _place(cluster: ClusterSpec, queued_on: ClusterSpec, k: int) -> dict[str, list[int]]:
    """`k` stages of 100 thousandths floored by the worker against `queued_on` (the cluster when they were queued), then
    placed on `cluster` by the scheduler (fifo) with the backend's per-node floor: node -> the thousandths booked for each
    stage there."""
    from qosflow.policies import get_policy
    from qosflow.prefect.scheduler import QoSScheduler, StageEntry
    from qosflow.prefect.worker import _at_least_a_slice

    be = backend()
    spec, _ = _at_least_a_slice(QoSSpec(gpus=1, gpu_milli=100, cpu_cores=0.5), be, queued_on)

    async def go():
        sched = QoSScheduler(cluster, get_policy("fifo"), coda=False, round_interval=0.05)
        sched.share_floor = lambda i: be.least_share_milli(sched.cluster, i)
        sched.start()
        fs = [asyncio.ensure_future(sched.request(StageEntry(JobState(Job(f"s{j}", 0.0, spec, duration=60.0)), f"s{j}")))
              for j in range(k)]
        while not all(f.done() for f in fs) and sched.rounds < 10:  # (rounds enough: every stage that fits is placed)
            await asyncio.sleep(0.02)
        booked: dict[str, list[int]] = {}
        for jid, p in sched.state.allocs.items():
            booked.setdefault(cluster.nodes[p.nodes[0]].name, []).append(p.gpu_milli)
        sched.state.check_invariants()
        for f in fs:
            f.cancel()
        task = sched._task
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.5)
        await sched.stop()
        return booked

    return asyncio.run(go())


def test_a_stage_is_booked_the_slice_of_the_node_it_lands_on():
    # a node of larger slices than the floor the stage was queued with (it joined later): booked its own slice, so the
    # plan puts no more stages there than it has slices (1 GPU, 2 replicas: 2 pods; before, 4 at 250 each)
    booked = _place(ClusterSpec((node("two", 2),)), ClusterSpec((node("four", 4),)), 4)
    assert booked == {"two": [500, 500]}, booked
    # a mixed cluster: on the node of smaller slices each stage is booked its slice (250), not the other node's (500)
    mixed = ClusterSpec((node("four", 4), node("two", 2)))
    booked = _place(mixed, mixed, 6)
    assert sorted(booked["two"]) == [500, 500] and set(booked["four"]) == {250} and len(booked["four"]) >= 3, booked
