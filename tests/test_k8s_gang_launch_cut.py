"""A gang of one Job per node whose launch was cut short between its Jobs (the API server went away after the first
create): what the next launch of the same attempt, or the adoption by another worker, does with the Jobs it left.

Since 82b322f a gang is one Job per node whenever its nodes' placements differ (GPUs 0,1 on one node and 2,3 on the
other), created one by one. A launch cut after the first Job raises BackendUnreachable; the worker then places the stage
again once the API answers, WITH THE SAME ATTEMPT ID ("what the failed launch created is adopted, never doubled"), and
a worker that died there leaves its lease to another worker, which adopts the attempt by that id.

* placed again on other nodes (or the same nodes with other GPUs: one Indexed Job now, or other per-node Jobs), the
  earlier launch's Job ran on beside the new ones: the same stage label (the wait counted its pods among the gang's), its
  GPUs not in the plan, and `kill` deleted only the new launch's Jobs; a Job of the same name pinned to another node
  was adopted as if it were the new placement's. Now such a launch deletes what the cut launch left and reports an
  infrastructure failure (the worker runs the stage again under a new attempt id); the same placement launched again
  still adopts what exists and creates the rest.
* adopted (`adopt`), the gang's Jobs found were counted as the whole gang (expected pods: those Jobs' pods): rank 0
  alone, whose pod ended, was the stage's success though rank 1 never ran. Now a gang missing some of its Jobs is
  deleted and reported as an infrastructure failure.

On qosflow's API emulator (EMULATED: no cluster), through the official `kubernetes` client."""

from __future__ import annotations

import asyncio

import pytest
import urllib3

from qosflow.backends.base import BackendUnreachable, ExitKind, LaunchSpec
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.placement import Placement
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from qosflow.k8s_emulator.state import ANN

pytestmark = pytest.mark.timeout(120)
#: the emulator runs a pod this long (seconds) before it succeeds: long enough to still run when looked at
LONG = {ANN + "run-seconds": "20"}


def _cut_at_second_create(be: KubernetesBackend) -> None:
    """The API server goes away at the backend's second Job create (urllib3 gives up: BackendUnreachable), and is back after."""
    real = be.batch.create_namespaced_job
    n = {"calls": 0}

    def create(*a, **kw):
        n["calls"] += 1
        if n["calls"] == 2:
            raise urllib3.exceptions.MaxRetryError(None, "/apis/batch/v1/namespaces/default/jobs",
                                                   reason=ConnectionRefusedError(111, "Connection refused"))
        return real(*a, **kw)

    be.batch.create_namespaced_job = create


def _jobs(be: KubernetesBackend, stage_id: str) -> dict[str, list[str]]:
    """The Jobs of the attempt that are not being deleted: name -> the nodes its pods may land on."""
    out = {}
    for j in be.batch.list_namespaced_job("default", label_selector=f"qosflow.dev/stage-id={stage_id}").items:
        if j.metadata.deletion_timestamp is not None:
            continue
        [term] = j.spec.template.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
        out[j.metadata.name] = list(term.match_expressions[0].values)
    return out


def _pods(be: KubernetesBackend, stage_id: str) -> list:
    return [p for p in be.core.list_namespaced_pod("default", label_selector=f"qosflow.dev/stage-id={stage_id}").items
            if p.metadata.deletion_timestamp is None and (p.status.phase if p.status else None) in ("Pending", "Running")]


def _emulator() -> EmulatorServer:
    return EmulatorServer([gpu_node("gpu-0", 4), gpu_node("gpu-1", 4), gpu_node("gpu-2", 4)])


def _backend(emu: EmulatorServer) -> KubernetesBackend:
    return KubernetesBackend(api_client=emu.api_client(), namespace="default", image="busybox:1.36", watch_nodes=False,
                             watch_pods=False, unschedulable_timeout_s=5.0)


def _per_node(cluster, a: str, b: str) -> Placement:
    """GPUs 0,1 of node a and 2,3 of node b: placements that differ, so one Job per node."""
    i, j = cluster.index_of(a), cluster.index_of(b)
    return Placement("g", ((i, 0), (i, 1), (j, 2), (j, 3)), ((i, 1.0), (j, 1.0)))


