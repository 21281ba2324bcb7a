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
from qosflow.backends.kubernetes import ANN_POOL, LABEL_POOL, KubernetesBackend, job_name, label_value, secret_name
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
    got = foreign_usage([mine, theirs, old, their_pipeline], pool=POOL_A, **KW)
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


def test_a_placeholder_of_another_pool_is_never_deleted_or_adopted_and_is_booked_as_another_workers():
    """Two pools (two Prefect servers, so two lease stores) on one cluster, one namespace, blocks of one name: their
    placeholders are listed by the same selector. Before, B judged A's by asking its own lease store whether A's maker
    was alive: never there, so B deleted them ("its maker is gone") or adopted them (rewritten to name B). Now a
    placeholder labelled with another pool is that pool's: kept as it is (no PATCH, no DELETE), even one that ended or
    that names a stage B asks for, and booked as another worker's is. One without a pool (an older version's) is judged
    as before."""
    from qosflow.backends.base import CapacityWant
    from qosflow.backends.kubernetes import ANN_CAPACITY_OWNER, ANN_CAPACITY_POOL

    def traffic(emu, key: str) -> int:
        return emu.state()["traffic"].get(key, {}).get("requests", 0)

    async def go():
        with EmulatorServer([]) as emu:
            core = client.CoreV1Api(emu.api_client())
            a_id, b_id, c_id, old_id = holder_id("wa"), holder_id("wb"), holder_id("wc"), holder_id("old")
            s1 = CapacityWant("s1", "train", gpus=2, cpu_cores=4, mem_mb=8192)
            s2, s3, s4 = (CapacityWant(j, "eval", gpus=1, cpu_cores=1) for j in ("s2", "s3", "s4"))
            a = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True)
            old = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True)
            try:  # (pool A's worker's placeholders, A alive in its own lease store; one of a version without pools)
                a.capacity_peers(a_id, POOL_A, None)
                theirs = [a.capacity_request_manifest(w) for w in (s1, s2, s3)]
                old.capacity_peers(old_id, "", None)
                pool_less = old.capacity_request_manifest(s4)
            finally:
                await a.aclose()
                await old.aclose()
            assert LABEL_POOL not in pool_less["metadata"]["labels"] and theirs[0]["metadata"]["labels"][LABEL_POOL] == label_value(POOL_A)
            for body in (*theirs, pool_less):
                await asyncio.to_thread(core.create_namespaced_pod, "default", body)
            names = [b["metadata"]["name"] for b in theirs]
            ended = await asyncio.to_thread(core.read_namespaced_pod, names[2], "default")
            ended.status.phase = "Failed"
            await asyncio.to_thread(core.replace_namespaced_pod_status, names[2], "default", ended)

            def pods() -> dict:
                return {p.metadata.name: p for p in core.list_namespaced_pod("default").items}

            before = {n: p.metadata.uid for n, p in (await asyncio.to_thread(pods)).items()}
            patches = traffic(emu, "PATCH pods")

            def b_live(pool: str) -> set:  # (B's lease store: pool B's workers; pool A is not there at all)
                return {b_id} if pool == POOL_B else set()

            b = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True, capacity_peer_check_s=0)
            try:
                b.capacity_peers(b_id, POOL_B, b_live)
                s5 = CapacityWant("s5", "mine", gpus=1, cpu_cores=1)
                for _ in range(3):  # (s1 as A asks for it: A's is not adopted; s5: B's own)
                    await b.sync_capacity_requests([s1, s5])
                now = await asyncio.to_thread(pods)
                for n in names:
                    assert now[n].metadata.uid == before[n], f"{n} was deleted and made again"
                    assert now[n].metadata.annotations[ANN_CAPACITY_OWNER] == a_id and now[n].metadata.annotations[ANN_CAPACITY_POOL] == POOL_A
                    assert now[n].metadata.labels[LABEL_POOL] == label_value(POOL_A)
                assert traffic(emu, "PATCH pods") == patches
                assert deleted_names(emu) == {pool_less["metadata"]["name"]}  # (the pool-less one: its maker is gone, as before)
                mine = b.capacity_request_manifest(s5)["metadata"]["name"]
                assert set(now) == {*names, mine}
                assert b._capacity == {"s5": (mine,)}, b._capacity  # (A's s1 is not taken for B's)
                assert b.stats["capacity_adopted"] == 0 and b.stats["capacity_left_deleted"] == 1
                # s1 placed, or everything leaves B's queue: B deletes its own only
                await b._clear_way("s1", [])
                await b.sync_capacity_requests([])
                assert set(await asyncio.to_thread(pods)) == set(names)
            finally:
                await b.aclose()

            # a worker of a third pool without a lease store takes itself to be alone: at its first sync it deletes the
            # other workers' placeholders of its pool and of none, never another pool's
            c = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True)
            try:
                c.capacity_peers(c_id, "third@0", None)
                await c.sync_capacity_requests([s2])
                assert set(await asyncio.to_thread(pods)) == set(names) and c._capacity == {}
                assert c.stats["capacity_left_deleted"] == 0 and c.stats["capacity_adopted"] == 0
            finally:
                await c.aclose()
            assert traffic(emu, "PATCH pods") == patches

            # bound, A's placeholder is booked by B as another worker's is (k8s_usage.counted): it holds its room, unless
            # it has a priority class (kube-scheduler preempts it for a stage); B's own never
            bound = {**theirs[1], "spec": {**theirs[1]["spec"], "nodeName": "n1"}, "status": {"phase": "Pending"}}
            kw = dict(gpu_resource="nvidia.com/gpu", shared_resource="nvidia.com/gpu.shared", namespace="default", cluster_name="kubernetes",
                      pool=POOL_B, own_placeholders={b_id})
            got = foreign_usage([bound], **kw)
            assert got["n1"].gpus == 1 and got["n1"].names == (f"default/{names[1]}",), got
            preemptible = {**bound, "spec": {**bound["spec"], "priorityClassName": "qosflow-capacity", "priority": -10}}
            assert foreign_usage([preemptible], **kw) == {}
            assert foreign_usage([bound], **{**kw, "own_placeholders": {a_id}}) == {}  # (to A, its own)

    asyncio.run(go())


