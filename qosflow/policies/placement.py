"""Placement search over a `ClusterState`: consolidated or spread gangs, shares, co-location.

All functions only read the state and return a `Placement` (or None); the caller allocates it.
Searches are numpy operations over nodes, so a round over 1,000 nodes x 8 GPUs stays fast.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from qosflow.core.cluster import ClusterState
from qosflow.core.job import Job
from qosflow.core.placement import Placement, SubBatchPlan
from qosflow.core.qos import QoSSpec

Locality = Literal["consolidated", "spread", "any"]
#: the names a `Locality` may take (a policy's constructor refuses others)
LOCALITIES: tuple[str, ...] = get_args(Locality)
Fit = Literal["best-fit", "first-fit", "worst-fit"]


def min_nodes_for(gpus: int, gpus_per_node: int) -> int:
    return max(1, -(-gpus // max(1, gpus_per_node)))


def _node_mask(state: ClusterState, qos: QoSSpec, *, include_down: bool = False) -> np.ndarray:
    """Nodes the job may use: its GPU model and enough memory per GPU (and up, unless `include_down`)."""
    ok = np.ones(state.num_nodes, bool) if include_down else ~state.down
    if qos.gpu_model is not None:
        ok = ok & state.spec.model_mask(qos.gpu_model)
    if qos.gpu_mem_mb is not None and qos.gpus > 0:
        ok = ok & (state.gmem_cap >= qos.gpu_mem_mb)
    return ok


def _pick(cands: np.ndarray, key: np.ndarray, fit: Fit) -> int:
    if fit == "first-fit":
        return int(cands[0])
    k = key[cands]
    i = int(np.argmin(k)) if fit == "best-fit" else int(np.argmax(k))
    return int(cands[i])


def find_cpu_only(state: ClusterState, job: Job, fit: Fit = "best-fit", cores: float | None = None) -> Placement | None:
    qos = job.qos
    c = qos.cpu_cores if cores is None else cores
    ok = (~state.down) & (state.cpu_free >= c - 1e-9) & (state.mem_free >= qos.mem_mb - 1e-6)
    cands = np.flatnonzero(ok)
    if cands.size == 0:
        return None
    n = _pick(cands, state.cpu_free, fit)
    return Placement(job.job_id, (), cpu=((n, float(c)),), mem_mb=qos.mem_mb)


def _whole_candidates(state: ClusterState, qos: QoSSpec, cpg: float) -> tuple[np.ndarray, int, np.ndarray | None]:
    """(nodes the job may use that are up, the largest GPU count among the nodes it may use, the nodes
    that can hold it alone now -- None when it is wider than that largest node)."""
    k = qos.gpus
    # the largest node the job may use (its GPU model and memory), up or not: a job wider than every
    # such node spans whole nodes even if some other, larger node would hold it alone
    eligible = _node_mask(state, qos, include_down=True)
    mask = eligible & ~state.down
    gmax = max(1, int(state.gpu_count[eligible].max())) if eligible.any() else max(1, state.spec.max_gpus_per_node)
    if k > gmax:
        return mask, gmax, None
    ok = mask & (state.empty >= k) & (state.cpu_free >= cpg * k - 1e-9) & (state.mem_free >= qos.mem_mb - 1e-6)
    return mask, gmax, np.flatnonzero(ok)


def one_node_candidates(state: ClusterState, job: Job) -> np.ndarray | None:
    """The nodes that can hold whole-GPU `job` alone now (empty GPUs, cores and memory), in node order;
    None if it is wider than every node it may use. With `place_on_one_node` this is `find_whole`'s
    single-node search split in two, so a caller can reuse the candidates for jobs of the same shape."""
    qos = job.qos
    if qos.gpus <= 0:
        raise ValueError(f"job {job.job_id!r} asks for no whole GPU")
    cands = _whole_candidates(state, qos, qos.cpu_cores / qos.gpus)[2]
    if cands is not None and state.total_empty_gpus() < qos.gpus:
        return cands[:0]
    return cands


def place_on_one_node(
    state: ClusterState,
    job: Job,
    cands: np.ndarray,
    *,
    fit: Fit = "best-fit",
    node_rank: np.ndarray | None = None,
    cores_per_gpu: float | None = None,
) -> Placement:
    """Place `job` on one of the non-empty candidate nodes `cands` (see `find_whole` for `node_rank`)."""
    qos = job.qos
    k = qos.gpus
    cpg = (qos.cpu_cores / k) if cores_per_gpu is None else cores_per_gpu
    if node_rank is not None:
        r = node_rank[cands]
        cands = cands[r <= r.min()]
    n = _pick(cands, state.empty, fit)
    gl = state.empty_gpus_on(n)[:k]
    return Placement(
        job.job_id,
        tuple((n, int(g)) for g in gl),
        cpu=((n, cpg * k),),
        gpu_mem_mb=qos.gpu_mem_mb if qos.gpu_mem_mb is not None else 0.0,
        mem_mb=qos.mem_mb,
    )


def find_whole(
    state: ClusterState,
    job: Job,
    *,
    locality: Locality = "consolidated",
    fit: Fit = "best-fit",
    cores_per_gpu: float | None = None,
    node_rank: np.ndarray | None = None,
) -> Placement | None:
    """Empty GPUs for a whole-GPU job.

    `consolidated`: the fewest nodes possible (one node if it fits on one; otherwise whole empty
    nodes, same switch first) -- Philly/YARN locality. `spread`: any empty GPUs, fewest nodes first
    (locality relaxed, at a slowdown). `any`: like spread, but callers treat it as free of penalty
    (counting placement, as in Tiresias' simulator).

    `node_rank` (one number per node, lower is better) chooses among the nodes a single-node job
    fits on, before the fit rule (which then breaks ties).
    """
    qos = job.qos
    k = qos.gpus
    if k == 0:
        return find_cpu_only(state, job, fit)
    if state.total_empty_gpus() < k:
        return None
    cpg = (qos.cpu_cores / k) if cores_per_gpu is None else cores_per_gpu
    mask, gmax, cands = _whole_candidates(state, qos, cpg)
    gmem = qos.gpu_mem_mb if qos.gpu_mem_mb is not None else 0.0

    if cands is not None:
        if cands.size:
            return place_on_one_node(state, job, cands, fit=fit, node_rank=node_rank, cores_per_gpu=cpg)
        if locality == "consolidated":
            return None

    # multi-node: the job's host memory is split evenly over its nodes, so a node needs at least
    # mem / (the fewest nodes it can span) free
    if qos.mem_mb > 0:
        mask = mask & (state.mem_free >= qos.mem_mb / max(2, min_nodes_for(k, gmax)) - 1e-6)
    if locality == "consolidated":
        # whole empty nodes, within one switch if possible
        full = mask & (state.empty == state.gpu_count) & (state.gpu_count > 0)
        full &= state.cpu_free >= cpg * state.gpu_count - 1e-9
        cands = np.flatnonzero(full)
        if state.gpu_count[cands].sum() < k if cands.size else True:
            return None
        chosen = _fill_nodes(state, cands, k, prefer_switch=True)
    else:
        usable = mask & (state.empty > 0)
        # a node gives as many GPUs as its cores can feed
        cap = np.minimum(state.empty, np.floor((state.cpu_free + 1e-9) / max(cpg, 1e-9)).astype(np.int64) if cpg > 0 else state.empty)
        usable &= cap > 0
        cands = np.flatnonzero(usable)
        if cands.size == 0 or cap[cands].sum() < k:
            return None
        chosen = _fill_nodes(state, cands, k, prefer_switch=True, cap=cap)
    if chosen is None or (qos.mem_mb > 0 and any(state.mem_free[n] < qos.mem_mb / len(chosen) - 1e-6 for n, _ in chosen)):
        return None
    gpus: list[tuple[int, int]] = []
    cpu: list[tuple[int, float]] = []
    for n, take in chosen:
        gl = state.empty_gpus_on(n)[:take]
        gpus.extend((n, int(g)) for g in gl)
        cpu.append((n, cpg * take))
    return Placement(job.job_id, tuple(gpus), cpu=tuple(cpu), gpu_mem_mb=gmem, mem_mb=qos.mem_mb)


def _fill_nodes(state: ClusterState, cands: np.ndarray, k: int, *, prefer_switch: bool, cap: np.ndarray | None = None):
    avail = (state.empty if cap is None else cap)[cands]
    order = np.lexsort((cands, -avail))  # most free first, then lowest index
    cands, avail = cands[order], avail[order]
    if prefer_switch and state.switch.max() > 0:
        sw = state.switch[cands]
        best = None
        for s in np.unique(sw):
            m = sw == s
            if avail[m].sum() >= k:
                sel = _take(cands[m], avail[m], k)
                if best is None or len(sel) < len(best):
                    best = sel
        if best is not None:
            return best
    return _take(cands, avail, k)


def _take(cands: np.ndarray, avail: np.ndarray, k: int):
    out = []
    left = k
    for n, a in zip(cands.tolist(), avail.tolist()):
        if left <= 0:
            break
        t = min(a, left)
        if t > 0:
            out.append((n, t))
            left -= t
    return out if left <= 0 else None


def find_share(state: ClusterState, job: Job, *, fit: Fit = "best-fit", scorer=None) -> Placement | None:
    """One GPU with room for a fractional share (`gpu_milli` < 1000).

    `scorer(state, job, cand_nodes, cand_gpus) -> scores` (lower is better) lets a
    fragmentation-aware packer (FGD) choose; otherwise best-fit on the milli left.
    """
    qos = job.qos
    mask = _node_mask(state, qos) & (state.cpu_free >= qos.cpu_cores - 1e-9) & (state.mem_free >= qos.mem_mb - 1e-6)
    need_mem = qos.gpu_mem_mb
    gm_ok = state.gmem_free >= (need_mem if need_mem is not None else state.gmem_cap[:, None] * qos.gpu_milli / 1000.0) - 1e-6
    ok = mask[:, None] & state.exists & (state.whole == 0) & (state.milli_free >= qos.gpu_milli) & gm_ok
    nodes, gpus = np.nonzero(ok)
    if nodes.size == 0:
        return None
    if scorer is not None:
        scores = np.asarray(scorer(state, job, nodes, gpus), dtype=float)
        i = int(np.argmin(scores))
    elif fit == "first-fit":
        i = 0
    else:
        left = state.milli_free[nodes, gpus] - qos.gpu_milli
        # best-fit: least milli left on the GPU, then the fullest node
        i = int(np.lexsort((state.empty[nodes], left))[0]) if fit == "best-fit" else int(np.argmax(left))
    n, g = int(nodes[i]), int(gpus[i])
    return Placement(
        job.job_id,
        ((n, g),),
        cpu=((n, float(qos.cpu_cores)),),
        gpu_milli=qos.gpu_milli,
        gpu_mem_mb=need_mem or 0.0,
        mem_mb=qos.mem_mb,
    )


def find_colocation(
    state: ClusterState,
    job: Job,
    partner: Job,
    *,
    sub_batch: SubBatchPlan | None = None,
    gpu_mem_mb: float | None = None,
) -> Placement | None:
    """Put `job` on exactly the GPUs `partner` holds (whole-GPU sharing, at most two per GPU).

    Needs the same GPU count, both jobs shareable, and `job`'s GPU memory (or the memory of its
    sub-batch plan, `gpu_mem_mb`) to fit next to the partner on every GPU.
    """
    qos = job.qos
    if not (qos.shareable and partner.qos.shareable) or qos.fractional or qos.gpus == 0:
        return None
    pp = state.allocs.get(partner.job_id)
    if pp is None or len(pp.gpus) != qos.gpus or pp.gpu_milli < 1000:
        return None
    mem = gpu_mem_mb if gpu_mem_mb is not None else qos.gpu_mem_mb
    if mem is None:
        return None
    cpu_need: dict[int, float] = {}
    per = qos.cpu_cores / qos.gpus
    for n, g in pp.gpus:
        if state.down[n] or not state.share_ok[n, g] or state.njobs[n, g] != 1:
            return None
        if state.gmem_free[n, g] < mem - 1e-6:
            return None
        if not qos.accepts_gpu_model(state.spec.nodes[n].gpu_model):
            return None
        cpu_need[n] = cpu_need.get(n, 0.0) + per
    for n, c in cpu_need.items():
        if state.cpu_free[n] < c - 1e-9:
            return None
        if qos.mem_mb > 0 and state.mem_free[n] < qos.mem_mb / len(cpu_need) - 1e-6:
            return None  # (host memory, split evenly over its nodes as `ClusterState.allocate` does)
    return Placement(
        job.job_id,
        tuple(pp.gpus),
        cpu=tuple(cpu_need.items()),
        gpu_mem_mb=float(mem),
        mem_mb=qos.mem_mb,
        colocated_with=(partner.job_id,),
        sub_batch=sub_batch,
    )


def find_for(state: ClusterState, job: Job, *, locality: Locality = "consolidated", fit: Fit = "best-fit") -> Placement | None:
    """Exclusive placement of any kind of job: CPU-only, fractional share or whole GPUs."""
    q = job.qos
    if q.gpus == 0:
        return find_cpu_only(state, job, fit)
    if q.fractional:
        return find_share(state, job, fit=fit)
    return find_whole(state, job, locality=locality, fit=fit)
