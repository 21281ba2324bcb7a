"""The qosflow (or FGD) fractional-GPU scorer for the time-based scheduler.

`qosflow.policies.placement.find_share(state, job, scorer=...)` asks a scorer to rank the GPUs
where a fractional request (``job.qos.gpu_milli`` < 1000) fits:

    scorer(state: ClusterState, job: Job, cand_nodes: np.ndarray, cand_gpus: np.ndarray) -> scores

lower is better; `find_share` takes the first minimum (candidates come node by node, GPU by GPU,
so ties go to the lowest node index, then GPU index -- FGD's tie rule with the node list as the
node order). This module adapts the packer of `qosflow.packing.qosflow_pack` to that signature:

    wl = workload_from_jobs(jobs)                 # the expected workload, from recent/queued jobs
    scorer = fractional_scorer(wl)                # qosflow's measure (fractional_scorer(wl, "fgd"): FGD's)
    scorer.set_departures(now, {job_id: expected_end})   # optional: running jobs that end soon
    placement = find_share(state, job, scorer=scorer)
    scorer.last_reason                            # why the last call ranked its best candidate first

The score is the packer's integer score (``int(sigmoid(-Delta/1000) * 100)``, higher is better)
negated. The scorer keeps per-node results between calls and recomputes only the nodes whose
free CPU, memory or GPU milli changed (compared by value, so snapshots of the state work).
Mapping from `ClusterState`: free cores x 1000 -> milli-CPU, ``mem_free`` (MB) as MiB, a GPU
holding a whole-GPU job has 0 milli free, nodes that are down have nothing free, a node's GPU
model is ``NodeSpec.gpu_model`` (a job's ``qos.gpu_model`` becomes the type's accepted model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from qosflow.errors import SpecError
from qosflow.packing.fgd import FragModel, fgd_score
from qosflow.packing.model import MILLI, Pod
from qosflow.packing.qosflow_pack import LAMBDA_STEP, CapacityModel
from qosflow.packing.workload import DEFAULT_POPULARITY, WorkloadDistribution

if TYPE_CHECKING:  # pragma: no cover
    from qosflow.core.cluster import ClusterState
    from qosflow.core.job import Job


def job_request(job: "Job") -> Pod:
    """A job's request as a packing `Pod` (cores -> milli-CPU, MB -> MiB, model -> gpu_spec)."""
    q = job.qos
    gpus = int(q.gpus)
    return Pod(
        job.job_id,
        int(round(q.cpu_cores * 1000)),
        int(round(q.mem_mb)),
        gpus,
        int(q.gpu_milli) if gpus else 0,
        (q.gpu_model,) if (q.gpu_model and gpus) else (),
    )


def workload_from_jobs(jobs: Iterable["Job"], popularity: float = DEFAULT_POPULARITY) -> WorkloadDistribution:
    """The expected workload (FGD's target workload) from a list of jobs, e.g. recent submissions.

    Types = (CPU, GPU count, milli per GPU, accepted model), counted over the jobs, the most
    frequent kept until they cover ``popularity`` of them; memory = the median per type.
    """
    pods = [job_request(j) for j in jobs]
    if not pods:
        raise SpecError("jobs", "need at least one job to derive the expected workload from")
    return WorkloadDistribution.from_pods(pods, popularity)


