"""GENIE-style QoS-aware scheduling (TPDS 2020).

GENIE predicts each job's processing rate under each candidate placement from lightweight
profiling, then serves jobs by the shortest *waiting allowance* first:

    allowance = deadline - now - predicted remaining time

(how long the job can still wait and meet its deadline). Jobs without a deadline come after all
jobs with one, first-come-first-served. For each job the placement with the highest predicted
rate is taken among those available now (consolidated, else spread, whichever runs faster).
Non-preemptive.
"""

from __future__ import annotations

import math

from qosflow.core.placement import Placement
from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView
from qosflow.policies.common import ExclusiveSearch, place_in_order
from qosflow.policies.placement import min_nodes_for


@register
class GeniePolicy(Policy):
    name = "genie"
    description = "shortest waiting allowance first, placement by predicted rate (GENIE)"

    def schedule(self, view: SchedulerView) -> Decision:
        est = view.estimator
        now = view.now
        gpn = view.gpus_per_node

        def allowance(js) -> float:
            dl = js.job.deadline
            if dl is None:
                return math.inf
            return dl - now - est.remaining(js)

        order = sorted(view.pending, key=lambda js: (allowance(js), js.job.submit_time))

        def predicted_rate(js, p: Placement) -> float:
            r = 1.0
            if js.job.qos.gpus > 1:
                nodes = len({n for n, _ in p.gpus})
                r /= est.spread_slowdown(js.job, nodes, min_nodes_for(js.job.qos.gpus, gpn))
            if p.cpu:
                r *= est.cpu_factor(js.job, p.cpu_cores)
            return r

        searches = {loc: ExclusiveSearch(locality=loc) for loc in ("consolidated", "spread")}

        def finder(st, js) -> Placement | None:
            cands = []
            for loc in ("consolidated", "spread"):
                p = searches[loc](st, js.job)
                if p is not None:
                    cands.append(p)
                    if loc == "consolidated":
                        break  # consolidated is never slower than spread
            if not cands:
                return None
            return max(cands, key=lambda p: predicted_rate(js, p))

        return place_in_order(view, order, finder=finder)
