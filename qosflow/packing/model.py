"""Nodes, pods and the allocation state of a GPU-sharing cluster, as numpy arrays.

The packing experiment of FGD (Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing
Workloads with Fragmentation Gradient Descent", USENIX ATC'23) places pods that ask for CPU,
memory and either nothing, a fraction of one GPU (``gpu_milli`` < 1000 on one GPU, an MPS or
time-slice share), or one or more whole GPUs. A node has CPU, memory and GPUs of one model; every
GPU has 1000 milli-GPU. This module keeps that state in per-node arrays so that a policy can
score all 1,213 nodes of the Alibaba list at once:

* ``cpu_left[n]``, ``mem_left[n]``: free milli-CPU and MiB of node ``n``;
* ``gpu_left[n, g]``: free milli-GPU of GPU ``g`` of node ``n`` (0 for padding slots beyond the
  node's GPU count, see ``gpu_exists``);
* ``version[n]``: bumped on every change of node ``n``, so policies can cache per-node results;
* ``node_rank[n]``: the node's position in the scheduler's node order (0 first). Policies break
  ties in favour of the lowest rank. By default the node list's order; the experiment uses a
  seeded random order, as the FGD authors' simulator does (it prefixes node names with a seeded
  random permutation, and its patched kube-scheduler takes the first of the best nodes).

Invariants (checked by `PackState.place`, never silently repaired): a GPU never goes beyond its
1000 milli; CPU and memory never go negative; a pod only lands on a GPU model its ``gpu_spec``
allows; a whole-GPU pod (``gpu_milli`` == 1000) gets ``num_gpu`` distinct, completely free GPUs;
a fractional pod gets exactly one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from qosflow.errors import QosflowError, SpecError

if TYPE_CHECKING:  # pragma: no cover
    from qosflow.sim.traces.alibaba import AlibabaNode, AlibabaPod

MILLI = 1000  #: milli-GPU in one GPU


class PackingError(QosflowError, ValueError):
    """A placement that would break the cluster's invariants (over-allocation, wrong model...)."""