class FractionalScorer:
    """Callable scorer for `find_share` (see the module docstring). ``measure``: "qosflow" or "fgd"."""

    def __init__(
        self,
        workload: WorkloadDistribution,
        measure: str = "qosflow",
        *,
        memory: bool = True,
        balance: bool = True,
        scarcity: bool = True,
    ):
        if measure not in ("qosflow", "fgd"):
            raise SpecError("measure", f"must be 'qosflow' or 'fgd', got {measure!r}")
        self.workload = workload
        self.measure = measure
        self.opts = dict(memory=memory, balance=balance, scarcity=scarcity)
        self._spec_id: int | None = None
        self.now: float | None = None
        self.ends: Mapping[str, float] = {}
        self.horizon: float | None = None
        #: one line: why the best candidate of the last call won
        self.last_reason = ""

    # -- departures -------------------------------------------------------------------------------
    def set_departures(self, now: float, ends: Mapping[str, float] | None, horizon: float | None = None) -> None:
        """Running jobs' expected end times (job id -> time); resources of jobs ending within
        ``horizon`` (default: the median remaining time) count as partly free. ``None`` clears."""
        if horizon is not None and not horizon > 0:
            raise SpecError("horizon", f"must be > 0 seconds, got {horizon}")
        self.now, self.ends, self.horizon = float(now), dict(ends or {}), horizon

    # -- state conversion -------------------------------------------------------------------------
    def _setup(self, state: "ClusterState") -> None:
        spec = state.spec
        models = [n.gpu_model for n in spec.nodes]
        self.models = tuple(sorted(set(models)))
        index = {m: i for i, m in enumerate(self.models)}
        self.model_idx = np.array([index[m] for m in models], dtype=np.int64)
        n, g = state.exists.shape
        if self.measure == "qosflow":
            self.cap = CapacityModel(self.workload, self.models, **{k: v for k, v in self.opts.items() if k != "scarcity"})
            self.acc = self.cap.access[self.model_idx]
            t = len(self.cap)
            self._cnt = np.zeros((n, t), dtype=np.int64)
            self._above = np.zeros((n, t))
            self._usable = np.zeros((n, t))
        else:
            self.fm = FragModel(self.workload, self.models)
            self.acc = self.fm.access[self.model_idx]
            t = len(self.fm.prob)
            self._cnt = np.zeros((n, t), dtype=np.int64)
            self._above = np.zeros((n, t), dtype=np.int64)  # FGD: milli on GPUs below each type
            self._frag = np.zeros(n, dtype=np.int64)
        self._total = np.zeros(n)
        self._strand = np.zeros(n)
        self._last = None  # (cpu, mem, gpu) the per-node arrays were computed for
        self._spec_id = id(spec)

    def _effective(self, state: "ClusterState") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        up = ~state.down
        cpu = np.where(up, state.cpu_free * 1000.0, 0.0)
        mem = np.where(up, state.mem_free, 0.0)
        gpu = np.where(state.exists & up[:, None], state.milli_free, 0).astype(np.float64)
        if self.measure != "qosflow" or self.now is None or not self.ends:
            return cpu, mem, gpu
        items = [(jid, p, self.ends[jid]) for jid, p in state.allocs.items() if jid in self.ends]
        if not items:
            return cpu, mem, gpu
        left = np.maximum(0.0, np.array([e for _, _, e in items]) - self.now)
        h = self.horizon if self.horizon is not None else float(np.median(left))
        lam = (left <= 0).astype(float) if h <= 0 else np.clip(1.0 - left / h, 0.0, 1.0)
        lam = np.round(lam / LAMBDA_STEP) * LAMBDA_STEP
        cpu, mem, gpu = cpu.copy(), mem.copy(), gpu.copy()
        for (jid, p, _), lm in zip(items, lam):
            if lm <= 0:
                continue
            for node, c in p.cpu:
                if up[node]:
                    cpu[node] += lm * c * 1000.0
            if p.mem_mb:
                for node in p.nodes:
                    if up[node]:
                        mem[node] += lm * p.mem_mb / len(p.nodes)
            for node, gi in p.gpus:
                if up[node] and (p.gpu_milli < MILLI or state.njobs[node, gi] == 1):
                    gpu[node, gi] = min(float(MILLI), gpu[node, gi] + lm * min(p.gpu_milli, MILLI))
        return cpu, mem, gpu

    def _refresh(self, state: "ClusterState") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._spec_id != id(state.spec):
            self._setup(state)
        cpu, mem, gpu = self._effective(state)
        if self._last is None:
            rows = np.arange(len(cpu))
        else:
            lc, lm, lg = self._last
            rows = np.flatnonzero((lc != cpu) | (lm != mem) | (lg != gpu).any(axis=1))
        if rows.size:
            if self.measure == "qosflow":
                cap = self.cap
                cnt, above, total = cap.stats(gpu[rows])
                self._cnt[rows], self._above[rows], self._total[rows] = cnt, above, total
                self._usable[rows] = cap.usable(cnt, above, cpu[rows], mem[rows], self.acc[rows])
                self._strand[rows] = cap.stranded(total, cpu[rows], mem[rows])
            else:
                fm = self.fm
                cnt, below, sumg = fm.stats(gpu[rows].astype(np.int64))
                self._cnt[rows], self._above[rows], self._total[rows] = cnt, below, sumg
                self._frag[rows] = fm.frag(cnt, below, sumg, cpu[rows].astype(np.int64), self.acc[rows])
        self._last = (cpu, mem, gpu)
        return cpu, mem, gpu

    # -- the scorer -------------------------------------------------------------------------------
    def scores(self, state: "ClusterState", job: "Job", cand_nodes: np.ndarray, cand_gpus: np.ndarray) -> np.ndarray:
        """Integer score per candidate (higher is better), the packer's."""
        q = job.qos
        if not q.fractional:
            raise SpecError("job", f"{job.job_id} is not a fractional-GPU request (gpus=1, gpu_milli<1000)")
        nodes = np.asarray(cand_nodes, dtype=np.int64)
        gpus = np.asarray(cand_gpus, dtype=np.int64)
        cpu, mem, gpu = self._refresh(state)
        if nodes.size == 0:
            return np.zeros(0, dtype=np.int64)
        milli = int(q.gpu_milli)
        creq, mreq = q.cpu_cores * 1000.0, float(q.mem_mb)
        v = gpu[nodes, gpus][:, None]
        if self.measure == "fgd":
            fm = self.fm
            s = fm.scale
            after = fm.frag_after_share(
                self._cnt[nodes], self._above[nodes], self._total[nodes].astype(np.int64), v.astype(np.int64),
                (cpu[nodes] - creq).astype(np.int64), self.acc[nodes], 0, milli,
            )[:, 0]
            return fgd_score(after - self._frag[nodes], s)
        cap = self.cap
        u2, s2 = cap.after_share(
            self._cnt[nodes], self._above[nodes], self._total[nodes], v, cpu[nodes] - creq, mem[nodes] - mreq,
            self.acc[nodes], milli,
        )
        # the packer's arithmetic, step for step (whole milli, stranding as one more column)
        loss = np.rint(np.concatenate([self._usable[nodes] - u2[:, 0, :], (s2[:, 0] - self._strand[nodes])[:, None]], axis=1))
        lost, dstrand = loss[:, :-1], loss[:, -1]
        w = cap.prob_t.copy()
        if self.opts["scarcity"]:
            w *= float(self._total.sum()) / np.maximum(self._usable.sum(axis=0), MILLI)
        tw = float(w.sum()) + cap.cpu_prob
        cost = loss @ np.append(w, 1.0 if cap.balance else 0.0)
        delta = np.round((cost - milli * tw) / tw, 6)
        sc = fgd_score(delta)
        if sc.size:
            i = int(np.argmax(sc))
            top = np.argsort(-(lost[i] * w))[:2]
            self.last_reason = (
                f"{job.job_id} -> node {nodes[i]} GPU {gpus[i]}: score {sc[i]} (fragmentation +{delta[i]:.0f} milli-GPU; "
                f"costs most to {', '.join(cap.labels[t] for t in top if lost[i, t] > 0) or 'no type'}"
                f"{f'; stranded {dstrand[i]:+.0f} milli' if abs(dstrand[i]) >= 1 else ''}); best of {nodes.size} GPUs"
            )
        return sc

    def __call__(self, state: "ClusterState", job: "Job", cand_nodes: np.ndarray, cand_gpus: np.ndarray) -> np.ndarray:
        return -self.scores(state, job, cand_nodes, cand_gpus).astype(np.float64)


def fractional_scorer(workload: WorkloadDistribution, measure: str = "qosflow", **opts) -> FractionalScorer:
    """A `find_share` scorer using the qosflow packer's measure (or ``measure="fgd"``: FGD's)."""
    return FractionalScorer(workload, measure, **opts)
