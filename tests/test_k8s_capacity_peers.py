"""Several workers on one pool, one cluster, one lease store, all asking the cluster's autoscaler for nodes
(`request_capacity`): a worker deletes another's placeholder pods only once that worker is gone.

Before, the first sync of every worker deleted each placeholder of its cluster it had not made ("left by a worker
that stopped"), a live worker's too: the autoscaler saw them vanish and come back at that worker's next heartbeat (a
scale-up lost or delayed), at every restart of any worker of the pool; and a worker that died later left its
placeholders until some worker started again. Now each placeholder names its maker (qosflow.dev/capacity-owner: the
worker's lease holder id) and pool, and a worker deletes it when its maker has no live presence in the lease store
(`LeaseStore.live_workers`), looking every `capacity_peer_check_s`. Workers (scheduler + KubernetesBackend + heartbeat)
run on qosflow's API emulator (EMULATED: no cluster) with a SQLite lease store each test makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
from kubernetes import client

from k8s_lab import until
from qosflow.backends.base import CapacityWant
from qosflow.backends.kubernetes import ANN_CAPACITY_OWNER, ANN_CAPACITY_POOL, KubernetesBackend
from qosflow.k8s_emulator import EmulatorServer
from qosflow.store.leases import LeaseStore, holder_id
from test_k8s_capacity import SHAPE, Lab, group

pytestmark = pytest.mark.timeout(120)
POOL = "k8s-capacity"  # (Lab's)
CHECK_S = 0.2  # capacity_peer_check_s here


class Peer(Lab):
    """A worker of the pool as `QosflowWorker` runs with a lease store: its presence claimed (`claim_name`) and
    renewed at each heartbeat (`renew_holder`, after the capacity requests, as `_health_loop` does). The pool is at zero
    with two stand-ins of the declared node (down): every stage queued waits for capacity and gets a placeholder. No
    node ever comes (the autoscaler's scale-up delay is long): only the placeholders are looked at."""

    def __init__(self, emu: EmulatorServer, store: LeaseStore, name: str, ttl_s: float = 30.0, **backend):
        super().__init__(emu, request_capacity=True, capacity_node={**SHAPE, "count": 2}, capacity_peer_check_s=CHECK_S, **backend)
        self.store, self.ttl_s = store, ttl_s
        self.holder = holder_id(name)
        self.beat = (*self.beat, "_renew_presence")

    async def __aenter__(self):
        await super().__aenter__()
        await until(lambda: bool(self.sched.state.down.all()), "the stand-ins down: nothing is placed on them")
        return self

    async def _beat(self) -> None:
        w = self.w
        w.leases, w.holder, w.lease_ttl_s = self.store, self.holder, self.ttl_s
        await asyncio.to_thread(self.store.claim_name, w._pool_key, self.holder, self.ttl_s)
        w._renew_presence = lambda: asyncio.to_thread(self.store.renew_holder, self.holder, self.ttl_s)
        await super()._beat()

    def mine(self) -> dict[str, str]:
        """This worker's placeholders now: name -> uid (a placeholder deleted and made again has another uid)."""
        return {p.metadata.name: p.metadata.uid for p in self.placeholders() if p.metadata.annotations.get(ANN_CAPACITY_OWNER) == self.holder}

    def die(self) -> None:
        """The worker stops heartbeating (SIGKILL, a lost host): its presence is no longer renewed, its placeholders
        stay."""
        for t in self.tasks:
            t.cancel()

    async def drop(self, *futures: asyncio.Future) -> None:
        for name in list(self.sched.entries):
            self.sched.drop(name)
        for f in futures:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await f


def deleted_pods(emu: EmulatorServer) -> set[str]:
    """The pods the emulator's API has seen deleted (its watch cache's DELETED events)."""
    for _ in range(20):
        try:
            log = list(emu.cluster.store.log)
            break
        except RuntimeError:  # (the deque changed meanwhile, in the emulator's thread)
            time.sleep(0.01)
    return {obj["metadata"]["name"] for _, plural, etype, obj, _ in log if plural == "pods" and etype == "DELETED"}


def the_store(tmp_path) -> LeaseStore:
    return LeaseStore(url=f"sqlite:///{tmp_path / 'leases.db'}")


def test_a_second_worker_starting_keeps_the_placeholders_of_a_live_first_one_and_its_launch_clears_only_its_own(tmp_path):
    async def go():
        store = the_store(tmp_path)
        with EmulatorServer([], autoscaler=group(scale_up_delay_s=600.0)) as emu:
            async with Peer(emu, store, "w1") as a:
                qa = [a.queue("a1"), a.queue("a2")]
                await until(lambda: len(a.mine()) == 2, "the first worker's two placeholders")
                before = a.mine()
                ph = a.placeholders()[0]
                assert ph.metadata.annotations[ANN_CAPACITY_POOL] == a.w._pool_key
                async with Peer(emu, store, "w2") as b:
                    qb = b.queue("b1")
                    await until(lambda: len(b.mine()) == 1, "the second worker's placeholder")
                    assert b.be._capacity_swept
                    await asyncio.sleep(10 * CHECK_S)  # (the second has looked at the first's makers several times)
                    assert a.mine() == before  # (same names, same pods)
                    assert not deleted_pods(emu) & set(before), deleted_pods(emu)
                    assert b.be.stats["capacity_left_deleted"] == 0 and a.be.stats["capacity_left_deleted"] == 0
                    assert a.be.stats["capacity_requested"] == 2 and b.be.stats["capacity_requested"] == 1
                    # the second places its stage: it deletes its own placeholders in the way, never the first's (both
                    # Pending, not bound yet: the kube-scheduler could bind either to the room freed)
                    await b.be._clear_way("b1", ["gpu-pool-x"])
                    assert b.mine() == {} and a.mine() == before
                    await b.drop(qb)
                await a.drop(*qa)
                await until(lambda: a.placeholders() == [], "the first worker's placeholders gone once its stages left the queue")

    asyncio.run(go())


@pytest.mark.parametrize("how", ["its presence expires", "it left the lease store"])
def test_a_worker_deletes_the_placeholders_of_a_peer_that_died_once_its_presence_is_gone(tmp_path, how):
    """The second worker started first (its first sync, which deleted what was left then, is long past) and has no
    stage of its own: it still looks every capacity_peer_check_s, and deletes the dead peer's placeholders within the
    peer's presence TTL and that (before, only a worker's first sync deleted another's: they stayed)."""
    ttl_s = 1.0

    async def go():
        store = the_store(tmp_path)
        with EmulatorServer([], autoscaler=group(scale_up_delay_s=600.0)) as emu:
            async with Peer(emu, store, "w2") as b:
                await until(lambda: b.be._capacity_swept, "the second worker's first sync")
                async with Peer(emu, store, "w1", ttl_s=ttl_s) as a:
                    qa = a.queue("a1")
                    await until(lambda: len(a.mine()) == 1, "the first worker's placeholder")
                    made = a.mine()
                    await asyncio.sleep(3 * ttl_s)  # (alive: kept, although the second looks every 0.2 s)
                    assert a.mine() == made
                    a.die()
                    if how == "it left the lease store":
                        await asyncio.to_thread(store.leave, a.holder)  # (stopped without deleting its placeholders)
                    t0 = time.monotonic()
                    await until(lambda: a.placeholders() == [] and b.be.stats["capacity_left_deleted"] == 1,
                                "the dead worker's placeholder deleted by the other", timeout=10)
                    took = time.monotonic() - t0
                    assert took < ttl_s + CHECK_S + 3.0, took  # (slack for a loaded machine; before, never)
                    await a.drop(qa)

    asyncio.run(go())


def test_at_its_first_sync_a_worker_deletes_placeholders_that_name_no_maker_or_a_dead_one_and_keeps_a_live_maker_s(tmp_path):
    async def go():
        store = the_store(tmp_path)
        with EmulatorServer([], autoscaler=group(scale_up_delay_s=600.0)) as emu:
            core = client.CoreV1Api(emu.api_client())
            live_holder, dead_holder = holder_id("w1"), holder_id("w0")
            other = KubernetesBackend(namespace="default", api_client=emu.api_client(), node_selector={"nvidia.com/gpu.present": "true"})
            try:
                from prefect.settings import PREFECT_API_URL

                from qosflow.store.leases import pool_key

                pool = pool_key(POOL, PREFECT_API_URL.value())
                await asyncio.to_thread(store.claim_name, pool, live_holder, 60.0)  # (w1 lives; w0 never did, or is long gone)
                old = other.capacity_request_manifest(CapacityWant("old", "old", gpus=1, cpu_cores=1))
                for k in (ANN_CAPACITY_OWNER, ANN_CAPACITY_POOL):  # (made by a version before makers were named)
                    old["metadata"]["annotations"].pop(k, None)
                other.capacity_peers(dead_holder, pool, None)
                dead = other.capacity_request_manifest(CapacityWant("dead", "dead", gpus=1, cpu_cores=1))
                other.capacity_peers(live_holder, pool, None)
                live = other.capacity_request_manifest(CapacityWant("live", "live", gpus=1, cpu_cores=1))
            finally:
                await other.aclose()
            assert live["metadata"]["annotations"][ANN_CAPACITY_OWNER] == live_holder
            for body in (old, dead, live):
                await asyncio.to_thread(core.create_namespaced_pod, "default", body)
            uid = (await asyncio.to_thread(core.read_namespaced_pod, live["metadata"]["name"], "default")).metadata.uid
            async with Peer(emu, store, "w2") as b:
                await until(lambda: b.be.stats["capacity_left_deleted"] == 2, "the old and the dead worker's placeholders deleted")
                await asyncio.sleep(5 * CHECK_S)
                assert [(p.metadata.name, p.metadata.uid) for p in b.placeholders()] == [(live["metadata"]["name"], uid)]
                assert deleted_pods(emu) == {old["metadata"]["name"], dead["metadata"]["name"]}

    asyncio.run(go())


def test_when_the_lease_store_cannot_say_who_is_alive_the_others_placeholders_are_kept_and_the_log_says_so(caplog):
    """A database error: another's placeholders are kept (deleting a live worker's would lose its scale-up), said once,
    and judged again once the store answers. Without a lease store (a worker alone on its pool) they go at the first
    sync, as before."""
    async def go():
        with EmulatorServer([]) as emu:
            core = client.CoreV1Api(emu.api_client())
            other = KubernetesBackend(namespace="default", api_client=emu.api_client())
            other.capacity_peers(holder_id("w1"), "gpu@x", None)
            body = other.capacity_request_manifest(CapacityWant("a", "a", gpus=1, cpu_cores=1))
            await other.aclose()
            await asyncio.to_thread(core.create_namespaced_pod, "default", body)
            names = lambda: [p.metadata.name for p in core.list_namespaced_pod("default").items]  # noqa: E731

            def broken(pool: str):
                raise RuntimeError("database is locked")

            be = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True, capacity_peer_check_s=0)
            try:
                be.capacity_peers(holder_id("w2"), "gpu@x", broken)
                with caplog.at_level(logging.INFO, "qosflow.backends.kubernetes"):
                    for _ in range(3):
                        await be.sync_capacity_requests([])
                    assert await asyncio.to_thread(names) == [body["metadata"]["name"]]
                    said = [r.getMessage() for r in caplog.records if "cannot read which workers are alive" in r.getMessage()]
                    assert len(said) == 1 and "database is locked" in said[0] and "are kept" in said[0], said
                    be.capacity_peers(holder_id("w2"), "gpu@x", lambda pool: set())  # (it answers: w1 is not alive)
                    await be.sync_capacity_requests([])
                    assert await asyncio.to_thread(names) == []
                    assert any("tells again" in r.getMessage() for r in caplog.records)
            finally:
                await be.aclose()
            await asyncio.to_thread(core.create_namespaced_pod, "default", body)
            be = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True)
            try:
                be.capacity_peers(holder_id("w2"), "gpu@x", None)
                await be.sync_capacity_requests([])
                assert await asyncio.to_thread(names) == [] and be.stats["capacity_left_deleted"] == 1
            finally:
                await be.aclose()

    asyncio.run(go())


