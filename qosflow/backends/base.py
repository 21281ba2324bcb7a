"""The backend interface: launch a stage on the slot a policy chose, watch it, stop it.

Data flows one way: flow run -> job model -> policy -> placement -> backend. A backend never
decides *where*; it turns a `Placement` into a running process (or pod) with the placement's
environment, and reports how it ended, classified the Philly way (user error or infrastructure).
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, AsyncIterator, Callable, Collection, Sequence

from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.placement import Placement
from qosflow.errors import QosflowError, SpecError
from qosflow.paths import file_stem


#: the killed_reason of stages an agent killed because it is stopping (an infrastructure failure)
AGENT_STOPPING = "agent shutting down"


class BackendUnreachable(QosflowError):
    """A backend's control plane cannot be reached (the Kubernetes API server: refused, reset, timed out
    after urllib3's retries). The worker treats it as an outage of the whole cluster, not as a failure
    of a stage: it launches nothing until the API answers again, and a stage whose launch hit it is
    placed again then."""


class ExitKind(str, Enum):
    OK = "ok"
    USER = "user"  # the stage's own code failed: follow its retry settings, do not retry blindly
    INFRA = "infra"  # node/agent lost, OOM-killed, evicted: retry on another slot
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class ExitStatus:
    kind: ExitKind
    code: int | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.kind is ExitKind.OK


@dataclass
class LaunchSpec:
    """Everything a backend needs to start one stage on one placement."""

    stage_id: str  # unique per attempt, e.g. "<flow-run-id>" or "<flow-run-id>-r1"
    command: list[str]
    placement: Placement
    cluster: ClusterSpec
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    #: node index -> CPU core ids to pin to (set by the caller's core allocator)
    cpusets: dict[int, list[int]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    image: str | None = None  # container backends
    #: the GPUs the stage's QoS asks for (`QoSSpec.gpus`); an elastic start (`min_gpus`) places it on
    #: fewer, and the stage is told so (`placement_env`). None: as many as the placement holds
    requested_gpus: int | None = None

    @property
    def nodes(self) -> list[NodeSpec]:
        return [self.cluster.nodes[n] for n in self.placement.nodes]


@dataclass
class StageHandle:
    stage_id: str
    backend: str
    node: str
    ref: dict = field(default_factory=dict)  # backend-specific (pid, pod name, agent URL...)


@dataclass
class ClusterUpdate:
    """What a backend took of an edited cluster description (`Backend.update_cluster`)."""

    #: the declared hosts as the backend now runs stages on them, in the description's order (added hosts
    #: included, removed ones not): what `inventory()` would give for the new description
    nodes: list[NodeSpec]
    #: the changes it could not apply while stages run, each in words ("its agent token changed"): they
    #: need a restart of the worker (or, where said, wait until the stages concerned end)
    not_applied: list[str] = field(default_factory=list)
    #: what it applied besides its hosts, in words ("image 'a:1' -> 'a:2' (for the stages launched from now on)")
    applied: list[str] = field(default_factory=list)


@dataclass
class NodeListing:
    """The nodes as the cluster's own API lists them now (`Backend.list_nodes`)."""

    #: every node that matches, as `inventory()` describes it (in the API's name order)
    nodes: list[NodeSpec]
    #: those that take stages now (`healthy_nodes`: Ready and not cordoned)
    healthy: set[str]
    #: those cordoned (Kubernetes' spec.unschedulable): no new stage, the running ones go on
    cordoned: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class CapacityWant:
    """A stage that has waited in the worker's QoS queue because no node of its plan has room for it
    (`QoSScheduler.waiting_for_capacity`): what a backend that can ask for nodes (`Backend.request_capacity`) asks
    for on its behalf. Data flows one way: the worker's queue -> the backend's actuation."""

    #: the stage's job id (its flow run id), the `Placement.job_id` it will be launched with
    job_id: str
    name: str
    #: whole GPUs (a fractional share asks for one GPU of `gpu_milli`/1000), cores and MB of memory, on one node
    gpus: int
    cpu_cores: float
    mem_mb: float = 0.0
    gpu_milli: int = 1000
    #: seconds it has waited in the queue
    waited_s: float = 0.0


