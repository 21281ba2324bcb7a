"""SJF-FFS: shortest job first with first-fit sharing (the SJF-BSBF paper's sharing baseline).

Jobs go in SJF order; each gets free GPUs if there are any, otherwise it joins the first running
job (same GPU count, alone on its GPUs, memory fits) -- without asking whether sharing pays.
"""

from __future__ import annotations

from qosflow.core.placement import Placement
from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView
from qosflow.policies.common import place_in_order
from qosflow.policies.placement import find_colocation, find_for
from qosflow.policies.sharing import memory_plan, partners_for


@register
class SjfFfsPolicy(Policy):
    name = "sjf-ffs"
    description = "SJF with first-fit GPU sharing (no benefit test)"

    def __init__(self, locality: str = "consolidated", sub_batch: bool = False):
        self.locality = locality
        self.sub_batch = sub_batch

    def schedule(self, view: SchedulerView) -> Decision:
        est = view.estimator
        states = {js.job_id: js for js in view.running}
        states.update({js.job_id: js for js in view.pending})
        order = sorted(view.pending, key=lambda js: (est.remaining(js), js.job.submit_time))

        def finder(st, js) -> Placement | None:
            p = find_for(st, js.job, locality=self.locality)
            if p is not None:
                return p
            for partner in partners_for(st, js.job, states):
                plan = memory_plan(js.job, float(st.gmem_free[partner.placement.gpus[0]] if partner.placement else st.gmem_free[st.allocs[partner.job_id].gpus[0]]), allow_sub_batch=self.sub_batch)
                if plan is None:
                    continue
                mem, sb = plan
                p = find_colocation(st, js.job, partner.job, sub_batch=sb, gpu_mem_mb=mem)
                if p is not None:
                    return p
            return None

        return place_in_order(view, order, finder=finder)
