"""The qosflow (or FGD) fractional-GPU scorer for the time-based scheduler.

`qosflow.policies.placement.find_share(state, job, scorer=...)` asks a scorer to rank the GPUs
where a fractional request (``job.qos.gpu_milli`` < 1000) fits:

    scorer(state: ClusterState, job: Job, cand_nodes: np.ndarray, cand_gpus: np.ndarray) -> scores

lower is better; `find_share` takes the first minimum (candidates come node by node, GPU by GPU,
so ties go to the lowest node index, then GPU index -- FGD's tie rule with the node list as the
node order). This module runs the packing policies themselves behind that signature:

    wl = workload_from_jobs(jobs)                 # the expected workload, from recent/queued jobs
    scorer = fractional_scorer(wl)                # qosflow's packer (fractional_scorer(wl, "fgd"): FGD)
    scorer.set_departures(now, {job_id: expected_end})   # optional: running jobs that end soon
    placement = find_share(state, job, scorer=scorer)
    scorer.last_reason                            # one line: why the winner won
    scorer.explain(state, job)                    # the packer's full explanation

Score per candidate: minus the packer's integer score of its node (``int(sigmoid(-Delta/1000) *
100)``) for the GPU the packer picks on that node, half a point worse for the node's other GPUs
(so `find_share` picks exactly what the packer would). The scorer mirrors the `ClusterState` in a
`PackState` it keeps -- free cores x 1000 -> milli-CPU, ``mem_free`` (MB) as MiB, ``milli_free``
per GPU (0 on GPUs with whole-GPU jobs), nothing on nodes that are down, the node's
``gpu_model`` -- and updates only the nodes whose free resources changed (compared by value, so
snapshots work), so the packer's per-node caches stay valid between calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from qosflow.errors import SpecError
from qosflow.packing.model import MILLI, Node, PackState, Pod
from qosflow.packing.policies import PackingPolicy, make_policy
from qosflow.packing.qosflow_pack import LAMBDA_STEP, QosflowPacker
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
        (q.gpu_models or ()) if gpus else (),
    )


def workload_from_jobs(jobs: Iterable["Job"], popularity: float = DEFAULT_POPULARITY) -> WorkloadDistribution:
    """The expected workload (FGD's target workload) from a list of jobs, e.g. recent submissions.

    Types = (CPU, GPU count, milli per GPU, accepted model), counted over the jobs, the most
    frequent kept until they cover ``popularity`` of them (FGD's 95 %); memory = the median per type.
    """
    pods = [job_request(j) for j in jobs]
    if not pods:
        raise SpecError("jobs", "need at least one job to derive the expected workload from")
    return WorkloadDistribution.from_pods(pods, popularity)


class _Bonus:
    """Stands in for the packer's departure tracker: resources the scorer computed as freeing soon."""

    def __init__(self, cpu: np.ndarray, mem: np.ndarray, gpu: np.ndarray):
        self.arrays = (cpu, mem, gpu)

    def bonus(self, n: int, max_gpus: int):
        return self.arrays


class FractionalScorer:
    """Callable scorer for `find_share` (see the module docstring). ``measure``: "qosflow" or "fgd"."""

    def __init__(self, workload: WorkloadDistribution, measure: str = "qosflow", **opts):
        if measure not in ("qosflow", "fgd"):
            raise SpecError("measure", f"must be 'qosflow' or 'fgd', got {measure!r}")
        if opts and measure != "qosflow":
            raise SpecError("measure", f"options {sorted(opts)} only apply to the qosflow measure")
        self.workload = workload
        self.measure = measure
        self.opts = opts
        self._spec_id: int | None = None
        self.now: float | None = None
        self.ends: Mapping[str, float] = {}
        self.horizon: float | None = None
        #: one line: why the best candidate of the last call won
        self.last_reason = ""

    # -- departures -------------------------------------------------------------------------------
    def set_departures(self, now: float, ends: Mapping[str, float] | None, horizon: float | None = None) -> None:
        """Running jobs' expected end times (job id -> time): their resources count as partly free,
        fully when ending now, not at all when ending ``horizon`` or later (default: a tenth of the
        median remaining time of the jobs given). ``None`` clears."""
        if horizon is not None and not horizon > 0:
            raise SpecError("horizon", f"must be > 0 seconds, got {horizon}")
        self.now, self.ends, self.horizon = float(now), dict(ends or {}), horizon

    # -- the mirror PackState ---------------------------------------------------------------------
    def _setup(self, state: "ClusterState") -> None:
        nodes = [Node(s.name, int(round(s.cpu_cores * 1000)), int(round(s.mem_mb)), s.gpus, s.gpu_model) for s in state.spec.nodes]
        self.view = PackState(nodes)
        self.policy: PackingPolicy = QosflowPacker(**self.opts) if self.measure == "qosflow" else make_policy("fgd")
        self.policy.prepare(self.view, self.workload)
        self._spec_id = id(state.spec)

    def _sync(self, state: "ClusterState") -> None:
        if self._spec_id != id(state.spec):
            self._setup(state)
        v = self.view
        up = ~state.down
        cpu = np.where(up, np.rint(state.cpu_free * 1000.0), 0).astype(np.int64)
        mem = np.where(up, np.rint(state.mem_free), 0).astype(np.int64)
        gpu = np.where(state.exists & up[:, None], state.milli_free, 0).astype(np.int64)
        changed = (cpu != v.cpu_left) | (mem != v.mem_left) | (gpu != v.gpu_left).any(axis=1)
        if changed.any():
            v.cpu_left[changed], v.mem_left[changed], v.gpu_left[changed] = cpu[changed], mem[changed], gpu[changed]
            v.gpu_left_total[changed] = gpu[changed].sum(axis=1)
            v.version[changed] += 1
        if isinstance(self.policy, QosflowPacker):
            # always a tracker (zeros without departures), so clearing departures refreshes the nodes
            dep = self._departures(state) if (self.now is not None and self.ends) else None
            n, g = state.exists.shape
            self.policy._dep = dep or _Bonus(np.zeros(n), np.zeros(n), np.zeros((n, g)))

    def _departures(self, state: "ClusterState") -> _Bonus | None:
        items = [(p, self.ends[jid]) for jid, p in state.allocs.items() if jid in self.ends]
        if not items:
            return None
        n, g = state.exists.shape
        cpu, mem, gpu = np.zeros(n), np.zeros(n), np.zeros((n, g))
        left = np.maximum(0.0, np.array([e for _, e in items]) - self.now)
        h = self.horizon if self.horizon is not None else 0.1 * float(np.median(left))
        lam = (left <= 0).astype(float) if h <= 0 else np.clip(1.0 - left / h, 0.0, 1.0)
        lam = np.round(lam / LAMBDA_STEP) * LAMBDA_STEP
        for (p, _), lm in zip(items, lam):
            if lm <= 0:
                continue
            for node, c in p.cpu:
                cpu[node] += lm * c * 1000.0
            if p.mem_mb:
                for node in p.nodes:
                    mem[node] += lm * p.mem_mb / len(p.nodes)
            for node, gi in p.gpus:
                if p.gpu_milli < MILLI or state.njobs[node, gi] == 1:
                    gpu[node, gi] += lm * min(p.gpu_milli, MILLI)
        up = ~state.down
        return _Bonus(cpu * up, mem * up, gpu * up[:, None])

    # -- the scorer -------------------------------------------------------------------------------
    def scores(self, state: "ClusterState", job: "Job", cand_nodes: np.ndarray, cand_gpus: np.ndarray) -> np.ndarray:
        """Per candidate: the packer's score of its node (higher is better), -0.5 for GPUs it would not pick."""
        if not job.qos.fractional:
            raise SpecError("job", f"{job.job_id} is not a fractional-GPU request (gpus=1, gpu_milli<1000)")
        nodes = np.asarray(cand_nodes, dtype=np.int64)
        gpus = np.asarray(cand_gpus, dtype=np.int64)
        self._sync(state)
        pod = job_request(job)
        if isinstance(self.policy, QosflowPacker):
            _, score, best, delta, _ = self.policy._scores(self.view, pod)
        else:
            score, best = self.policy.scores(self.view, pod)
            delta = None
        if nodes.size == 0:
            return np.zeros(0)
        out = score[nodes].astype(np.float64) - 0.5 * (best[nodes] != gpus)
        out = np.where(score[nodes] >= 0, out, -1.0)
        i = int(np.argmax(out))
        n = int(nodes[i])
        frag = f" (fragmentation {delta[n]:+.0f} milli-GPU)" if delta is not None else ""
        self.last_reason = (
            f"{job.job_id} -> {state.spec.nodes[n].name} GPU {gpus[i]}: score {score[n]}{frag}, "
            f"best of {np.unique(nodes).size} nodes with room ({self.measure})"
        )
        return out

    def __call__(self, state: "ClusterState", job: "Job", cand_nodes: np.ndarray, cand_gpus: np.ndarray) -> np.ndarray:
        return -self.scores(state, job, cand_nodes, cand_gpus)

    def explain(self, state: "ClusterState", job: "Job"):
        """The qosflow packer's `Explanation` for this job on this state (qosflow measure only)."""
        if self.measure != "qosflow":
            raise SpecError("measure", "explanations come from the qosflow packer (measure='qosflow')")
        self._sync(state)
        return self.policy.explain(self.view, job_request(job))


def fractional_scorer(workload: WorkloadDistribution, measure: str = "qosflow", **opts) -> FractionalScorer:
    """A `find_share` scorer running qosflow's packer (or ``measure="fgd"``: FGD).

    ``opts`` go to `QosflowPacker` (``memory``, ``balance``, ``scarcity``)."""
    return FractionalScorer(workload, measure, **opts)
