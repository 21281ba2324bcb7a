"""A worker on Kubernetes follows the cluster's GPU nodes as they come and go, without an edit of its cluster block.

A cluster autoscaler adds a GPU node, an administrator cordons one or deletes it: the worker lists the nodes again
every `cluster_reload_s` (`QosflowWorker._follow_nodes`, one list call) and applies the difference as an edit of the
block (`_settle_cluster`). Here a worker given a KubernetesBackend on qosflow's API emulator (EMULATED: no cluster),
its reload loop every 0.2 s, its scheduler placing stages (fifo: first fit) that the backend runs as Jobs; nodes are
added through the emulator's control API, deleted and cordoned through the official client (DELETE
/api/v1/nodes/NAME, a patch of spec.unschedulable), as `kubectl delete node` and `kubectl cordon` do.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.core.job import Job, JobState
from qosflow.core.qos import QoSSpec
from qosflow.k8s_emulator import EmulatorServer, gpu_node
from k8s_lab import EmulatedWorker
from k8s_lab import until as _until

pytestmark = pytest.mark.timeout(120)
RELOAD_S = 0.2


async def until(cond, what: str, timeout: float = 30.0) -> None:
    await _until(cond, what, timeout)


class Lab(EmulatedWorker):
    """A worker (scheduler + backend + its cluster reload loop) on the emulator."""

    def __init__(self, emu: EmulatorServer, *, follow: bool = True):
        super().__init__(emu, pool="k8s-node-changes", reload_s=RELOAD_S if follow else None)

    async def __aenter__(self) -> "Lab":
        await super().__aenter__()
        self.loop = self.tasks[0] if self.tasks else None
        return self

    @property
    def names(self) -> list[str]:
        return list(self.sched.cluster.node_names)

    def said(self, line: str) -> bool:
        return any(x == line for _, x in self.w.cluster_events)

    def down(self, name: str) -> bool:
        return bool(self.sched.state.down[self.sched.cluster.index_of(name)])

    async def place(self, name: str, gpus: int = 1) -> str:
        """Queue a stage; the node the scheduler gives it."""
        from qosflow.prefect.scheduler import StageEntry

        e = StageEntry(JobState(Job(name, 0.0, QoSSpec(gpus=gpus, cpu_cores=1), duration=5.0)), name)
        g = await asyncio.wait_for(self.sched.request(e), 20)
        (node,) = g.placement.nodes
        return self.sched.cluster.nodes[node].name



def test_a_node_added_to_the_cluster_takes_a_stage_without_an_edit_of_the_block():
    async def go():
        with EmulatorServer([gpu_node("gpu-0", 1)]) as emu:
            async with Lab(emu) as lab:
                assert await lab.place("a") == "gpu-0"  # the only GPU, busy
                await asyncio.to_thread(emu.add_node, name="gpu-1", gpus=1)  # (the autoscaler's new node)
                await until(lambda: lab.names == ["gpu-0", "gpu-1"] and not lab.down("gpu-1"), "gpu-1 planned on, up")
                assert lab.said("host gpu-1 added (1 GPU, virtual, 32 cores)"), lab.w.cluster_events
                assert ("qosflow.node.added", "gpu-1") in lab.events
                assert await lab.place("b") == "gpu-1"
                h = await lab.launch("b", 0.3)
                st = await lab.be.wait(h)
                assert st.kind is ExitKind.OK, st
                assert lab.pod_node("b") == "gpu-1"

    asyncio.run(go())


def test_a_deleted_node_takes_no_new_stage_and_its_running_stage_is_lost_at_once():
    """A node object deleted (`kubectl delete node`, an autoscaler's scale-down): its pods will not run again (the pod
    garbage collector deletes them, in the emulator too, after its quarantine of 5 s: the stage is reported lost before
    that, from the node's deletion itself). Before, its stage was reported
    NodeLost only after node_lost_grace_s (40 s), the grace of a node merely NotReady; now within a beat or two."""
    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)]) as emu:
            async with Lab(emu) as lab:
                assert await lab.place("a") == "gpu-0"
                ha = await lab.launch("a", 60.0)
                await until(lambda: lab.pod_node("a") == "gpu-0", "a running on gpu-0")
                wa = asyncio.ensure_future(lab.be.wait(ha))
                t = time.monotonic()
                await asyncio.to_thread(lab.core.delete_node, "gpu-0")  # kubectl delete node gpu-0
                sa = await asyncio.wait_for(wa, 20)
                lost = time.monotonic() - t
                assert sa.kind is ExitKind.INFRA and "node gpu-0 was deleted from the cluster" in sa.reason, sa
                assert lost < 3.0, f"reported lost after {lost:.1f}s"
                await until(lambda: lab.said("host gpu-0 removed (1 stage still running there, no new ones)")
                            or lab.said("host gpu-0 removed"), "the removal said")
                # gpu-0 has free GPUs and comes first, but takes no new stage
                assert await lab.place("b") == "gpu-1"
                hb = await lab.launch("b", 0.3)
                sb = await lab.be.wait(hb)
                assert sb.kind is ExitKind.OK, sb
                assert lab.pod_node("b") == "gpu-1"
                lab.sched.release("a")
                await until(lambda: lab.names == ["gpu-1"], "gpu-0 forgotten once its stage ended")
                assert lab.sched.entries["b"].grant.placement.nodes == (0,)  # (renumbered: gpu-1 is node 0 now)
                lab.sched.release("b")
                lab.sched.state.check_invariants()

    asyncio.run(go())


def test_every_node_deleted_stages_wait_and_nodes_that_come_back_are_used():
    """A cluster autoscaler scales the GPU node pool to zero: every node is deleted. The running stage is lost at once,
    every node is down (the heartbeat says why: deleted), new stages wait, an edit of the cluster block meanwhile is
    taken (before, `update_cluster` failed with 'no Kubernetes node matches'), and the node the autoscaler brings
    back takes the waiting stage."""
    async def go():
        with EmulatorServer([gpu_node("gpu-0", 1), gpu_node("gpu-1", 1)]) as emu:
            async with Lab(emu) as lab:

                async def heartbeat() -> None:
                    while True:
                        await lab.w._sync_health()
                        await asyncio.sleep(0.2)

                beat = asyncio.get_running_loop().create_task(heartbeat())
                try:
                    assert await lab.place("a") == "gpu-0"
                    ha = await lab.launch("a", 60.0)
                    await until(lambda: lab.pod_node("a") == "gpu-0", "a running on gpu-0")
                    wa = asyncio.ensure_future(lab.be.wait(ha))
                    for name in ("gpu-0", "gpu-1"):  # scaled to zero
                        await asyncio.to_thread(lab.core.delete_node, name)
                    sa = await asyncio.wait_for(wa, 20)
                    assert sa.kind is ExitKind.INFRA and "node gpu-0 was deleted from the cluster" in sa.reason, sa
                    lab.sched.release("a")
                    await until(lambda: lab.down("gpu-0") and lab.down("gpu-1"), "every node down")
                    assert lab.be.down_reasons() == {"gpu-0": "the node was deleted from the cluster",
                                                     "gpu-1": "the node was deleted from the cluster"}
                    assert (await lab.be.list_nodes()).nodes == []
                    waiting = asyncio.ensure_future(lab.place("b"))
                    await asyncio.sleep(1.0)
                    assert not waiting.done()  # no node: the stage waits
                    # the cluster block edited meanwhile: taken, nothing fails
                    edited = KubernetesBackend(namespace="default", image="busybox:1.37", api_client=emu.api_client())
                    try:
                        upd = await lab.be.update_cluster(edited)
                    finally:
                        await edited.aclose()
                    # (the nodes last listed, as the worker plans on them: both, or gpu-1 alone if a reading saw gpu-0 deleted
                    # first, which was then forgotten once its stage ended)
                    assert lab.be.image == "busybox:1.37" and [n.name for n in upd.nodes] == lab.names, (upd, lab.names)
                    assert lab.names in (["gpu-0", "gpu-1"], ["gpu-1"])
                    assert any("no node of the cluster matches" in m for m in upd.not_applied), upd
                    # the autoscaler brings a node back
                    await asyncio.to_thread(emu.add_node, name="gpu-7", gpus=1)
                    assert await asyncio.wait_for(waiting, 20) == "gpu-7"
                    await until(lambda: lab.names == ["gpu-7"], "the deleted nodes forgotten")
                    hb = await lab.launch("b", 0.3)
                    assert (await lab.be.wait(hb)).kind is ExitKind.OK
                    assert lab.pod_node("b") == "gpu-7"
                    lab.sched.release("b")
                finally:
                    beat.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await beat

    asyncio.run(go())


def test_a_cordoned_node_takes_no_new_stage_keeps_its_running_one_and_is_used_again_once_uncordoned():
    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)]) as emu:
            async with Lab(emu) as lab:
                assert await lab.place("a") == "gpu-0"
                ha = await lab.launch("a", 2.0)
                await until(lambda: lab.pod_node("a") == "gpu-0", "a running on gpu-0")
                await asyncio.to_thread(lab.core.patch_node, "gpu-0", {"spec": {"unschedulable": True}})  # kubectl cordon gpu-0
                said = "host gpu-0 is cordoned (spec.unschedulable): no new stage goes there; 1 stage running there goes on"
                await until(lambda: lab.said(said), "the cordon said")
                assert lab.down("gpu-0") and lab.names == ["gpu-0", "gpu-1"]  # kept: its stage runs on
                assert lab.events == [("qosflow.node.changed", "gpu-0")]
                assert await lab.place("b") == "gpu-1"
                assert (await lab.be.wait(ha)).kind is ExitKind.OK
                lab.sched.release("a")
                lab.sched.release("b")
                # Kubernetes' own scheduler binds no new pod there either (the emulator as a cluster does)
                cl = lab.sched.cluster
                from qosflow.core.placement import Placement

                pinned = Placement("pinned", ((0, 0),), ((0, 1.0),))
                st = await lab.be.wait(await lab.be.launch(LaunchSpec("pinned", ["true"], pinned, cl)))
                assert st.kind is ExitKind.INFRA and "node(s) were unschedulable" in st.reason, st

                await asyncio.to_thread(lab.core.patch_node, "gpu-0", {"spec": {"unschedulable": False}})  # kubectl uncordon gpu-0
                await until(lambda: lab.said("host gpu-0 is uncordoned: new stages go there again") and not lab.down("gpu-0"), "uncordoned")
                assert await lab.place("c") == "gpu-0"
                assert (await lab.be.wait(await lab.launch("c", 0.3))).kind is ExitKind.OK
                assert lab.pod_node("c") == "gpu-0"
                # one line per change, not one per reading
                assert sum(line.startswith("host gpu-0 is") for _, line in lab.w.cluster_events) == 2, lab.w.cluster_events

    asyncio.run(go())


def test_following_1000_nodes_is_no_list_call_and_does_not_block_the_event_loop():
    """A new node among 1,000: no list call per reading (before: one, of every node), the node watch's view is read
    (the settle reuses its health), and the event loop keeps turning while it is described (off the loop)."""
    nodes = [gpu_node(f"gpu-{i:04d}", 8) for i in range(1000)]

    async def go():
        with EmulatorServer(nodes, window=5000) as emu:
            async with Lab(emu) as lab:
                lab.loop.cancel()  # (readings driven by hand here)
                calls = []
                real = lab.be.core.list_node

                def counted(*a, **kw):
                    calls.append(1)
                    return real(*a, **kw)

                await until(lambda: lab.be._node_synced, "the node watch follows the nodes")
                lab.be.core.list_node = counted
                assert await lab.w.reload_cluster() == [] and calls == []  # nothing changed (and no LIST: the watch's view)
                await asyncio.to_thread(emu.add_node, name="gpu-1000", gpus=8)
                await until(lambda: lab.be._cached_node("gpu-1000") is not None, "the watch saw gpu-1000")
                gaps, stop = [], asyncio.Event()

                async def tick():
                    t = time.monotonic()
                    while not stop.is_set():
                        await asyncio.sleep(0.005)
                        now = time.monotonic()
                        gaps.append(now - t)
                        t = now

                ticker = asyncio.get_running_loop().create_task(tick())
                calls.clear()
                said = await lab.w.reload_cluster()
                stop.set()
                await ticker
                assert said == ["host gpu-1000 added (8 GPUs, virtual, 32 cores)"] and calls == [], (said, calls)
                assert len(lab.names) == 1001 and not lab.down("gpu-1000")
                return max(gaps)

    worst = asyncio.run(go())
    assert worst < 0.5, f"the event loop stood still for {worst:.3f}s"


@contextlib.contextmanager
def _messages(logger):
    """The messages `logger` logs meanwhile."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def test_the_heartbeat_says_a_cordoned_node_s_stages_run_on():
    """The heartbeat (`_sync_health`) marks a cordoned node down within a beat, before the node listing sees it:
    its line said the node's stages "will run again elsewhere", which nothing does for a cordon. It says why
    the node is down and that its stages run on."""
    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)]) as emu:
            async with Lab(emu, follow=False) as lab:
                assert await lab.place("a") == "gpu-0"
                ha = await lab.launch("a", 2.0)
                await until(lambda: lab.pod_node("a") == "gpu-0", "a running on gpu-0")
                with _messages(lab.w._logger) as lines:
                    await asyncio.to_thread(lab.core.patch_node, "gpu-0", {"spec": {"unschedulable": True}})
                    await lab.w._sync_health()
                    assert lab.down("gpu-0")
                    st = await lab.be.wait(ha)
                    assert st.kind is ExitKind.OK, st  # (it did run on)
                lab.sched.release("a")
                return lines

    lines = asyncio.run(go())
    said = [x for x in lines if x.startswith("host gpu-0 is down")]
    assert said == ["host gpu-0 is down (the node is cordoned (spec.unschedulable)): no new stage goes there; the 1 stage(s) on it run on"], lines


