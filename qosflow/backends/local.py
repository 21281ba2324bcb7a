"""The local backend: every stage is a process on this host.

The cluster it offers is either the real GPUs (NVML) or virtual GPUs declared by a cluster block
(`NodeSpec.virtual=True`; shown as virtual everywhere). Virtual hosts all map onto this machine:
a stage placed on "node1 GPU 3" runs here, with `CUDA_VISIBLE_DEVICES=3` and the cores of its
cpuset folded onto the real CPUs (core id modulo the CPUs this process may use).

Processes start in their own session (process group), so killing a stage kills its children too. A stage's output
goes to a file (`output_file`, copied to the worker's stdout while it runs when `stream_output`), not to the worker's
stdout: a worker killed (SIGKILL, the OOM killer) leaves its stages running, and the worker restarted under its name
adopts them (`adopt_unplaced`, with the pid and start time its lease recorded) rather than killing them and running
them again; a write to the dead worker's terminal or pipe would have failed them. A stop of the worker still ends its
stages (`aclose`).

A pipeline run (`launch_unplaced`) of a backend made with `keep_unplaced=True` (the worker's pipelines when
its stages run on host agents or Kubernetes) outlives the backend: it is a plain `subprocess.Popen` (asyncio
kills a child whose transport it closes), its output goes to a file rather than the worker's stdout (which
may be gone after the worker), `aclose()` leaves it running, and the next worker finds it again with
`adopt_unplaced(pid, start)`: a process that is not its child, watched by polling its pid, its start time
(`process_start`) guarding against the pid's reuse. A local pool's own pipeline runs end with the backend
(`aclose`), but one left running by a worker that was killed is adopted the same way, and then ends with the
adopting backend.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

from qosflow.backends.base import Backend, ExitKind, ExitStatus, LaunchSpec, StageHandle, placement_env
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.gpu_names import short_gpu_model
from qosflow.placement_api import PROGRESS_FILE_ENV
from qosflow.procgroup import group_members, kill_group, stat_fields


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

    #: seconds between two looks at a pipeline process that this backend cannot wait on (`keep_unplaced`)
    POLL_S = 0.5

    def __init__(self, cluster: ClusterSpec | None = None, *, stream_output: bool = True, workdir: str | None = None,
                 keep_unplaced: bool = False, output_dir: str | None = None):
        """`keep_unplaced`: pipeline runs started by `launch_unplaced` outlive this backend (`aclose` leaves them
        running, for the next worker to `adopt_unplaced`); their output goes to `output_dir/<id>.log`."""
        self._declared = cluster
        self.keep_unplaced = keep_unplaced
        self._output_dir = output_dir
        #: processes that outlive this backend (`keep_unplaced`), and those of an earlier worker it adopted (None)
        self._detached: dict[str, subprocess.Popen | None] = {}
        #: the processes of an earlier worker adopted here (`adopt_unplaced`), by stage id
        self._adopted: dict[str, StageHandle] = {}
        self._tails: dict[str, asyncio.Task] = {}
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
            self._own_workdir = make_workdir()
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

        name = spec.cluster.nodes[node].name if spec.cluster.nodes else "local"
        # its output goes to a file, not the worker's stdout (a terminal or a pipe that may be gone while it runs on after
        # its worker was killed); it is recorded in its lease with its pid and start time (the handle), so that a worker
        # restarted after a SIGKILL adopts it (`adopt_unplaced`) rather than killing it and running the stage again
        return await self._launch_detached(spec.stage_id, list(spec.command), env, spec.cwd, node=name, child=True,
                                           preexec=_pin if sys.platform.startswith("linux") else None,
                                           ref={"cpus": real, "progress": env[PROGRESS_FILE_ENV], "stream": self.stream_output})

    async def launch_unplaced(self, stage_id: str, command: list[str], env: dict[str, str], cwd: str | None = None) -> StageHandle:
        """Start a process that holds no slot (a pipeline's orchestrating flow run)."""
        full = dict(os.environ)
        full.update({k: v for k, v in env.items() if v is not None})
        full.setdefault("PYTHONUNBUFFERED", "1")
        if self.keep_unplaced:
            return await self._launch_detached(stage_id, command, full, cwd)
        out = None if self.stream_output else asyncio.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_exec(*command, cwd=cwd or None, env=full, stdout=out, stderr=out, start_new_session=True)
        self._procs[stage_id] = proc
        return StageHandle(stage_id, self.name, "local", ref={"pid": proc.pid})

    def output_file(self, stage_id: str) -> str:
        """Where a pipeline process that outlives this backend writes its stdout and stderr."""
        d = self._output_dir
        if not d:  # (not the temporary workdir: aclose removes it while the pipeline writes on)
            from qosflow.paths import data_dir

            d = self._output_dir = str(data_dir() / "pipeline-output")
        os.makedirs(d, mode=0o700, exist_ok=True)
        return os.path.join(d, f"{stage_id}.log")

    async def _launch_detached(self, stage_id: str, command: list[str], env: dict[str, str], cwd: str | None, *,
                               node: str = "local", child: bool = False, preexec: Any = None,
                               ref: dict[str, Any] | None = None) -> StageHandle:
        """A process that outlives its worker: its own session (a signal to the worker's process group, Ctrl-C in its
        terminal, does not reach it), no stdin, its output to a file (the worker's stdout, a terminal or a pipe, may be
        gone while it runs on: a write there would fail it), copied to this worker's stdout while it is watched
        (`stream_output`), and its pid, start time (`process_start`) and output file in its handle, for a later worker
        to find it again (`adopt_unplaced`).

        A pipeline (`child` False) is not an asyncio child (asyncio kills a child process whose transport is closed, as
        at the worker's exit), so that it also outlives a stop of a `keep_unplaced` backend. A stage (`child`, from
        `launch`) is one: its exit status is read and its end seen at once (`wait`), and a stop of its worker ends it
        anyway (`aclose`); only a worker that is killed leaves it running, to be adopted by the next one."""
        path = self.output_file(stage_id)
        with open(path, "ab") as out:
            # (a run again under the same id appends to what its failed attempt left: only its own output is copied)
            offset = out.seek(0, os.SEEK_END)
            if child:
                proc: Any = await asyncio.create_subprocess_exec(*command, cwd=cwd or None, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                                 stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                                                                 preexec_fn=preexec)
                self._procs[stage_id] = proc
            else:
                proc = subprocess.Popen(command, cwd=cwd or None, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=preexec)
                self._detached[stage_id] = proc
        start = process_start(proc.pid)
        handle = StageHandle(stage_id, self.name, node, ref={"pid": proc.pid, "start": start, "output": path, **(ref or {})})
        if self.stream_output:
            self._tail(stage_id, path, offset)
        return handle

    def adopt_unplaced(self, stage_id: str, pid: int, start: str | None, output: str | None = None,
                       stream: bool | None = None, *, node: str = "local", ref: dict[str, Any] | None = None) -> StageHandle | None:
        """A process an earlier worker started (`_launch_detached`: a pipeline, or a stage of a local pool whose worker
        was killed) and that still runs: pid `pid` with the start time `start` recorded at its launch (another process
        that got the pid since is not it). None when it is gone. It is watched by polling (`wait`: not a child of this
        process, its exit status is unknown), `kill` stops it, and a local pool's backend stops it when it closes."""
        if not start or process_start(int(pid)) != start:
            return None
        self._detached[stage_id] = None
        handle = StageHandle(stage_id, self.name, node, ref={**(ref or {}), "pid": int(pid), "start": start, "output": output, "adopted": True})
        self._adopted[stage_id] = handle
        if output and (self.stream_output if stream is None else stream) and os.path.exists(output):
            try:
                self._tail(stage_id, output, os.path.getsize(output))  # (what it writes from now on)
            except OSError:
                pass
        return handle

    def _tail(self, stage_id: str, path: str, offset: int) -> None:
        """Copy what a detached process writes to its output file to this worker's stdout while it is watched
        (`stream_output`, as a process writing to the worker's stdout did)."""

        async def tail() -> None:
            pos = offset
            try:
                while True:
                    pos = _copy_out(path, pos)
                    await asyncio.sleep(self.POLL_S)
            finally:
                _copy_out(path, pos)

        self._tails[stage_id] = asyncio.get_running_loop().create_task(tail(), name=f"qosflow-tail-{stage_id}")

    def _alive(self, handle: StageHandle) -> bool:
        """Does a detached (or adopted) pipeline process still run? A child is reaped here."""
        proc = self._detached.get(handle.stage_id)
        if proc is not None:
            return proc.poll() is None
        return process_start(int(handle.ref["pid"])) == handle.ref.get("start")

    async def _wait_detached(self, handle: StageHandle) -> ExitStatus:
        sid = handle.stage_id
        try:
            while self._alive(handle):
                await asyncio.sleep(self.POLL_S)
        finally:
            tail = self._tails.pop(sid, None)
            if tail is not None:
                tail.cancel()
        proc = self._detached.pop(sid, None)
        self._adopted.pop(sid, None)
        handle.ref["reaped"] = True
        killed = self._killed.pop(sid, None)
        pid = int(handle.ref["pid"]) if proc is None else proc.pid
        # (what it left in its process group ends with it, as for a child of `launch`: a group with members left is
        # still its own, since a pid is not given to another process while it names a group)
        if group_members(pid):
            kill_group(pid)
        if proc is None:
            # not this worker's child (an earlier worker started it): its exit status is not ours to read
            if killed is not None:
                return ExitStatus(ExitKind.CANCELLED, None, killed)
            return ExitStatus(ExitKind.INFRA, None, "ended (a process of an earlier worker: its exit status is unknown)")
        rc = proc.returncode
        if rc == 0:
            return ExitStatus(ExitKind.OK, 0)
        if killed is not None:
            return ExitStatus(ExitKind.CANCELLED, rc, killed)
        if rc < 0:
            return ExitStatus(ExitKind.INFRA, rc, f"killed by signal {signal.Signals(-rc).name}")
        return ExitStatus(ExitKind.USER, rc, f"exited with status {rc}")

    async def wait(self, handle: StageHandle) -> ExitStatus:
        if handle.stage_id in self._detached:
            return await self._wait_detached(handle)
        proc = self._procs.get(handle.stage_id)
        if proc is None:
            return ExitStatus(ExitKind.INFRA, None, f"no process for stage {handle.stage_id} on this worker")
        try:
            rc = await proc.wait()
        finally:
            tail = self._tails.pop(handle.stage_id, None)
            if tail is not None:  # (it copies what is left of the output file as it ends)
                tail.cancel()
        handle.ref["reaped"] = True  # (its pid may be another process's from now on: kill() leaves it alone)
        # what the stage left in its process group (`cmd &`, a launcher's children) ends with it: its slot
        # is free from now on, and kill() and aclose() only look for processes still registered, so such
        # processes kept running on GPUs the next stage was given (as on agents: qosflow.agent.runner). The
        # leader is reaped: its id is its group's only while a member lives, and may lead another process's
        # group once none does (pid reuse: qosflow.procgroup), so only a group with members left is signalled
        if group_members(proc.pid):
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
        if handle.stage_id in self._detached:
            await self._kill_detached(handle, reason, grace)
            return
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

    async def _kill_detached(self, handle: StageHandle, reason: str, grace: float) -> None:
        """SIGTERM to a detached pipeline's process group (its engine reports why), SIGKILL after `grace` s. Only
        while it is the process launched (its start time): a pid free again may be another process's."""
        if not self._alive(handle):
            return
        self._killed[handle.stage_id] = reason
        pid = int(handle.ref["pid"])
        kill_tree(pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            if not self._alive(handle):
                return
        if self._alive(handle):
            kill_tree(pid, signal.SIGKILL)

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
        closed"). Pipeline processes of a `keep_unplaced` backend are left running (for the next worker), only
        no longer watched. Those an other backend adopted (a local pool's pipelines, left running by a worker that
        was killed) end with it as its own do: SIGTERM (their engine reports why), SIGKILL after `grace` s."""
        for tail in self._tails.values():
            tail.cancel()
        self._tails.clear()
        adopted = [] if self.keep_unplaced else [h for h in self._adopted.values() if self._alive(h)]
        if adopted:
            await asyncio.gather(*(self._kill_detached(h, "the worker stopped", grace) for h in adopted), return_exceptions=True)
        self._adopted.clear()
        self._detached.clear()
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


#: a local backend's own work directory (its stages' progress files) in the temporary directory:
#: `qosflow-local-<pid>-<random>`, with its owner (`WORKDIR_OWNER`: the pid and start time of the process that made it)
WORKDIR_PREFIX = "qosflow-local-"
WORKDIR_OWNER = ".owner"


def make_workdir(tmpdir: str | None = None) -> str:
    """A new work directory for a local backend, naming its owner (this process) in `WORKDIR_OWNER` as
    `{"pid": ..., "start": ...}` (`process_start`), so that once that process is gone (a worker SIGKILLed: its
    `aclose` never ran) a worker starting on this host removes it (`sweep_stale_workdirs`)."""
    import json

    d = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir=tmpdir)
    tmp = os.path.join(d, WORKDIR_OWNER + ".tmp")
    try:
        with open(tmp, "w") as fh:
            json.dump({"pid": os.getpid(), "start": process_start(os.getpid()), **_where_pids_mean()}, fh)
        os.replace(tmp, os.path.join(d, WORKDIR_OWNER))  # (whole or absent: a sweep never reads half of it)
    except OSError:
        pass  # (no owner recorded: never swept, as an older qosflow's)
    return d


def _where_pids_mean() -> dict[str, str]:
    """Where a pid recorded in a work directory's owner file means this process's pid: this host (its name) and this
    PID namespace (`/proc/self/ns/pid`). A temporary directory can be shared by processes a pid means nothing to: two
    containers with one /tmp (a volume, a Kubernetes pod's emptyDir), hosts whose TMPDIR is on a shared file system;
    there a live worker's pid is no process, or another one. Empty when that cannot be told (no /proc)."""
    import socket

    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return {}
    return {"host": socket.gethostname(), "pidns": ns}


def sweep_stale_workdirs(tmpdir: str | None = None) -> list[str]:
    """Remove the work directories of local backends (`qosflow-local-*` in the temporary directory, `make_workdir`)
    whose owner process is gone: its pid no longer runs with the start time it recorded (a pid another process got
    since is not it), or it was recorded in an earlier boot. Never a live process's (two workers may run on one host),
    never one without a readable owner (an older qosflow's, one being made, another user's), never one whose owner was
    recorded on another host or in another PID namespace (`_where_pids_mean`: a container sharing /tmp with this one, a
    TMPDIR on a shared file system: its pid is not a process here, and a live worker's directory was removed), and
    never one a process
    of this host still uses (a stage of the dead worker runs on, adopted or to be adopted by the next worker, and
    writes its progress there: its `QOSFLOW_PROGRESS_FILE` is in it, or it has a file there open). Without /proc
    (not Linux) nothing is removed. Returns the directories removed."""
    import json
    import shutil

    boot = boot_id()
    if boot is None:
        return []
    here = _where_pids_mean()
    base = tmpdir or tempfile.gettempdir()
    stale: list[str] = []
    try:
        with os.scandir(base) as it:
            entries = [e for e in it if e.name.startswith(WORKDIR_PREFIX)]
    except OSError:
        return []
    for e in entries:
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
            with open(os.path.join(e.path, WORKDIR_OWNER)) as fh:
                owner = json.load(fh)
        except (OSError, ValueError):
            continue
        pid, start = (owner.get("pid"), owner.get("start")) if isinstance(owner, dict) else (None, None)
        if not isinstance(pid, int) or not isinstance(start, str) or not start:
            continue
        if not here or any(owner.get(k) != v for k, v in here.items()):
            continue  # (its pid means another process here: another host sharing the directory, another container)
        if start.split(":", 1)[0] == boot and process_start(pid) == start:
            continue  # (its owner runs)
        stale.append(e.path)
    if not stale:
        return []
    used = _dirs_in_use(stale)
    if used is None:
        return []
    removed = []
    for d in stale:
        if d in used:
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not os.path.exists(d):
            removed.append(d)
    return removed


def _dirs_in_use(dirs: list[str]) -> set[str] | None:
    """Of the directories `dirs`, those a process of this host (this user's; all as root) uses: its
    `QOSFLOW_PROGRESS_FILE` is in one, or it has a file there open, or works there. None without /proc."""
    real = {os.path.realpath(d): d for d in dirs}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    used: set[str] = set()

    def hit(path: str) -> None:
        for r, d in real.items():
            if path == r or path.startswith(r + os.sep):
                used.add(d)

    for e in entries:
        try:
            with open(f"/proc/{e}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            env = b""
        for var in env.split(b"\0"):
            if var.startswith(PROGRESS_FILE_ENV.encode() + b"="):
                hit(os.path.realpath(var.split(b"=", 1)[1].decode(errors="replace")))
        try:
            hit(os.readlink(f"/proc/{e}/cwd"))
            for fd in os.listdir(f"/proc/{e}/fd"):
                try:
                    hit(os.readlink(f"/proc/{e}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:
            continue
    return used


def sweep_old_output(directory: str, *, max_age_s: float | None, keep: "Iterable[str]" = (), now: float | None = None,
                     also_keep: "Callable[[], Iterable[str] | None] | None" = None,
                     on_error: "Callable[[str], None] | None" = None) -> list[str]:
    """Remove the output files (`*.log`) in `directory` (a local stage's or a pipeline's, `output_file`) last written
    more than `max_age_s` ago (None: keep them all), except those in `keep` (the processes this worker watches) and
    those a process of this host has open (a stage or pipeline still running, whoever started it: a quiet one writes
    nothing for days); where open files cannot be seen (no /proc) nothing is removed. The sweep of a worker without a
    lease store (`QOSFLOW_LEASES=0`); with one, `LeaseStore.sweep_pipeline_output` also spares the files of processes
    it records, through `also_keep` (more paths to keep, asked only when some file is old enough; None: remove
    nothing). `on_error` is told why a directory that exists could not be listed. Returns the paths removed."""
    now = time.time() if now is None else now
    if max_age_s is None or not os.path.isdir(directory):
        return []
    kept = {os.path.realpath(p) for p in keep if p}
    old: dict[str, float] = {}
    try:
        with os.scandir(directory) as it:
            for e in it:
                if e.name.endswith(".log") and e.is_file(follow_symlinks=False):
                    mtime = e.stat(follow_symlinks=False).st_mtime
                    real = os.path.realpath(e.path)
                    if mtime < now - max_age_s and real not in kept:
                        old[real] = mtime
    except OSError as exc:
        if on_error is not None:
            on_error(f"cannot list it ({exc})")
        return []
    if old and also_keep is not None:
        more = also_keep()
        if more is None:
            return []
        more = {os.path.realpath(p) for p in more if p}
        old = {p: m for p, m in old.items() if p not in more}
    if not old:
        return []
    busy = files_open(old)
    if busy is None:
        return []
    removed = []
    for p, mtime in old.items():
        if p in busy:
            continue
        try:
            if os.stat(p).st_mtime != mtime:  # (written meanwhile: a run of that id again)
                continue
            os.unlink(p)
        except OSError:
            continue
        removed.append(p)
    return removed


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
        f = stat_fields(e)
        try:
            ppid = int(f[1])
        except (TypeError, ValueError, IndexError):  # (TypeError: gone meanwhile)
            continue
        children.setdefault(ppid, []).append(int(e))
    out: list[int] = []
    stack = [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def boot_id() -> str | None:
    """This host's boot id (Linux: a new one at each boot), None without /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """When process `pid` started: '<boot id>:<start time in clock ticks since boot>' (Linux /proc; None when
    there is no such process, or it is a zombie). Two processes never share it, so a pid with the start time
    recorded at its launch is still that process, not another that got the pid since."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    boot = boot_id()
    if boot is None:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # (a zombie has ended: only its exit status is left)
        return None
    return f"{boot}:{fields[19]}"  # (field 22 of stat; fields here start at the 3rd, the state)


def recorded_process_alive(host: str, pid: int, start: str | None) -> tuple[bool | None, str]:
    """Does the process recorded as pid `pid` started at `start` (`process_start`) on host `host` still run?
    (True or False, "") where that can be told: on that host (its name), in the boot it was recorded in.
    Elsewhere (None, why): "other host", "other boot" (a pid and a start time mean nothing in another
    boot, or on another machine of the same name), "no /proc" (not Linux). Never a guess."""
    import socket

    if host != socket.gethostname():
        return None, "other host"
    boot = boot_id()
    if boot is None:
        return None, "no /proc"
    if not start or start.split(":", 1)[0] != boot:
        return None, "other boot"
    return process_start(int(pid)) == start, ""


def files_open(paths: Iterable[str]) -> set[str] | None:
    """Of the files `paths`, those that some process of this host has open (their real paths), by its
    /proc/PID/fd links: the processes of this user (and all of them as root; other users' cannot be
    looked into). None when that cannot be told at all (no /proc)."""
    want = {os.path.realpath(p) for p in paths}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found: set[str] = set()
    for e in entries:
        if not e.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{e}/fd")
        except OSError:  # (another user's, or gone meanwhile)
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{e}/fd/{fd}")
            except OSError:
                continue
            if target in want:
                found.add(target)
    return found


def _copy_out(path: str, pos: int) -> int:
    """Write what file `path` has past `pos` to this process's stdout; the new position."""
    try:
        with open(path, "rb") as fh:
            fh.seek(pos)
            data = fh.read()
    except OSError:
        return pos
    if data:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        except (OSError, ValueError, AttributeError):
            pass
    return pos + len(data)


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
