"""Two qosflow pools on one Kubernetes cluster, in one namespace, whose cluster blocks have the same name (the default
"kubernetes"): each pool's stage pods are another's to the other pool's worker.

Before, a stage pod was this worker's own when its qosflow.dev/cluster label matched: the other pool's stage pods (which
its own worker books, not this one) were left out of the pods booked as another's, so both workers planned the same
GPUs and overbooked the nodes. Now what a backend creates carries its pool (qosflow.dev/pool: the pool's key in the lease
store, which the worker tells the backend, `capacity_peers`), and a stage pod, Job or Secret labelled with another pool
is never counted as its own, adopted, swept or taken over on a 409. One without the label (an older version's), and
everything while the worker has not said its pool, is taken as its own, as before. On qosflow's API emulator (EMULATED:
no cluster).
"""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from k8s_lab import until
from qosflow.backends.base import LaunchSpec
from qosflow.backends.k8s_usage import foreign_usage
from qosflow.backends.kubernetes import LABEL_POOL, KubernetesBackend, job_name, label_value, secret_name
from qosflow.core.placement import Placement
from qosflow.errors import QosflowError
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from qosflow.store.leases import holder_id

pytestmark = pytest.mark.timeout(90)
POOL_A, POOL_B = "vision@0123456789ab", "speech@ba9876543210"  # (pool keys: name@hash of the Prefect API URL)
KW = dict(gpu_resource="nvidia.com/gpu", shared_resource="nvidia.com/gpu.shared", namespace="ml", cluster_name="kubernetes")


def _pod(name: str, labels: dict) -> dict:
    return {"metadata": {"name": name, "namespace": "ml", "labels": labels},
            "spec": {"nodeName": "n1", "containers": [{"resources": {"requests": {"cpu": "2", "nvidia.com/gpu": "1"}}}]},
            "status": {"phase": "Running"}}


def test_a_stage_pod_of_another_pool_with_the_same_cluster_name_is_booked_and_one_of_this_pool_or_unlabelled_is_not():
    stage = {"qosflow.dev/stage-id": "s", "qosflow.dev/cluster": "kubernetes"}
    mine = _pod("mine", {**stage, LABEL_POOL: label_value(POOL_A)})
    theirs = _pod("theirs", {**stage, LABEL_POOL: label_value(POOL_B)})
    old = _pod("old", dict(stage))  # (made before stage pods carried their pool: taken as this pool's)
    their_pipeline = _pod("pipe", {**stage, "qosflow.dev/role": "pipeline", LABEL_POOL: label_value(POOL_A)})  # (counted, as before)
    got = foreign_usage([mine, theirs, old, their_pipeline], pool=label_value(POOL_A), **KW)
    assert sorted(got["n1"].names) == ["ml/pipe", "ml/theirs"] and got["n1"].gpus == 2, got
    # the worker has not said its pool: every stage pod of this cluster is its own, as before
    assert foreign_usage([mine, theirs, old, their_pipeline], **KW)["n1"].names == ("ml/pipe",)


def test_two_pools_with_one_cluster_name_book_each_others_stage_pods_and_never_adopt_sweep_or_take_over_each_others():
    with EmulatorServer([gpu_node("gpu-a", 4, cpu="16", memory="64Gi")]) as emu:
        async def go():
            def backend(**kw) -> KubernetesBackend:
                be = KubernetesBackend(namespace="default", image="busybox:1.36", api_client=emu.api_client(), unschedulable_timeout_s=5.0,
                                       **kw)
                be.pod_usage_every_s = 0.0  # (a LIST reading at every call while the informer does not serve)
                return be

            a, b = backend(), backend()
            batch, core = client.BatchV1Api(emu.api_client()), client.CoreV1Api(emu.api_client())
            try:
                a.capacity_peers(holder_id("worker-a"), POOL_A, None)  # (what QosflowWorker says before its backend's inventory)
                cluster = await a.inventory()

                def spec(stage: str, gpus: int = 2, **kw) -> LaunchSpec:
                    return LaunchSpec(stage, ["true"], Placement(stage, tuple((0, g) for g in range(gpus)), ((0, 2.0),)), cluster, **kw)

                emu.add_rule(selector="qosflow.dev/stage-id=a-1", run_s=120)
                h = await a.launch(spec("a-1", env={"HF_TOKEN": "hf_x"}))
                assert not h.ref["launch_error"], h.ref
                [job] = (await asyncio.to_thread(batch.list_namespaced_job, "default", label_selector="qosflow.dev/stage-id=a-1")).items
                await until(lambda: [p.status.phase for p in core.list_namespaced_pod("default", label_selector="qosflow.dev/stage-id=a-1").items]
                            == ["Running"], "pool A's stage pod running")
                [pod] = (await asyncio.to_thread(core.list_namespaced_pod, "default", label_selector="qosflow.dev/stage-id=a-1")).items
                sec = await asyncio.to_thread(core.read_namespaced_secret, secret_name("a-1"), "default")
                for labels in (job.metadata.labels, job.spec.template.metadata.labels, pod.metadata.labels, sec.metadata.labels):
                    assert labels[LABEL_POOL] == label_value(POOL_A) == "vision-0123456789ab", labels

                # B not told its pool yet: A's stage pod is taken as its own (as before), by the LIST reading and the informer
                assert await b.foreign_pod_usage() == {}
                await until(lambda: b._pod_informer.usage() is not None, "B's pod informer following the pods")
                assert await b.foreign_pod_usage() == {}
                # told: A's stage pod is another's to it (the informer sums again); A's own reading still leaves it out
                b.capacity_peers(holder_id("worker-b"), POOL_B, None)
                assert (await b.foreign_pod_usage())["gpu-a"].gpus == 2  # (the LIST reading at once)
                await until(lambda: (b._pod_informer.usage() or {}).get("gpu-a") is not None, "B's informer booking A's stage pod")
                got = (await b.foreign_pod_usage())["gpu-a"]
                assert got.names == (f"default/{pod.metadata.name}",) and got.gpus == 2 and got.cpu == 2.0, got
                assert await a.foreign_pod_usage() == {}

                # adoption after a restart: only the pool's own worker finds the Job
                assert await b.adopt("a-1") is None
                adopted = await a.adopt("a-1")
                assert adopted is not None and adopted.ref["jobs"] == [job.metadata.name]
                # the same attempt id launched by B (its 409 would adopt A's Job, or rewrite A's Secret): refused, A's untouched
                with pytest.raises(QosflowError, match="belongs to another pool"):
                    await b.launch(spec("a-1", env={"HF_TOKEN": "hf_y"}))
                with pytest.raises(QosflowError, match="belongs to another pool"):
                    await b.launch(spec("a-1"))
                again = await asyncio.to_thread(batch.read_namespaced_job, job.metadata.name, "default")
                assert again.metadata.uid == job.metadata.uid and again.metadata.deletion_timestamp is None
                assert (await asyncio.to_thread(core.read_namespaced_secret, secret_name("a-1"), "default")).data == sec.data

                # an orphaned Secret of A's (its worker died between the Secret and the Job): B's sweep leaves it to A's
                await a._put_secret(a.secret_manifest(spec("a-2", env={"HF_TOKEN": "hf_x"})), "a-2", "test")
                assert await b.sweep_orphan_secrets(grace_s=0) == []
                assert await a.sweep_orphan_secrets(grace_s=0) == [secret_name("a-2")]
                assert job_name("a-1") == job.metadata.name
            finally:
                await a.aclose()
                await b.aclose()

        asyncio.run(go())
