"""The target workload: how often each kind of request appears (FGD, ATC'23, section 4.1).

FGD measures a node's fragmentation *against the workload it expects to serve*: a distribution
over "task types" M = {m: (CPU, GPU request, GPU model), p_m}. As in the authors' simulator
(kubernetes-scheduler-simulator, `GetTypicalPods`, configured by its experiment scripts with
``isInvolvedCpuPods=true``, ``podPopularityThreshold=95``, ``podIncreaseStep=1``,
``gpuResWeight=0``), a type is (milli-CPU, milli-GPU per GPU, number of GPUs, allowed GPU
models) -- memory is not part of it -- counted over the pod list; the most frequent types are
kept until they cover 95 % of the pods, and their frequencies are renormalised to sum to 1.
Ties in frequency are ordered by (CPU, GPU milli, GPU count, model) descending, as there.

``memory_mib`` (optional, per type) is the median memory of the pods of that type. FGD ignores
it; qosflow's packer uses it to tell when a node's memory, not its GPUs, stops a type.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from qosflow.errors import SpecError
from qosflow.packing.model import Pod

#: the authors' default share of pods the typical types must cover
DEFAULT_POPULARITY = 0.95


@dataclass(frozen=True)
class WorkloadDistribution:
    """Task types and their probabilities (arrays of length T, sorted by decreasing frequency)."""

    cpu_milli: np.ndarray  # (T,) int64
    gpu_milli: np.ndarray  # (T,) int64, per GPU (0 for CPU-only types)
    num_gpu: np.ndarray  # (T,) int64
    gpu_spec: tuple[tuple[str, ...], ...]  # (T,) allowed models, () = any
    prob: np.ndarray  # (T,) float64, sums to 1
    #: (T,) integer weights proportional to ``prob`` (the pod counts when built from a pod list);
    #: FGD sums fragments with them so that equal node states give exactly equal values
    weights: np.ndarray | None = None
    #: (T,) int64 typical memory (MiB) of a task of each type (median over the pods); None: unknown
    memory_mib: np.ndarray | None = None

    def __post_init__(self) -> None:
        t = len(self.prob)
        if t == 0:
            raise SpecError("workload", "needs at least one task type")
        for name in ("cpu_milli", "gpu_milli", "num_gpu"):
            if len(getattr(self, name)) != t:
                raise SpecError("workload", f"{name} has {len(getattr(self, name))} entries, prob has {t}")
        if len(self.gpu_spec) != t:
            raise SpecError("workload", f"gpu_spec has {len(self.gpu_spec)} entries, prob has {t}")
        if np.any(self.prob < 0) or not np.isclose(self.prob.sum(), 1.0):
            raise SpecError("workload", f"probabilities must be >= 0 and sum to 1, sum is {self.prob.sum():.6f}")
        if self.weights is None:
            # 1e9 resolution: exact enough, and sums of weight x milli stay far below 2**63
            object.__setattr__(self, "weights", np.rint(self.prob * 1e9).astype(np.int64))
        elif len(self.weights) != t or np.any(np.asarray(self.weights) < 0):
            raise SpecError("workload", "weights must be one non-negative integer per type")
        if self.memory_mib is not None:
            mem = np.asarray(self.memory_mib, dtype=np.int64)
            if len(mem) != t or np.any(mem < 0):
                raise SpecError("workload", f"memory_mib needs one value >= 0 per type ({t}), got {len(mem)}")
            object.__setattr__(self, "memory_mib", mem)

    def __len__(self) -> int:
        return len(self.prob)

    @classmethod
    def from_types(
        cls,
        types: Sequence[tuple[int, int, int, tuple[str, ...]]],
        prob: Sequence[float],
        memory_mib: Sequence[int] | None = None,
    ) -> "WorkloadDistribution":
        """From explicit (cpu_milli, num_gpu, gpu_milli, gpu_spec) types and probabilities
        (or counts: integer values are kept as exact weights), optionally each type's memory."""
        raw = np.asarray(prob, dtype=np.float64)
        weights = raw.astype(np.int64) if np.all(raw == np.floor(raw)) else None
        p = raw / raw.sum() if raw.sum() > 0 else raw
        return cls(
            cpu_milli=np.array([t[0] for t in types], dtype=np.int64),
            num_gpu=np.array([t[1] for t in types], dtype=np.int64),
            gpu_milli=np.array([t[2] for t in types], dtype=np.int64),
            gpu_spec=tuple(tuple(t[3]) for t in types),
            prob=p,
            weights=weights,
            memory_mib=None if memory_mib is None else np.asarray(memory_mib, dtype=np.int64),
        )

    @classmethod
    def from_pods(
        cls, pods: Iterable[Pod], popularity: float = DEFAULT_POPULARITY, include_cpu_pods: bool = True
    ) -> "WorkloadDistribution":
        """The typical task types of a pod list (see the module docstring)."""
        if not 0 < popularity <= 1:
            raise SpecError("popularity", f"must be in (0, 1], got {popularity}")
        counts: Counter[tuple[int, int, int, tuple[str, ...]]] = Counter()
        mems: dict[tuple[int, int, int, tuple[str, ...]], list[int]] = {}
        for pod in pods:
            if pod.num_gpu == 0 and not include_cpu_pods:
                continue
            counts[pod.request_key] += 1
            mems.setdefault(pod.request_key, []).append(pod.memory_mib)
        if not counts:
            raise SpecError("workload", "no pods to derive the target workload from")
        total = sum(counts.values())
        # decreasing count; ties by (cpu, gpu_milli, num_gpu, spec) decreasing, as the Go sort.Reverse
        ordered = sorted(counts.items(), key=lambda kv: (kv[1], kv[0][0], kv[0][2], kv[0][1], kv[0][3]), reverse=True)
        kept, cum = [], 0
        for key, cnt in ordered:
            if cum >= popularity * total:
                break
            kept.append((key, cnt))
            cum += cnt
        return cls.from_types(
            [k for k, _ in kept], [c for _, c in kept], [int(np.median(mems[k])) for k, _ in kept]
        )

    def access_matrix(self, models: Sequence[str]) -> np.ndarray:
        """(len(models), T) bool: may type t run on GPU model m? (always True for CPU-only types)."""
        out = np.ones((len(models), len(self)), dtype=bool)
        for t, spec in enumerate(self.gpu_spec):
            if spec and self.num_gpu[t] > 0:
                out[:, t] = [m in spec for m in models]
        return out

    def describe(self) -> list[dict]:
        return [
            {
                "cpu_milli": int(self.cpu_milli[t]),
                "num_gpu": int(self.num_gpu[t]),
                "gpu_milli": int(self.gpu_milli[t]),
                "gpu_spec": "|".join(self.gpu_spec[t]),
                "prob": float(self.prob[t]),
                **({"memory_mib": int(self.memory_mib[t])} if self.memory_mib is not None else {}),
            }
            for t in range(len(self))
        ]
