"""SJF: shortest (estimated) job first, non-preemptive, backfilling whatever fits."""

from __future__ import annotations

from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView, check_choice
from qosflow.policies.common import place_in_order, sjf_order
from qosflow.policies.placement import LOCALITIES, Locality


@register
class SjfPolicy(Policy):
    name = "sjf"
    description = "shortest estimated job first (non-preemptive)"

    def __init__(self, locality: Locality = "consolidated"):
        check_choice(self.name, "locality", locality, LOCALITIES)
        self.locality = locality

    def schedule(self, view: SchedulerView) -> Decision:
        return place_in_order(view, sjf_order(view), locality=self.locality)
