"""`QosflowPolicy`: its options and one scheduling round (the package docstring describes the policy)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from qosflow.core.estimate import placement_gpu_speed
from qosflow.core.speed import width_fraction
from qosflow.core.job import JobState
from qosflow.core.placement import Placement
from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView, check_choice, check_flag, check_number
from qosflow.policies.common import WholeFailures, why_waiting
from qosflow.policies.placement import find_share
from qosflow.policies.qosflow_policy.colocation import KEPT_OFF, CoLocationMixin
from qosflow.policies.qosflow_policy.cores import CpuCoresMixin
from qosflow.policies.qosflow_policy.deadlines import DeadlinesMixin
from qosflow.policies.qosflow_policy.elastic import ElasticStartMixin
from qosflow.policies.qosflow_policy.express import EXPRESS, ExpressLaneMixin, _DeadlineArrivals
from qosflow.policies.qosflow_policy.gpu_models import GpuModelsMixin
from qosflow.policies.qosflow_policy.ordering import OrderingMixin, _ArrivalLog, _UsageLog
from qosflow.policies.qosflow_policy.reservations import ReservationsMixin
from qosflow.policies.qosflow_policy.whole_gpus import WholeGpusMixin


def _soon(s: float) -> str:
    """When a reserved node is free, for a waiting job's note: '40 s', '12 min', '1.5 h' (a live stage
    waiting a few seconds read 'free for it in about 0.0 h')."""
    if s < 90:
        return f"{max(1.0, s):.0f} s"
    if s < 2700:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


@register
class QosflowPolicy(
    OrderingMixin,
    CoLocationMixin,
    DeadlinesMixin,
    ElasticStartMixin,
    WholeGpusMixin,
    GpuModelsMixin,
    ExpressLaneMixin,
    ReservationsMixin,
    CpuCoresMixin,
    Policy,
):
    """qosflow's own policy (the package docstring describes it). Each concern is a mixin in a module
    of its own, whose docstring names the options and round attributes it reads; this class holds the
    options, what is kept across rounds (arrival logs, pairing plan, express-lane memo) and the round
    (`schedule`), which sets the round's state on the object before it places any job."""

    name = "qosflow"
    preemptive = False
    #: the names `partner_rank` takes, listed by `--set` when given another value
    option_choices = {**Policy.option_choices, "partner_rank": ("benefit", "throughput")}
    description = "QoS-aware, sharing-aware, CPU-aware, non-preemptive (qosflow)"
    #: about 4 x the baselines' time per round on the Muri trace (docs/benchmarks.md)
    relative_cost = 4.0

    def __init__(
        self,
        *,
        qos_weight: float = 4.0,
        makespan_beta: float | None = 0.5,
        makespan_inflow: bool = True,
        makespan_longest: bool = True,
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
        gpu_models: bool = True,
        elastic: bool = True,
        fair_share: bool = True,
        fair_half_life: float = 3600.0,
        fair_weights: dict[str, float] | None = None,
        fair_margin: float = 0.1,
        reserve_single: bool = True,
        long_pairs: float | None = None,
        share_after: float | None = None,
    ):
        check_number("qosflow", "express_share", express_share, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
        for name, value in (("express_max_s", express_max_s), ("express_deadline_s", express_deadline_s)):
            check_number("qosflow", name, value, lambda v: v >= 0, ">= 0 (seconds)")
        check_number("qosflow", "express_release", express_release, lambda v: v >= 0, ">= 0 (0: the lane never closes)")
        check_number("qosflow", "reserve_share", reserve_share, lambda v: 0.0 <= v <= 1.0, "in [0, 1] (a share of the nodes)")
        for name, value in (("makespan_inflow", makespan_inflow), ("makespan_longest", makespan_longest),
                            ("starvation_backlog", starvation_backlog), ("deadline_band", deadline_band),
                            ("gpu_models", gpu_models), ("elastic", elastic), ("fair_share", fair_share),
                            ("reserve_single", reserve_single)):
            check_flag("qosflow", name, value)
        check_number("qosflow", "fair_half_life", fair_half_life, lambda v: v >= 0 and math.isfinite(v),
                     ">= 0 seconds (0: the GPUs a user holds now)")
        check_number("qosflow", "fair_margin", fair_margin, lambda v: v >= 0 and math.isfinite(v), ">= 0 (0.1: over once 10 % above the share)")
        if fair_weights is not None:
            if not isinstance(fair_weights, dict):
                raise ValueError(f"qosflow policy: fair_weights must be a mapping of user name to weight, e.g. {{'alice': 2}}, got {fair_weights!r}")
            for user, weight in fair_weights.items():
                if not isinstance(user, str) or not user:
                    raise ValueError(f"qosflow policy: fair_weights: a user must be a name, got {user!r}")
                check_number("qosflow", f"fair_weights[{user!r}]", weight, lambda v: v > 0 and math.isfinite(v), "a weight > 0")
        #: order the GPU jobs of a user over their fair share behind other users' (`OrderingMixin._fair_tiers`)
        self.fair_share = fair_share
        #: half-life (seconds) of the recent GPU usage a user's share is compared with (0: the GPUs held now)
        self.fair_half_life = float(fair_half_life)
        #: user -> weight of their share (1 for a user not listed)
        self.fair_weights = dict(fair_weights) if fair_weights else None
        #: a user is over their share once their recent usage exceeds (1 + fair_margin) x the share
        self.fair_margin = float(fair_margin)
        self._usage = _UsageLog()
        #: check deadline promises against the estimator's pessimistic (about 90th percentile) values
        self.deadline_band = deadline_band
        #: on a cluster of mixed GPU models, choose each job's GPU model by its speed there (`GpuModelsMixin`)
        self.gpu_models = gpu_models
        #: start a deadline gang that declared `min_gpus` on fewer GPUs when that meets its deadline
        #: (`ElasticStartMixin`)
        self.elastic = elastic
        check_choice("qosflow", "partner_rank", partner_rank, self.option_choices["partner_rank"])
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
        #: ... and never less than the longest remaining time of any known job (no schedule ends sooner)
        self.makespan_longest = makespan_longest
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
        #: a waiting 1-GPU job that a guard puts first reserves the GPU that frees soonest (no new partner joins it)
        self.reserve_single = reserve_single
        if long_pairs is not None:
            check_number("qosflow", "long_pairs", long_pairs, lambda v: v > 0, "> 0 seconds (None: long jobs may pair)")
        #: two jobs both with more than this many seconds to run do not share a GPU (None: they may)
        self.long_pairs = long_pairs
        if share_after is not None:
            check_number("qosflow", "share_after", share_after, lambda v: v >= 0 and math.isfinite(v), ">= 0 (None: the usual pair tests only)")
        #: a best-effort job that has waited this many times its remaining time shares where the pair's
        #: average completion improves for every partner, even at a GPU-throughput loss down to
        #: `DL_COST_FLOOR` per GPU (None: the usual tests only)
        self.share_after = share_after
        self._kept = None  # GPUs reserved so this round (`reserve_single`), or None
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
        #: the cluster as the last round left it, and whether every job holding GPUs was one of that
        #: round's (`_same_state`: the round's shape-and-state searches carry over while it holds)
        self._memo_state = None
        self._memo_all_known = False
        self._tops_memo: dict = {}  # `_top_width`: request -> width, for one cluster spec (key None)
        #: scorer for fractional shares (e.g. `qosflow.packing` FGD); None: best fit
        self.fractional_scorer = fractional_scorer

    def options(self):
        return {
            "qos_weight": self.qos_weight,
            "makespan_beta": self.makespan_beta,
            "makespan_inflow": self.makespan_inflow,
            "makespan_longest": self.makespan_longest,
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
            "gpu_models": self.gpu_models,
            "elastic": self.elastic,
            "fair_share": self.fair_share,
            "fair_half_life": self.fair_half_life,
            "fair_weights": self.fair_weights,
            "fair_margin": self.fair_margin,
            "reserve_single": self.reserve_single,
            "long_pairs": self.long_pairs,
            "share_after": self.share_after,
        }

    @property
    def elastic_starts(self) -> bool:
        """A job that declared `min_gpus` may start narrower (`Policy.elastic_starts`): with the option
        `elastic`, and then also one whose full width never fits the cluster (on the widest width
        that does: `_top_width`)."""
        return self.elastic

    def _top_width(self, spec, q) -> int | None:
        """For a job that declared `min_gpus` whose full width can never fit cluster `spec` (it was
        admitted for a narrower one: `ClusterSpec.why_never_fits(..., elastic=True)`), the widest width
        that can; None for every other job (remembered per spec and request)."""
        if not self.elastic or q.min_gpus is None or len(q.widths) == 1:
            return None
        memo = self._tops_memo
        if memo.get(None) is not spec:
            memo.clear()
            memo[None] = spec
        if q not in memo:
            w = spec.widest_width(q)
            memo[q] = w if w is not None and w < q.gpus else None
        return memo[q]

    # ------------------------------------------------------------------ round
    def schedule(self, view: SchedulerView) -> Decision:
        est = view.estimator
        st = view.cluster
        now = view.now
        gpn = view.gpus_per_node
        d = Decision()
        rem: dict[str, float] = {}
        states: dict[str, JobState] = {}
        #: running jobs started on fewer GPUs than they asked for (elastic): the share they got
        self._wfrac = {}
        for js in view.running:
            jid = js.job.job_id
            rem[jid] = est.remaining(js)
            states[jid] = js
            if js.job.qos.min_gpus is not None and js.placement is not None:
                f = width_fraction(js.job, js.placement)
                if f < 1.0:
                    # (an estimator's remaining time is on all its GPUs; on fewer it takes longer)
                    self._wfrac[jid] = f
                    rem[jid] /= f
        #: waiting jobs whose full width never fits the cluster: the widest width that does (`_top_width`);
        #: their remaining time is counted at that width, as a narrowed running job's is
        tops: dict[str, int] = {}
        for js in view.pending:
            jid = js.job.job_id
            rem[jid] = est.remaining(js)
            states[jid] = js
            if js.job.qos.min_gpus is not None:
                top = self._top_width(st.spec, js.job.qos)
                if top is not None:
                    tops[jid] = top
                    self._wfrac[jid] = top / js.job.qos.gpus
                    rem[jid] /= self._wfrac[jid]
        self._rem, self._now = rem, now
        self._est, self._states, self._rem_hi, self._promises = est, states, {}, {}
        # on a cluster of mixed GPU models: remaining times in wall time where the jobs run (running
        # jobs) or would run best (waiting ones); `_rspeed` keeps the factor for the pessimistic values
        models = self._node_models(st)
        self._rspeed, self._empty_memo = {}, {}
        if models is not None:
            for js in view.running:
                self._rspeed[js.job.job_id] = self._held_speed(est, js, models)
            for js in view.pending:
                self._rspeed[js.job.job_id] = self._best_speed(st, est, js, models)
            for jid, s in self._rspeed.items():
                rem[jid] /= s
            waiting = [rem[js.job.job_id] for js in view.pending if js.job.qos.gpus > 0]
            self._typical_wait_r = float(np.median(waiting)) if waiting else 0.0
        # each pending job's GPU demand, in the order of `view.pending` (read once per round)
        demand = {js.job.job_id: js.job.qos.gpu_demand for js in view.pending}
        for jid, top in tops.items():
            demand[jid] = float(top)
        order, starving = self._order(view, rem, demand, d.notes)
        self._max_rem = max(rem.values(), default=0.0)
        self._update_plan(view, rem)
        self._st = st
        self._gpu_jobs_waiting = any(js.job.qos.gpus > 0 for js in view.pending)
        # GPU demand still waiting behind each job: sharing for throughput only pays while work queues
        queued_gpus = sum(demand.values())
        #: node -> (time the reservation starts, job holding it): EASY backfilling -- others may use a
        #: reserved node only if they are predicted to be done before the reservation starts
        reserved: dict[int, tuple[float, str]] = {}
        max_res = max(1, int(round(self.reserve_share * st.num_nodes)))
        failures = WholeFailures()
        # per GPU: when its last job is predicted to end (kept up to date this round)
        # (the maxima are taken in plain Python, in the same order, then written once)
        end_max: dict[tuple[int, int], float] = {}
        for jid, pl in st.allocs.items():
            e = rem.get(jid, 0.0)
            for ng in pl.gpus:
                end_max[ng] = max(end_max.get(ng, 0.0), e)
        self._end_max = np.zeros(st.njobs.shape)
        for ng, e in end_max.items():
            self._end_max[ng] = e
        share_tries = 0
        if not self._same_state(st, states):
            # the searches that depend on the request's shape and the cluster's state only: kept
            # from the last round while the cluster is exactly as that round left it (`_same_state`:
            # e.g. a round for an arrival that started nothing), else begun afresh
            self._ver = 0
            self._whole_memo: dict[tuple, tuple[int, Placement | np.ndarray | None]] = {}
            self._gmem_caps = sorted(set(np.asarray(st.gmem_cap).ravel().tolist()))
            self._nofit: dict[tuple, int] = {}
            self._nofit_why: dict[tuple, str] = {}
            self._elig_cache: dict[tuple, tuple] = {}
            self._partners_cache: dict[tuple, tuple] = {}
            self._waiting_memo: dict[tuple, tuple[int, str]] = {}
            self._largest: tuple[int, int | None] = (-1, 0)
        if self._kept is not None:
            self._ver += 1  # (the last round's searches saw GPUs reserved for 1-GPU jobs: not this round's)
        self._kept = None
        kept_max = max(1, int(round(self.reserve_share * st.spec.num_gpus))) if self.reserve_single else 0
        self._relaxed_memo: dict[tuple, tuple] = {}  # (depends on the round's reservations too)
        self._drain: tuple[int, np.ndarray | None] = (-1, None)  # (depends on the round's estimates)
        self._reject: str | None = None
        self._why_not: str | None = None
        self._last_values: tuple = (None, {}, {})  # (job, partner values) of the last sharing search

        # express nodes: a standing reservation (as in EASY backfilling) that starts
        # `express_max_s` from now, so they always drain soon and a short job with a tight deadline
        # finds a free node without preempting anyone
        self._express = self._express_nodes(st, view)
        for n in self._express:
            reserved[n] = (now + self.express_max_s, EXPRESS)
        max_res += len(self._express)

        def blocked(p: Placement, js: JobState, finish: float) -> bool:
            """Would `js` on the nodes of `p`, finishing at `finish`, be in a reservation's way?"""
            return blocked_on(p.nodes, js, finish)

        def blocked_on(nodes, js: JobState, finish: float) -> bool:
            """Would `js` on `nodes`, finishing at `finish`, be in a reservation's way?"""
            fin_h = None  # the pessimistic finish, worked out only if a reserved node is in the way
            for n in nodes:
                if n not in reserved:
                    continue
                if self._promised(reserved[n][1]):
                    if fin_h is None:
                        fin_h = self._finish_high(js, finish)
                    end = fin_h
                else:
                    end = finish
                if end > reserved[n][0]:
                    if reserved[n][1] == EXPRESS and self._express_ok(js, finish):
                        continue
                    return True
            return False

        # why a job waits depends on the cluster and the request fields `why_waiting` reads only: one
        # answer per request shape and state (`_ver`)
        waiting_memo = self._waiting_memo
        for rank, js in enumerate(order):
            job = js.job
            jid = job.job_id
            q = job.qos
            queued_gpus -= demand[jid]
            r = rem[jid]
            dl = job.deadline
            has_dl = dl is not None and now + r <= dl
            p: Placement | None = None
            why = ""
            not_shared = None
            held = False  # GPUs of its own were free, but only on nodes reserved for others
            r_run = r  # its remaining time where it starts (on a slower GPU model or fewer GPUs: longer)
            narrow_job = job  # the request as it starts (fewer GPUs: `_narrow_start`)
            typed_wait = None  # why it waits for GPUs of a faster model
            top = tops.get(jid)  # its full width never fits: the widest width that does (r is at that width)
            if top is not None:
                # only its narrower widths can ever fit: the widest of them takes the part of its full
                # width, deadline or not (`_narrow_start`); sharing, the deadline rescue and relaxed
                # locality look for its full width, which never fits
                found = self._narrow_start(st, js, r, reserved, failures, top=top)
                if found is not None:
                    p, narrow_job, why = found
            elif q.gpus == 0:
                p = self._cpu_only(st, js)
            elif q.fractional:
                p = find_share(st, js.job, scorer=self.fractional_scorer)
            else:
                # the request's shape as the whole-GPU searches key it (worked out once per job)
                wshape = self._whole_shape(q, q.gpu_model)
                groups = self._model_groups(st, est, job, models) if models is not None else ()
                if len(groups) > 1:
                    # GPU models that differ for it: the fastest that pays; while work queues behind it,
                    # the slowest that costs it little (`GpuModelsMixin`)
                    typed = self._loaded_gpus if queued_gpus > 0 else self._typed_gpus
                    p, held, why = typed(st, js, groups, r, reserved, failures)
                    typed_wait = (why or None) if p is None else None
                else:
                    p, held = self._own_gpus(st, js, job, r, wshape, reserved, failures)
                # sharing, the deadline rescue and relaxed locality: on a cluster of mixed models, on the
                # models that cost it little (`_other_ways`), its time taken on the slowest of them
                ojs = js
                if p is None and len(groups) > 1:
                    ojs, slowest = self._other_ways(js, groups, r)
                    rem[jid] = r * groups[0][0] / slowest
                if p is None and self.elastic and has_dl and q.min_gpus is not None and len(groups) <= 1:
                    found = self._narrow_start(st, js, r, reserved, failures)
                    if found is not None:
                        p, narrow_job, why = found
                if p is None and self.share and (has_dl or share_tries < self.share_attempts):
                    share_tries += 1
                    # (a placement in a reservation's way is not made: `keep_off`)
                    keep_off = (lambda nodes: blocked_on(nodes, js, now + r * 1.5)) if reserved else None
                    found = self._shared_slot(st, ojs, rem, states, est, now, queued_gpus > 0, keep_off=keep_off)
                    if found is KEPT_OFF:
                        not_shared = "the GPUs it could share are reserved for a job that starts before it would end"
                    elif found is not None:
                        p, why = found
                    else:
                        not_shared = self._why_not
                if p is None and has_dl and q.gpus > 1:
                    found = self._deadline_rescue(st, ojs, rem, states, est, now, gpn)
                    if found is not None and not (reserved and blocked(found[0], js, now + r * 1.5)):
                        p, why = found
                if p is None and q.gpus > 1 and typed_wait is None and now - js.queued_since >= self.relax_after:
                    p = self._relaxed(st, ojs, rem, est, gpn, reserved, shape=wshape if ojs is js else None)
                    if p is not None:
                        why = "locality relaxed after waiting: spread over nodes"
                rem[jid] = r
            if p is None:
                # why it waits, always: a note the ordering left (`_order`: the makespan or starvation
                # guard, a deadline out of reach) says where it stands in the queue, not why it did not
                # start, and follows in its waiting form
                wjs = js
                if top is not None:  # (it waits for the GPUs of its widest width that fits)
                    wjs = JobState(job=replace(job, qos=q.narrowed(top)), queued_since=js.queued_since)
                wq = wjs.job.qos
                # (GPU memory counts by the nodes whose GPUs are large enough, as in `_whole_gpus`)
                shape = (wq.gpus, wq.gpu_milli, wq.cpu_cores, wq.mem_mb, wq.gpu_model, self._cap_class(wq))
                w = waiting_memo.get(shape)
                if w is None or w[0] != self._ver:
                    if self._largest[0] != self._ver:  # the largest block of free GPUs on a node that is up
                        up = st.empty[~st.down]  # (none up: why_waiting decides what to say)
                        self._largest = (self._ver, int(up.max()) if up.size else None)
                    w = waiting_memo[shape] = (self._ver, why_waiting(st, wjs, self._largest[1]))
                # (the ordering's remark in its waiting form; a remark made for waiting jobs only, such as
                # fairness between users, has no started form)
                queue_note = self._queue_notes.get(jid, d.notes.get(jid))
                d.notes[jid] = (
                    (f"waiting: {typed_wait}" if typed_wait else w[1])
                    + (f" (on {top} of its {q.gpus} GPUs: all {q.gpus} never fit this cluster)" if top is not None else "")
                    + ("; the free nodes that fit it are reserved for jobs that start before it would end" if held else "")
                    + (f"; not shared: {not_shared}" if not_shared else "")
                    + (f"; {queue_note}" if queue_note else "")
                )
                important = has_dl or js in starving
                if q.gpus > 1 and not q.fractional and len(reserved) < max_res and (important or rank < 3) and wq.gpus > 1:
                    got = self._reserve(st, wjs, rem, reserved)
                    if got is not None:
                        nodes, ready = got
                        for n in nodes:
                            reserved[n] = (now + ready, jid)
                        d.notes[jid] += (
                            f"; reserved {', '.join(st.spec.nodes[n].name for n in nodes)} "
                            f"(free for it in about {_soon(ready)})"
                        )
                elif (q.gpus == 1 and not q.fractional and top is None and kept_max > 0
                      and (jid in self._guarded or js in starving)):
                    got = self._reserve_gpu(st, js, reserved, kept_max)
                    if got is not None:
                        (n, g), ready = got
                        d.notes[jid] += f"; reserved GPU {g} of {st.spec.nodes[n].name}: no job joins it (free for it in about {_soon(ready)})"
                continue
            # (whole-GPU jobs only: fractional and CPU-only placements do not look at reservations)
            if self._express and q.gpus > 0 and not q.fractional and r > self.express_max_s and any(n in self._express for n in p.nodes):
                if has_dl:
                    lane = f"express node: the deadline ({dl - now - r:.0f}s of slack) cannot wait for a regular node"
                else:
                    lane = "express node: the regular nodes can never fit it"
                why = f"{why}; {lane}" if why else lane
            if models is not None and p.gpus:
                # in wall time on the GPU model it got (its slowest GPU's), not at its best case
                r_run = r * self._rspeed.get(jid, 1.0) / placement_gpu_speed(est, job, p, models)
            if narrow_job is not job:
                r_run *= (q.gpus if top is None else top) / len(p.gpus)  # (on fewer GPUs than it asked for: `_narrow_start`)
            # (an elastic start gets the cores of the narrowed request: `_narrow_start`)
            p = self._with_cores(st, narrow_job, self._own(p, job), est)
            st.allocate(p, q)
            self._ver += 1
            for ng in p.gpus:
                self._end_max[ng] = max(self._end_max[ng], r_run)
            d.starts.append(p)
            if js in starving:
                js.tags["qosflow_rescued"] = True
            if why:
                d.notes[jid] = why
        self._memo_state = (st, self.align, self.sub_batch, self.SHARE_NODES)  # (as this round leaves it: `_same_state`)
        return d

    def _reserve_gpu(self, st, js: JobState, reserved, kept_max: int):
        """For a waiting 1-GPU job that a guard puts first (`reserve_single`): the GPU it could use whose
        last job ends soonest, on a node no gang has reserved, as ((node, GPU), seconds until then); from
        now on this round no job joins that GPU (`_gpu_masks`), so it empties when its jobs end and the
        job, first in line, takes it. Without it, each job leaving a shared GPU made room for a newcomer
        next to the one that stayed, and a GPU of a busy cluster never emptied: on Gavel 6214e9 on 4x8 a
        131-day job first in line waited 88 days. None: none to reserve, or `kept_max` GPUs are already."""
        if self._kept is None:
            self._kept = np.zeros(st.njobs.shape, dtype=bool)
        kept = self._kept
        if int(kept.sum()) >= kept_max:
            return None
        ok = self._gpus_for(st, js.job.qos) & (st.njobs > 0) & ~kept
        ok[st.down] = False
        if reserved:
            ok[list(reserved)] = False
        if not ok.any():
            return None
        t = np.where(ok, self._end_max, np.inf)
        n, g = np.unravel_index(int(np.argmin(t)), t.shape)
        kept[n, g] = True
        self._ver += 1  # (the searches remembered so far saw it open to partners)
        return (int(n), int(g)), float(t[n, g])

    def _own_gpus(self, st, js: JobState, job, r: float, wshape: tuple, reserved, failures) -> tuple[Placement | None, bool]:
        """GPUs of `job`'s own (`js`'s request, or it restricted to some GPU models), consolidated, clear
        of reservations it would be in the way of, for a remaining time `r`: (the placement or None,
        held -- GPUs were free, but only on nodes reserved for others). `_own` makes a placement the
        job's if it starts."""
        q = job.qos
        if failures.hopeless(st, q):
            return None, False
        held = False
        now = self._now
        p = self._whole_gpus(st, job, "consolidated", r, shape=wshape)
        if p is not None and reserved:
            finish = now + r
            on = p.nodes
            if len(on) == 1:
                # GPUs on one node: if the job must keep off it and the search without that node finds
                # nothing, the search around all the reservations it must keep off finds nothing either
                # (hiding nodes only takes candidates away), and the other reserved nodes need no test
                n0 = on[0]
                if n0 in reserved and self._avoid(js, {n0: reserved[n0]}, finish)[n0]:
                    if self._whole_gpus(st, job, "consolidated", finish - now, masked=(n0,), shape=wshape) is None:
                        p = None
                    else:
                        p = self._unreserved_whole(st, js, reserved, finish, shape=wshape, job=job)
                    held = p is None
            else:
                # which reserved nodes the job must keep off (the same test for the GPUs found and for
                # the search around reservations: `blocked`, `_unreserved_whole`)
                avoid = self._avoid(js, reserved, finish)
                if any(avoid.get(n, False) for n in on):
                    p = self._unreserved_whole(st, js, reserved, finish, avoid=avoid, shape=wshape, job=job)
                    held = p is None
        if p is None and not reserved:
            failures.failed(q)
        return p, held

    #: cluster-state arrays that the remembered searches read (besides the spec and the allocations)
    _STATE_ARRAYS = ("milli_free", "njobs", "whole", "share_ok", "gmem_free", "empty", "cpu_free", "mem_free", "down")

    def _same_state(self, st, states) -> bool:
        """Is `st` exactly the cluster the last round left (`_memo_state`: its snapshot after the
        round's own placements, with the options the searches read), so that what that round
        remembered at its last `_ver` still holds? The same spec, the same placement objects, the
        same occupants per GPU, every array equal to the bit -- and every job holding GPUs is one of
        the round's jobs (the sharing search only takes those as partners), as it was then. A
        cluster whose placements are new objects (rebuilt, not a snapshot of the same state) starts
        afresh."""
        prev = self._memo_state
        self._memo_state = None
        allocs = st.allocs
        if not all(jid in states for jid in allocs):
            self._memo_all_known = False
            return False
        if prev is None or not self._memo_all_known or prev[1:] != (self.align, self.sub_batch, self.SHARE_NODES):
            self._memo_all_known = True
            return False
        self._memo_all_known = True
        prev = prev[0]
        if prev.spec is not st.spec:
            return False
        pa = prev.allocs
        if len(pa) != len(allocs) or any(pa.get(jid) is not p for jid, p in allocs.items()):
            return False
        if st.gpu_jobs != prev.gpu_jobs or st.n_empty != prev.n_empty:
            return False
        return all(getattr(st, a).tobytes() == getattr(prev, a).tobytes() for a in self._STATE_ARRAYS)