def test_the_cluster_block_sets_capacity_peer_check_s_and_an_edit_of_it_is_taken_at_once():
    """The block's capacity_peer_check_s reaches the backend (before, only KubernetesBackend(capacity_peer_check_s=...)
    set it: a block user had the 10 s default), and an edited block's value is taken at the next look, like the other
    capacity requests' fields (`update_cluster`)."""
    from qosflow.prefect.blocks import KubernetesGPUCluster

    async def go():
        with EmulatorServer([]) as emu:
            block = KubernetesGPUCluster(api_url=emu.url, request_capacity=True, capacity_peer_check_s=2.5)
            be = block.make_backend()
            try:
                assert be.capacity_peer_check_s == 2.5
                assert KubernetesGPUCluster(api_url=emu.url).make_backend().capacity_peer_check_s == 10.0  # (the default)
                edited = KubernetesGPUCluster(api_url=emu.url, request_capacity=True, capacity_peer_check_s=0.5).make_backend()
                try:
                    up = await be.update_cluster(edited)
                finally:
                    await edited.aclose()
                assert be.capacity_peer_check_s == 0.5
                assert any("capacity_peer_check_s 2.5 -> 0.5" in a for a in up.applied), up
            finally:
                await be.aclose()

    asyncio.run(go())


def test_a_worker_that_takes_over_a_dead_workers_stage_adopts_its_placeholder_instead_of_deleting_and_making_it_again():
    """Worker A made the placeholder of stage S and died; S is now worker B's (its lease taken over, S back in B's QoS
    queue, still waiting for capacity). Before, B's sync deleted A's placeholder ("its maker is gone") and made the same
    pod again at once: the autoscaler saw the pod vanish and come back (a pending scale-up restarted, or a node it had
    brought for the pod taken as unneeded). Now B adopts it: the same pod (same uid) is rewritten to name B as its maker
    (a PATCH, no DELETE), so that a third worker does not take it for the dead A's. A placeholder of A's that does not
    ask for what B would (S's resources changed) is still replaced."""
    async def go():
        with EmulatorServer([]) as emu:
            core = client.CoreV1Api(emu.api_client())
            a_id, b_id, c_id, pool = holder_id("wa"), holder_id("wb"), holder_id("wc"), "gpu@x"
            want = CapacityWant("s1", "train", gpus=2, cpu_cores=4, mem_mb=8192)
            other = CapacityWant("s2", "eval", gpus=1, cpu_cores=1)
            a = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True)
            try:  # (A's placeholders, as A made them; A then dies: nobody deletes them)
                a.capacity_peers(a_id, pool, None)
                bodies = [a.capacity_request_manifest(want), a.capacity_request_manifest(other)]
            finally:
                await a.aclose()
            for body in bodies:
                await asyncio.to_thread(core.create_namespaced_pod, "default", body)
            name, name2 = bodies[0]["metadata"]["name"], bodies[1]["metadata"]["name"]
            uid = (await asyncio.to_thread(core.read_namespaced_pod, name, "default")).metadata.uid
            uid2 = (await asyncio.to_thread(core.read_namespaced_pod, name2, "default")).metadata.uid

            def pods() -> dict:
                return {p.metadata.name: p for p in core.list_namespaced_pod("default").items}

            def deletes() -> int:
                return emu.state()["traffic"].get("DELETE pods", {}).get("requests", 0)

            b = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True, capacity_peer_check_s=0)
            try:
                b.capacity_peers(b_id, pool, lambda p: {b_id})  # (A has no live presence: dead)
                s2_now = CapacityWant("s2", "eval", gpus=2, cpu_cores=1)  # (s2 asks for more now: A's does not do)
                for _ in range(3):
                    await b.sync_capacity_requests([want, s2_now])
                now = await asyncio.to_thread(pods)
                assert now[name].metadata.uid == uid, "the placeholder was deleted and made again"
                assert now[name].metadata.annotations[ANN_CAPACITY_OWNER] == b_id
                assert now[name].metadata.annotations[ANN_CAPACITY_POOL] == pool
                assert now[name2].metadata.uid != uid2 and now[name2].metadata.annotations[ANN_CAPACITY_OWNER] == b_id
                assert now[name2].spec.containers[0].resources.requests["nvidia.com/gpu"] == "2"
                assert deleted_pods(emu) == {name2} and deletes() == 1  # (only the one that no longer fits)
                assert b._capacity == {"s1": (name,), "s2": (name2,)}
                assert b.stats["capacity_requested"] == 1 and b.stats["capacity_left_deleted"] == 1
                assert b.stats["capacity_adopted"] == 1
                # a third worker, alive with B, keeps B's placeholders (it would delete one still naming the dead A)
                c = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True, capacity_peer_check_s=0)
                try:
                    c.capacity_peers(c_id, pool, lambda p: {b_id, c_id})
                    await c.sync_capacity_requests([])
                    assert c.stats["capacity_left_deleted"] == 0 and set(await asyncio.to_thread(pods)) == {name, name2}
                finally:
                    await c.aclose()
                await b.sync_capacity_requests([])  # (S placed or gone: B deletes what is its own now)
                assert await asyncio.to_thread(pods) == {} and deletes() == 3
            finally:
                await b.aclose()

    asyncio.run(go())


