"""Gavel (Narayanan et al., "Heterogeneity-Aware Cluster Scheduling Policies for Deep Learning
Workloads", OSDI'20): the heterogeneity-aware max-min fairness ("LAS") policy and its round-based
mechanism. Written from the paper (sections 3-5) and the structure of its public code
(`scheduler/policies/max_min_fairness.py`, `proportional.py`, `scheduler/scheduler.py`), from
memory: no code of it is copied.

**Allocation (the policy).** Over the active jobs m (running or waiting, asking for GPUs) and the
cluster's GPU types j, X[m, j] is the fraction of time job m should spend on type j. With T[m, j] the
job's speed on type j (`core.estimate.gpu_speed`, relative to its reference GPU) and sf_m its GPU
count (Gavel's `scale_factor`), the linear program is

    maximise  min_m  sum_j a[m, j] X[m, j],   a[m, j] = T[m, j] sf_m / sum_j T[m, j] X_equal[m, j]
    s.t.      X >= 0,  sum_j X[m, j] <= 1 (each job),  sum_m sf_m X[m, j] <= GPUs of type j (each type)

written in epigraph form (one variable t below every job's normalised throughput, maximise t) and
solved with `scipy.optimize.linprog` (HiGHS), one row per kind of job (jobs with the same speeds and
GPU count share an allocation: the LP is symmetric in them, so an optimum of that form exists, and
it is ~3x smaller on Gavel's traces). X_equal is Gavel's `ProportionalPolicy` allocation
(every job the same time share of each type, in proportion to the type's GPUs): its throughput
sum_j T[m, j] X_equal[m, j] is the job's speed on the cluster's average GPU times one constant for
all jobs, which does not move the optimum. Multiplying by sf_m is what Gavel's `max_min_fairness`
does ("a job run on 1 GPU should receive scale_factor more time than a job run on scale_factor
GPUs"): fairness in GPU-time. Priority weights are all 1, as in the paper's experiments. A type a
job may not use (its `gpu_model`) or that has fewer GPUs than the job asks for gets X = 0. As in
Gavel's scheduler (an arrival or completion marks the allocation stale; the next round recomputes
it), the LP is solved at the start of a round, and only when the set of active jobs (or the GPUs
that are up) changed since the last solve -- not every round. A job that arrives mid-round has no
allocation until then (it may still take free GPUs, below).

**Which variant.** This is the paper's heterogeneity-aware "LAS" = `max_min_fairness` (the
"perf" flavour: throughputs per type, no space sharing, i.e. not `max_min_fairness_packed`), not the
later water-filling variant. Attained service enters through the mechanism, as in Gavel: a job's
priority on a type is its allocation over the share of time it has received there.

**Simplifications and choices (documented, not hidden).**

* Max-min LPs have many optima (only the worst-off job's throughput is pinned). By default
  (`tiebreak="throughput"`) a second LP picks, among allocations within 1e-6 of the optimal minimum,
  one that maximises the sum of normalised throughputs -- jobs on the types where they are
  relatively fastest. This keeps the LP's max-min value; Gavel's water-filling variant goes further
  (it raises the second-worst job and so on). `tiebreak="none"` takes HiGHS's first vertex.
* Rounds of `round_seconds` (360 s, Gavel's default). The share of time received is counted from the
  job's arrival, per type (seconds it ran there / seconds since it arrived), and not reset when the
  allocation is recomputed; a type never received gives priority X x 1e9 (Gavel's convention).
* Each round (Gavel's `_schedule_jobs_on_workers`) the (job, type) pairs are taken greedily by
  priority, highest first (ties: the type the job runs on now, then the larger allocation, then
  arrival), each job on at most one type, whole GPUs, while the type has GPUs left; a job keeps its
  GPUs if it stays on its type (Gavel's lease extension: no restart), otherwise it is checkpointed
  (preempted; the simulator charges its restart overhead) and started on its new type,
  consolidated (as the other baselines), a gang on one type. GPUs left over after the pairs with
  X > 0 (Gavel's LP may leave some idle) go to the remaining jobs, least attained GPU-time first,
  on their fastest type with room: work conservation.
* Between rounds (arrivals, completions) nothing is preempted; free GPUs are filled in the same
  priority order (`backfill=True`). Gavel's own mechanism leaves them idle until the round ends;
  `backfill=False` does that.
* Placement that fails for fragmentation (counting said the type had GPUs) leaves the job waiting
  this round, and the free GPUs go to whichever remaining job fits, fastest type first; a job
  preempted this round whose own GPUs are still empty then keeps them instead of restarting.
* A gang wider than every GPU type it may use (8 GPUs on a 4:4:4 cluster) could never run on one
  type: it spans types (at its slowest GPU's pace) on the GPUs left over, least attained service
  first. The paper's clusters had no such job; without this a run with one never ended.
* No space sharing (Gavel's packed variant) and no per-round migration cost model beyond the
  simulator's restart overhead.

On a cluster of one GPU model this is max-min fair time sharing in GPU-time with LAS-like
round priorities.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

from qosflow.core.cluster import PlacementError
from qosflow.core.estimate import gpu_speed
from qosflow.core.job import Job, JobState
from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView, check_choice, check_flag, check_number
from qosflow.policies.common import ExclusiveSearch, hosts_down_note, why_waiting

#: Gavel's priority of a (job, type) pair the job has never run on (its allocation times this)
NEVER_RECEIVED = 1e9
#: the second LP keeps the max-min value within this relative slack
TIEBREAK_SLACK = 1e-6
#: the "type" of a gang wider than every GPU type it may use: it spans types (see `_too_wide`)
SPAN = "*"


def solve_allocation(T: np.ndarray, sf: np.ndarray, cap: np.ndarray, *, tiebreak: bool = True) -> np.ndarray:
    """Gavel's heterogeneity-aware max-min fairness allocation (see the module docstring).

    `T` (jobs x types): each job's speed on each type, 0 where it may not run; `sf`: GPUs per job;
    `cap`: GPUs per type. Returns X (jobs x types), time fractions. Jobs that can run nowhere get 0.
    """
    from scipy import sparse
    from scipy.optimize import linprog

    T = np.asarray(T, float)
    sf = np.asarray(sf, float)
    cap = np.asarray(cap, float)
    m, n = T.shape
    X = np.zeros((m, n))
    allowed = (T > 0) & (sf[:, None] <= cap[None, :] + 1e-9) & (cap[None, :] > 0)
    rows = np.flatnonzero(allowed.any(axis=1))
    if rows.size == 0:
        return X
    # jobs alike (the same speeds and GPU count) form one class: the LP is symmetric in them and
    # concave, so some optimum (of both stages) gives them the same allocation -- solve per class
    # with its size `cnt` (the LP shrinks from jobs to job kinds: ~3x on Gavel's traces)
    key = np.column_stack([T[rows] * allowed[rows], sf[rows]])
    uniq, inv, cnt = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    T, sf, allowed = uniq[:, :n], uniq[:, n], uniq[:, :n] > 0
    cnt = cnt.astype(float)
    k = len(uniq)
    # X_equal's throughput: the job's speed on the cluster's average GPU (one constant aside)
    eq = T @ cap / cap.sum()
    a = np.where(allowed, T * sf[:, None] / eq[:, None], 0.0)
    # variables: X (k*n, row-major), then t
    nv = k * n + 1
    idx = np.arange(k * n).reshape(k, n)
    r_job = np.repeat(np.arange(k), n)
    # sum_j X[m, j] <= 1
    A1 = sparse.csr_matrix((np.ones(k * n), (r_job, idx.ravel())), shape=(k, nv))
    # sum_m sf_m X[m, j] <= cap_j (a class counts its size times)
    A2 = sparse.csr_matrix((np.repeat(sf * cnt, n), (np.tile(np.arange(n), k), idx.ravel())), shape=(n, nv))
    # t - sum_j a[m, j] X[m, j] <= 0
    A3 = sparse.csr_matrix(
        (np.concatenate([-a.ravel(), np.ones(k)]), (np.concatenate([r_job, np.arange(k)]), np.concatenate([idx.ravel(), np.full(k, k * n)]))),
        shape=(k, nv),
    )
    A = sparse.vstack([A1, A2, A3], format="csr")
    b = np.concatenate([np.ones(k), cap, np.zeros(k)])
    ub = np.where(allowed.ravel(), 1.0, 0.0)
    bounds = np.column_stack([np.zeros(nv), np.concatenate([ub, [np.inf]])])
    c = np.zeros(nv)
    c[-1] = -1.0
    res = linprog(c, A_ub=A, b_ub=b, bounds=bounds, method="highs")
    if res.status != 0:  # (feasible and bounded by construction: only numerical trouble gets here)
        # equal GPU-time shares of each type among the jobs that may use it, rows scaled to <= 1
        share = np.where(allowed, cap[None, :] / np.maximum((cnt[:, None] * sf[:, None] * allowed).sum(axis=0), 1e-12)[None, :], 0.0)
        share /= np.maximum(share.sum(axis=1, keepdims=True), 1.0)
        X[rows] = share[inv]
        return X
    z = res.x
    if tiebreak:
        tstar = z[-1]
        bounds[-1, 0] = tstar * (1.0 - TIEBREAK_SLACK)
        c2 = np.concatenate([-(a * cnt[:, None]).ravel(), [0.0]])
        res2 = linprog(c2, A_ub=A, b_ub=b, bounds=bounds, method="highs")
        if res2.status == 0:
            z = res2.x
    X[rows] = (np.clip(z[:-1].reshape(k, n), 0.0, 1.0) * allowed)[inv]
    return X


@register
class GavelPolicy(Policy):
    name = "gavel"
    preemptive = True
    description = "Gavel (OSDI'20): heterogeneity-aware max-min fairness (LAS) LP, 360 s rounds, preemptive"
    relative_cost = 3.0

    def __init__(
        self,
        round_seconds: float = 360.0,
        tiebreak: Literal["throughput", "none"] = "throughput",
        backfill: bool = True,
    ):
        check_number("gavel", "round_seconds", round_seconds, lambda v: 0 < v < math.inf,
                     "a finite number of seconds > 0 between re-allocations, e.g. 360 (Gavel's)")
        check_choice("gavel", "tiebreak", tiebreak, ("throughput", "none"))
        check_flag("gavel", "backfill", backfill)
        self.round_seconds = float(round_seconds)
        self.tiebreak = tiebreak
        self.backfill = backfill
        self._reset()

    def _reset(self) -> None:
        self._round_end: float | None = None
        self._last_now = -math.inf
        self._lp_key: tuple | None = None
        #: job id -> {type: X}
        self.allocation: dict[str, dict[str, float]] = {}
        self._restricted: dict[tuple[str, str], Job] = {}
        self._spec = None
        #: counters (tests, reports): LP solves and rounds (round boundaries acted on)
        self.lp_solves = 0
        self.rounds = 0
        self.round_times: list[float] = []

    def options(self):
        return {"round_seconds": self.round_seconds, "tiebreak": self.tiebreak, "backfill": self.backfill}

    # ------------------------------------------------------------------ helpers
    def _types(self, view: SchedulerView) -> tuple[list[str], list[str], np.ndarray]:
        """(per node its GPU model, the types sorted, GPUs per type on nodes that are up)."""
        st = view.cluster
        if self._spec is not st.spec:
            node_models = [nd.gpu_model for nd in st.spec.nodes]
            types = sorted(set(node_models))
            ti = np.array([types.index(x) for x in node_models], dtype=int) if node_models else np.zeros(0, int)
            self._spec, self._node_models, self._type_list, self._ti = st.spec, node_models, types, ti
        up = ~st.down
        cap = np.bincount(self._ti[up], weights=st.gpu_count[up].astype(float), minlength=len(self._type_list))
        return self._node_models, self._type_list, cap

    def _free(self, st) -> dict[str, float]:
        """Empty GPUs per type on nodes that are up."""
        up = ~st.down
        f = np.bincount(self._ti[up], weights=st.empty[up].astype(float), minlength=len(self._type_list))
        return dict(zip(self._type_list, f.tolist()))

    def _model_of(self, est, js: JobState, node_models: list[str]) -> str | None:
        p = js.placement
        if p is None or not p.gpus:
            return None
        first, last = node_models[p.gpus[0][0]], node_models[p.gpus[-1][0]]
        if first == last and len(p.gpus) <= 2:
            return first
        on = sorted({node_models[nd] for nd, _ in p.gpus})
        return on[0] if len(on) == 1 else min(on, key=lambda x: gpu_speed(est, js.job, x))

    def _account(self, view: SchedulerView, node_models: list[str], jobs: list[JobState]) -> dict[str, str | None]:
        """Per job and type, the seconds it has run there (from `attained`, which the caller keeps).
        Returns the type each running job runs on."""
        est = view.estimator
        current: dict[str, str | None] = {}
        for js in jobs:
            tg = js.tags
            if "gavel_since" not in tg:
                tg["gavel_since"] = view.now
                tg["gavel_on"] = {}
                tg["gavel_att"] = js.attained
            if js.running:
                p = js.placement
                if tg.get("gavel_p") is not p:  # (a placement's type, worked out once)
                    tg["gavel_p"] = p
                    tg["gavel_model"] = self._model_of(est, js, node_models)
                    tg["gavel_spans"] = len({node_models[nd] for nd, _ in p.gpus}) > 1 if p is not None and p.gpus else False
                current[js.job_id] = SPAN if tg["gavel_spans"] else tg["gavel_model"]
            delta = js.attained - tg["gavel_att"]
            if delta > 0:
                model = tg.get("gavel_model")  # (a job that failed since: the type it ran on)
                if model is not None:
                    tg["gavel_on"][model] = tg["gavel_on"].get(model, 0.0) + delta
            tg["gavel_att"] = js.attained
        return current

    def _solve(self, view: SchedulerView, jobs: list[JobState], types: list[str], cap: np.ndarray) -> None:
        key = (tuple(sorted(js.job_id for js in jobs)), tuple(cap.tolist()))
        if key == self._lp_key:
            return
        est = view.estimator
        T = np.array([[gpu_speed(est, js.job, t) if js.job.qos.accepts_gpu_model(t) else 0.0 for t in types] for js in jobs]).reshape(len(jobs), len(types))
        sf = np.array([js.job.qos.gpu_demand for js in jobs])
        X = solve_allocation(T, sf, cap, tiebreak=self.tiebreak == "throughput") if jobs else np.zeros((0, len(types)))
        self.allocation = {js.job_id: {t: float(X[i, j]) for j, t in enumerate(types) if X[i, j] > 1e-12} for i, js in enumerate(jobs)}
        self._lp_key = key
        self.lp_solves += 1

    def _too_wide(self, js: JobState, cap: np.ndarray) -> bool:
        """Is `js` a gang wider than every GPU type it may use (8 GPUs on a 4:4:4 cluster)? Gavel places
        each job on one type, so it could never run: it spans types instead (at its slowest GPU's pace),
        on GPUs left over, least attained service first -- our choice, the paper's clusters had no such
        job. (Without it a simulation with one waited for ever, a round every 360 s.)"""
        g = js.job.qos.gpu_demand
        return not js.job.qos.fractional and all(g > c + 1e-9 for t, c in zip(self._type_list, cap.tolist())
                                                 if js.job.qos.accepts_gpu_model(t))

    def _on_type(self, job: Job, model: str) -> Job:
        """`job` restricted to GPUs of `model` (for the placement search); `SPAN`: the job as it is."""
        if model == SPAN:
            return job
        key = (job.job_id, model)
        j = self._restricted.get(key)
        if j is None:
            j = self._restricted[key] = dataclasses.replace(job, qos=dataclasses.replace(job.qos, gpu_model=model))
        return j

    def _pairs(self, now: float, jobs: list[JobState], current: dict[str, str | None]) -> list[tuple[str, str]]:
        """(job, type) pairs with X > 0, highest Gavel priority first."""
        keyed = []
        for js in jobs:
            alloc = self.allocation.get(js.job_id)
            if not alloc:
                continue
            elapsed = max(now - js.tags["gavel_since"], 1e-9)
            on = js.tags["gavel_on"]
            for t, x in alloc.items():
                frac = on.get(t, 0.0) / elapsed
                prio = x / frac if frac > 0 else x * NEVER_RECEIVED
                keyed.append((-prio, 0 if current.get(js.job_id) == t else 1, -x, js.job.submit_time, js.job_id, t))
        keyed.sort()
        return [(k[4], k[5]) for k in keyed]

    # ------------------------------------------------------------------ the round
    def schedule(self, view: SchedulerView) -> Decision:
        now = view.now
        if now < self._last_now - 1e-9:  # a new run with the same policy object
            self._reset()
        self._last_now = now
        est = view.estimator
        st = view.cluster
        d = Decision()
        node_models, types, cap = self._types(view)
        everyone = list(view.running) + list(view.pending)
        current = self._account(view, node_models, everyone)
        gpu_jobs = [js for js in everyone if js.job.qos.gpu_demand > 0]
        boundary = self._round_end is None or now >= self._round_end - 1e-6
        if boundary:
            self._round_end = now + self.round_seconds
            self.rounds += 1
            self.round_times.append(now)
            # Gavel recomputes the allocation at the start of a round once the job set changed
            self._solve(view, gpu_jobs, types, cap)
        search = ExclusiveSearch(locality="consolidated")
        by_id = {js.job_id: js for js in everyone}
        pending = list(view.pending)

        # CPU-only jobs need no GPU: start them wherever they fit
        for js in pending:
            if js.job.qos.gpus == 0:
                p = search(st, js.job)
                if p is not None:
                    st.allocate(p, js.job.qos)
                    d.starts.append(p)
                else:
                    d.notes[js.job_id] = why_waiting(st, js)
        if not boundary and not self.backfill:
            for js in pending:
                if js.job.qos.gpu_demand > 0:
                    d.notes[js.job_id] = (hosts_down_note(st, js)
                                          or f"waiting: for the next Gavel round ({self.round_seconds:g} s)")
            return d

        def fastest_types(js: JobState) -> list[str]:
            """The types the job may use, fastest first (a running job's own type first: leftover GPUs
            need not move it)."""
            tg = js.tags
            r = tg.get("gavel_fastest")
            if r is None or tg.get("gavel_fastest_of") is not types:
                ok = [t for t in types if js.job.qos.accepts_gpu_model(t)]
                r = tg["gavel_fastest"] = sorted(ok, key=lambda t: (-gpu_speed(est, js.job, t), t))
                tg["gavel_fastest_of"] = types
            cur = current.get(js.job_id)
            if cur is not None and r and r[0] != cur and cur in r:
                r = [cur] + [t for t in r if t != cur]
            return r

        if boundary:
            pairs = self._pairs(now, gpu_jobs, current)
            # least attained GPU-time first: who gets the GPUs the allocation leaves over
            las = sorted(gpu_jobs, key=lambda js: (js.gpu_attained, js.job.submit_time, js.job_id))
            # counting pass (Gavel's mechanism): each job on at most one type, while the type has GPUs
            free = dict(zip(types, cap.tolist()))
            chosen: dict[str, str] = {}
            order: list[str] = []
            for jid, t in pairs:
                if jid in chosen:
                    continue
                g = by_id[jid].job.qos.gpu_demand
                if g <= free[t] + 1e-9:
                    chosen[jid] = t
                    free[t] -= g
                    order.append(jid)
            if any(v >= 1e-9 for v in free.values()):
                for js in las:  # leftover GPUs: work conservation
                    if js.job_id in chosen:
                        continue
                    g = js.job.qos.gpu_demand
                    ts = fastest_types(js)
                    for t in ts:
                        if g <= free[t] + 1e-9:
                            chosen[js.job_id] = t
                            free[t] -= g
                            order.append(js.job_id)
                            break
                    else:
                        if self._too_wide(js, cap) and sum(free[t] for t in ts) >= g - 1e-9:
                            chosen[js.job_id] = SPAN  # over several types, the fastest first
                            order.append(js.job_id)
                            for t in ts:
                                take = min(free[t], g)
                                free[t] -= take
                                g -= take
            preempted = set()
            for js in view.running:
                if js.job.qos.gpu_demand > 0 and chosen.get(js.job_id) != current.get(js.job_id):
                    st.release(js.job_id)
                    d.preempt.append(js.job_id)
                    preempted.add(js.job_id)
                    t = chosen.get(js.job_id)
                    d.notes[js.job_id] = (f"preempted: Gavel round moves it to {t}" if t is not None
                                          else "preempted: lower Gavel priority this round than the jobs given its GPUs")
            started: set[str] = set()
            for jid in order:
                js = by_id[jid]
                if js.running and jid not in preempted:
                    continue  # stays on its type: keeps its GPUs
                p = search(st, self._on_type(js.job, chosen[jid]))
                if p is not None:
                    st.allocate(p, js.job.qos)
                    d.starts.append(p)
                    started.add(jid)
            # fragmentation: GPUs the counting gave away but placement could not use
            waiting = [js for js in las if js.job_id not in started and (not js.running or js.job_id in preempted)]
            self._fill(st, d, search, waiting, fastest_types, started, cap)
            for js in waiting:
                if js.job_id not in started:
                    d.notes.setdefault(js.job_id, hosts_down_note(st, js)
                                       or "waiting: lower Gavel priority this round than the jobs running")
            return d

        # between rounds: nothing is preempted; free GPUs go to waiting jobs in priority order
        waiting = [js for js in pending if js.job.qos.gpu_demand > 0]
        started = set()
        if waiting and (st.total_empty_gpus() > 0 or any(js.job.qos.fractional for js in waiting)):
            free = self._free(st)
            for jid, t in self._pairs(now, waiting, current):
                if jid in started:
                    continue
                js = by_id[jid]
                if not js.job.qos.fractional and free[t] < js.job.qos.gpus:
                    continue
                p = search(st, self._on_type(js.job, t))
                if p is not None:
                    st.allocate(p, js.job.qos)
                    d.starts.append(p)
                    started.add(jid)
                    free = self._free(st)
            rest = sorted((js for js in waiting if js.job_id not in started),
                          key=lambda js: (js.gpu_attained, js.job.submit_time, js.job_id))
            self._fill(st, d, search, rest, fastest_types, started, cap)
        for js in waiting:
            if js.job_id not in started:
                d.notes.setdefault(js.job_id, hosts_down_note(st, js)
                                   or f"waiting: for the next Gavel round ({self.round_seconds:g} s)")
        return d

    def _fill(self, st, d: Decision, search: ExclusiveSearch, jobs: list[JobState], fastest_types, started: set[str],
              cap: np.ndarray) -> None:
        """Start `jobs` (in order) wherever GPUs are free, on their fastest type with room (`cap`: GPUs per
        type on nodes that are up, for gangs wider than every type, `_too_wide`)."""
        free = self._free(st)
        for js in jobs:
            if js.job_id in started:
                continue
            q = js.job.qos
            if not q.fractional and max(free.values(), default=0.0) < 1:
                break
            if (js.running and js.placement is not None and js.job_id in d.preempt
                    and all(st.njobs[nd, g] == 0 for nd, g in js.placement.gpus)):
                # preempted this round, and its own GPUs are still empty: it keeps them (no restart)
                try:
                    st.allocate(js.placement, q)
                except PlacementError:
                    pass
                else:
                    d.preempt.remove(js.job_id)
                    d.notes.pop(js.job_id, None)
                    started.add(js.job_id)
                    free = self._free(st)
                    continue
            ts = fastest_types(js)
            for t in ts:
                if not q.fractional and free[t] < q.gpus:
                    continue
                p = search(st, self._on_type(js.job, t))
                if p is not None:
                    st.allocate(p, q)
                    d.starts.append(p)
                    started.add(js.job_id)
                    free = self._free(st)
                    break
            else:
                if self._too_wide(js, cap) and sum(free[t] for t in ts) >= q.gpus:
                    p = search(st, js.job)
                    if p is not None:
                        st.allocate(p, q)
                        d.starts.append(p)
                        started.add(js.job_id)
                        free = self._free(st)

    def next_wakeup(self, view: SchedulerView) -> float | None:
        """The end of the current round, while there are jobs."""
        if self._round_end is None or not (view.running or view.pending):
            return None
        return self._round_end
