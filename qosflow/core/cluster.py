"""Clusters: switch -> node -> GPU, and the mutable allocation state policies plan against.

`ClusterSpec` is the static description (what hardware exists). `ClusterState` is the allocation
state, kept in numpy arrays so that a policy can search 1,000 nodes x 8 GPUs quickly and take a
cheap `snapshot()` to try decisions in a session before they are committed as one statement
(the shape of NVIDIA KAI's scheduler sessions).

Sharing rules (the invariants the tests check):
* a GPU holds either whole-GPU jobs or fractional shares, never both;
* at most two whole-GPU jobs share a GPU (SJF-BSBF), only if both are shareable and their GPU
  memory fits;
* fractional shares fit within 1000 milli-GPU and the GPU's memory;
* CPU cores and host memory of a node are never over-allocated;
* a gang (multi-GPU) job gets all its GPUs at once or none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable

import numpy as np

from qosflow.core.placement import Placement
from qosflow.core.qos import QoSSpec
from qosflow.errors import SpecError


def _n_gpus(n: int) -> str:
    """'1 GPU', '4 GPUs' (a rejection read '1 GPUs')."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"

class PlacementError(SpecError):
    """A placement conflicts with the cluster state (over-allocation, missing node...)."""

    def __init__(self, message: str):
        super().__init__("placement", message)


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    gpus: int
    gpu_mem_mb: float = 16_384.0
    cpu_cores: float = 32.0
    mem_mb: float = 262_144.0
    switch: int = 0
    gpu_model: str = "generic"
    #: True when the GPUs are declared, not detected (no NVML): shown as virtual everywhere
    virtual: bool = False
    address: str | None = None
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        where = f"node {self.name!r}"
        if not self.name:
            raise SpecError("name", "a node needs a name")
        if self.gpus < 0:
            raise SpecError("gpus", f"must be >= 0, got {self.gpus}", where=where)
        if self.gpu_mem_mb <= 0:
            raise SpecError("gpu_mem_mb", f"must be > 0 MiB, got {self.gpu_mem_mb}", where=where)
        if self.cpu_cores <= 0:
            raise SpecError("cpu_cores", f"must be > 0, got {self.cpu_cores}", where=where)
        if self.mem_mb <= 0:
            raise SpecError("mem_mb", f"must be > 0 MiB, got {self.mem_mb}", where=where)


def gang_spreads(nodes: Iterable[tuple[float, int, float]], gpus: int, cpu_cores: float, mem_mb: float) -> bool:
    """Can a gang of `gpus` GPUs spread over k >= 2 of `nodes`, each given as (host memory MiB, GPUs, cores) -- their
    capacities (`ClusterSpec.why_never_fits`) or what they have free now (`QoSScheduler.waiting_for_capacity`) --, its
    host memory split evenly over them (mem/k on each) and its cores in proportion to the GPUs it takes on each?"""
    per_gpu_cpu = cpu_cores / gpus
    caps = sorted(
        ((m, g if per_gpu_cpu <= 0 else min(g, int(c / per_gpu_cpu + 1e-9))) for m, g, c in nodes),
        key=lambda mc: -mc[1],
    )
    for k in range(2, min(gpus, len(caps)) + 1):
        fit = [c for m, c in caps if c >= 1 and m >= mem_mb / k - 1e-6]
        if len(fit) >= k and sum(fit[:k]) >= gpus:
            return True
    return False