def test_a_live_workers_placeholder_is_never_adopted_by_another_that_asks_for_the_same_stage():
    """Workers A and B alive on one pool, both asking for stage S (its lease passed to B while A lives on: a lease that
    expired under A, a stage queued again). Before, B adopted A's placeholder at its first sync whoever made it (a PATCH
    making it name B): A lost it from under it, and two live workers took placeholders from each other. Now only one
    whose maker is gone is adopted (the test that would delete it): A's stays A's, untouched (no PATCH, no DELETE), B
    does not take it for its own (its placement's clearing and its later syncs leave it) and makes none under its name;
    once A is gone, B adopts it. While the lease store cannot tell, nothing is adopted."""
    async def go():
        with EmulatorServer([]) as emu:
            core = client.CoreV1Api(emu.api_client())
            a_id, b_id, pool = holder_id("wa"), holder_id("wb"), "gpu@x"
            want = CapacityWant("s1", "train", gpus=2, cpu_cores=4, mem_mb=8192)
            a = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True)
            try:
                a.capacity_peers(a_id, pool, None)
                body = a.capacity_request_manifest(want)
            finally:
                await a.aclose()
            await asyncio.to_thread(core.create_namespaced_pod, "default", body)
            name = body["metadata"]["name"]
            uid = (await asyncio.to_thread(core.read_namespaced_pod, name, "default")).metadata.uid

            def traffic(key: str) -> int:
                return emu.state()["traffic"].get(key, {}).get("requests", 0)

            def pod():
                return core.read_namespaced_pod(name, "default")

            patches = traffic("PATCH pods")
            live, failing = {a_id, b_id}, [True]

            def live_holders(p: str) -> set:
                if failing[0]:
                    raise ConnectionError("lease store down")
                return set(live) if p == pool else set()

            b = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True, capacity_peer_check_s=0)
            try:
                b.capacity_peers(b_id, pool, live_holders)
                await b.sync_capacity_requests([want])  # (the lease store fails: who made it cannot be known)
                failing[0] = False
                for _ in range(3):
                    await b.sync_capacity_requests([want])  # (A alive)
                now = await asyncio.to_thread(pod)
                assert now.metadata.uid == uid and now.metadata.annotations[ANN_CAPACITY_OWNER] == a_id, "B took A's placeholder"
                assert traffic("PATCH pods") == patches and traffic("DELETE pods") == 0 and not deleted_pods(emu)
                assert b._capacity == {} and not b.holds_capacity_requests
                assert b.stats["capacity_adopted"] == 0 and b.stats["capacity_requested"] == 0 and b.stats["capacity_left_deleted"] == 0
                # S placed by B, then leaving B's queue: B deletes its own placeholders only
                await b._clear_way("s1", [])
                b._capacity_placed.clear()
                await b.sync_capacity_requests([])
                assert (await asyncio.to_thread(pod)).metadata.uid == uid and traffic("DELETE pods") == 0
                # A gone: B, asking for S again, adopts it (the same pod, naming B now)
                live.discard(a_id)
                await b.sync_capacity_requests([want])
                now = await asyncio.to_thread(pod)
                assert now.metadata.uid == uid and now.metadata.annotations[ANN_CAPACITY_OWNER] == b_id
                assert traffic("PATCH pods") == patches + 1 and traffic("DELETE pods") == 0
                assert b._capacity == {"s1": (name,)} and b.stats["capacity_adopted"] == 1
            finally:
                await b.aclose()

    asyncio.run(go())