def deleted_names(emu) -> set[str]:
    from test_k8s_capacity_peers import deleted_pods

    return deleted_pods(emu)


#: two pools of one Prefect server whose names differ only where a label value cannot say it: both pool keys are the one
#: label value "gpu-team-0123456789ab" (label_value turns " " and "@" into "-")
TEAM_A, TEAM_B = "gpu team@0123456789ab", "gpu-team@0123456789ab"


def test_two_pools_whose_keys_make_one_label_value_are_told_apart_by_the_pool_key_annotation():
    """Before, a stage's pool was its qosflow.dev/pool label alone, and two pool keys can make one label value (the pools
    "gpu team" and "gpu-team" of one Prefect server): each pool's worker took the other's stage pods, Jobs and Secrets
    for its own (not booked, adopted, swept, taken over on a 409). Now what a backend creates carries the exact key too
    (annotation qosflow.dev/pool-key), which decides when present; the label decides for an object of the previous
    release, which has no annotation (so that a worker that is upgraded still knows its own)."""
    assert label_value(TEAM_A) == label_value(TEAM_B)
    with EmulatorServer([gpu_node("gpu-a", 4, cpu="16", memory="64Gi")]) as emu:
        async def go():
            def backend(pool: str) -> KubernetesBackend:
                be = KubernetesBackend(namespace="default", image="busybox:1.36", api_client=emu.api_client(), unschedulable_timeout_s=5.0)
                be.pod_usage_every_s = 0.0
                be.capacity_peers(holder_id(pool.split("@")[0]), pool, None)
                return be

            a, b = backend(TEAM_A), backend(TEAM_B)
            core = client.CoreV1Api(emu.api_client())
            try:
                cluster = await a.inventory()

                def spec(stage: str, **kw) -> LaunchSpec:
                    return LaunchSpec(stage, ["true"], Placement(stage, ((0, 0), (0, 1)), ((0, 2.0),)), cluster, **kw)

                emu.add_rule(selector="qosflow.dev/stage-id=t-1", run_s=120)
                h = await a.launch(spec("t-1", env={"HF_TOKEN": "hf_x"}))
                assert not h.ref["launch_error"], h.ref
                await until(lambda: [p.status.phase for p in core.list_namespaced_pod("default", label_selector="qosflow.dev/stage-id=t-1").items]
                            == ["Running"], "pool A's stage pod running")
                [pod] = (await asyncio.to_thread(core.list_namespaced_pod, "default", label_selector="qosflow.dev/stage-id=t-1")).items
                assert pod.metadata.annotations[ANN_POOL] == TEAM_A and pod.metadata.labels[LABEL_POOL] == label_value(TEAM_A)

                assert (await b.foreign_pod_usage())["gpu-a"].gpus == 2  # (B books A's stage pod)
                assert await a.foreign_pod_usage() == {}
                await until(lambda: (b._pod_informer.usage() or {}).get("gpu-a") is not None, "B's informer booking A's stage pod")
                assert await b.adopt("t-1") is None and await a.adopt("t-1") is not None
                with pytest.raises(QosflowError, match="belongs to another pool"):
                    await b.launch(spec("t-1", env={"HF_TOKEN": "hf_y"}))
                with pytest.raises(QosflowError, match="belongs to another pool"):
                    await b.launch(spec("t-1"))
                await a._put_secret(a.secret_manifest(spec("t-2", env={"HF_TOKEN": "hf_x"})), "t-2", "test")
                assert await b.sweep_orphan_secrets(grace_s=0) == []
                assert await a.sweep_orphan_secrets(grace_s=0) == [secret_name("t-2")]
            finally:
                await a.aclose()
                await b.aclose()

        asyncio.run(go())

    # the previous release's stage pod (the pool label, no annotation) is its pool's by the label, as it was
    kw = {**KW, "pool": TEAM_A}
    old = _pod("old", {"qosflow.dev/stage-id": "s", "qosflow.dev/cluster": "kubernetes", LABEL_POOL: label_value(TEAM_A)})
    assert foreign_usage([old], **kw) == {}
    assert foreign_usage([old], **{**KW, "pool": "vision@0123456789ab"})["n1"].gpus == 1
    new = {**old, "metadata": {**old["metadata"], "annotations": {ANN_POOL: TEAM_B}}}
    assert foreign_usage([new], **kw)["n1"].gpus == 1 and foreign_usage([new], **{**KW, "pool": TEAM_B}) == {}


