"""Placements: where a job runs (GPUs, CPU cores, memory) and how (co-located, sub-batched)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qosflow.errors import SpecError


@dataclass(frozen=True, slots=True, order=True)
class JobIdPair:
    """Two co-located jobs as one key (Gavel's JobIdPair), order-independent."""

    first: str
    second: str

    @classmethod
    def of(cls, a: str, b: str) -> "JobIdPair":
        if a == b:
            raise SpecError("pair", f"a job cannot be paired with itself ({a!r})")
        return cls(*sorted((a, b)))

    def other(self, job_id: str) -> str:
        if job_id == self.first:
            return self.second
        if job_id == self.second:
            return self.first
        raise KeyError(job_id)

    def __iter__(self):
        yield self.first
        yield self.second


@dataclass(frozen=True, slots=True)
class SubBatchPlan:
    """Run with a smaller sub-batch and accumulate gradients, keeping the global batch (SJF-BSBF).

    `sub_batch * accumulation_steps == global_batch`, so the optimizer sees the same batch and the
    job converges as before, while each forward/backward pass needs less GPU memory.
    """

    global_batch: int
    sub_batch: int
    accumulation_steps: int

    def __post_init__(self) -> None:
        if self.sub_batch <= 0 or self.accumulation_steps <= 0:
            raise SpecError("sub_batch", f"sub-batch and accumulation steps must be positive, got {self}")
        if self.sub_batch * self.accumulation_steps != self.global_batch:
            raise SpecError(
                "sub_batch",
                f"sub_batch {self.sub_batch} x accumulation {self.accumulation_steps} != global batch {self.global_batch}",
            )

    @classmethod
    def split(cls, global_batch: int, accumulation_steps: int) -> "SubBatchPlan":
        if global_batch % accumulation_steps:
            raise SpecError("sub_batch", f"{accumulation_steps} does not divide the global batch {global_batch}")
        return cls(global_batch, global_batch // accumulation_steps, accumulation_steps)

    def to_dict(self) -> dict[str, int]:
        return {
            "global_batch": self.global_batch,
            "sub_batch": self.sub_batch,
            "accumulation_steps": self.accumulation_steps,
        }


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one job runs.

    `gpus` are (node index, GPU index) pairs in the cluster the placement was made for;
    `cpu` gives the cores allocated on each node used; `gpu_milli` < 1000 is a fractional share of
    the single GPU; `colocated_with` names the job(s) already on these GPUs (whole-GPU sharing).
    """

    job_id: str
    gpus: tuple[tuple[int, int], ...]
    cpu: tuple[tuple[int, float], ...] = ()
    gpu_milli: int = 1000
    gpu_mem_mb: float = 0.0
    mem_mb: float = 0.0
    colocated_with: tuple[str, ...] = ()
    sub_batch: SubBatchPlan | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def nodes(self) -> tuple[int, ...]:
        seen: dict[int, None] = {}
        for n, _ in self.gpus:
            seen.setdefault(n, None)
        for n, _ in self.cpu:
            seen.setdefault(n, None)
        return tuple(seen)

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    @property
    def shared(self) -> bool:
        return bool(self.colocated_with) or self.gpu_milli < 1000

    @property
    def cpu_cores(self) -> float:
        return float(sum(c for _, c in self.cpu))

    def cores_on(self, node: int) -> float:
        return float(sum(c for n, c in self.cpu if n == node))

    def gpus_on(self, node: int) -> list[int]:
        return [g for n, g in self.gpus if n == node]

    def describe(self, node_names: list[str] | tuple[str, ...] | None = None) -> str:
        parts = []
        for n in self.nodes:
            name = node_names[n] if node_names else f"node{n}"
            gp = ",".join(str(g) for g in self.gpus_on(n))
            parts.append(f"{name}[gpu {gp or '-'}; {self.cores_on(n):g} cores]")
        s = " + ".join(parts)
        if self.gpu_milli < 1000:
            s += f" share {self.gpu_milli}/1000"
        if self.colocated_with:
            s += f" with {','.join(self.colocated_with)}"
        if self.sub_batch:
            s += f" sub-batch {self.sub_batch.sub_batch}x{self.sub_batch.accumulation_steps}"
        return s