@dataclass(frozen=True)
class ClusterSpec:
    nodes: tuple[NodeSpec, ...]
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SpecError("nodes", "a cluster needs at least one node")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise SpecError("nodes", f"node name {dup!r} appears twice")

    @classmethod
    def uniform(
        cls,
        num_nodes: int,
        gpus_per_node: int,
        *,
        gpu_mem_mb: float = 16_384.0,
        cpu_cores: float = 32.0,
        mem_mb: float = 262_144.0,
        nodes_per_switch: int | None = None,
        gpu_model: str = "generic",
        virtual: bool = False,
        name: str | None = None,
        prefix: str = "node",
    ) -> "ClusterSpec":
        if num_nodes <= 0 or gpus_per_node < 0:
            raise SpecError("cluster", f"need nodes > 0 and GPUs per node >= 0, got {num_nodes}x{gpus_per_node}")
        per = nodes_per_switch or num_nodes
        nodes = tuple(
            NodeSpec(
                name=f"{prefix}{i}",
                gpus=gpus_per_node,
                gpu_mem_mb=gpu_mem_mb,
                cpu_cores=cpu_cores,
                mem_mb=mem_mb,
                switch=i // per,
                gpu_model=gpu_model,
                virtual=virtual,
            )
            for i in range(num_nodes)
        )
        return cls(nodes, name=name or f"{num_nodes}x{gpus_per_node}")

    @cached_property
    def num_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @cached_property
    def max_gpus_per_node(self) -> int:
        return max(n.gpus for n in self.nodes)

    @cached_property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    def index_of(self, name: str) -> int:
        for i, n in enumerate(self.nodes):
            if n.name == name:
                return i
        raise SpecError("node", f"no node named {name!r} in cluster {self.name!r}")

    def model_mask(self, gpu_model: str | None) -> np.ndarray:
        """Read-only boolean mask of the nodes whose GPU model `gpu_model` accepts (a QoS spec's
        `gpu_model`: one model, several separated by `|`, or None for any)."""
        cache = self._model_masks
        mask = cache.get(gpu_model)
        if mask is None:
            # without regard to case: a stage's "V100" is the host's "v100"
            accepted = None if gpu_model is None else {m.lower() for m in gpu_model.split("|")}
            mask = np.fromiter((accepted is None or n.gpu_model.lower() in accepted for n in self.nodes), bool, len(self.nodes))
            mask.flags.writeable = False
            cache[gpu_model] = mask
        return mask

    @cached_property
    def _model_masks(self) -> dict[str | None, np.ndarray]:
        return {}

    def why_never_fits(self, qos: QoSSpec, *, single_node: bool = False, elastic: bool = False) -> str | None:
        """None if some placement on an empty cluster can satisfy `qos`, else the reason. With
        `single_node` the request must also fit on one node (a Kubernetes pod never spans nodes).

        A job that declared `min_gpus` may start on fewer GPUs (`QoSSpec.widths`) under a policy that
        does so (`elastic`, `Policy.elastic_starts`): it fits if one of its widths does
        (`widest_width`). Under one that starts every job on all its GPUs it fits only at full width,
        and the reason says that a narrower width would."""
        why = self._why_fits_width(qos, single_node)
        if why is None or len(qos.widths) == 1:
            return why
        width = self.widest_width(qos, single_node=single_node)
        if width is None:
            narrowest = qos.widths[-1]
            return (f"{why}; nor on fewer, down to its min_gpus={qos.min_gpus} ({', '.join(map(str, qos.widths[1:]))} GPUs); "
                    f"on {narrowest}: {self._why_fits_width(qos.narrowed(narrowest), single_node)}")
        if elastic:
            return None
        return (f"{why}; its min_gpus={qos.min_gpus} would let it start on {width}, but this policy ignores min_gpus "
                f"and starts every job on all its GPUs (the qosflow policy starts it narrower)")

    def widest_width(self, qos: QoSSpec, *, single_node: bool = False) -> int | None:
        """The widest of `qos.widths` (its GPU count, and with `min_gpus` the narrower ones it may start
        on) that some placement on an empty cluster can hold; None if none can."""
        for w in qos.widths:
            if self._why_fits_width(qos.narrowed(w), single_node) is None:
                return w
        return None

    def _why_fits_width(self, qos: QoSSpec, single_node: bool) -> str | None:
        why = self._why_never_fits(qos)
        if why is None and single_node:
            why = self._why_not_one_node(qos)
        return why

    def _model_nodes(self, qos: QoSSpec) -> list[NodeSpec]:
        if qos.gpu_model is None:
            return list(self.nodes)
        return [n for n, ok in zip(self.nodes, self.model_mask(qos.gpu_model)) if ok]

    @staticmethod
    def _models_text(qos: QoSSpec) -> str:
        return " or ".join(repr(m) for m in qos.gpu_models or ())

    @staticmethod
    def _node_kind(qos: QoSSpec) -> str:
        """"node", or "A or B node" for a request restricted to GPU models A and B (for messages)."""
        models = qos.gpu_models
        return f"{' or '.join(models)} node" if models else "node"

    def _why_not_one_node(self, qos: QoSSpec) -> str | None:
        if any(n.gpus >= qos.gpus and n.cpu_cores >= qos.cpu_cores - 1e-9 and n.mem_mb >= qos.mem_mb - 1e-6 for n in self._model_nodes(qos)):
            return None
        return f"a pod runs on one node, and no {self._node_kind(qos)} has {qos.gpus} GPU(s), {qos.cpu_cores:g} cores and {qos.mem_mb:g} MiB"

    def _why_never_fits(self, qos: QoSSpec) -> str | None:
        nodes = self._model_nodes(qos)
        if not nodes:
            return f"no node has GPU model {self._models_text(qos)} (the cluster has {', '.join(sorted({n.gpu_model for n in self.nodes}))})"
        if qos.gpus == 0:
            if not any(n.cpu_cores >= qos.cpu_cores and n.mem_mb >= qos.mem_mb for n in nodes):
                largest = f"{max(n.cpu_cores for n in nodes):g} cores"
                mem = ""
                if qos.mem_mb > 0:
                    mem, largest = f" and {qos.mem_mb:g} MiB of memory", f"{largest}, {max(n.mem_mb for n in nodes):g} MiB"
                return f"no node has {qos.cpu_cores:g} CPU cores{mem} (largest: {largest})"
            return None
        mem_ok = [n for n in nodes if qos.gpu_mem_mb is None or n.gpu_mem_mb >= qos.gpu_mem_mb]
        if not mem_ok:
            return f"no GPU has {qos.gpu_mem_mb:g} MiB of memory (largest: {max(n.gpu_mem_mb for n in nodes):g})"
        total = sum(n.gpus for n in mem_ok)
        if qos.gpus > total:
            return f"asks for {_n_gpus(qos.gpus)}; the cluster has {total} that fit it"
        per_gpu_cpu = qos.cpu_cores / qos.gpus
        if qos.gpus <= max(n.gpus for n in mem_ok):
            fed = [n for n in mem_ok if n.gpus >= qos.gpus and per_gpu_cpu * qos.gpus <= n.cpu_cores + 1e-9]
            if not fed:
                return f"no node has {_n_gpus(qos.gpus)} with {qos.cpu_cores:g} cores"
            # a job that fits on one node is placed on one first (locality), so one node must have
            # its host memory (a spread placement splits memory only for jobs wider than a node)
            if any(n.mem_mb >= qos.mem_mb - 1e-6 for n in fed):
                return None
            return f"no {self._node_kind(qos)} has {qos.mem_mb:g} MiB of host memory with {_n_gpus(qos.gpus)} (largest: {max(n.mem_mb for n in fed):g} MiB)"
        # a multi-node gang: its cores are split over its nodes in proportion to its GPUs there
        fits = sum(n.gpus for n in mem_ok if per_gpu_cpu * n.gpus <= n.cpu_cores + 1e-9)
        if fits < qos.gpus:
            return f"asks for {qos.gpus} GPUs with {per_gpu_cpu:g} cores each; only {fits} such GPUs exist"
        if qos.mem_mb > 0 and not self._spreads(mem_ok, qos):
            return f"asks for {qos.gpus} GPUs and {qos.mem_mb:g} MiB of host memory; too few nodes have memory for their part"
        return None

    @staticmethod
    def _spreads(nodes: list[NodeSpec], qos: QoSSpec) -> bool:
        """Can the gang spread over k >= 2 of `nodes` (`gang_spreads` on their capacities)?"""
        return gang_spreads(((n.mem_mb, n.gpus, n.cpu_cores) for n in nodes), qos.gpus, qos.cpu_cores, qos.mem_mb)

    def validate_qos(self, qos: QoSSpec, *, where: str | None = None) -> None:
        reason = self.why_never_fits(qos)
        if reason:
            field = ("gpu_model" if "GPU model" in reason else "mem_mb" if "host memory" in reason
                     else "gpu_mem_mb" if "MiB of memory" in reason else "gpus" if "GPU" in reason else "qos")
            raise SpecError(field, f"can never be placed on {self.name}: {reason}", where=where)


