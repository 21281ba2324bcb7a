"""A gang of one Job per node whose rank ended before rank 0: its Job finished, and the TTL-after-finished controller
deleted it with its pod (`ttl_after_finished_s`, ttlSecondsAfterFinished) while rank 0 still ran.

Since 82b322f every gang whose nodes' placements differ is one Job per node; each Job finishes when its own pod does.
The stage's wait took any pod of the stage deleted for a pod deleted outside qosflow (drained, preempted: INFRA), so a
gang whose rank 1 had succeeded, and whose Job the TTL controller then deleted, failed as INFRA while rank 0 ran on
(and was killed, and the stage run again): with the default TTL (an hour) a rank 0 that works alone for an hour after
the others (an evaluation, an upload), with a short TTL (a namespace kept tidy) any gang whose ranks end a little
apart. A pod seen Succeeded is now counted as succeeded when it is deleted. (An Indexed Job finishes only when all its
pods have: its TTL never comes during the gang.) On qosflow's API emulator (EMULATED: no cluster), whose job
controller now has the TTL-after-finished controller too."""

from __future__ import annotations

import asyncio

import pytest

from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.placement import Placement
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from qosflow.k8s_emulator.state import ANN

pytestmark = pytest.mark.timeout(120)


def test_a_rank_whose_job_the_ttl_controller_deleted_after_it_succeeded_still_counts_as_succeeded():
    with EmulatorServer([gpu_node("gpu-0", 4), gpu_node("gpu-1", 4)]) as emu:
        be = KubernetesBackend(api_client=emu.api_client(), namespace="default", image="busybox:1.36", watch_nodes=False,
                               watch_pods=False, ttl_after_finished_s=1)
        emu.add_rule(node="gpu-1", run_s=0.2)  # rank 1 (on gpu-1) ends at once; rank 0 runs 6 s

        async def go():
            try:
                cluster = await be.inventory()
                i, j = cluster.index_of("gpu-0"), cluster.index_of("gpu-1")
                p = Placement("g", ((i, 0), (i, 1), (j, 2), (j, 3)), ((i, 1.0), (j, 1.0)))  # (one Job per node)
                h = await be.launch(LaunchSpec("ttl-gang", ["true"], p, cluster, labels={ANN + "run-seconds": "6"}))
                assert len(h.ref["jobs"]) == 2, h.ref
                st = await asyncio.wait_for(be.wait(h), 60)
                left = [j.metadata.name for j in (await asyncio.to_thread(be.batch.list_namespaced_job, "default",
                                                                          label_selector=h.ref["selector"])).items]
                return h, st, left
            finally:
                await be.aclose()

        h, st, left = asyncio.run(go())
    assert st.kind is ExitKind.OK, st
    # rank 1's Job was deleted by the TTL controller during the gang (the case this test is about)
    assert h.ref["jobs"][1] not in left, left


def test_the_emulators_ttl_controller_deletes_a_finished_job_and_its_pods_only_after_its_ttl():
    from kubernetes import client

    with EmulatorServer([gpu_node("gpu-0", 1)]) as emu:
        batch, core = client.BatchV1Api(emu.api_client()), client.CoreV1Api(emu.api_client())

        def job(name: str, ttl: int | None) -> dict:
            spec = {"backoffLimit": 0, "template": {"metadata": {"labels": {"t": name}}, "spec": {
                "restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox:1.36", "command": ["true"]}]}}}
            if ttl is not None:
                spec["ttlSecondsAfterFinished"] = ttl
            return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": spec}

        for name, ttl in (("short", 0), ("long", 3600), ("none", None)):
            batch.create_namespaced_job("default", job(name, ttl))

        import time

        end = time.monotonic() + 30
        while True:
            names = {j.metadata.name for j in batch.list_namespaced_job("default").items}
            done = {j.metadata.name for j in batch.list_namespaced_job("default").items
                    if any(c.type == "Complete" for c in (j.status.conditions or []))}
            if "short" not in names and {"long", "none"} <= done:
                break
            assert time.monotonic() < end, (names, done)
            time.sleep(0.05)
        assert {"long", "none"} <= names and not core.list_namespaced_pod("default", label_selector="t=short").items
        assert core.list_namespaced_pod("default", label_selector="t=long").items
