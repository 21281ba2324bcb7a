"""qosflow policy, steps 1 and 2: admission and ordering -- weighted SJF, with the makespan guard
(and the arrival log it counts inflow with), the starvation guard and fairness between users (the
usage log it measures each user's recent GPU usage with)."""

from __future__ import annotations

import bisect
import math

from qosflow.core.job import JobState
from qosflow.policies.base import SchedulerView

#: with `starvation_backlog`, a job's starvation bound is at most this many times the backlog it
#: found when it was queued: the bound stays finite even if the backlog grows for ever (sustained
#: overload above twice the capacity), so the guard still reaches every job
BACKLOG_CAP = 4.0


def _span(s: float) -> str:
    """A duration as the ordering's notes say it: seconds under 2 min, minutes under 2 h, else hours."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.0f} h"


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


#: the account of the jobs whose user is not known (one account for all of them)
NO_USER = None


def job_user(job) -> str | None:
    """Who submitted `job`: `Job.user`, else the user its QoS spec carries (`QoSSpec.user`: a stage's
    `@qos_task(user=...)` or its pipeline run's `user:NAME` tag), else None (not known)."""
    u = job.user
    if u is None:
        u = getattr(job.qos, "user", None)
    return u or None


def _who(user: str | None) -> str:
    return f"user {user}" if user is not None else "the jobs with no user"


class _UsageLog:
    """Each user's GPU usage, decayed with a half-life: what the fair-share ordering charges a user with.

    A user's usage is the GPU-seconds their jobs received (`JobState.gpu_attained`, as the simulator
    and the live scheduler keep it), each second weighted 2^(-age / half_life); divided by the same
    integral of a constant 1 GPU over the time the log has watched (`kernel`), it reads as the GPUs
    the user held on average recently. The log keeps the states of the jobs it has seen (waiting or
    running), charges what each received since the last round, and forgets a job once it is neither
    waiting nor running (after charging its last seconds: a job that ended between two rounds is
    charged up to its end). A clock that goes back (the policy object reused for a new simulation)
    starts it afresh."""

    def __init__(self) -> None:
        self.now = -math.inf
        self.usage: dict[str | None, float] = {}
        self.kernel = 0.0
        #: job id -> [its state, its user, GPU-seconds already charged]
        self.seen: dict[str, list] = {}

    def record(self, view: SchedulerView, half_life: float) -> None:
        now = view.now
        if now < self.now:
            self.__init__()
        dt = now - self.now if math.isfinite(self.now) else 0.0
        self.now = now
        if dt > 0 and half_life > 0:
            f = 2.0 ** (-dt / half_life)
            mid = 2.0 ** (-0.5 * dt / half_life)  # (a second received in the interval counts as received at its middle)
            for u in self.usage:
                self.usage[u] *= f
            self.kernel = self.kernel * f + half_life / math.log(2.0) * (1.0 - f)
        else:
            mid = 1.0
        seen = self.seen
        current = set()
        for js in (*view.pending, *view.running):
            jid = js.job_id
            current.add(jid)
            if jid not in seen:
                # (what it received before the log first saw it -- a job adopted by a restarted worker,
                # or every job when the log starts -- lies outside the time the log watched: not charged)
                seen[jid] = [js, job_user(js.job), js.gpu_attained]
        usage = self.usage
        for jid in list(seen):
            rec = seen[jid]
            js = rec[0]
            got = js.gpu_attained
            delta = got - rec[2]
            if delta < 0:  # (a live rerun counts its GPU-seconds from its own start)
                delta = got
            if delta > 0:
                usage[rec[1]] = usage.get(rec[1], 0.0) + delta * mid
            rec[2] = got
            if jid not in current:
                del seen[jid]
        if half_life > 0:
            for u in [u for u, x in usage.items() if x < 1e-9 * max(1.0, self.kernel)]:
                del usage[u]

    def average(self, user: str | None, held_now: float) -> float:
        """The GPUs `user` held on average recently (`held_now`, the GPUs they hold now, before the log
        has watched any time, or with a half-life of 0)."""
        if self.kernel <= 0:
            return held_now
        return self.usage.get(user, 0.0) / self.kernel


class OrderingMixin:
    """The queue's order for `QosflowPolicy`. Reads the options `qos_weight`, `makespan_beta`,
    `makespan_inflow`, `makespan_longest`, `starvation_bound`, `starvation_backlog`, `guard_share`,
    `fair_share`, `fair_half_life`, `fair_weights`, `fair_margin`, the arrival log `_arrivals` and the
    usage log `_usage` (both kept across rounds); sets the round's `_backlog`."""

    def _order(self, view: SchedulerView, rem: dict[str, float], demand: dict[str, float], notes: dict[str, str]):
        """The pending jobs in the order they are tried, and those the starvation guard serves. Each
        remark on a job's place in the queue goes to `notes` as a started job's note; its form for a
        job that then does not start (which says why it waits first), where it differs, to
        `_queue_notes`."""
        now = view.now
        self._queue_notes = queue_notes = {}
        #: the jobs the makespan guard puts first this round (long against the backlog): a 1-GPU one that
        #: waits reserves a GPU (`reserve_single`)
        self._guarded = guarded_ids = set()
        keyed = []
        # backlog: how long the cluster needs to finish all work it knows of; a job whose own length is
        # comparable must start now, or it alone will stretch the makespan (LPT near the end)
        cap_gpus = float(view.cluster.gpu_count[~view.cluster.down].sum())
        cap = max(1.0, cap_gpus)
        # `demand`: each pending job's GPU demand by id, in the order of `view.pending` (the round
        # reads it once; the sums below add in the same order as summing over `view.pending` would)
        pending = view.pending
        ids = list(demand)
        work = sum([rem[jid] * g for jid, g in demand.items()])
        work += sum([rem[js.job.job_id] * js.job.qos.gpu_demand for js in view.running])
        backlog = work / cap
        self._backlog = backlog
        # the guard only matters while jobs queue for GPUs
        queueing = sum(demand.values()) > view.cluster.total_empty_gpus()
        inflow = self.makespan_beta is not None and self.makespan_inflow
        if inflow:
            self._arrivals.record(view, rem)
        # no schedule ends before the longest known job does, so the guard measures a job against that
        # too: one much shorter than the longest has slack however short the backlog, and waits its
        # turn (with `makespan_longest`; without it, under moderate load, every job as long as the
        # backlog of the moment jumped the queue while a far longer one ran anyway)
        longest = 0.0
        if self.makespan_beta is not None and self.makespan_longest:
            longest = max([x for x in rem.values() if 0 <= x < math.inf], default=0.0)
        guarded = self.makespan_beta is not None and queueing
        whole = max(backlog, longest)  # (the same for every job)
        exempt: set[str] = set()
        for js, jid in zip(pending, ids):
            r = rem[jid]
            seen = js.tags.get("qosflow_backlog_at_queue")
            if seen is None or seen[0] != js.queued_since:  # new, or queued again after a failure
                js.tags["qosflow_backlog_at_queue"] = (js.queued_since, backlog)
            dl = js.job.deadline
            long = False
            coming = 0.0
            if guarded:
                if inflow:
                    # long against the backlog plus the work that will arrive while it runs -- or
                    # as long as the whole backlog: it then ends after all known work (with both
                    # measured against the longest job too, see above)
                    coming = self._arrivals.work_since(now - r) / cap
                    long = r >= self.makespan_beta * max(backlog + coming, longest) or r >= whole
                else:
                    long = r >= self.makespan_beta * whole
            if dl is not None:
                allowance = dl - now - r
                if allowance >= 0:
                    exempt.add(jid)  # (a job that can still meet its deadline keeps its place: fairness does not move it)
                if allowance < 0:
                    notes[jid] = f"deadline out of reach (needs {r:.0f}s, {max(0.0, dl - now):.0f}s left): best effort"
                elif not (long and r >= backlog):
                    # weighted SJF -- unless the job alone is as long as the whole backlog: it then
                    # ends last whatever else runs, so waiting only eats its slack and stretches the
                    # makespan; the makespan guard starts it early like any long job
                    keyed.append(((2, r / self.qos_weight, js.job.submit_time), js))
                    continue
            if long:
                guarded_ids.add(jid)
                keyed.append(((1, -r, js.job.submit_time), js))
                guard = (
                    f"long job ({_span(r)}) against a backlog of {_span(backlog)}"
                    + (f" plus {_span(coming)} of work arriving meanwhile" if coming > 0 else "")
                    + (f" and the longest job's {_span(longest)}" if longest > backlog + coming else "")
                )
                before = f"{notes[jid]}; " if jid in notes else ""
                notes[jid] = f"{before}{guard}: started early to keep the makespan short"
                queue_notes[jid] = f"{before}{guard}: first in line to keep the makespan short"
                continue
            keyed.append(((2, r, js.job.submit_time), js))
        # starvation guard: the job that has waited longest beyond the bound goes first and, if it
        # cannot start, gets a reservation -- one at a time, so every job eventually starts without
        # turning the queue into FIFO under sustained overload
        rescued = sum(js.job.qos.gpu_demand for js in view.running if js.tags.get("qosflow_rescued"))

        def bound(js: JobState) -> float:
            if not self.starvation_backlog:
                return self.starvation_bound
            return max(self.starvation_bound, min(backlog, BACKLOG_CAP * js.tags["qosflow_backlog_at_queue"][1]))

        oldest = None
        for i, (k, js) in enumerate(keyed):
            if rescued > 0 and rescued + js.job.qos.gpu_demand > self.guard_share * cap_gpus:
                continue
            # (a bound is never below `starvation_bound`: shorter waits need not work it out)
            if k[0] == 2 and now - js.queued_since >= self.starvation_bound and now - js.queued_since >= bound(js):
                if oldest is None or js.queued_since < keyed[oldest][1].queued_since:
                    oldest = i
        if oldest is not None:
            k, js = keyed[oldest]
            keyed[oldest] = ((1, -1e300, js.job.submit_time), js)
            starved = (
                f"waited {(now - js.queued_since) / 3600:.0f} h (starvation bound {bound(js) / 3600:.0f} h), longest of all"
            )
            notes[js.job_id] = f"{starved}: served first (starvation guard)"
            queue_notes[js.job_id] = f"{starved}: first in the queue (starvation guard)"
        served = None if oldest is None else keyed[oldest][1]
        if self.fair_share:
            keyed = self._fair_tiers(view, keyed, exempt, served, cap_gpus, queue_notes, notes)
        keyed.sort(key=lambda kv: kv[0])
        return [js for _, js in keyed], [] if served is None else [served]

    def _fair_tiers(self, view: SchedulerView, keyed: list, exempt: set[str], served, cap_gpus: float,
                    queue_notes: dict[str, str], notes: dict[str, str]) -> list:
        """Fairness between users (`fair_share`): the GPU jobs of a user who has held more than their
        fair share of the GPUs recently go, within their class of the queue (guarded first, then the
        rest), behind the jobs of the other users. Only while another user's job waits: with a single
        user (or none known) among the jobs, or when only over-share users' jobs wait, the order is left
        as it is, job by job. A job that can still meet its deadline, a CPU-only job and the job the
        starvation guard serves keep their place. Work-conserving: the order changes, never whether free
        GPUs are used. A user's share is the GPUs (up) over the users with jobs (waiting or running),
        in proportion to `fair_weights` (1 each by default); their recent usage is the GPUs they held on
        average, decayed with `fair_half_life` (`_UsageLog`; 0: the GPUs they hold now); over means more
        than (1 + `fair_margin`) x the share. A job moved behind another user's says so in its waiting
        note."""
        pending, running = view.pending, view.running
        log = self._usage
        if not (log.seen or any(job_user(js.job) is not None for js in (*pending, *running))):
            return keyed  # (no user known, nor seen: one account, nothing to share out)
        log.record(view, self.fair_half_life)
        held: dict[str | None, float] = {}
        accounts: dict[str | None, None] = {}
        for js in running:
            q = js.job.qos
            if q.gpus > 0:
                u = job_user(js.job)
                accounts[u] = None
                p = js.placement
                held[u] = held.get(u, 0.0) + (len(p.gpus) * p.gpu_milli / 1000.0 if p is not None else q.gpu_demand)
        for js in pending:
            if js.job.qos.gpus > 0:
                accounts[job_user(js.job)] = None
        if len(accounts) < 2:
            return keyed
        weights = self.fair_weights or {}
        w = {u: float(weights.get(u, 1.0)) if u is not None else 1.0 for u in accounts}
        total_w = sum(w.values())
        hl = self.fair_half_life
        over: dict[str | None, tuple[float, float]] = {}
        for u in accounts:
            share = cap_gpus * w[u] / total_w
            avg = log.average(u, held.get(u, 0.0)) if hl > 0 else held.get(u, 0.0)
            if avg > share * (1.0 + self.fair_margin) + 1e-9:
                over[u] = (avg, share)
        if not over:
            return keyed
        tier = {}
        for k, js in keyed:
            jid = js.job_id
            if js is served or jid in exempt or js.job.qos.gpus == 0:
                tier[jid] = 0
            else:
                tier[jid] = 1 if job_user(js.job) in over else 0
        # the GPU jobs of users within their share, by class (guarded or not): those a moved job now
        # waits behind are the ones whose place was after its own
        ahead: dict[int, list] = {}
        for k, js in keyed:
            if js.job.qos.gpus > 0 and job_user(js.job) not in over:
                ahead.setdefault(k[0], []).append(k)
        if not ahead:
            return keyed  # (only over-share users' GPU jobs wait: nothing to let go first)
        for lst in ahead.values():
            lst.sort()
        n_acc = len(accounts)
        out = []
        for k, js in keyed:
            t = tier[js.job_id]
            out.append(((k[0], t, *k[1:]), js))
            if t == 0:
                continue
            lst = ahead.get(k[0], ())
            passed = len(lst) - bisect.bisect_right(lst, k)
            if passed == 0:
                continue
            u = job_user(js.job)
            avg, share = over[u]
            one = u is not None
            if hl > 0:
                usage = f"{'has' if one else 'have'} held {avg:.1f} GPUs on average recently (half-life {_span(hl)})"
            else:
                usage = f"{'holds' if one else 'hold'} {avg:.1f} GPUs"
            remark = (
                f"{passed} job{'s' if passed > 1 else ''} of other users first: {_who(u)} {usage}, over "
                f"their fair share of {share:.1f} of the {cap_gpus:.0f} GPUs ({n_acc} users with jobs)"
            )
            jid = js.job_id
            before = queue_notes.get(jid, notes.get(jid))
            queue_notes[jid] = f"{before}; {remark}" if before else remark
        return out
