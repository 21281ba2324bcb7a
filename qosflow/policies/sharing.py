"""GPU sharing between two whole-GPU training jobs (SJF-BSBF, arXiv 2407.13088).

* `bsbf_times` -- the paper's benefit test: the pair's average completion time when sharing now
  versus running one after the other;
* `memory_plan` -- fit a job next to a partner, if need be with a smaller sub-batch and gradient
  accumulation (same global batch, so the same convergence);
* `partners_for` -- running jobs a pending job could join (same GPU count, alone on their GPUs);
* `SjfSharingPolicy` -- the round SJF-BSBF and SJF-FFS share: SJF order, free GPUs first, else a
  partner chosen by the policy's `share`.
"""

from __future__ import annotations

from typing import Iterable

from qosflow.core.cluster import ClusterState
from qosflow.core.estimate import Estimator
from qosflow.core.job import Job, JobState
from qosflow.core.placement import Placement, SubBatchPlan
from qosflow.policies.base import Decision, Policy, SchedulerView, check_choice, check_flag
from qosflow.policies.common import ExclusiveSearch, place_in_order, sjf_order, states_of
from qosflow.policies.placement import LOCALITIES, Locality

#: share of a job's GPU memory that does not shrink with the batch (weights, optimizer state,
#: workspace); the rest scales with the (sub-)batch. An assumption, documented in docs/policies.md.
FIXED_MEMORY_SHARE = 0.35
#: largest gradient-accumulation factor tried
MAX_ACCUMULATION = 8


def bsbf_times(t_a: float, t_b: float, xi_a: float, xi_b: float) -> tuple[float, float]:
    """(t_con, t_seq) for pending job a joining running job b.

    T_a, T_b are solo remaining times, xi >= 1 the slowdowns when sharing. A_hat = xi_a T_a,
    B_hat = xi_b T_b. Sharing now: if A_hat >= B_hat (b ends first) t_con = T_a/2 + (1 - 1/(2 xi_a)) B_hat,
    else t_con = T_b/2 + (1 - 1/(2 xi_b)) A_hat. Sequential (a waits for b): t_seq = T_b + T_a/2.
    Both are the pair's average completion time from now. Share iff t_con < t_seq.
    """
    xi_a, xi_b = max(1.0, xi_a), max(1.0, xi_b)
    a_hat, b_hat = xi_a * t_a, xi_b * t_b
    if a_hat >= b_hat:
        t_con = t_a / 2.0 + (1.0 - 1.0 / (2.0 * xi_a)) * b_hat
    else:
        t_con = t_b / 2.0 + (1.0 - 1.0 / (2.0 * xi_b)) * a_hat
    t_seq = t_b + t_a / 2.0
    return t_con, t_seq


def memory_plan(job: Job, free_mem: float, *, allow_sub_batch: bool = True) -> tuple[float, SubBatchPlan | None] | None:
    """GPU memory the job would use next to a partner, and the sub-batch plan that makes it fit.

    None if it cannot fit even with the smallest sub-batch tried."""
    mem = job.qos.gpu_mem_mb
    if mem is None:
        return None
    if mem <= free_mem + 1e-6:
        return mem, None
    if not allow_sub_batch or not job.batch_size:
        return None
    fixed = FIXED_MEMORY_SHARE * mem
    acc = 2
    while acc <= MAX_ACCUMULATION and job.batch_size % acc == 0:
        need = fixed + (mem - fixed) / acc
        if need <= free_mem + 1e-6:
            return need, SubBatchPlan.split(job.batch_size, acc)
        acc *= 2
    return None


