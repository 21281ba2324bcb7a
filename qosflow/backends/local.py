"""The local backend: every stage is a process on this host.

The cluster it offers is either the real GPUs (NVML) or virtual GPUs declared by a cluster block
(`NodeSpec.virtual=True`; shown as virtual everywhere). Virtual hosts all map onto this machine:
a stage placed on "node1 GPU 3" runs here, with `CUDA_VISIBLE_DEVICES=3` and the cores of its
cpuset folded onto the real CPUs (core id modulo the CPUs this process may use).

Processes start in their own session (process group), so killing a stage kills its children too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from qosflow.backends.base import Backend, ExitKind, ExitStatus, LaunchSpec, StageHandle, placement_env
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.gpu_names import short_gpu_model
from qosflow.placement_api import PROGRESS_FILE_ENV
from qosflow.procgroup import kill_group


# ---------------------------------------------------------------------------------------- inventory
@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_mb: float
    uuid: str = ""


def nvml_gpus() -> tuple[list[GpuInfo] | None, str]:
    """The GPUs NVML sees, or (None, why not). Never invents numbers."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "no GPU: NVML (nvidia-ml-py) is not installed; using virtual GPUs"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded...
        return None, f"no GPU: NVML unavailable ({exc}); using virtual GPUs"
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode()
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**20
            try:
                uuid = pynvml.nvmlDeviceGetUUID(h)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            except Exception:
                uuid = ""
            out.append(GpuInfo(i, str(name), float(mem), str(uuid)))
        if not out:
            return None, "no GPU: NVML found no devices; using virtual GPUs"
        return out, f"{len(out)} GPU(s) from NVML"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def local_inventory(declared: ClusterSpec | None = None) -> tuple[ClusterSpec, str]:
    """Real GPUs when NVML has them, else the declared (virtual) cluster, else 1 virtual host x 4 GPUs."""
    gpus, why = nvml_gpus()
    if gpus is not None and (declared is None or not any(n.virtual for n in declared.nodes)):
        import socket

        node = NodeSpec(
            name=socket.gethostname() or "localhost",
            gpus=len(gpus),
            gpu_mem_mb=min(g.memory_mb for g in gpus),
            cpu_cores=float(len(usable_cpus())),
            gpu_model=short_gpu_model(gpus[0].name),
            virtual=False,
        )
        return ClusterSpec((node,), name="local"), why
    if declared is not None:
        if not all(n.virtual for n in declared.nodes):
            raise_msg = "the local backend has no real GPUs here (" + why + "); declare the cluster's GPUs as virtual"
            from qosflow.errors import SpecError

            raise SpecError("cluster.virtual", raise_msg)
        return declared, why
    return ClusterSpec.uniform(1, 4, virtual=True, cpu_cores=8.0, name="local-virtual", prefix="local"), why