@pytest.mark.parametrize("again", ["indexed", "per-node"])
def test_a_cut_gang_launch_placed_again_elsewhere_leaves_no_job_of_the_earlier_launch_running(again):
    """Cut after rank 0's Job (on gpu-0), then launched again with the same attempt id on gpu-1 and gpu-2: as one Indexed
    Job (the same GPUs on both) or as one Job per node again (rank 0 now on gpu-2). Before: the earlier Job on gpu-0 ran on
    (Indexed: not even known to the handle, so `kill` left it; per-node: adopted by name as rank 0 of the new placement,
    pinned to gpu-0)."""
    with _emulator() as emu:
        be = _backend(emu)

        async def go():
            try:
                cluster = await be.inventory()
                first = LaunchSpec("cut-elsewhere", ["true"], _per_node(cluster, "gpu-0", "gpu-1"), cluster, labels=LONG)
                _cut_at_second_create(be)
                with pytest.raises(BackendUnreachable):
                    await be.launch(first)
                left = await asyncio.to_thread(_jobs, be, "cut-elsewhere")
                assert list(left.values()) == [["gpu-0"]], left  # (rank 0's Job, made before the cut)
                if again == "indexed":
                    i, j = cluster.index_of("gpu-1"), cluster.index_of("gpu-2")
                    p = Placement("g", ((i, 0), (i, 1), (j, 0), (j, 1)), ((i, 1.0), (j, 1.0)))
                else:
                    p = _per_node(cluster, "gpu-2", "gpu-1")
                h = await be.launch(LaunchSpec("cut-elsewhere", ["true"], p, cluster, labels=LONG))
                now = await asyncio.to_thread(_jobs, be, "cut-elsewhere")
                pods = await asyncio.to_thread(_pods, be, "cut-elsewhere")
                st = await asyncio.wait_for(be.wait(h), 60)
                after = await asyncio.to_thread(_jobs, be, "cut-elsewhere")
                return now, pods, st, after
            finally:
                await be.aclose()

        now, pods, st, after = asyncio.run(go())
    # no Job (nor pod) of the attempt is pinned to gpu-0, a node the new placement does not have
    assert all("gpu-0" not in nodes for nodes in now.values()), now
    assert all(p.spec.node_name != "gpu-0" and "gpu-0" not in str(p.spec.affinity) for p in pods), [p.metadata.name for p in pods]
    # the launch said why it did not run the stage: an infrastructure failure (the worker runs it again, a new attempt id)
    assert st.kind is ExitKind.INFRA and "earlier launch of this attempt" in st.reason and "gpu-0" in st.reason, st
    assert after == {}, after


def test_a_cut_gang_launch_placed_again_on_the_same_placement_adopts_its_first_job_and_creates_the_rest():
    """The same placement launched again (the worker's relaunch after the outage): rank 0's Job is adopted (409, not made
    twice), rank 1's created, and the gang runs to its end."""
    with _emulator() as emu:
        be = _backend(emu)

        async def go():
            try:
                cluster = await be.inventory()
                spec = LaunchSpec("cut-same", ["true"], _per_node(cluster, "gpu-0", "gpu-1"), cluster)
                _cut_at_second_create(be)
                with pytest.raises(BackendUnreachable):
                    await be.launch(spec)
                h = await be.launch(spec)
                st = await asyncio.wait_for(be.wait(h), 60)
                return h, st
            finally:
                await be.aclose()

        h, st = asyncio.run(go())
    assert st.kind is ExitKind.OK, st
    assert be.stats["adopted_409"] == 1 and len(h.ref["jobs"]) == 2 and h.ref["expected_pods"] == 2, (be.stats, h.ref)