@dataclass(frozen=True, slots=True)
class Node:
    """One machine: CPU (milli-cores), memory (MiB) and ``num_gpu`` GPUs of one ``model``."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    model: str = ""

    def __post_init__(self) -> None:
        for field_name in ("cpu_milli", "memory_mib", "num_gpu"):
            if getattr(self, field_name) < 0:
                raise SpecError(field_name, f"must be >= 0, got {getattr(self, field_name)}", where=f"node {self.name}")

    @classmethod
    def from_record(cls, rec: "AlibabaNode") -> "Node":
        return cls(rec.sn, rec.cpu_milli, rec.memory_mib, rec.gpu, rec.model)


@dataclass(frozen=True, slots=True)
class Pod:
    """A resource request: CPU, memory and ``num_gpu`` x ``gpu_milli`` GPU.

    ``gpu_milli`` is per GPU: < 1000 asks for a share of one GPU, 1000 for whole GPUs.
    ``gpu_spec`` lists the GPU models the pod accepts (empty: any model).
    ``creation_time``/``deletion_time`` (seconds, from the trace) are kept for policies that are
    given knowledge of departures; the FGD experiment itself never deletes pods.
    """

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int = 0
    gpu_milli: int = 0
    gpu_spec: tuple[str, ...] = ()
    creation_time: float | None = None
    deletion_time: float | None = None

    def __post_init__(self) -> None:
        where = f"pod {self.name}"
        for field_name in ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli"):
            if getattr(self, field_name) < 0:
                raise SpecError(field_name, f"must be >= 0, got {getattr(self, field_name)}", where=where)
        if self.gpu_milli > MILLI:
            raise SpecError("gpu_milli", f"is per GPU and at most {MILLI}, got {self.gpu_milli}", where=where)
        if self.num_gpu == 0 and self.gpu_milli != 0:
            raise SpecError("gpu_milli", f"must be 0 when num_gpu is 0, got {self.gpu_milli}", where=where)
        if self.num_gpu > 0 and self.gpu_milli == 0:
            raise SpecError("gpu_milli", "must be 1..1000 when num_gpu >= 1, got 0", where=where)
        if self.num_gpu > 1 and self.gpu_milli != MILLI:
            raise SpecError(
                "gpu_milli",
                f"a pod with num_gpu={self.num_gpu} must ask for whole GPUs (gpu_milli=1000), got {self.gpu_milli}",
                where=where,
            )

    @classmethod
    def from_record(cls, rec: "AlibabaPod") -> "Pod":
        return cls(
            rec.name,
            rec.cpu_milli,
            rec.memory_mib,
            rec.num_gpu,
            rec.gpu_milli,
            rec.gpu_spec,
            rec.creation_time,
            rec.deletion_time,
        )

    @property
    def total_gpu_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def is_fractional(self) -> bool:
        """Asks for a share (< 1000 milli) of a single GPU."""
        return self.num_gpu == 1 and self.gpu_milli < MILLI

    @property
    def kind(self) -> str:
        """``"cpu"``, ``"share"`` (fraction of one GPU) or ``"whole"`` (one or more whole GPUs)."""
        if self.num_gpu == 0:
            return "cpu"
        return "share" if self.gpu_milli < MILLI else "whole"

    @property
    def request_key(self) -> tuple[int, int, int, tuple[str, ...]]:
        """What placement depends on, apart from memory: (cpu, num_gpu, gpu_milli, gpu_spec)."""
        return (self.cpu_milli, self.num_gpu, self.gpu_milli, self.gpu_spec)


@dataclass(frozen=True, slots=True)
class Placement:
    """Node index and the GPU indices (on that node) a pod gets; ``gpus`` is empty for CPU pods."""

    node: int
    gpus: tuple[int, ...] = ()


class PackState:
    """The allocation state of a set of nodes (see the module docstring for the arrays)."""

    def __init__(self, nodes: Sequence[Node], node_order: Sequence[int] | np.ndarray | None = None):
        if len(nodes) == 0:
            raise SpecError("nodes", "the cluster has no nodes")
        self.nodes: tuple[Node, ...] = tuple(nodes)
        n = len(self.nodes)
        self.max_gpus = max(1, max(nd.num_gpu for nd in self.nodes))
        self.cpu_cap = np.array([nd.cpu_milli for nd in self.nodes], dtype=np.int64)
        self.mem_cap = np.array([nd.memory_mib for nd in self.nodes], dtype=np.int64)
        self.gpu_count = np.array([nd.num_gpu for nd in self.nodes], dtype=np.int64)
        self.gpu_exists = np.arange(self.max_gpus)[None, :] < self.gpu_count[:, None]
        self.models: tuple[str, ...] = tuple(sorted({nd.model for nd in self.nodes}))
        model_index = {m: i for i, m in enumerate(self.models)}
        self.model_idx = np.array([model_index[nd.model] for nd in self.nodes], dtype=np.int64)
        self.total_gpus = int(self.gpu_count.sum())
        self.total_gpu_milli = self.total_gpus * MILLI
        self._model_masks: dict[tuple[str, ...], np.ndarray] = {}
        self.cpu_left = self.cpu_cap.copy()
        self.mem_left = self.mem_cap.copy()
        self.gpu_left = np.where(self.gpu_exists, MILLI, 0).astype(np.int64)
        self.gpu_left_total = self.gpu_count * MILLI
        self.version = np.zeros(n, dtype=np.int64)
        self.allocated_gpu_milli = 0
        self.placed_pods = 0
        self.node_rank = np.arange(n, dtype=np.int64)
        if node_order is not None:
            self.set_node_order(node_order)

    def set_node_order(self, order: Sequence[int] | np.ndarray) -> None:
        """Visit nodes in ``order`` (a permutation of node indices): ``order[0]`` is first."""
        order = np.asarray(order, dtype=np.int64)
        if sorted(order.tolist()) != list(range(len(self.nodes))):
            raise SpecError("node_order", f"must be a permutation of 0..{len(self.nodes) - 1}")
        rank = np.empty(len(self.nodes), dtype=np.int64)
        rank[order] = np.arange(len(self.nodes))
        self.node_rank = rank

    def __len__(self) -> int:
        return len(self.nodes)

    # -- queries ---------------------------------------------------------------------------------
    def model_mask(self, gpu_spec: tuple[str, ...]) -> np.ndarray:
        """Nodes whose GPU model the spec accepts (all nodes for an empty spec). Cached, read-only."""
        mask = self._model_masks.get(gpu_spec)
        if mask is None:
            if not gpu_spec:
                mask = np.ones(len(self.nodes), dtype=bool)
            else:
                allowed = np.array([m in gpu_spec for m in self.models], dtype=bool)
                mask = allowed[self.model_idx]
            mask.setflags(write=False)
            self._model_masks[gpu_spec] = mask
        return mask

    def gpu_fit_mask(self, pod: Pod) -> np.ndarray:
        """Nodes with GPUs for the pod now (ignoring CPU, memory and model)."""
        if pod.num_gpu == 0:
            return np.ones(len(self.nodes), dtype=bool)
        if pod.gpu_milli < MILLI:
            return (self.gpu_left >= pod.gpu_milli).any(axis=1)
        return (self.gpu_left == MILLI).sum(axis=1) >= pod.num_gpu

    def fit_mask(self, pod: Pod) -> np.ndarray:
        """Nodes where the pod fits now: CPU, memory, GPU model and GPUs (the kube filter stage)."""
        mask = (self.cpu_left >= pod.cpu_milli) & (self.mem_left >= pod.memory_mib)
        if pod.num_gpu:
            mask &= self.model_mask(pod.gpu_spec)
            mask &= self.gpu_fit_mask(pod)
        return mask

    def free_whole_gpus(self, node: int, count: int) -> tuple[int, ...]:
        """The first ``count`` completely free GPUs of a node, by index."""
        return tuple(int(g) for g in np.flatnonzero(self.gpu_left[node] == MILLI)[:count])

    @property
    def alloc_ratio(self) -> float:
        """Share of the cluster's GPU milli that is allocated (the paper's GPU allocation ratio)."""
        return self.allocated_gpu_milli / self.total_gpu_milli if self.total_gpu_milli else 0.0

    # -- changes ---------------------------------------------------------------------------------
    def _check(self, pod: Pod, placement: Placement) -> None:
        n = placement.node
        where = f"placing pod {pod.name}"
        if not 0 <= n < len(self.nodes):
            raise PackingError(f"{where}: node index {n} does not exist (cluster has {len(self.nodes)} nodes)")
        name = self.nodes[n].name
        if self.cpu_left[n] < pod.cpu_milli:
            raise PackingError(f"{where} on {name}: needs {pod.cpu_milli} milli-CPU, {self.cpu_left[n]} free")
        if self.mem_left[n] < pod.memory_mib:
            raise PackingError(f"{where} on {name}: needs {pod.memory_mib} MiB, {self.mem_left[n]} free")
        gpus = placement.gpus
        if len(gpus) != pod.num_gpu:
            raise PackingError(f"{where} on {name}: pod asks for {pod.num_gpu} GPU(s), placement gives {len(gpus)}")
        if not gpus:
            return
        if not self.model_mask(pod.gpu_spec)[n]:
            raise PackingError(f"{where} on {name}: GPU model {self.nodes[n].model!r} not in {'|'.join(pod.gpu_spec)}")
        if len(set(gpus)) != len(gpus):
            raise PackingError(f"{where} on {name}: GPU indices {gpus} repeat")
        for g in gpus:
            if not 0 <= g < self.gpu_count[n]:
                raise PackingError(f"{where} on {name}: GPU {g} does not exist ({self.gpu_count[n]} GPUs)")
            need = pod.gpu_milli
            if pod.gpu_milli == MILLI and self.gpu_left[n, g] != MILLI:
                raise PackingError(f"{where} on {name}: whole-GPU pod on GPU {g} that is not free")
            if self.gpu_left[n, g] < need:
                raise PackingError(f"{where} on {name}: GPU {g} has {self.gpu_left[n, g]} milli free, needs {need}")

    def place(self, pod: Pod, placement: Placement) -> None:
        """Allocate; raises `PackingError` (and changes nothing) if it would break an invariant."""
        self._check(pod, placement)
        n = placement.node
        self.cpu_left[n] -= pod.cpu_milli
        self.mem_left[n] -= pod.memory_mib
        for g in placement.gpus:
            self.gpu_left[n, g] -= pod.gpu_milli
        self.gpu_left_total[n] -= pod.total_gpu_milli
        self.allocated_gpu_milli += pod.total_gpu_milli
        self.placed_pods += 1
        self.version[n] += 1

    def release(self, pod: Pod, placement: Placement) -> None:
        """Give back what `place` took (for pods that leave; the FGD experiment never calls it)."""
        n = placement.node
        if self.cpu_left[n] + pod.cpu_milli > self.cpu_cap[n] or self.mem_left[n] + pod.memory_mib > self.mem_cap[n]:
            raise PackingError(f"releasing pod {pod.name} from {self.nodes[n].name}: it was not placed there")
        for g in placement.gpus:
            if self.gpu_left[n, g] + pod.gpu_milli > MILLI:
                raise PackingError(f"releasing pod {pod.name}: GPU {g} of {self.nodes[n].name} would exceed 1000 milli")
        self.cpu_left[n] += pod.cpu_milli
        self.mem_left[n] += pod.memory_mib
        for g in placement.gpus:
            self.gpu_left[n, g] += pod.gpu_milli
        self.gpu_left_total[n] += pod.total_gpu_milli
        self.allocated_gpu_milli -= pod.total_gpu_milli
        self.placed_pods -= 1
        self.version[n] += 1


def never_fitting(pods: Sequence[Pod], empty: PackState) -> list[tuple[str, str]]:
    """(pod name, reason) for pods that fit no node of the cluster `empty` (an empty PackState;
    memoised per request)."""
    memo: dict[tuple, str | None] = {}
    out: list[tuple[str, str]] = []
    for pod in pods:
        key = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.gpu_spec)
        if key not in memo:
            why = None
            if not empty.fit_mask(pod).any():
                if pod.num_gpu and not empty.model_mask(pod.gpu_spec).any():
                    have = sorted({str(n.model) for n in empty.nodes if n.num_gpu})
                    why = f"no node has GPU model {'|'.join(pod.gpu_spec)} (the nodes have {', '.join(have) or 'none'})"
                else:
                    gpus = f"{pod.num_gpu} GPU(s) x {pod.gpu_milli} milli, " if pod.num_gpu else ""
                    spec = f" ({'|'.join(pod.gpu_spec)})" if pod.gpu_spec else ""
                    why = f"no node has {gpus}{pod.cpu_milli} milli-CPU and {pod.memory_mib} MiB{spec}"
            memo[key] = why
        if memo[key]:
            out.append((pod.name, memo[key]))
    return out


def pods_from_records(records: Iterable["AlibabaPod"]) -> list[Pod]:
    return [Pod.from_record(r) for r in records]


def spell_models_as_nodes(pods: Sequence[Pod], nodes: Sequence[Node]) -> list[Pod]:
    """The pods, each GPU model of a ``gpu_spec`` spelt as the node list spells it when the two differ only
    in case ('t4' for the nodes' 'T4'). The simulator (`ClusterSpec.model_mask`) matches models without
    regard to case; packing compared them exactly, so such a pod fit no node in `qosflow pack` while
    `qosflow simulate` placed it."""
    spelt = {str(n.model).lower(): n.model for n in nodes if n.model}
    out = []
    for pod in pods:
        spec = tuple(spelt.get(m.lower(), m) for m in pod.gpu_spec)
        out.append(pod if spec == pod.gpu_spec else replace(pod, gpu_spec=spec))
    return out


def nodes_from_records(records: Iterable["AlibabaNode"]) -> list[Node]:
    return [Node.from_record(r) for r in records]
