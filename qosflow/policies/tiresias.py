"""Tiresias (NSDI'19): discretized two-dimensional least-attained-service (2D-LAS).

A job's priority is the GPU-time it has received (GPUs x time, the "2D" service). Queues are
separated by thresholds on that service: every job starts in the top queue and is demoted when
its attained GPU-time crosses the queue's threshold. Queues are served in order; inside a queue,
running jobs keep their place ahead of waiting ones and waiting ones go first-come-first-served
(as in the Tiresias and Muri simulators), which stops jobs of equal priority thrashing.
Preemptive, needing no knowledge of durations.

Defaults: two queues split at 3,250 GPU-seconds (the threshold the Tiresias/Muri simulators use
for their first queue); `thresholds=(3250, 7200)` gives Muri's three-queue setting. At least one
threshold is required: with none (one queue) nothing is ever preempted and the policy is
first-come-first-served with backfilling, which `fifo` with `backfill=True` is. Starvation
knob (Tiresias' PROMOTEKNOB): a waiting demoted job whose waiting time exceeds `promote_knob` times
its executed time returns to the top queue (0 disables it, as in Muri's runs).
Placement (Tiresias' profile-guided placement): consolidated where possible; a job whose model
is not sensitive to spreading (estimated spread slowdown <= `spread_tolerance`; Tiresias profiles
the skew of a model's tensors for this) may instead be spread over nodes at once, while sensitive
("skewed") models wait for a consolidated slot.
"""

from __future__ import annotations

import math

from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView, check_choice, check_number
from qosflow.policies.common import ExclusiveSearch, preempt_and_place
from qosflow.policies.placement import LOCALITIES as PLACEMENT_LOCALITIES, min_nodes_for

#: where a job's GPUs may be: `auto` is Tiresias' profile-guided placement (module docstring), the
#: others are `qosflow.policies.placement.Locality`'s
LOCALITIES = ("auto", *PLACEMENT_LOCALITIES)


@register
class TiresiasPolicy(Policy):
    name = "tiresias"
    preemptive = True
    description = "discretized 2D-LAS (Tiresias), preemptive, duration-agnostic"
    option_choices = {"locality": LOCALITIES}

    def __init__(
        self,
        thresholds: tuple[float, ...] = (3250.0,),
        promote_knob: float = 0.0,
        locality: str = "auto",
        spread_tolerance: float = 1.25,
    ):
        is_list = isinstance(thresholds, (list, tuple))
        if is_list and not thresholds:
            # (was accepted: one queue, where running jobs keep their place and waiting ones go in arrival
            # order -- no preemption and no least-attained-service left, first-come-first-served under
            # Tiresias' name, which is not what a Tiresias run is asked for)
            raise ValueError(
                "tiresias policy: thresholds must be at least one threshold (GPU-seconds at which a job moves "
                f"down a queue), e.g. [3250] (two queues) or [3250, 7200] (three), got {thresholds!r}: with none every job "
                "stays in one queue and Tiresias never preempts, i.e. first-come-first-served with backfilling; "
                "for that, run the fifo policy with --set fifo.backfill=true")
        numbers = is_list and all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf for t in thresholds)
        if not numbers or any(b <= a for a, b in zip(thresholds, thresholds[1:])):
            raise ValueError(
                "tiresias policy: thresholds must be " + ("" if is_list else "a list of ")
                + "increasing GPU-seconds > 0 at which a job moves down a queue, e.g. [3250] (two queues) or "
                f"[3250, 7200] (three), got {thresholds!r}")
        check_number("tiresias", "promote_knob", promote_knob, lambda v: 0 <= v < math.inf,
                     "a finite number >= 0 (times a job's executed time it may wait before it returns to the top queue; 0: never)")
        check_choice("tiresias", "locality", locality, LOCALITIES)
        check_number("tiresias", "spread_tolerance", spread_tolerance, lambda v: v >= 1,
                     ">= 1 (the largest slowdown a job may take from being spread over nodes, e.g. 1.25; 1: only when it costs nothing)")
        self.thresholds = tuple(float(t) for t in thresholds)
        self.promote_knob = promote_knob
        self.locality = locality
        self.spread_tolerance = spread_tolerance

    def options(self):
        return {"thresholds": self.thresholds, "promote_knob": self.promote_knob, "locality": self.locality,
                "spread_tolerance": self.spread_tolerance}

    def _finder(self, view: SchedulerView):
        est = view.estimator
        gpn = view.gpus_per_node

        consolidated, spread = ExclusiveSearch(locality="consolidated"), ExclusiveSearch(locality="spread")

        def finder(st, js):
            p = consolidated(st, js.job)
            if p is not None or js.job.qos.gpus <= 1:
                return p
            p = spread(st, js.job)
            if p is None:
                return None
            nodes = len({n for n, _ in p.gpus})
            if est.spread_slowdown(js.job, nodes, min_nodes_for(js.job.qos.gpus, gpn)) <= self.spread_tolerance:
                return p
            return None

        return finder

    def queue_of(self, js) -> int:
        q = js.tags.get("tiresias_q", 0)
        service = js.gpu_attained - js.tags.get("tiresias_reset", 0.0)
        while q < len(self.thresholds) and service >= self.thresholds[q] - 1e-9:
            q += 1
        if self.promote_knob > 0 and q > 0 and not js.running:
            executed = max(js.attained, 1e-9)
            waited = 0.0 if js.last_start is None else (js.queued_since and max(0.0, self._now - js.queued_since))
            if waited >= self.promote_knob * executed:
                js.tags["tiresias_reset"] = js.gpu_attained
                q = 0
        js.tags["tiresias_q"] = q
        return q

    def schedule(self, view: SchedulerView) -> Decision:
        self._now = view.now
        jobs = list(view.running) + list(view.pending)
        # within a queue: running first (by when they started), then waiting by arrival
        jobs.sort(
            key=lambda js: (
                self.queue_of(js),
                0 if js.running else 1,
                (js.last_start or 0.0) if js.running else js.job.submit_time,
            )
        )
        if self.locality == "auto":
            return preempt_and_place(view, jobs, finder=self._finder(view))
        return preempt_and_place(view, jobs, locality=self.locality)

    def next_wakeup(self, view: SchedulerView) -> float | None:
        """The next moment a running job crosses its queue threshold."""
        best = math.inf
        for js in view.running:
            q = js.tags.get("tiresias_q", 0)
            if q < len(self.thresholds):
                g = max(js.job.qos.gpu_demand, 1e-9)
                left = self.thresholds[q] - (js.gpu_attained - js.tags.get("tiresias_reset", 0.0))
                best = min(best, view.now + max(left, 0.0) / g)
        return None if best is math.inf else best