# ---------------------------------------------------------------------------------------- backend
class LocalBackend(Backend):
    """Processes on this host. `cluster` is the (virtual or NVML) cluster the scheduler plans on."""

    name = "local"

    def __init__(self, cluster: ClusterSpec | None = None, *, stream_output: bool = True, workdir: str | None = None):
        self._declared = cluster
        self._cluster: ClusterSpec | None = None
        self.inventory_note = ""
        self.stream_output = stream_output
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._killed: dict[str, str] = {}
        # the stages' progress files go here; a directory of our own is made when the first stage needs it
        # and removed by aclose(): it was made at construction and never removed, so every worker's start,
        # and every check of a local cluster block that builds its backend (`qosflow init`, `worker start`),
        # left one behind in /tmp (soak test: 634 of them on a machine that ran the tests for a day)
        self._given_workdir = workdir
        self._own_workdir: str | None = None
        self._cpus = usable_cpus()

    @property
    def _workdir(self) -> str:
        if self._given_workdir:
            return self._given_workdir
        if self._own_workdir is None:
            self._own_workdir = tempfile.mkdtemp(prefix="qosflow-local-")
        return self._own_workdir

    def _remove_own_workdir(self) -> None:
        if self._own_workdir is not None:
            import shutil

            shutil.rmtree(self._own_workdir, ignore_errors=True)
            self._own_workdir = None

    async def inventory(self) -> ClusterSpec:
        if self._cluster is None:
            self._cluster, self.inventory_note = local_inventory(self._declared)
        return self._cluster

    def real_cpus(self, cpuset: list[int]) -> list[int]:
        """Fold (virtual) core ids onto the CPUs this host really has."""
        if not cpuset:
            return list(self._cpus)
        n = len(self._cpus)
        return sorted({self._cpus[c % n] for c in cpuset})

    def progress_file(self, stage_id: str) -> str:
        return os.path.join(self._workdir, f"{stage_id}.progress")

    async def launch(self, spec: LaunchSpec) -> StageHandle:
        p = spec.placement
        node = p.nodes[0] if p.nodes else 0
        cpuset = spec.cpusets.get(node, [])
        env = dict(os.environ)
        env.update({k: v for k, v in spec.env.items() if v is not None})
        env.update(placement_env(p, spec.cluster, node=node, cpuset=cpuset, requested_gpus=spec.requested_gpus))
        env[PROGRESS_FILE_ENV] = self.progress_file(spec.stage_id)
        env.setdefault("PYTHONUNBUFFERED", "1")
        real = self.real_cpus(cpuset)

        def _pin() -> None:  # runs in the child before exec
            try:
                os.sched_setaffinity(0, real)
            except (AttributeError, OSError):
                pass

        out = None if self.stream_output else asyncio.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_exec(
            *spec.command,
            cwd=spec.cwd or None,
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,
            preexec_fn=_pin if sys.platform.startswith("linux") else None,
        )
        self._procs[spec.stage_id] = proc
        name = spec.cluster.nodes[node].name if spec.cluster.nodes else "local"
        return StageHandle(spec.stage_id, self.name, name, ref={"pid": proc.pid, "cpus": real})

    async def launch_unplaced(self, stage_id: str, command: list[str], env: dict[str, str], cwd: str | None = None) -> StageHandle:
        """Start a process that holds no slot (a pipeline's orchestrating flow run)."""
        full = dict(os.environ)
        full.update({k: v for k, v in env.items() if v is not None})
        full.setdefault("PYTHONUNBUFFERED", "1")
        out = None if self.stream_output else asyncio.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_exec(*command, cwd=cwd or None, env=full, stdout=out, stderr=out, start_new_session=True)
        self._procs[stage_id] = proc
        return StageHandle(stage_id, self.name, "local", ref={"pid": proc.pid})

    async def wait(self, handle: StageHandle) -> ExitStatus:
        proc = self._procs.get(handle.stage_id)
        if proc is None:
            return ExitStatus(ExitKind.INFRA, None, f"no process for stage {handle.stage_id} on this worker")
        rc = await proc.wait()
        handle.ref["reaped"] = True  # (its pid may be another process's from now on: kill() leaves it alone)
        # what the stage left in its process group (`cmd &`, a launcher's children) ends with it: its slot
        # is free from now on, and kill() and aclose() only look for processes still registered, so such
        # processes kept running on GPUs the next stage was given (as on agents: qosflow.agent.runner)
        kill_group(proc.pid)
        self._procs.pop(handle.stage_id, None)
        killed = self._killed.pop(handle.stage_id, None)
        if rc == 0:
            return ExitStatus(ExitKind.OK, 0)
        if killed is not None:
            return ExitStatus(ExitKind.CANCELLED, rc, killed)
        if rc < 0:
            sig = -rc
            if sig == signal.SIGKILL:
                # killed by someone else: the kernel's OOM killer is the usual suspect
                return ExitStatus(ExitKind.INFRA, rc, "killed by SIGKILL (out of memory?)")
            return ExitStatus(ExitKind.INFRA, rc, f"killed by signal {signal.Signals(sig).name}")
        return ExitStatus(ExitKind.USER, rc, f"exited with status {rc}")

    async def kill(self, handle: StageHandle, reason: str = "cancelled", grace: float | None = 5.0) -> None:
        grace = 5.0 if grace is None else float(grace)
        proc = self._procs.get(handle.stage_id)
        pid = handle.ref.get("pid") if proc is None else proc.pid
        if pid is None or (proc is None and handle.ref.get("reaped")):
            # ended and reaped by wait(): its pid, free again, may be another process's by now (the cancel
            # watch kills a run's handle until the run is marked Cancelled, after its process ended)
            return
        self._killed[handle.stage_id] = reason
        kill_tree(int(pid), signal.SIGTERM if grace > 0 else signal.SIGKILL)
        if proc is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), grace)
        except asyncio.TimeoutError:
            kill_tree(int(pid), signal.SIGKILL)

    async def set_cpus(self, handle: StageHandle, node: int, cpuset: list[int]) -> None:
        pid = handle.ref.get("pid")
        if pid is None:
            return
        real = self.real_cpus(cpuset)
        for p in [int(pid), *descendants(int(pid))]:
            try:
                for tid in os.listdir(f"/proc/{p}/task"):
                    os.sched_setaffinity(int(tid), real)
            except (OSError, AttributeError):
                continue
        handle.ref["cpus"] = real

    def pid_of(self, stage_id: str) -> int | None:
        proc = self._procs.get(stage_id)
        return proc.pid if proc else None

    async def aclose(self, grace: float = 3.0) -> None:
        """Stop: give processes still running `grace` seconds to end on their own (a flow run that just reported its
        final state may still be flushing its logs), kill the rest with their children, and reap them all while the
        loop still runs (a child reaped after its loop closed makes asyncio warn "Loop ... that handles pid N is
        closed")."""
        live = [proc for proc in self._procs.values() if proc.returncode is None]
        try:
            if live and grace > 0:
                await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=grace)
        finally:  # also when cancelled during the grace period: no stage may outlive its worker
            for proc in live:
                if proc.returncode is None:
                    kill_tree(proc.pid, signal.SIGKILL)
        for proc in live:
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except (asyncio.TimeoutError, ProcessLookupError):
                pass
        self._remove_own_workdir()  # (its stages have ended: nobody writes their progress any more)


def descendants(pid: int) -> list[int]:
    """All descendant pids of `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", "rb") as fh:
                stat = fh.read().decode("utf-8", "replace")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out: list[int] = []
    stack = [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def kill_tree(pid: int, sig: int) -> None:
    """Signal a stage's process group (it is a session leader) and any stray descendants."""
    kill_group(pid, sig)
    for c in descendants(pid):
        try:
            os.kill(c, sig)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def describe_inventory(spec: ClusterSpec) -> list[dict[str, Any]]:
    return [
        {
            "name": n.name,
            "gpus": n.gpus,
            "gpu_mem_mb": n.gpu_mem_mb,
            "cpu_cores": n.cpu_cores,
            "gpu_model": n.gpu_model,
            "virtual": n.virtual,
        }
        for n in spec.nodes
    ]