def grad_accumulation(width: int, requested_gpus: int | None) -> int:
    """Gradient-accumulation steps of a stage that asked for `requested_gpus` GPUs and got `width` of
    them (an elastic start, `QoSSpec.min_gpus`): requested // width, 1 at full width (or None asked).
    A width that does not divide the request would change the global batch: an error."""
    if not requested_gpus or width <= 0 or width >= requested_gpus:
        return 1
    if requested_gpus % width:
        raise SpecError("min_gpus", f"a stage of {requested_gpus} GPUs cannot start on {width}: not a divisor, so no whole number of "
                                    "gradient-accumulation steps keeps its global batch")
    return requested_gpus // width


def placement_env(p: Placement, cluster: ClusterSpec, node: int | None = None, cpuset: list[int] | None = None, *,
                  requested_gpus: int | None = None) -> dict[str, str]:
    """The environment a stage sees on `node` (default: its first node).

    CUDA_VISIBLE_DEVICES lists the GPUs there; a fractional or co-located GPU gets an MPS active
    thread percentage; OMP_NUM_THREADS follows the cores; QOSFLOW_PLACEMENT carries the whole plan
    (read it with `qosflow.placement()`), including a sub-batch/gradient-accumulation plan.

    A stage with GPUs also gets QOSFLOW_GPUS, the GPUs it got on all its nodes, and
    QOSFLOW_GRAD_ACCUMULATION, `requested_gpus // QOSFLOW_GPUS` ("1" at full width): an elastic start
    (`QoSSpec.min_gpus`) on fewer GPUs than `requested_gpus` (its `QoSSpec.gpus`) accumulates that many
    passes per optimizer step, to keep its global batch (`qosflow.accumulation_steps()`).
    """
    n = p.nodes[0] if node is None else node
    spec = cluster.nodes[n]
    gpus = p.gpus_on(n)
    cores = p.cores_on(n)
    env: dict[str, str] = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
        "OMP_NUM_THREADS": str(max(1, int(cores))),
        "QOSFLOW_NODE": spec.name,
        "QOSFLOW_VIRTUAL_GPUS": "1" if spec.virtual else "0",
    }
    width = len(p.gpus)
    accumulation = grad_accumulation(width, requested_gpus)
    if width:
        env["QOSFLOW_GPUS"] = str(width)
        env["QOSFLOW_GRAD_ACCUMULATION"] = str(accumulation)
    if p.gpu_milli < 1000:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(p.gpu_milli / 10)))
    elif p.colocated_with:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "50"
    plan = {
        "job_id": p.job_id,
        "node": spec.name,
        "nodes": [cluster.nodes[i].name for i in p.nodes],
        "gpus": gpus,
        "gpu_milli": p.gpu_milli,
        "cpu_cores": cores,
        "cpuset": cpuset or [],
        "colocated_with": list(p.colocated_with),
        "sub_batch": p.sub_batch.to_dict() if p.sub_batch else None,
        "virtual_gpus": spec.virtual,
    }
    if width:
        plan["requested_gpus"] = max(width, requested_gpus or 0)
        plan["grad_accumulation"] = accumulation
    env["QOSFLOW_PLACEMENT"] = json.dumps(plan, separators=(",", ":"))
    return env