def test_another_pools_placeholder_whose_priority_class_is_not_below_the_stages_is_booked_and_said(caplog):
    """Each pool's administrator sets its own capacity_priority_class. Before, a placeholder with any priority class was
    taken as preemptible for a stage (not booked), so a class of another pool's above this pool's stages left its room
    unbooked: a stage placed there stayed Unschedulable (kube-scheduler does not preempt a higher priority) until it
    failed as INFRA. Now the placeholder's priority (spec.priority, which the API server's Priority admission resolves
    from its class; the emulator does the same) is compared with the stage pods' (0, or a globalDefault class's, as the
    backend sees on its own stage pods): not below them, it is booked and the log says so once, with the fix; the maker
    is told too when its own class is not below its stages'. On the emulator (EMULATED: no cluster)."""
    import logging

    from qosflow.backends.base import CapacityWant

    def pclass(name: str, value: int, **kw) -> dict:
        return {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name}, "value": value, **kw}

    async def go():
        with EmulatorServer([gpu_node("gpu-a", 4, cpu="16", memory="64Gi")]) as emu:
            sched, core = client.SchedulingV1Api(emu.api_client()), client.CoreV1Api(emu.api_client())
            for body in (pclass("a-high", 1000), pclass("a-low", -10, preemptionPolicy="Never")):
                await asyncio.to_thread(sched.create_priority_class, body)

            alive = {POOL_A: {holder_id("a1"), holder_id("a2")}, POOL_B: {holder_id("b")}}  # (two live workers of pool A)

            def backend(pool: str, holder: str, **kw) -> KubernetesBackend:
                be = KubernetesBackend(namespace="default", image="busybox:1.36", api_client=emu.api_client(), request_capacity=True, **kw)
                be.pod_usage_every_s = 0.0
                be.capacity_peers(holder, pool, lambda p: alive.get(p, set()))
                return be

            (a1, a2), (bh,) = sorted(alive[POOL_A]), alive[POOL_B]
            a_high, a_low = backend(POOL_A, a1, capacity_priority_class="a-high"), backend(POOL_A, a2, capacity_priority_class="a-low")
            b = backend(POOL_B, bh)
            try:
                with caplog.at_level(logging.WARNING, logger="qosflow.backends.kubernetes"):
                    await a_high.sync_capacity_requests([CapacityWant("hi", "hi", gpus=1, cpu_cores=1)])
                    await a_low.sync_capacity_requests([CapacityWant("lo", "lo", gpus=1, cpu_cores=1)])
                    await until(lambda: sorted((p.metadata.labels["qosflow.dev/capacity-for"], p.spec.priority, p.spec.node_name)
                                               for p in core.list_namespaced_pod("default", label_selector="qosflow.dev/role=capacity-request").items)
                                == [("hi", 1000, "gpu-a"), ("lo", -10, "gpu-a")], "both placeholders bound, their priorities resolved")
                    got = (await b.foreign_pod_usage())["gpu-a"]
                    assert got.gpus == 1 and len(got.names) == 1 and got.names[0].endswith("-cap"), got  # (a-high's only)
                    assert "hi" in (await asyncio.to_thread(core.read_namespaced_pod, got.names[0].split("/")[1], "default")).metadata.annotations[
                        "qosflow.dev/capacity-for"]
                said = [r.getMessage() for r in caplog.records]
                theirs = [m for m in said if "capacity placeholder default/" in m]
                assert len(theirs) == 1 and "'a-high'" in theirs[0] and "its priority, 1000, is not lower than this pool's stage pods' (0)" in theirs[0] \
                    and POOL_A in theirs[0] and "below 0" in theirs[0], said
                mine = [m for m in said if "capacity_priority_class 'a-high' has priority 1000" in m]
                assert len(mine) == 1 and not any("'a-low' has priority" in m for m in said), said
                await b.foreign_pod_usage()
                assert len([r for r in caplog.records if "capacity placeholder default/" in r.getMessage()]) == 1  # (said once)

                # this pool's stage pods get a globalDefault class above 1000: B learns it from its own stage pod, and
                # a-high's placeholder is then one its stages preempt (not booked)
                await asyncio.to_thread(sched.create_priority_class, pclass("stages", 2000, globalDefault=True))
                cluster = await b.inventory()
                emu.add_rule(selector="qosflow.dev/stage-id=b-1", run_s=0.2)
                h = await b.launch(LaunchSpec("b-1", ["true"], Placement("b-1", ((0, 3),), ((0, 1.0),)), cluster))
                assert (await b.wait(h)).ok
                assert b._stage_priority == 2000
                assert await b.foreign_pod_usage() == {}
                # a pod naming a class that does not exist is refused, as the Priority admission refuses it
                from kubernetes.client.exceptions import ApiException
                with pytest.raises(ApiException) as e:
                    await asyncio.to_thread(core.create_namespaced_pod, "default", {
                        "metadata": {"name": "x"}, "spec": {"priorityClassName": "nope", "containers": [{"name": "c", "image": "i"}]}})
                assert e.value.status == 403 and "no PriorityClass with name nope was found" in e.value.body
            finally:
                for be in (a_high, a_low, b):
                    await be.aclose()

    asyncio.run(go())