def test_a_placeholder_made_by_another_worker_between_a_sync_s_list_and_its_create_is_not_taken_for_this_one_s():
    """Two live workers of one pool ask for the same stage (its lease passed on while the first lives). B's sync LISTs
    the placeholders, A creates the stage's placeholder, B's create of the same name answers 409. Before, B recorded the
    pod as its own until its next sync: its `_clear_way` for the stage (placed here meanwhile) deleted A's live
    placeholder, and it counted a request it had not made. Now the 409 reads the pod (one LIST by name: no `get` on pods
    is granted) and records it only if it names B as its maker (B's own create whose answer was lost)."""
    async def go():
        with EmulatorServer([]) as emu:
            admin = client.CoreV1Api(emu.api_client())
            a_id, b_id = holder_id("wa"), holder_id("wb")
            want = CapacityWant("s1", "train", gpus=1, cpu_cores=1)
            a = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True)
            b = KubernetesBackend(namespace="default", api_client=emu.api_client(), request_capacity=True, capacity_peer_check_s=0)
            try:
                a.capacity_peers(a_id, POOL, lambda p: {a_id, b_id})
                b.capacity_peers(b_id, POOL, lambda p: {a_id, b_id})
                race: list[dict] = []  # (a pod to create right after B's next LIST of the placeholders: the race)
                real = b.core.list_namespaced_pod

                def racing(*args, **kw):
                    out = real(*args, **kw)
                    if race and not kw.get("field_selector"):
                        admin.create_namespaced_pod("default", race.pop())
                    return out

                b.core.list_namespaced_pod = racing
                theirs = a.capacity_request_manifest(want)
                race.append(theirs)
                await b.sync_capacity_requests([want])
                assert not race and b._capacity == {} and not b.holds_capacity_requests, b._capacity
                assert b.stats["capacity_conflict_theirs"] == 1 and b.stats["capacity_requested"] == 0, b.stats
                name = theirs["metadata"]["name"]
                uid = (await asyncio.to_thread(admin.read_namespaced_pod, name, "default")).metadata.uid
                await b._clear_way("s1", [])  # (the stage placed by B: only B's own placeholders go)
                await b.sync_capacity_requests([want])
                pod = await asyncio.to_thread(admin.read_namespaced_pod, name, "default")
                assert pod.metadata.uid == uid and pod.metadata.annotations[ANN_CAPACITY_OWNER] == a_id
                assert b._capacity == {} and b.stats["capacity_requested"] == 0, (b._capacity, b.stats)
                await asyncio.to_thread(admin.delete_namespaced_pod, name, "default")

                # B's own create whose answer was lost (the pod there names B): recorded as B's, as before
                b._capacity_placed.clear()  # (s1 queued again, its launch over: B asks for it again)
                b._capacity_settling.clear()
                race.append(b.capacity_request_manifest(want))
                await b.sync_capacity_requests([want])
                assert b._capacity == {"s1": (name,)} and b.stats["capacity_conflict_mine"] == 1, (b._capacity, b.stats)
            finally:
                await a.aclose()
                await b.aclose()

    asyncio.run(go())
