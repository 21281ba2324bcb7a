"""SRTF: shortest remaining (estimated) time first, preemptive.

As in Muri's and Tiresias' simulators ("shortest"): at every event all runnable jobs are ranked
by remaining time and the cluster is given to them in that order; running jobs that fall out of
the set are checkpointed and preempted. Placement is consolidated (YARN-style). Unlike those
simulators we do not migrate running jobs between GPUs for free, and each restart pays the
simulator's restart overhead.
"""

from __future__ import annotations

from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView, check_choice
from qosflow.policies.common import preempt_and_place
from qosflow.policies.placement import LOCALITIES, Locality


@register
class SrtfPolicy(Policy):
    name = "srtf"
    preemptive = True
    description = "shortest remaining time first (preemptive)"

    def __init__(self, locality: Locality = "consolidated"):
        check_choice(self.name, "locality", locality, LOCALITIES)
        self.locality = locality

    def schedule(self, view: SchedulerView) -> Decision:
        est = view.estimator
        jobs = list(view.running) + list(view.pending)
        # running jobs first among equals, so ties do not thrash
        jobs.sort(key=lambda js: (est.remaining(js), not js.running, js.job.submit_time))
        return preempt_and_place(view, jobs, locality=self.locality)
