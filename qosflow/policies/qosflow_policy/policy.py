"""`QosflowPolicy`: its options and one scheduling round (the package docstring describes the policy)."""

from __future__ import annotations

import bisect
import math

from qosflow.core.job import JobState
from qosflow.core.placement import Placement
from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView
from qosflow.policies.common import exclusive_key, why_waiting
import numpy as np

from qosflow.policies.placement import find_share
from qosflow.policies.qosflow_policy.colocation import CoLocationMixin
from qosflow.policies.qosflow_policy.cores import CpuCoresMixin
from qosflow.policies.qosflow_policy.deadlines import DeadlinesMixin
from qosflow.policies.qosflow_policy.express import EXPRESS, ExpressLaneMixin, _DeadlineArrivals
from qosflow.policies.qosflow_policy.reservations import ReservationsMixin
from qosflow.policies.qosflow_policy.whole_gpus import WholeGpusMixin

#: with `starvation_backlog`, a job's starvation bound is at most this many times the backlog it
#: found when it was queued: the bound stays finite even if the backlog grows for ever (sustained
#: overload above twice the capacity), so the guard still reaches every job
BACKLOG_CAP = 4.0


class _ArrivalLog:
    """GPU work of the jobs seen so far, by submit time: the inflow the makespan guard counts.

    A job's work is its predicted remaining time x GPU demand when first seen. Kept across rounds
    (the snapshot holds no finished jobs); a clock that goes back (the policy object reused for a
    new simulation) starts it afresh. Bounded for a worker that runs for months: past `MAX_KEEP`
    arrivals it forgets those older than twice the longest remaining time it has seen (older ones
    lie outside any window asked for so far) and the ids of jobs no longer in the snapshot."""

    MAX_KEEP = 100_000

    def __init__(self) -> None:
        self.times: list[float] = []  # submit times, non-decreasing
        self.cum: list[float] = [0.0]  # cum[i]: work of the first i arrivals
        self.seen: set[str] = set()
        self.now = -math.inf
        self.longest = 0.0  # longest remaining time seen

    def record(self, view: SchedulerView, rem: dict[str, float]) -> None:
        if view.now < self.now:
            self.__init__()
        self.now = view.now
        if len(self.times) > self.MAX_KEEP:
            self._forget(view)
        new = [js for js in (*view.pending, *view.running) if js.job_id not in self.seen]
        new.sort(key=lambda js: js.job.submit_time)
        for js in new:
            self.seen.add(js.job_id)
            t = js.job.submit_time
            if self.times and t < self.times[-1]:
                t = self.times[-1]  # seen late (e.g. by a restarted worker): counted as arriving now-ish
            r = rem[js.job_id]
            if not math.isfinite(r) or r < 0:  # an estimator without an answer: no work to count
                r = 0.0
            self.times.append(t)
            self.cum.append(self.cum[-1] + r * js.job.qos.gpu_demand)
            self.longest = max(self.longest, r)

    def _forget(self, view: SchedulerView) -> None:
        cut = bisect.bisect_left(self.times, self.now - 2.0 * self.longest)
        if cut == 0:
            return
        base = self.cum[cut]
        self.times = self.times[cut:]
        self.cum = [c - base for c in self.cum[cut:]]
        self.seen = {js.job_id for js in (*view.pending, *view.running)}

    def work_since(self, t: float) -> float:
        """GPU-seconds of the jobs that arrived at or after `t`."""
        return self.cum[-1] - self.cum[bisect.bisect_left(self.times, t)]


