"""One entry point for simulation workloads: load a trace (or generate one), reject what can never
fit the cluster, assign deadlines.

``load_workload(trace, fmt, cluster=..., seed=...)`` with `fmt` one of ``muri``, ``gavel``,
``alibaba``, ``synthetic`` returns a `Workload`: the jobs (sorted by submission), the rejected
``(job id, reason)`` pairs, a name, and a hint of the cluster the trace was made for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job
from qosflow.errors import SpecError, UnknownNameError
from qosflow.sim.deadlines import DEFAULT_LAMBDA, DEFAULT_SHARE, assign_deadlines
from qosflow.sim.traces._common import Rejected

FORMATS = ("muri", "gavel", "alibaba", "synthetic")


@dataclass
class Workload:
    jobs: list[Job]
    rejected: list[Rejected]
    name: str
    #: the cluster the trace was made for, as a `load_cluster` spec (None if unknown)
    cluster_hint: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.jobs)


def _sibling(path: Path, pattern: str, prefer: str | None = None) -> str | None:
    """The one file next to the trace matching `pattern` (its cluster description), or, if several
    do, the one matching `prefer`; None when that is still ambiguous."""
    hits = sorted(path.parent.glob(pattern))
    if len(hits) > 1 and prefer is not None:
        hits = sorted(path.parent.glob(prefer))
    return str(hits[0]) if len(hits) == 1 else None


def _muri(trace: str, cluster: ClusterSpec, seed: int, opts: dict[str, Any]):
    from qosflow.sim.traces.muri import load_muri

    jobs, rej = load_muri(trace, cluster=cluster, **opts)
    return jobs, rej, Path(trace).stem, _sibling(Path(trace), "muri_cluster*.csv")


def _gavel(trace: str, cluster: ClusterSpec, seed: int, opts: dict[str, Any]):
    from qosflow.sim.traces.gavel import load_gavel

    jobs, rej = load_gavel(trace, cluster=cluster, **opts)
    hint = _sibling(Path(trace), "cluster_specs.json")
    return jobs, rej, Path(trace).stem, hint


def _alibaba(trace: str, cluster: ClusterSpec, seed: int, opts: dict[str, Any]):
    from qosflow.sim.traces.alibaba_jobs import load_alibaba_jobs

    jobs, rej = load_alibaba_jobs(trace, cluster=cluster, **opts)
    # the dataset ships a GPU-node list and an all-node list: GPU jobs are placed on the GPU nodes
    return jobs, rej, Path(trace).stem, _sibling(Path(trace), "*node_list*.csv", prefer="*node_list_gpu_node*.csv")


def _synthetic(trace: str, cluster: ClusterSpec, seed: int, opts: dict[str, Any]):
    from qosflow.sim.interference import load_gavel_interference
    from qosflow.sim.traces.synthetic import DEFAULT_JOBS, generate_synthetic

    n = opts.pop("num_jobs", DEFAULT_JOBS)
    opts.setdefault("table", load_gavel_interference())
    jobs, rej = generate_synthetic(n, seed=seed, cluster=cluster, **opts)
    return jobs, rej, f"synthetic-{n}-seed{seed}", "8x8"


_LOADERS: dict[str, Callable] = {"muri": _muri, "gavel": _gavel, "alibaba": _alibaba, "synthetic": _synthetic}


def load_workload(
    trace: str | Path,
    fmt: str,
    *,
    cluster: ClusterSpec,
    seed: int = 0,
    deadline_share: float = DEFAULT_SHARE,
    deadline_lambda: tuple[float, float] = DEFAULT_LAMBDA,
    min_gpus_share: float | None = None,
    **opts: Any,
) -> Workload:
    """Load `trace` in format `fmt` for `cluster`, with deadlines assigned reproducibly for `seed`.

    `opts` go to the loader: ``muri`` (iteration_overhead, cores_per_gpu), ``gavel`` (throughputs,
    gpu_type, cores_per_gpu), ``synthetic`` (num_jobs, rate_per_hour, load, table, users: a number of
    users or their shares, for fairness between users); `trace` is ignored for ``synthetic``.

    `min_gpus_share` (None: every job rigid, as the traces are) lets every multi-GPU job start on as
    few as that share of its GPUs (`elastic`), an assumption about the jobs that no trace records.
    """
    key = str(fmt).strip().lower()
    loader = _LOADERS.get(key)
    if loader is None:
        raise UnknownNameError("trace format", str(fmt), FORMATS)
    if not isinstance(cluster, ClusterSpec):
        raise SpecError("cluster", f"expected a ClusterSpec (see qosflow.sim.clusters.load_cluster), got {type(cluster).__name__}")
    jobs, rejected, name, hint = loader(str(trace), cluster, seed, dict(opts))
    jobs = assign_deadlines(jobs, share=deadline_share, seed=seed, lam=deadline_lambda)
    if min_gpus_share is not None:
        jobs = elastic(jobs, min_gpus_share)
    jobs.sort(key=lambda j: (j.submit_time, j.meta.get("line", 0)))
    with_deadline = sum(1 for j in jobs if j.qos.deadline is not None)
    users = opts.get("users") if key == "synthetic" else None
    return Workload(
        jobs=jobs,
        rejected=rejected,
        name=name,
        cluster_hint=hint,
        info={"format": key, "seed": seed, "deadline_share": deadline_share, "with_deadline": with_deadline,
              "min_gpus_share": min_gpus_share, "users": users},
    )


def elastic(jobs: list[Job], share: float) -> list[Job]:
    """`jobs` with every job of two or more whole GPUs declaring `min_gpus` = ceil(share x gpus): it may
    start on fewer GPUs with gradient accumulation (`QoSSpec.min_gpus`). A job that already declares
    one keeps it; `share` 1 changes nothing, nor does a share that leaves a job no divisor of its GPUs
    to start on below them (3 GPUs at 0.5: it may start on 3 only, so it stays rigid)."""
    import math
    from dataclasses import replace

    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise SpecError("min_gpus_share", f"must be a share of a job's GPUs in (0, 1] (0.5: an 8-GPU job may start on 4), got {share!r}")
    out = []
    for j in jobs:
        q = j.qos
        if q.gpus > 1 and not q.fractional and q.min_gpus is None:
            m = max(1, math.ceil(share * q.gpus - 1e-9))
            # (only if some divisor of its GPUs below them is m or more: otherwise it stays rigid, which
            # `QoSSpec` requires of a min_gpus that would allow no narrower width, e.g. 2 of 3 GPUs)
            if any(q.gpus % w == 0 for w in range(m, q.gpus)):
                j = replace(j, qos=q.with_(min_gpus=m))
        out.append(j)
    return out
