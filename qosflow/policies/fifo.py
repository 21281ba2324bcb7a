"""FIFO: jobs start in submission order; the head of the queue blocks the rest (no backfill).

The classic YARN/Slurm default the Philly study describes; placement is consolidated
(Philly's locality constraint).
"""

from __future__ import annotations

from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView, check_choice, check_flag
from qosflow.policies.common import place_in_order
from qosflow.policies.placement import LOCALITIES, Locality


@register
class FifoPolicy(Policy):
    name = "fifo"
    description = "first in, first out; strict (the head of the queue blocks)"

    def __init__(self, backfill: bool = False, locality: Locality = "consolidated"):
        check_flag(self.name, "backfill", backfill)
        check_choice(self.name, "locality", locality, LOCALITIES)
        self.backfill = backfill
        self.locality = locality

    def options(self):
        return {"backfill": self.backfill, "locality": self.locality}

    def schedule(self, view: SchedulerView) -> Decision:
        order = sorted(view.pending, key=lambda js: js.job.submit_time)  # stable: arrival order
        return place_in_order(view, order, locality=self.locality, blocking=not self.backfill)