def _check_number(name: str, value, ok, want: str) -> None:
    """Refuse an option that is not a number (a bool is not one) or fails `ok`, naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"qosflow policy: {name} must be {want}, got {value!r}")


@register
class QosflowPolicy(CoLocationMixin, DeadlinesMixin, WholeGpusMixin, ExpressLaneMixin, ReservationsMixin, CpuCoresMixin, Policy):
    name = "qosflow"
    preemptive = False
    description = "QoS-aware, sharing-aware, CPU-aware, non-preemptive (qosflow)"

    def __init__(
        self,
        *,
        qos_weight: float = 4.0,
        makespan_beta: float | None = 0.5,
        makespan_inflow: bool = True,
        starvation_bound: float = 7 * 86400.0,
        starvation_backlog: bool = True,
        guard_share: float = 0.1,
        throughput_gain: float = 0.15,
        relax_after: float = 600.0,
        reserve_share: float = 0.5,
        share_attempts: int = 48,
        sub_batch: bool = True,
        share: bool = True,
        plan: bool = False,
        plan_interval: float = 3600.0,
        fractional_scorer=None,
        align: bool = False,
        partner_rank: str = "throughput",
        express_share: float = 0.0,
        express_max_s: float = 600.0,
        express_deadline_s: float = 86400.0,
        express_release: float = 2.0,
        deadline_band: bool = True,
    ):
        _check_number("express_share", express_share, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
        for name, value in (("express_max_s", express_max_s), ("express_deadline_s", express_deadline_s)):
            _check_number(name, value, lambda v: v >= 0, ">= 0 (seconds)")
        _check_number("express_release", express_release, lambda v: v >= 0, ">= 0 (0: the lane never closes)")
        _check_number("reserve_share", reserve_share, lambda v: 0.0 <= v <= 1.0, "in [0, 1] (a share of the nodes)")
        if not isinstance(makespan_inflow, bool):
            raise ValueError(f"qosflow policy: makespan_inflow must be true or false, got {makespan_inflow!r}")
        if not isinstance(starvation_backlog, bool):
            raise ValueError(f"qosflow policy: starvation_backlog must be true or false, got {starvation_backlog!r}")
        if not isinstance(deadline_band, bool):
            raise ValueError(f"qosflow policy: deadline_band must be true or false, got {deadline_band!r}")
        #: check deadline promises against the estimator's pessimistic (about 90th percentile) values
        self.deadline_band = deadline_band
        if partner_rank not in ("benefit", "throughput"):
            raise ValueError(f"qosflow policy: partner_rank must be 'benefit' or 'throughput', got {partner_rank!r}")
        #: which GPUs a job shares first: the partners with the largest SJF-BSBF benefit, or the
        #: largest GPU-throughput balance
        self.partner_rank = partner_rank
        #: share of the nodes kept as express nodes (rounded down; see `_express_nodes`)
        self.express_share = express_share
        #: any job may start on an express node if predicted done within this many seconds
        self.express_max_s = express_max_s
        #: a deadline job this short that cannot wait for a regular node may take an express node
        self.express_deadline_s = express_deadline_s
        #: the lane closes (its nodes become regular ones) once no deadline job has arrived for
        #: max(express_deadline_s, express_release x the longest gap seen between deadline arrivals),
        #: and opens again with the next one; 0: never closes
        self.express_release = express_release
        #: place single-node jobs where they extend the node's busy time least (time-aligned packing)
        self.align = align
        #: a job that can still meet its deadline is ordered as if `qos_weight` times shorter
        self.qos_weight = qos_weight
        #: start a job early once its remaining time reaches this share of the backlog (None: never)
        self.makespan_beta = makespan_beta
        #: ... counting in that backlog the work that arrived in the last r seconds (r: the job's remaining time)
        self.makespan_inflow = makespan_inflow
        self._arrivals = _ArrivalLog()
        #: a job starves after waiting this long (seconds) ...
        self.starvation_bound = starvation_bound
        #: ... or, if longer, the backlog (all known work over the GPUs; at most BACKLOG_CAP x the
        #: backlog the job found when queued)
        self.starvation_backlog = starvation_backlog
        #: at most this share of the GPUs runs jobs started by the starvation guard
        self.guard_share = guard_share
        #: GPU-throughput gain per GPU that makes best-effort sharing worth it while work queues
        self.throughput_gain = throughput_gain
        self.relax_after = relax_after
        #: at most this share of nodes is held by reservations
        self.reserve_share = reserve_share
        #: best-effort jobs that look for a GPU to share per round (front of the queue first): bounds a
        #: round's cost when thousands wait; jobs with a deadline always look
        self.share_attempts = share_attempts
        self.sub_batch = sub_batch
        self.share = share
        #: restrict best-effort pairs to the fluid-optimal pairing plan (`pairing_plan`); off by default
        self.use_plan = plan
        self.plan_interval = plan_interval
        self._plan_at = -float("inf")
        self._plan: dict[tuple[str, str], float] = {}
        self._dl_arrivals = _DeadlineArrivals()
        self._regular: tuple = (None, None, {})
        #: scorer for fractional shares (e.g. `qosflow.packing` FGD); None: best fit
        self.fractional_scorer = fractional_scorer

    def options(self):
        return {
            "qos_weight": self.qos_weight,
            "makespan_beta": self.makespan_beta,
            "makespan_inflow": self.makespan_inflow,
            "starvation_bound": self.starvation_bound,
            "starvation_backlog": self.starvation_backlog,
            "guard_share": self.guard_share,
            "throughput_gain": self.throughput_gain,
            "relax_after": self.relax_after,
            "reserve_share": self.reserve_share,
            "sub_batch": self.sub_batch,
            "share": self.share,
            "plan": self.use_plan,
            "align": self.align,
            "partner_rank": self.partner_rank,
            "express_share": self.express_share,
            "express_max_s": self.express_max_s,
            "express_deadline_s": self.express_deadline_s,
            "express_release": self.express_release,
            "deadline_band": self.deadline_band,
        }

    # ------------------------------------------------------------------ ordering
    def _order(self, view: SchedulerView, rem: dict[str, float], notes: dict[str, str]):
        now = view.now
        keyed = []
        # backlog: how long the cluster needs to finish all work it knows of; a job whose own length is
        # comparable must start now, or it alone will stretch the makespan (LPT near the end)
        cap = max(1.0, float(view.cluster.gpu_count[~view.cluster.down].sum()))
        work = sum(rem[js.job_id] * js.job.qos.gpu_demand for js in view.pending)
        work += sum(rem[js.job_id] * js.job.qos.gpu_demand for js in view.running)
        backlog = work / cap
        self._backlog = backlog
        # the guard only matters while jobs queue for GPUs
        queueing = sum(js.job.qos.gpu_demand for js in view.pending) > view.cluster.total_empty_gpus()
        inflow = self.makespan_beta is not None and self.makespan_inflow
        if inflow:
            self._arrivals.record(view, rem)
        for js in view.pending:
            r = rem[js.job_id]
            seen = js.tags.get("qosflow_backlog_at_queue")
            if seen is None or seen[0] != js.queued_since:  # new, or queued again after a failure
                js.tags["qosflow_backlog_at_queue"] = (js.queued_since, backlog)
            dl = js.job.deadline
            long = False
            coming = 0.0
            if self.makespan_beta is not None and queueing:
                if inflow:
                    # long against the backlog plus the work that will arrive while it runs -- or
                    # as long as the whole backlog: it then ends after all known work
                    coming = self._arrivals.work_since(now - r) / cap
                    long = r >= self.makespan_beta * (backlog + coming) or r >= backlog
                else:
                    long = r >= self.makespan_beta * backlog
            if dl is not None:
                allowance = dl - now - r
                if allowance < 0:
                    notes[js.job_id] = f"deadline out of reach (needs {r:.0f}s, {max(0.0, dl - now):.0f}s left): best effort"
                elif not (long and r >= backlog):
                    # weighted SJF -- unless the job alone is as long as the whole backlog: it then
                    # ends last whatever else runs, so waiting only eats its slack and stretches the
                    # makespan; the makespan guard starts it early like any long job
                    keyed.append(((2, r / self.qos_weight, js.job.submit_time), js))
                    continue
            if long:
                keyed.append(((1, -r, js.job.submit_time), js))
                guard = (
                    f"long job ({r / 3600:.0f} h) against a backlog of {backlog / 3600:.0f} h"
                    + (f" plus {coming / 3600:.0f} h of work arriving meanwhile" if coming > 0 else "")
                    + ": started early to keep the makespan short"
                )
                notes[js.job_id] = f"{notes[js.job_id]}; {guard}" if js.job_id in notes else guard
                continue
            keyed.append(((2, r, js.job.submit_time), js))
        # starvation guard: the job that has waited longest beyond the bound goes first and, if it
        # cannot start, gets a reservation -- one at a time, so every job eventually starts without
        # turning the queue into FIFO under sustained overload
        cap_gpus = float(view.cluster.gpu_count[~view.cluster.down].sum())
        rescued = sum(js.job.qos.gpu_demand for js in view.running if js.tags.get("qosflow_rescued"))

        def bound(js: JobState) -> float:
            if not self.starvation_backlog:
                return self.starvation_bound
            return max(self.starvation_bound, min(backlog, BACKLOG_CAP * js.tags["qosflow_backlog_at_queue"][1]))

        oldest = None
        for i, (k, js) in enumerate(keyed):
            if rescued > 0 and rescued + js.job.qos.gpu_demand > self.guard_share * cap_gpus:
                continue
            if k[0] == 2 and now - js.queued_since >= bound(js):
                if oldest is None or js.queued_since < keyed[oldest][1].queued_since:
                    oldest = i
        if oldest is not None:
            k, js = keyed[oldest]
            keyed[oldest] = ((1, -1e300, js.job.submit_time), js)
            notes[js.job_id] = (
                f"waited {(now - js.queued_since) / 3600:.0f} h (starvation bound {bound(js) / 3600:.0f} h), "
                "longest of all: served first (starvation guard)"
            )
        keyed.sort(key=lambda kv: kv[0])
        return [js for _, js in keyed], [js for k, js in keyed if k[0] == 1 and k[1] == -1e300]

    # ------------------------------------------------------------------ round
    def schedule(self, view: SchedulerView) -> Decision:
        est = view.estimator
        st = view.cluster
        now = view.now
        gpn = view.gpus_per_node
        d = Decision()
        rem: dict[str, float] = {}
        states: dict[str, JobState] = {}
        for js in view.running:
            rem[js.job_id] = est.remaining(js)
            states[js.job_id] = js
        for js in view.pending:
            rem[js.job_id] = est.remaining(js)
            states[js.job_id] = js
        self._rem, self._now = rem, now
        self._est, self._states, self._rem_hi = est, states, {}
        order, starving = self._order(view, rem, d.notes)
        self._max_rem = max(rem.values(), default=0.0)
        self._update_plan(view, rem)
        self._gpus_of = lambda jid: max(1, states[jid].job.qos.gpus)
        self._st = st
        self._gpu_jobs_waiting = any(js.job.qos.gpus > 0 for js in view.pending)
        # GPU demand still waiting behind each job: sharing for throughput only pays while work queues
        queued_gpus = sum(js.job.qos.gpu_demand for js in view.pending)
        #: node -> (time the reservation starts, job holding it): EASY backfilling -- others may use a
        #: reserved node only if they are predicted to be done before the reservation starts
        reserved: dict[int, tuple[float, str]] = {}
        max_res = max(1, int(round(self.reserve_share * st.num_nodes)))
        failed_k: dict[tuple, int] = {}
        # per GPU: when its last job is predicted to end (kept up to date this round)
        self._end_max = np.zeros(st.njobs.shape)
        for jid, pl in st.allocs.items():
            e = rem.get(jid, 0.0)
            for ng in pl.gpus:
                self._end_max[ng] = max(self._end_max[ng], e)
        share_tries = 0
        self._ver = 0
        self._whole_memo: dict[tuple, tuple[int, Placement | np.ndarray | None]] = {}
        self._gmem_caps = sorted(set(np.asarray(st.gmem_cap).ravel().tolist()))
        self._drain: tuple[int, np.ndarray | None] = (-1, None)
        self._nofit: dict[tuple, int] = {}
        self._nofit_why: dict[tuple, str] = {}
        self._reject: str | None = None
        self._why_not: str | None = None
        self._elig_cache: dict[tuple, tuple] = {}
        self._partners_cache: dict[tuple, tuple] = {}

        # express nodes: a standing reservation (as in EASY backfilling) that starts
        # `express_max_s` from now, so they always drain soon and a short job with a tight deadline
        # finds a free node without preempting anyone
        self._express = self._express_nodes(st, view)
        for n in self._express:
            reserved[n] = (now + self.express_max_s, EXPRESS)
        max_res += len(self._express)

        def blocked(p: Placement, finish: float) -> bool:
            fin_h = self._finish_high(states[p.job_id], finish)
            for n in p.nodes:
                if n in reserved and (fin_h if self._promised(reserved[n][1]) else finish) > reserved[n][0]:
                    if reserved[n][1] == EXPRESS and self._express_ok(states.get(p.job_id), finish):
                        continue
                    return True
            return False

        for rank, js in enumerate(order):
            q = js.job.qos
            queued_gpus -= q.gpu_demand
            r = rem[js.job_id]
            p: Placement | None = None
            why = ""
            not_shared = None
            held = False  # GPUs of its own were free, but only on nodes reserved for others
            if q.gpus == 0:
                p = self._cpu_only(st, js)
            elif q.fractional:
                p = find_share(st, js.job, scorer=self.fractional_scorer)
            else:
                sig = exclusive_key(q)
                if st.total_empty_gpus() >= q.gpus and failed_k.get(sig, 1 << 30) > q.gpus:
                    p = self._whole(st, js.job, "consolidated", r)
                    if p is not None and reserved and blocked(p, now + r):
                        p = self._unreserved_whole(st, js, reserved, now + r)
                        held = p is None
                    if p is None and not reserved:
                        failed_k[sig] = min(failed_k.get(sig, 1 << 30), q.gpus)
                has_dl = js.job.deadline is not None and now + r <= js.job.deadline
                if p is None and self.share and (has_dl or share_tries < self.share_attempts):
                    share_tries += 1
                    found = self._shared_slot(st, js, rem, states, est, now, queued_gpus > 0)
                    if found is not None and not (reserved and blocked(found[0], now + r * 1.5)):
                        p, why = found
                    elif found is not None:
                        not_shared = "the GPUs it could share are reserved for a job that starts before it would end"
                    else:
                        not_shared = self._why_not
                if p is None and has_dl and q.gpus > 1:
                    found = self._deadline_rescue(st, js, rem, states, est, now, gpn)
                    if found is not None and not (reserved and blocked(found[0], now + r * 1.5)):
                        p, why = found
                if p is None and q.gpus > 1 and now - js.queued_since >= self.relax_after:
                    p = self._relaxed(st, js, rem, est, gpn, reserved)
                    if p is not None:
                        why = "locality relaxed after waiting: spread over nodes"
            if p is None:
                if js.job_id not in d.notes:
                    d.notes[js.job_id] = (
                        why_waiting(st, js)
                        + ("; the free nodes that fit it are reserved for jobs that start before it would end" if held else "")
                        + (f"; not shared: {not_shared}" if not_shared else "")
                    )
                important = js.job.deadline is not None and now + r <= js.job.deadline or js in starving
                if q.gpus > 1 and not q.fractional and len(reserved) < max_res and (important or rank < 3):
                    got = self._reserve(st, js, rem, reserved)
                    if got is not None:
                        nodes, ready = got
                        for n in nodes:
                            reserved[n] = (now + ready, js.job_id)
                        d.notes[js.job_id] += (
                            f"; reserved {', '.join(st.spec.nodes[n].name for n in nodes)} "
                            f"(free for it in about {ready / 3600:.1f} h)"
                        )
                continue
            # (whole-GPU jobs only: fractional and CPU-only placements do not look at reservations)
            if self._express and q.gpus > 0 and not q.fractional and r > self.express_max_s and any(n in self._express for n in p.nodes):
                if js.job.deadline is not None and now + r <= js.job.deadline:
                    lane = f"express node: the deadline ({js.job.deadline - now - r:.0f}s of slack) cannot wait for a regular node"
                else:
                    lane = "express node: the regular nodes can never fit it"
                why = f"{why}; {lane}" if why else lane
            p = self._with_cores(st, js.job, p, est)
            st.allocate(p, q)
            self._ver += 1
            for ng in p.gpus:
                self._end_max[ng] = max(self._end_max[ng], r)
            d.starts.append(p)
            if js in starving:
                js.tags["qosflow_rescued"] = True
            if why:
                d.notes[js.job_id] = why
        return d