def test_a_gang_adopted_with_a_job_missing_is_an_infrastructure_failure_not_a_success_of_rank_0_alone():
    """The worker died between the gang's two creates (here: the API went away there, and the worker stopped); another
    worker takes its lease and adopts the attempt. Before: adopt counted rank 0's Job as the gang (expected pods 1), and
    rank 0's pod ending was the stage's success, rank 1 never run. Now: the Jobs found are deleted, the wait says INFRA."""
    with _emulator() as emu:
        be = _backend(emu)
        other = _backend(emu)

        async def go():
            try:
                cluster = await be.inventory()
                spec = LaunchSpec("cut-adopt", ["true"], _per_node(cluster, "gpu-0", "gpu-1"), cluster)
                _cut_at_second_create(be)
                with pytest.raises(BackendUnreachable):
                    await be.launch(spec)
                h = await other.adopt("cut-adopt", ["gpu-0", "gpu-1"])
                st = await asyncio.wait_for(other.wait(h), 60)
                return h, st, await asyncio.to_thread(_jobs, other, "cut-adopt")
            finally:
                await be.aclose()
                await other.aclose()

        h, st, left = asyncio.run(go())
    assert h is not None
    assert st.kind is ExitKind.INFRA and "rank 1" in st.reason, st
    assert left == {}, left


def test_a_whole_per_node_gang_is_adopted_as_before():
    """Both Jobs made: adopted with both, its two pods expected, and it runs to its end."""
    with _emulator() as emu:
        be = _backend(emu)
        other = _backend(emu)

        async def go():
            try:
                cluster = await be.inventory()
                await be.launch(LaunchSpec("whole-adopt", ["true"], _per_node(cluster, "gpu-0", "gpu-1"), cluster))
                h = await other.adopt("whole-adopt", ["gpu-0", "gpu-1"])
                st = await asyncio.wait_for(other.wait(h), 60)
                return h, st
            finally:
                await be.aclose()
                await other.aclose()

        h, st = asyncio.run(go())
    assert st.kind is ExitKind.OK and h.ref["expected_pods"] == 2 and len(h.ref["jobs"]) == 2, (st, h.ref)


def test_an_adoption_whose_delete_of_the_partial_gang_fails_returns_its_handle_and_the_wait_deletes_it():
    """The API refuses the deletion at the adoption (500s past the retries): `adopt` does not raise (the worker recovers
    its leases one after another in one loop: an adoption that raised stopped the recovery of every other one); the
    handle's wait deletes the Jobs then, and reports INFRA."""
    with _emulator() as emu:
        be = _backend(emu)
        other = _backend(emu)

        async def go():
            try:
                cluster = await be.inventory()
                spec = LaunchSpec("cut-refused", ["true"], _per_node(cluster, "gpu-0", "gpu-1"), cluster, labels=LONG)
                _cut_at_second_create(be)
                with pytest.raises(BackendUnreachable):
                    await be.launch(spec)
                emu.add_fault(r"/jobs/qf-cut-refused", method="DELETE", status=500, count=other.api_retries + 1)
                h = await other.adopt("cut-refused", ["gpu-0", "gpu-1"])
                before = await asyncio.to_thread(_jobs, other, "cut-refused")
                st = await asyncio.wait_for(other.wait(h), 60)
                return h, before, st, await asyncio.to_thread(_jobs, other, "cut-refused")
            finally:
                await be.aclose()
                await other.aclose()

        h, before, st, after = asyncio.run(go())
    assert h is not None and len(before) == 1, before  # (not deleted at the adoption: refused)
    assert st.kind is ExitKind.INFRA and "rank 1" in st.reason, st
    assert after == {}, after


def test_a_gang_with_a_job_missing_that_its_ttl_may_have_deleted_is_adopted_as_found():
    """A Job as old as ttlSecondsAfterFinished (less a minute) may be missing because it ended and the TTL controller
    deleted it (its rank done): then nothing is deleted, and the pods found are waited for, as before."""
    with _emulator() as emu:
        be = _backend(emu)
        other = KubernetesBackend(api_client=emu.api_client(), namespace="default", image="busybox:1.36", watch_nodes=False,
                                  watch_pods=False, ttl_after_finished_s=30)

        async def go():
            try:
                cluster = await be.inventory()
                _cut_at_second_create(be)
                with pytest.raises(BackendUnreachable):
                    await be.launch(LaunchSpec("cut-ttl", ["true"], _per_node(cluster, "gpu-0", "gpu-1"), cluster))
                h = await other.adopt("cut-ttl", ["gpu-0", "gpu-1"])
                return h, await asyncio.to_thread(_jobs, other, "cut-ttl")
            finally:
                await be.aclose()
                await other.aclose()

        h, left = asyncio.run(go())
    assert h.ref["launch_error"] is None and h.ref["expected_pods"] == 1 and len(left) == 1, (h.ref, left)
