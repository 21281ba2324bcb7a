"""qosflow policy, step 3e: express nodes -- `express_share` of the nodes hold a standing reservation a
few minutes ahead while deadline jobs keep arriving, so a short gang with a tight deadline can start
at once without preemption."""

from __future__ import annotations

import math

import numpy as np

from qosflow.core.cluster import ClusterState
from qosflow.core.job import JobState
from qosflow.policies.base import SchedulerView

#: owner of an express node's standing reservation
EXPRESS = "<express>"


class _DeadlineArrivals:
    """When deadline jobs arrive: the latest submit time seen and the longest gap between two
    successive ones -- what decides whether the express lane is still needed (`express_release`).

    Updated from each round's snapshot (pending and running jobs: a restarted worker sees its
    running ones); a clock that goes back (the policy object reused for a new simulation) starts it
    afresh."""

    def __init__(self) -> None:
        self.last = -math.inf  # submit time of the latest deadline job seen
        self.gap = 0.0  # longest gap seen between two successive deadline-job arrivals
        self.now = -math.inf

    def update(self, view: SchedulerView) -> None:
        if view.now < self.now:
            self.__init__()
        self.now = view.now
        new = sorted(
            t for t in (js.job.submit_time for js in (*view.pending, *view.running) if js.job.deadline is not None) if t > self.last
        )
        for t in new:
            if self.last > -math.inf:
                self.gap = max(self.gap, t - self.last)
            self.last = t

    @property
    def seen(self) -> bool:
        return self.last > -math.inf


class ExpressLaneMixin:
    """Express nodes for `QosflowPolicy`. Reads the options `express_share`, `express_deadline_s`,
    `express_release`, the arrival history `_dl_arrivals` and the memo `_regular` (kept across rounds),
    and the round's `_express` (this round's express nodes), `_st`, `_rem`, `_now`."""

    def _express_nodes(self, st: ClusterState, view: SchedulerView) -> list[int]:
        """The nodes kept as express nodes this round: `express_share` of the nodes that are up
        (rounded down), the largest ones, last in the cluster's order first -- the same nodes every
        round while the cluster does not change. None while no job has a deadline: the lane exists
        for deadline jobs only."""
        if self.express_share <= 0 or not self._lane_open(view):
            return []
        up = np.flatnonzero(~st.down & (st.gpu_count > 0))
        n = int(self.express_share * len(up) + 1e-9)
        if n <= 0:
            return []
        order = sorted(up.tolist(), key=lambda i: (-int(st.gpu_count[i]), -i))
        return order[:n]

    def _lane_open(self, view: SchedulerView) -> bool:
        """Is the express lane needed now? Not before the first deadline job, and not once deadline
        jobs have stopped arriving: none for `express_deadline_s` and for `express_release` times the
        longest gap seen between two of them (on the Muri trace the arrivals end on day 125 of a
        schedule of 240-265 days; a lane kept after that only idles its nodes)."""
        arr = self._dl_arrivals
        arr.update(view)
        if not arr.seen:
            return False
        if self.express_release <= 0:
            return True
        return view.now - arr.last <= max(self.express_deadline_s, self.express_release * arr.gap)

    def _express_ok(self, js: JobState | None, finish: float) -> bool:
        """May `js`, finishing at `finish`, use an express node past its standing reservation? Only a
        job with a deadline it will meet, no longer than `express_deadline_s`, whose slack is shorter
        than the predicted wait for a regular node (it could not make it otherwise)."""
        if js is None:
            return False
        if self._needs_express(js):
            return True  # never hold a job back for good (the starving one waits for regular nodes)
        dl = js.job.deadline
        if dl is None or finish > dl or finish - self._now > self.express_deadline_s:
            return False
        return dl - finish < self._consolidated_wait(self._st, js, self._rem, exclude=self._express, all_nodes=True)

    def _needs_express(self, js: JobState) -> bool:
        """Can `js` never be placed on the regular (non-express) nodes, even all empty?"""
        key = tuple(self._express)
        if self._regular[0] != key:
            from qosflow.core.cluster import ClusterSpec

            express = set(key)
            nodes = [s for i, s in enumerate(self._st.spec.nodes) if i not in express]
            self._regular = (key, ClusterSpec(nodes, name="regular") if nodes else None, {})
        _, spec, memo = self._regular
        q = js.job.qos
        sig = (q.gpus, q.gpu_model, q.gpu_mem_mb, q.cpu_cores, q.mem_mb)
        if sig not in memo:
            memo[sig] = spec is None or spec.why_never_fits(q) is not None
        return memo[sig]