class Backend(ABC):
    """Runs stages on some infrastructure. All methods are async (the Prefect worker is)."""

    name: str = "backend"

    @property
    def runs_pipelines(self) -> bool:
        """True: the pool's deployed pipeline runs (role pipeline: no slot, they dispatch the stages) run through this
        backend (`launch_unplaced(..., labels=, cpu_cores=, mem_mb=)`), each under a lease that books no slot
        (`LeaseStore.acquire_pipeline`), found again by `adopt` from any worker of the pool: Kubernetes (a Job of its
        own, its `pipelines_as_jobs`), host agents with `pipelines_on` agents or a host. False: the worker runs them
        as processes on its own host (the local backend's, or `QosflowWorker._unplaced_backend`)."""
        return bool(getattr(self, "pipelines_as_jobs", False))

    @abstractmethod
    async def inventory(self) -> ClusterSpec:
        """The nodes and GPUs this backend can run on (real GPUs via NVML, or declared virtual ones)."""

    @abstractmethod
    async def launch(self, spec: LaunchSpec) -> StageHandle:
        """Start the stage; return at once with a handle."""

    @abstractmethod
    async def wait(self, handle: StageHandle) -> ExitStatus:
        """Wait until the stage ends and say how it ended."""

    @abstractmethod
    async def kill(self, handle: StageHandle, reason: str = "cancelled", grace: float | None = None) -> None:
        """Stop the stage (idempotent): SIGTERM, then SIGKILL after `grace` seconds (the backend's
        default if None; 0: SIGKILL at once, so the stage's Prefect engine cannot report a state)."""

    async def ranks_exited_ok(self, handle: StageHandle, skip: Collection[int] = ()) -> set[int]:
        """The ranks (> 0, not in `skip`) of a gang on several hosts (`handle`) whose process ended on its own with exit
        status 0, not stopped by qosflow: the worker writes a missing end label for such a rank (`_watch_gang_ranks`).
        Only those: a rank that ended otherwise ends the gang's wait (the backend stops the gang). Default: none (a
        backend that runs a gang as one process)."""
        return set()

    async def logs(self, handle: StageHandle) -> AsyncIterator[str]:  # pragma: no cover - optional
        if False:
            yield ""

    async def set_cpus(self, handle: StageHandle, node: int, cpuset: list[int]) -> None:
        """Move a running stage to other cores (CODA's feedback allocator). Optional."""
        raise NotImplementedError(f"{self.name} cannot change a running stage's cores")

    def progress_file(self, stage_id: str) -> str | None:
        """A file on the worker's host holding the progress lines a stage writes (`qosflow.report_progress`),
        as the scheduler reads them; None if this backend cannot see them."""
        return None

    def drop_progress(self, stage_id: str) -> None:
        """The worker has read the stage's progress for the last time: remove its `progress_file`."""
        path = self.progress_file(stage_id)
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass

    #: whether two stages can really share one GPU here (a fractional share, or a co-located pair); a
    #: backend that cannot gets every stage on whole GPUs of its own (the worker's `_whole_gpus_only`)
    shares_gpus: bool = True
    def least_share_milli(self, cluster: Any) -> int:
        """The least part of a GPU (thousandths) a shared stage takes here whatever it asks for: a stage under it is
        booked at it (the worker's `_at_least_a_slice`). Default 0: a stage takes what it asks for."""
        return 0

    #: whether `sync_progress` has anything to do (a backend whose stages write their progress elsewhere)
    syncs_progress: bool = False
    #: seconds between two `sync_progress` rounds of the worker (QOSFLOW_PROGRESS_SYNC_SECONDS overrides it)
    progress_sync_s: float = 2.0

    async def sync_progress(self, handles: Sequence[StageHandle]) -> None:
        """Bring the `progress_file`s of these stages up to date with what the stages wrote where they run
        (a remote backend copies it). Never raises for a stage it cannot reach. Default: nothing to do."""
        return None

    async def healthy_nodes(self) -> set[str]:
        """Names of nodes that answer now (heartbeats). Default: all of the inventory."""
        return {n.name for n in (await self.inventory()).nodes}

    def keeps_stages(self, node: str) -> bool:
        """Whether the stages running on `node`, down for new stages now, run on there (a cordoned Kubernetes
        node) rather than being lost with it (a silent agent, a node not Ready). Default: lost."""
        return False

    def down_reasons(self) -> dict[str, str]:
        """Why each node that does not answer is down (name -> reason), for the note of a stage that
        waits for those nodes (`qosflow.policies.common.with_down_causes`). Default: none known."""
        return {}

    async def update_cluster(self, new: "Backend", busy: Collection[str] = ()) -> ClusterUpdate:
        """Take the cluster that `new` describes (a backend of the same kind, built from the edited cluster
        block or file, never started): hosts it adds are used from now on; hosts it no longer has are
        retired -- they take no new stage, and the stages running there are still followed (wait, kill,
        progress) until `drop_host` forgets them. `busy`: hosts where this worker has stages. Nothing is
        raised for a change that cannot be applied safely: it is said in `ClusterUpdate.not_applied`.
        A backend that cannot change its cluster while it runs raises NotImplementedError (default)."""
        raise NotImplementedError(f"the {self.name} backend cannot change its cluster while the worker runs")

    #: its nodes come from the cluster's own API, not from its description, and may change without an edit of
    #: the description (a Kubernetes cluster's autoscaler adds a node, an administrator deletes one): the worker
    #: lists them again every `cluster_reload_s` (`list_nodes`), and as soon as the backend says they changed
    #: (`on_nodes_changed`), and applies the difference as an edit
    lists_nodes: bool = False

    async def list_nodes(self) -> NodeListing:
        """The nodes as the cluster's API lists them now (a backend whose `lists_nodes` is true)."""
        raise NotImplementedError(f"the {self.name} backend's hosts are those its description names")

    def on_nodes_changed(self, callback: Callable[[], None] | None) -> bool:
        """Have `callback` called, from any thread, as soon as the backend sees its nodes change in what the worker plans
        on (a node added or deleted, its GPUs, cpu or memory, Ready or cordoned), so that the worker follows them then
        (`list_nodes`) rather than at its next reading, up to `cluster_reload_s` later; None: no more. Whether the backend
        does so: False (default) for one whose hosts are those its description names, or that learns of a change only
        when it lists its nodes."""
        return False

    #: the backend asks its cluster for capacity (nodes) for the stages that wait because no node has room for
    #: them (`sync_capacity_requests`); the worker gives it those stages at its heartbeats when this is true
    request_capacity: bool = False
    #: how long a stage waits for capacity before it is asked for
    capacity_request_after_s: float = 30.0

    #: whether requests it made are still there (to be deleted once `request_capacity` is turned off)
    holds_capacity_requests: bool = False

    def may_become(self) -> ClusterSpec | None:
        """The cluster this one may grow to (an autoscaler's node group, declared), against which a stage no node listed
        now could ever hold is judged before it is refused; None: the nodes listed are all there may be (default)."""
        return None

    async def sync_capacity_requests(self, wants: Sequence[CapacityWant]) -> None:
        """The stages that wait for capacity now (all of them: one missing is no longer waiting, or waiting no more
        for capacity). Default: nothing is asked for."""
        return None

    def capacity_peers(self, holder: str, pool: str, live: Callable[[str], Collection[str]] | None) -> None:
        """Who makes this backend's capacity requests, and how to learn whether the maker of another one is alive
        (several workers on one pool share a cluster): `holder`, the worker's lease holder id (recorded on each
        request it makes), `pool`, its pool's key in the lease store, and `live(pool)`, the holder ids of that pool's
        worker processes whose presence in the lease store is live (a blocking call, made in a thread; it raises when
        that cannot be known); None: no lease store. The worker says it before each `sync_capacity_requests`.
        Default: nothing to note (a backend that asks for no capacity)."""
        return None

    def drop_host(self, name: str) -> bool:
        """Forget host `name`, retired by `update_cluster`, now that no stage of this worker is placed there.
        False (kept) while this backend still follows something there. Default: nothing to forget."""
        return True

    def planned(self, cluster: ClusterSpec) -> None:
        """The cluster the worker's scheduler plans on from now on (after `update_cluster`; a host whose change
        could not be applied yet keeps its old size there). Default: nothing to note."""
        return None

    def renumber(self, handle: StageHandle, where: dict[int, int]) -> None:
        """The worker's cluster changed: node index i of the old cluster is where[i] now. Update any node index
        `handle` keeps (`set_cpus` is given the new ones). Default: none kept."""
        return None

    async def aclose(self) -> None:
        return None


class ProgressCopies:
    """Copies, on the worker's host, of the progress files that stages write where they run (a remote
    backend's `progress_file`): the scheduler reads them as it reads a local stage's file. Made in a
    temporary directory on first use, removed by `close()`."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._dir: str | None = None

    def path(self, stage_id: str) -> str:
        if self._dir is None:
            import tempfile

            self._dir = tempfile.mkdtemp(prefix=self.prefix)
        return os.path.join(self._dir, file_stem(stage_id) + ".progress")

    def size(self, stage_id: str) -> int:
        try:
            return os.path.getsize(self.path(stage_id))
        except OSError:
            return 0

    def append(self, stage_id: str, data: bytes) -> None:
        if data:
            with open(self.path(stage_id), "ab") as fh:
                fh.write(data)

    def close(self) -> None:
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
