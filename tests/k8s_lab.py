"""A qosflow worker's Kubernetes side on the API emulator (EMULATED: no cluster), for the tests that follow what the
worker does as nodes come and go, pods not its own appear, or capacity is asked for: its scheduler (fifo), its
KubernetesBackend, and, as `QosflowWorker` runs them, its cluster reload loop and the steps of its heartbeat. No
Prefect server: the worker's node events are kept in `events`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from kubernetes import client

from qosflow.backends.base import LaunchSpec
from qosflow.backends.kubernetes import KubernetesBackend
from qosflow.k8s_emulator import EmulatorServer


async def until(cond, what: str, timeout: float = 20.0) -> None:
    """Wait until `cond()` (called in a thread: it may ask the emulator's API) is true, else fail naming `what`."""
    end = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting until {what}")
        await asyncio.sleep(0.05)


class EmulatedWorker:
    """`async with EmulatedWorker(emu, pool=..., reload_s=..., beat=(...)) as lab:` -- `lab.be`, `lab.w`, `lab.sched`.

    `reload_s`: the worker's cluster reload loop runs every that many seconds (None: not run); `beat`: names of the
    worker's heartbeat steps run every `beat_s` (`_sync_health`, `_sync_capacity_requests`); `backend`: the
    KubernetesBackend's keyword arguments over the defaults below."""

    BACKEND_DEFAULTS: dict[str, Any] = {"namespace": "default", "image": "busybox:1.36", "unschedulable_timeout_s": 1.0}

    def __init__(self, emu: EmulatorServer, *, pool: str, reload_s: float | None = None, beat: tuple[str, ...] = (),
                 beat_s: float = 0.2, **backend: Any):
        self.emu = emu
        self.core = client.CoreV1Api(emu.api_client())
        self.pool = pool
        self.reload_s = reload_s
        self.beat = beat
        self.beat_s = beat_s
        self.backend = {**self.BACKEND_DEFAULTS, **backend}
        self.events: list[tuple[str, str]] = []

    def make_backend(self) -> KubernetesBackend:
        return KubernetesBackend(api_client=self.emu.api_client(), **self.backend)

    async def __aenter__(self):
        from qosflow.policies import get_policy
        from qosflow.prefect.scheduler import QoSScheduler
        from qosflow.prefect.worker import QosflowWorker

        self.be = self.make_backend()
        self.w = QosflowWorker(work_pool_name=self.pool, backend=self.be)
        self.w.scheduler = self.sched = QoSScheduler(await self.be.inventory(), get_policy("fifo"), coda=False)
        self.sched.may_become = self.be.may_become  # (as the worker sets it: what an autoscaled pool may grow to)
        self.w._node_event = lambda name, node, payload: self.events.append((name, node))
        self.sched.start()
        loop = asyncio.get_running_loop()
        self.tasks: list[asyncio.Task] = []
        if self.reload_s is not None:
            self.w.cluster_reload_s = self.reload_s
            self.tasks.append(loop.create_task(self.w._cluster_reload_loop()))
        if self.beat:
            self.tasks.append(loop.create_task(self._beat()))
        return self

    async def launch(self, name: str, run_s: float):
        """Run the placed stage `name` as a Job (the emulator "runs" its pod for run_s)."""
        self.emu.add_rule(selector=f"qosflow.dev/stage-id={name}", run_s=run_s)
        p = self.sched.entries[name].grant.placement
        return await self.be.launch(LaunchSpec(name, ["true"], p, self.sched.cluster))

    def pod_node(self, name: str) -> str | None:
        """The node of stage `name`'s pod once it runs (or ran), else None."""
        pods = self.core.list_namespaced_pod("default", label_selector=f"qosflow.dev/stage-id={name}").items
        return pods[0].spec.node_name if pods and pods[0].status.phase in ("Running", "Succeeded") else None

    async def _beat(self) -> None:
        while True:
            for step in self.beat:
                await getattr(self.w, step)()
            await asyncio.sleep(self.beat_s)

    async def __aexit__(self, *exc) -> None:
        for t in self.tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        # (not `sched.stop()` alone: on Python 3.11 its round loop's asyncio.wait_for can swallow the cancel when a
        # wake comes at the same moment, and the stop waits for ever; cancelled again until it is done)
        task = self.sched._task
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.5)
        await self.sched.stop()
        await self.be.aclose()