def test_a_node_down_with_no_stage_of_the_worker_says_so():
    """A host that goes down with nothing of this worker's on it (e.g. a gang whose other host's loss already ended it
    and queued it again) was said to have '0 stage(s) on it [that] will run again elsewhere'."""
    async def go():
        with EmulatorServer([gpu_node("gpu-0", 2), gpu_node("gpu-1", 2)]) as emu:
            async with Lab(emu, follow=False) as lab:
                with _messages(lab.w._logger) as lines:
                    await asyncio.to_thread(lab.core.patch_node, "gpu-1", {"spec": {"unschedulable": True}})
                    await lab.w._sync_health()
                    assert lab.down("gpu-1")
                return lines

    lines = asyncio.run(go())
    said = [x for x in lines if x.startswith("host gpu-1 is down")]
    assert said == ["host gpu-1 is down (the node is cordoned (spec.unschedulable)): no new stage goes there; no stage of "
                    "this worker runs there now"], lines


def test_a_second_scale_to_zero_is_said_again():
    """The warning that no node is listed was said once per worker: an autoscaler that scales the GPU pool to zero each
    night was reported the first night only. It is said again each time, and the nodes' return is said too."""
    import logging

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    async def go():
        with EmulatorServer([gpu_node("gpu-0", 1)]) as emu:
            async with Lab(emu) as lab:
                h = Lines()
                lab.w._logger.addHandler(h)

                def count(what: str) -> int:
                    return sum(what in x for x in h.lines)

                for night, name in enumerate(("gpu-0", "gpu-5"), 1):
                    await asyncio.to_thread(lab.core.delete_node, name)
                    await until(lambda: count("no node of the cluster matches its node selector now") == night, f"night {night} said")
                    assert "scaled to zero" in h.lines[-1]
                    await asyncio.to_thread(emu.add_node, name=f"gpu-{5 * night}", gpus=1)
                    await until(lambda: count("nodes are listed again") == night, f"morning {night} said")
                await asyncio.sleep(5 * RELOAD_S)
                assert count("no node of the cluster matches its node selector now") == 2  # (once a night, not at every reload)

    asyncio.run(go())
