"""SJF-FFS: shortest job first with first-fit sharing (the SJF-BSBF paper's sharing baseline).

Jobs go in SJF order; each gets free GPUs if there are any, otherwise it joins the first running
job (same GPU count, alone on its GPUs, memory fits) -- without asking whether sharing pays.
"""

from __future__ import annotations

from qosflow.core.placement import Placement
from qosflow.policies import register
from qosflow.policies.placement import Locality, find_colocation
from qosflow.policies.sharing import SjfSharingPolicy, memory_plan


@register
class SjfFfsPolicy(SjfSharingPolicy):
    name = "sjf-ffs"
    description = "SJF with first-fit GPU sharing (no benefit test)"

    def __init__(self, locality: Locality = "consolidated", sub_batch: bool = False):
        super().__init__(locality, sub_batch)

    def share(self, st, js, partners, est, notes) -> Placement | None:
        for partner in partners:
            plan = memory_plan(js.job, float(st.gmem_free[st.allocs[partner.job_id].gpus[0]]), allow_sub_batch=self.sub_batch)
            if plan is None:
                continue
            mem, sb = plan
            p = find_colocation(st, js.job, partner.job, sub_batch=sb, gpu_mem_mb=mem)
            if p is not None:
                return p
        return None