class PartnerIndex:
    """Running jobs that a pending job could join, grouped so a round stays fast at scale.

    Groups are keyed by (GPU count, model, the partner's GPU memory, the GPU's memory, GPU model);
    inside a group, candidates are kept by estimated remaining time, longest first. For the BSBF
    benefit `t_seq - t_con` is continuous and piecewise linear in the partner's remaining time T_b,
    increasing once the partner outlasts the newcomer (slope 1/2) and linear through 0 before that,
    so its positive maximum over a group lies at the group's longest job: only group heads need
    evaluating. Entries that stopped being shareable this round are dropped lazily.
    """

    def __init__(self, st: ClusterState, states: dict[str, JobState], remaining):
        import heapq

        self._heapq = heapq
        self.st = st
        self.states = states
        self.remaining = remaining
        self.groups: dict[tuple, list] = {}
        self._seq = 0
        for jid in st.allocs:
            js = states.get(jid)
            if js is not None:
                self.add(js)

    def _key(self, js: JobState):
        p = self.st.allocs.get(js.job_id)
        if p is None or p.gpu_milli < 1000 or not p.gpus or p.colocated_with:
            return None, None
        if not js.job.qos.shareable or js.job.qos.gpu_mem_mb is None:
            return None, None
        n, g = p.gpus[0]
        return (len(p.gpus), js.job.model, js.job.qos.gpu_mem_mb, float(self.st.gmem_cap[n]), self.st.spec.nodes[n].gpu_model), p

    def add(self, js: JobState) -> None:
        key, p = self._key(js)
        if key is None:
            return
        self._seq += 1
        self._heapq.heappush(self.groups.setdefault(key, []), (-self.remaining(js), self._seq, js.job_id))

    def _alive(self, jid: str, ngpus: int) -> bool:
        p = self.st.allocs.get(jid)
        if p is None or len(p.gpus) != ngpus:
            return False
        for n, g in p.gpus:
            if self.st.njobs[n, g] != 1 or not self.st.share_ok[n, g]:
                return False
        return True

    def heads(self, job: Job) -> list[JobState]:
        """The longest-running shareable candidate of every group with `job`'s GPU count."""
        q = job.qos
        if not q.shareable or q.fractional or q.gpus == 0:
            return []
        out = []
        for key in sorted(k for k in self.groups if k[0] == q.gpus):
            h = self.groups[key]
            while h and not self._alive(h[0][2], q.gpus):
                self._heapq.heappop(h)
            if h:
                out.append(self.states[h[0][2]])
        return out


def partners_for(st: ClusterState, job: Job, states: dict[str, JobState]) -> Iterable[JobState]:
    """Jobs on the snapshot that `job` could share GPUs with: same GPU count, alone and shareable."""
    if not job.qos.shareable or job.qos.fractional or job.qos.gpus == 0:
        return
    for jid, p in st.allocs.items():
        if len(p.gpus) != job.qos.gpus or p.gpu_milli < 1000 or p.colocated_with:
            continue
        n, g = p.gpus[0]
        if not st.share_ok[n, g] or st.njobs[n, g] != 1:
            continue
        other = states.get(jid)
        if other is not None:
            yield other


class SjfSharingPolicy(Policy):
    """Jobs in SJF order; a job takes free GPUs if there are any, otherwise `share` may place it next
    to one of the running jobs it could join (`PartnerIndex.heads`). Jobs started earlier in the
    round become partners too. Non-preemptive."""

    def __init__(self, locality: Locality, sub_batch: bool):
        check_choice(self.name, "locality", locality, LOCALITIES)
        check_flag(self.name, "sub_batch", sub_batch)
        self.locality = locality
        self.sub_batch = sub_batch

    def share(
        self, st: ClusterState, js: JobState, partners: list[JobState], est: Estimator, notes: dict[str, str]
    ) -> Placement | None:
        """Where `js` runs next to one of `partners` (None: it waits); may explain in `notes`."""
        raise NotImplementedError

    def schedule(self, view: SchedulerView) -> Decision:
        est = view.estimator
        states = states_of(view)
        order = sjf_order(view)
        notes: dict[str, str] = {}
        index = PartnerIndex(view.cluster, states, est.remaining)
        started: list[JobState] = []
        exclusive = ExclusiveSearch(locality=self.locality)

        def finder(st, js) -> Placement | None:
            while started:  # jobs started earlier this round are allocated by now: partners too
                index.add(started.pop())
            p = exclusive(st, js.job)
            if p is not None:
                started.append(js)
                return p
            return self.share(st, js, index.heads(js.job), est, notes)

        d = place_in_order(view, order, finder=finder)
        d.notes.update(notes)
        return d