class ClusterState:
    """Allocation state of a cluster. Mutable; `snapshot()` gives an independent copy."""

    __slots__ = (
        "spec",
        "gpu_count",
        "exists",
        "milli_free",
        "njobs",
        "whole",
        "share_ok",
        "gmem_free",
        "gmem_cap",
        "empty",
        "cpu_free",
        "mem_free",
        "switch",
        "gpu_jobs",
        "allocs",
        "_shareable",
        "down",
        "n_empty",
    )

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        n = len(spec.nodes)
        gmax = max(1, spec.max_gpus_per_node)
        self.gpu_count = np.array([s.gpus for s in spec.nodes], dtype=np.int64)
        self.exists = np.arange(gmax)[None, :] < self.gpu_count[:, None]
        self.milli_free = np.where(self.exists, 1000, 0).astype(np.int64)
        self.njobs = np.zeros((n, gmax), dtype=np.int64)
        self.whole = np.zeros((n, gmax), dtype=np.int64)
        self.share_ok = np.zeros((n, gmax), dtype=bool)
        self.gmem_cap = np.array([s.gpu_mem_mb for s in spec.nodes], dtype=np.float64)
        self.gmem_free = np.where(self.exists, self.gmem_cap[:, None], 0.0)
        self.empty = self.gpu_count.copy()
        self.cpu_free = np.array([s.cpu_cores for s in spec.nodes], dtype=np.float64)
        self.mem_free = np.array([s.mem_mb for s in spec.nodes], dtype=np.float64)
        self.switch = np.array([s.switch for s in spec.nodes], dtype=np.int64)
        self.down = np.zeros(n, dtype=bool)
        #: empty GPUs on nodes that are up (kept in step with `empty` and `down`)
        self.n_empty = int(self.empty.sum())
        #: (node, gpu) -> job ids on that GPU
        self.gpu_jobs: dict[tuple[int, int], tuple[str, ...]] = {}
        self.allocs: dict[str, Placement] = {}
        self._shareable: dict[str, bool] = {}

    # ------------------------------------------------------------------ copies
    def snapshot(self) -> "ClusterState":
        new = object.__new__(ClusterState)
        new.spec = self.spec
        new.gpu_count = self.gpu_count
        new.exists = self.exists
        new.gmem_cap = self.gmem_cap
        new.switch = self.switch
        for name in ("milli_free", "njobs", "whole", "share_ok", "gmem_free", "empty", "cpu_free", "mem_free", "down"):
            setattr(new, name, getattr(self, name).copy())
        new.n_empty = self.n_empty
        new.gpu_jobs = dict(self.gpu_jobs)
        new.allocs = dict(self.allocs)
        new._shareable = dict(self._shareable)
        return new

    # ------------------------------------------------------------------ queries
    @property
    def num_nodes(self) -> int:
        return len(self.spec.nodes)

    def total_empty_gpus(self) -> int:
        return self.n_empty

    def used_gpus(self) -> int:
        return int((self.njobs > 0).sum())

    def jobs_on_gpu(self, node: int, gpu: int) -> tuple[str, ...]:
        return self.gpu_jobs.get((node, gpu), ())

    def empty_gpus_on(self, node: int) -> np.ndarray:
        return np.flatnonzero(self.exists[node] & (self.njobs[node] == 0))

    def usable_nodes(self, qos: QoSSpec | None = None) -> np.ndarray:
        """Boolean mask of nodes that are up and (if given) match the GPU model and memory."""
        ok = ~self.down
        if qos is not None:
            if qos.gpu_model is not None:
                ok = ok & self.spec.model_mask(qos.gpu_model)
            if qos.gpu_mem_mb is not None and qos.gpus > 0:
                ok = ok & (self.gmem_cap >= qos.gpu_mem_mb)
        return ok

    def placement_of(self, job_id: str) -> Placement | None:
        return self.allocs.get(job_id)

    # ------------------------------------------------------------------ mutation
    def allocate(self, p: Placement, qos: QoSSpec) -> None:
        """Apply a placement. Raises PlacementError, leaving the state unchanged, on any conflict."""
        self._check(p, qos)
        share = p.gpu_milli < 1000
        per_gpu_mem = p.gpu_mem_mb if p.gpu_mem_mb > 0 else None
        for node, g in p.gpus:
            gm = per_gpu_mem if per_gpu_mem is not None else (
                self.gmem_cap[node] * p.gpu_milli / 1000.0 if share else self.gmem_cap[node]
            )
            was_empty = self.njobs[node, g] == 0
            self.njobs[node, g] += 1
            self.gmem_free[node, g] -= gm
            if share:
                self.milli_free[node, g] -= p.gpu_milli
                self.share_ok[node, g] = False
            else:
                self.milli_free[node, g] = 0
                self.whole[node, g] += 1
                self.share_ok[node, g] = self.whole[node, g] == 1 and qos.shareable
            if was_empty:
                self.empty[node] -= 1
                if not self.down[node]:
                    self.n_empty -= 1
            self.gpu_jobs[(node, g)] = self.gpu_jobs.get((node, g), ()) + (p.job_id,)
        for node, c in p.cpu:
            self.cpu_free[node] -= c
        if p.mem_mb:
            for node in p.nodes:
                self.mem_free[node] -= p.mem_mb / len(p.nodes)
        self.allocs[p.job_id] = p
        self._shareable[p.job_id] = qos.shareable

    def release(self, job_id: str) -> Placement:
        p = self.allocs.pop(job_id, None)
        if p is None:
            raise PlacementError(f"job {job_id!r} holds no placement to release")
        self._shareable.pop(job_id, None)
        share = p.gpu_milli < 1000
        for node, g in p.gpus:
            gm = p.gpu_mem_mb if p.gpu_mem_mb > 0 else (
                self.gmem_cap[node] * p.gpu_milli / 1000.0 if share else self.gmem_cap[node]
            )
            self.njobs[node, g] -= 1
            self.gmem_free[node, g] += gm
            rest = tuple(j for j in self.gpu_jobs.get((node, g), ()) if j != job_id)
            if rest:
                self.gpu_jobs[(node, g)] = rest
            else:
                self.gpu_jobs.pop((node, g), None)
            if share:
                self.milli_free[node, g] += p.gpu_milli
            else:
                self.whole[node, g] -= 1
                self.milli_free[node, g] = 1000 if self.whole[node, g] == 0 else 0
            self.share_ok[node, g] = self.whole[node, g] == 1 and all(self._shareable.get(j, False) for j in rest)
            if self.njobs[node, g] == 0:
                self.empty[node] += 1
                if not self.down[node]:
                    self.n_empty += 1
                self.gmem_free[node, g] = self.gmem_cap[node]  # clear float drift
        for node, c in p.cpu:
            self.cpu_free[node] += c
        if p.mem_mb:
            for node in p.nodes:
                self.mem_free[node] += p.mem_mb / len(p.nodes)
        return p

    def set_node_down(self, node: int, down: bool = True) -> list[str]:
        """Mark a node lost (or back). Returns the jobs that were running on it."""
        if bool(self.down[node]) != down:
            self.n_empty += -int(self.empty[node]) if down else int(self.empty[node])
        self.down[node] = down
        return [j for j, p in self.allocs.items() if node in p.nodes]

    def resize_cpu(self, job_id: str, node: int, cores: float) -> Placement:
        """Change the cores a running job holds on a node (CODA's adaptive allocator)."""
        p = self.allocs[job_id]
        old = p.cores_on(node)
        if cores - old > self.cpu_free[node] + 1e-9:
            raise PlacementError(f"node {self.spec.nodes[node].name}: {cores - old:g} more cores asked, {self.cpu_free[node]:g} free")
        if cores <= 0:
            raise PlacementError(f"job {job_id!r} must keep at least some cores on node {node}")
        cpu = tuple((n, cores if n == node else c) for n, c in p.cpu)
        from dataclasses import replace

        newp = replace(p, cpu=cpu)
        self.cpu_free[node] -= cores - old
        self.allocs[job_id] = newp
        return newp

    # ------------------------------------------------------------------ checks
    def _check(self, p: Placement, qos: QoSSpec) -> None:
        n_nodes = self.num_nodes
        if p.job_id in self.allocs:
            raise PlacementError(f"job {p.job_id!r} is already placed")
        if len(p.gpus) != qos.gpus and (qos.min_gpus is None or len(p.gpus) not in qos.widths):
            if qos.min_gpus is not None:
                raise PlacementError(
                    f"job {p.job_id!r} asks for {qos.gpus} GPUs and may start on {', '.join(map(str, qos.widths))}; "
                    f"placement gives {len(p.gpus)}"
                )
            raise PlacementError(f"job {p.job_id!r} asks for {qos.gpus} GPUs, placement gives {len(p.gpus)} (gang all-or-nothing)")
        if len(set(p.gpus)) != len(p.gpus):
            raise PlacementError(f"job {p.job_id!r}: a GPU is listed twice")
        share = p.gpu_milli < 1000
        if share != qos.fractional or (share and p.gpu_milli != qos.gpu_milli):
            raise PlacementError(f"job {p.job_id!r}: placement share {p.gpu_milli} does not match request {qos.gpu_milli}")
        for node, g in list(p.gpus) + [(n, 0) for n, _ in p.cpu]:
            if not 0 <= node < n_nodes:
                raise PlacementError(f"job {p.job_id!r}: node index {node} is not in the cluster ({n_nodes} nodes)")
            if self.down[node]:
                raise PlacementError(f"job {p.job_id!r}: node {self.spec.nodes[node].name} is down")
        for node, g in p.gpus:
            if not (0 <= g < self.exists.shape[1] and self.exists[node, g]):
                raise PlacementError(f"job {p.job_id!r}: node {self.spec.nodes[node].name} has no GPU {g}")
            if not qos.accepts_gpu_model(self.spec.nodes[node].gpu_model):
                raise PlacementError(f"job {p.job_id!r} needs GPU model {qos.gpu_model}, node {self.spec.nodes[node].name} has {self.spec.nodes[node].gpu_model}")
            gm = p.gpu_mem_mb if p.gpu_mem_mb > 0 else (
                self.gmem_cap[node] * p.gpu_milli / 1000.0 if share else self.gmem_cap[node]
            )
            if share:
                if self.whole[node, g]:
                    raise PlacementError(f"job {p.job_id!r}: GPU {node}/{g} holds a whole-GPU job; shares cannot join it")
                if self.milli_free[node, g] < p.gpu_milli:
                    raise PlacementError(f"job {p.job_id!r}: GPU {node}/{g} has {self.milli_free[node, g]} milli free, needs {p.gpu_milli}")
            else:
                if self.njobs[node, g] >= 2:
                    raise PlacementError(f"job {p.job_id!r}: GPU {node}/{g} already holds two jobs")
                if self.njobs[node, g] == 1:
                    if not (self.share_ok[node, g] and qos.shareable):
                        raise PlacementError(f"job {p.job_id!r}: GPU {node}/{g} is busy and not shareable with it")
                    if p.gpu_mem_mb <= 0:
                        raise PlacementError(f"job {p.job_id!r}: co-location needs the job's GPU memory (gpu_mem_mb)")
            if gm > self.gmem_free[node, g] + 1e-6:
                raise PlacementError(f"job {p.job_id!r}: GPU {node}/{g} has {self.gmem_free[node, g]:.0f} MiB free, needs {gm:.0f}")
        need: dict[int, float] = {}
        for node, c in p.cpu:
            if c < 0:
                raise PlacementError(f"job {p.job_id!r}: negative cores on node {node}")
            need[node] = need.get(node, 0.0) + c
        for node, c in need.items():
            if c > self.cpu_free[node] + 1e-9:
                raise PlacementError(f"job {p.job_id!r}: node {self.spec.nodes[node].name} has {self.cpu_free[node]:g} cores free, needs {c:g}")
        if p.mem_mb:
            per = p.mem_mb / len(p.nodes)
            for node in p.nodes:
                if per > self.mem_free[node] + 1e-6:
                    raise PlacementError(f"job {p.job_id!r}: node {self.spec.nodes[node].name} has {self.mem_free[node]:g} MiB free, needs {per:g}")

    def check_invariants(self) -> None:
        """Raise AssertionError if the arrays disagree with the allocations (used by tests)."""
        assert (self.whole <= 2).all(), "a GPU holds more than two whole-GPU jobs"
        assert (self.milli_free >= 0).all(), "a GPU is over-shared"
        assert (self.gmem_free >= -1e-3).all(), "GPU memory over-allocated"
        assert (self.cpu_free >= -1e-6).all(), "CPU cores over-allocated"
        assert (self.mem_free >= -1e-3).all(), "host memory over-allocated"
        assert not ((self.whole > 0) & (self.milli_free > 0)).any(), "whole-GPU job mixed with shares"
        counts: dict[tuple[int, int], int] = {}
        for p in self.allocs.values():
            for ng in p.gpus:
                counts[ng] = counts.get(ng, 0) + 1
        for (n, g), c in counts.items():
            assert self.njobs[n, g] == c, f"GPU {n}/{g}: {self.njobs[n, g]} recorded, {c} placed"
        assert int(self.njobs.sum()) == sum(counts.values())
        assert (self.empty == (self.exists & (self.njobs == 0)).sum(axis=1)).all()
        assert self.n_empty == int(self.empty[~self.down].sum())

    def __repr__(self) -> str:
        return f"ClusterState({self.spec.name}: {self.used_gpus()}/{self.spec.num_gpus} GPUs busy, {len(self.allocs)} jobs)"


def default_cpu_split(qos: QoSSpec, gpus: Iterable[tuple[int, int]], node: int | None = None) -> tuple[tuple[int, float], ...]:
    """Split a job's requested cores over its nodes in proportion to its GPUs there."""
    gl = list(gpus)
    if not gl:
        return ((node if node is not None else 0, float(qos.cpu_cores)),)
    per_node: dict[int, int] = {}
    for n, _ in gl:
        per_node[n] = per_node.get(n, 0) + 1
    total = len(gl)
    return tuple((n, qos.cpu_cores * k / total) for n, k in per_node.items())
