"""SJF-FFS: shortest job first with first-fit sharing (the SJF-BSBF paper's sharing baseline).

Jobs go in SJF order; each gets free GPUs if there are any, otherwise it joins the first running
job (same GPU count, alone on its GPUs, memory fits) -- without asking whether sharing pays.
"""

from __future__ import annotations

from qosflow.core.placement import Placement
from qosflow.policies import register
from qosflow.core.job import JobState
from qosflow.policies.base import Decision, Policy, SchedulerView
from qosflow.policies.common import ExclusiveSearch, place_in_order, sjf_order, states_of
from qosflow.policies.placement import Locality, find_colocation
from qosflow.policies.sharing import PartnerIndex, memory_plan


@register
class SjfFfsPolicy(Policy):
    name = "sjf-ffs"
    description = "SJF with first-fit GPU sharing (no benefit test)"

    def __init__(self, locality: Locality = "consolidated", sub_batch: bool = False):
        self.locality = locality
        self.sub_batch = sub_batch

    def schedule(self, view: SchedulerView) -> Decision:
        est = view.estimator
        states = states_of(view)
        order = sjf_order(view)

        index = PartnerIndex(view.cluster, states, est.remaining)
        exclusive = ExclusiveSearch(locality=self.locality)

        def finder(st, js) -> Placement | None:
            p = exclusive(st, js.job)
            if p is not None:
                index_add(js, p)
                return p
            for partner in index.heads(js.job):
                plan = memory_plan(js.job, float(st.gmem_free[st.allocs[partner.job_id].gpus[0]]), allow_sub_batch=self.sub_batch)
                if plan is None:
                    continue
                mem, sb = plan
                p = find_colocation(st, js.job, partner.job, sub_batch=sb, gpu_mem_mb=mem)
                if p is not None:
                    return p
            return None

        pending_new: list[tuple[JobState, Placement]] = []

        def index_add(js, p):
            pending_new.append((js, p))

        def finder_and_index(st, js):
            # a job started this round becomes a partner once it is allocated on the snapshot
            while pending_new:
                njs, _ = pending_new.pop()
                index.add(njs)
            return finder(st, js)

        return place_in_order(view, order, finder=finder_and_index)
