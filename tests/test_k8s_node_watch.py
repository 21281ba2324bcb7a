"""The Kubernetes backend keeps its view of the nodes from a watch (an informer), and a stage whose node is deleted
is reported lost at once.

Before, every heartbeat of the worker (~2 s) and every reading of the nodes LISTed all the cluster's nodes (at
1,000 nodes, a large answer every 2 s), and a stage whose node object was deleted was reported NodeLost only after
`node_lost_grace_s` (40 s), the grace of a node that is merely NotReady. Here on qosflow's API emulator (EMULATED:
no cluster), whose `GET /emulator/state` counts the API's requests per verb and resource.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes import client

from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.placement import Placement
from qosflow.k8s_emulator import EmulatorServer, gpu_node

pytestmark = pytest.mark.timeout(120)


async def until(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting until {what}")
        await asyncio.sleep(0.02)


def traffic(emu: EmulatorServer, key: str) -> int:
    return emu.state()["traffic"].get(key, {}).get("requests", 0)


def test_heartbeats_and_readings_are_served_from_a_node_watch_not_a_list_each():
    """Old code: one LIST of every node per heartbeat. Now one LIST, then a WATCH; the view follows nodes added,
    cordoned, made NotReady and deleted, without another LIST."""

    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)]) as emu:
            be = KubernetesBackend(api_client=emu.api_client())
            core = client.CoreV1Api(emu.api_client())
            try:
                await be.inventory()
                await until(lambda: be._node_synced and emu.state()["watches"]["by_resource"].get("nodes", 0) >= 1, "the node watch is open")
                lists = traffic(emu, "LIST nodes")
                for _ in range(20):  # 20 heartbeats
                    assert await be.healthy_nodes() == {"gpu-0", "gpu-1"}
                    assert {n.name for n in (await be.list_nodes()).nodes} == {"gpu-0", "gpu-1"}
                assert traffic(emu, "LIST nodes") == lists, emu.state()["traffic"]
                await asyncio.to_thread(emu.add_node, name="gpu-2", gpus=1)
                await until(lambda: asyncio.run(be.healthy_nodes()) == {"gpu-0", "gpu-1", "gpu-2"}, "gpu-2 seen")
                await asyncio.to_thread(core.patch_node, "gpu-1", {"spec": {"unschedulable": True}})
                await until(lambda: asyncio.run(be.healthy_nodes()) == {"gpu-0", "gpu-2"}, "gpu-1 cordoned seen")
                assert be.keeps_stages("gpu-1") and "cordoned" in be.down_reasons()["gpu-1"]
                assert (await be.list_nodes()).cordoned == {"gpu-1"}
                await asyncio.to_thread(core.patch_node_status, "gpu-2", {"status": {"conditions": [
                    {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "container runtime is down"}]}})
                await until(lambda: asyncio.run(be.healthy_nodes()) == {"gpu-0"}, "gpu-2 NotReady seen")
                assert be.down_reasons()["gpu-2"] == "the node is not Ready"
                await asyncio.to_thread(core.delete_node, "gpu-0")
                await until(lambda: asyncio.run(be.healthy_nodes()) == set(), "gpu-0 deleted seen")
                assert be.down_reasons()["gpu-0"] == "the node was deleted from the cluster"
                assert {n.name for n in (await be.list_nodes()).nodes} == {"gpu-1", "gpu-2"}
                assert traffic(emu, "LIST nodes") == lists, emu.state()["traffic"]  # (all of it through the watch)
                assert be.stats["node_lists"] == 1 and be.stats["node_events"] >= 4
            finally:
                await be.aclose()
            await until(lambda: not be._node_thread.is_alive(), "the node watch stopped with the backend")

    asyncio.run(go())


def test_the_node_watch_lists_again_on_410_and_the_heartbeat_lists_while_it_is_broken():
    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
            be = KubernetesBackend(api_client=emu.api_client())
            try:
                await be.healthy_nodes()  # (a LIST: the watch is not open yet; then it starts)
                await until(lambda: be._node_synced and emu.state()["watches"]["by_resource"].get("nodes", 0) >= 1, "the node watch is open")
                # the watch's version is compacted (as etcd does): 410 Gone, a LIST, and a watch from there
                core = client.CoreV1Api(emu.api_client())
                await asyncio.to_thread(core.create_namespaced_config_map, "default", {"metadata": {"name": "after-the-watch"}})
                await asyncio.to_thread(emu.compact)  # (the watch's last version, before the ConfigMap, is gone)
                await asyncio.to_thread(emu.add_node, name="gpu-1", gpus=1)
                await until(lambda: be.stats["node_watch_410"] >= 1 and be.stats["node_lists"] >= 2, "the watch listed again")
                await until(lambda: asyncio.run(be.healthy_nodes()) == {"gpu-0", "gpu-1"}, "gpu-1 seen after the 410")
                # the watch broken (here: stopped): each heartbeat LISTs, as before
                be._stop_node_watch()
                await until(lambda: not be._node_thread.is_alive(), "the watch stopped")
                lists = traffic(emu, "LIST nodes")
                await asyncio.to_thread(emu.add_node, name="gpu-2", gpus=1)
                assert await be.healthy_nodes() == {"gpu-0", "gpu-1", "gpu-2"}
                assert traffic(emu, "LIST nodes") == lists + 1
            finally:
                await be.aclose()

    asyncio.run(go())


def test_a_backend_without_the_node_watch_lists_at_every_heartbeat():
    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2)]) as emu:
            be = KubernetesBackend(api_client=emu.api_client(), watch_nodes=False)
            try:
                lists = traffic(emu, "LIST nodes")
                for _ in range(3):
                    assert await be.healthy_nodes() == {"gpu-0"}
                assert traffic(emu, "LIST nodes") == lists + 3 and be._node_thread is None
            finally:
                await be.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("watch_nodes", [True, False])
def test_a_stage_whose_node_is_deleted_is_lost_at_once_a_not_ready_node_keeps_its_grace(watch_nodes):
    """Old code: 40 s (node_lost_grace_s) for a deleted node as for a NotReady one. Now a node deleted (its DELETED
    event, or gone from the heartbeat's LIST without the watch) ends its stages' waits with NodeLost within a
    heartbeat or two; a NotReady node still has its grace (here 3 s)."""

    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)]) as emu:
            emu.add_rule(selector="qosflow.dev/stage-id=on-0", run_s=120)
            emu.add_rule(selector="qosflow.dev/stage-id=on-1", run_s=120)
            be = KubernetesBackend(api_client=emu.api_client(), watch_nodes=watch_nodes, node_lost_grace_s=3.0)
            core = client.CoreV1Api(emu.api_client())
            try:
                cluster = await be.inventory()

                async def run_on(stage: str, node: int):
                    h = await be.launch(LaunchSpec(stage, ["true"], Placement(stage, ((node, 0),), ((node, 0.5),)), cluster))

                    def running() -> bool:
                        pods = core.list_namespaced_pod("default", label_selector=f"qosflow.dev/stage-id={stage}").items
                        return bool(pods) and pods[0].status.phase == "Running"

                    await until(running, f"{stage} running")
                    return h

                h0, h1 = await run_on("on-0", 0), await run_on("on-1", 1)
                w0 = asyncio.ensure_future(be.wait(h0))
                w1 = asyncio.ensure_future(be.wait(h1))
                await until(lambda: len(be._waiting) == 2 and all(w["watch"] is not None for w in be._waiting.values()),
                            "both waits watch their pods")

                async def heartbeats() -> None:
                    while True:
                        await be.healthy_nodes()
                        await asyncio.sleep(0.5)

                beat = asyncio.ensure_future(heartbeats())
                t = time.monotonic()
                await asyncio.to_thread(core.delete_node, "gpu-0")  # kubectl delete node gpu-0
                await asyncio.to_thread(core.patch_node_status, "gpu-1", {"status": {"conditions": [
                    {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "PLEG is not healthy"}]}})
                st0 = await asyncio.wait_for(w0, 20)
                lost0 = time.monotonic() - t
                st1 = await asyncio.wait_for(w1, 60)
                lost1 = time.monotonic() - t
                beat.cancel()
                return st0, lost0, st1, lost1
            finally:
                await be.aclose()

    st0, lost0, st1, lost1 = asyncio.run(go())
    assert st0.kind is ExitKind.INFRA and "NodeLost" in st0.reason or "node was lost" in st0.reason, st0
    assert "gpu-0 was deleted from the cluster" in st0.reason, st0
    assert lost0 < 2.5, f"the deleted node's stage was reported lost after {lost0:.1f}s"
    assert st1.kind is ExitKind.INFRA and "has not been Ready for 3s" in st1.reason, st1
    assert lost1 >= 3.0, f"the NotReady node's stage was reported lost after {lost1:.1f}s, before its grace"
