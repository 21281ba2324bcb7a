"""SJF-BSBF: shortest job first with best sharing benefit first (arXiv 2407.13088).

Jobs go in SJF order. A job takes free GPUs if there are any. Otherwise it may join a running job
(same GPU count, alone on its GPUs) -- but only the partner whose sharing benefit is largest, and
only if sharing improves the pair's average completion time (`bsbf_times`: t_con < t_seq). When
the pair's memory does not fit, the newcomer runs with a smaller sub-batch and gradient
accumulation (same global batch). Non-preemptive.
"""

from __future__ import annotations

from qosflow.core.placement import Placement
from qosflow.policies import register
from qosflow.policies.placement import Locality, find_colocation
from qosflow.policies.sharing import SjfSharingPolicy, bsbf_times, memory_plan


@register
class SjfBsbfPolicy(SjfSharingPolicy):
    name = "sjf-bsbf"
    description = "SJF with best-sharing-benefit-first GPU sharing and sub-batching"

    def __init__(self, locality: Locality = "consolidated", sub_batch: bool = True):
        super().__init__(locality, sub_batch)

    def share(self, st, js, partners, est, notes) -> Placement | None:
        t_a = est.remaining(js)
        best = None
        for partner in partners:
            pp = st.allocs[partner.job_id]
            plan = memory_plan(js.job, float(st.gmem_free[pp.gpus[0]]), allow_sub_batch=self.sub_batch)
            if plan is None:
                continue
            xi_a, xi_b = est.pair_slowdown(js.job, partner.job)
            t_con, t_seq = bsbf_times(t_a, est.remaining(partner), xi_a, xi_b)
            gain = t_seq - t_con
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, partner, plan, xi_a, xi_b)
        if best is None:
            return None
        gain, partner, (mem, sb), xi_a, xi_b = best
        p = find_colocation(st, js.job, partner.job, sub_batch=sb, gpu_mem_mb=mem)
        if p is not None:
            notes[js.job_id] = (
                f"sharing with {partner.job_id}: slowdowns {xi_a:.2f}/{xi_b:.2f}, pair's average JCT "
                f"{gain:.0f}s better than waiting" + (f"; sub-batch {sb.sub_batch}x{sb.accumulation_steps}" if sb else "")
            )
        return p
