"""Event-driven cluster simulator.

The simulator owns the truth: each job's real duration, the real slowdowns of co-location,
spreading and CPU starvation (a `SpeedModel`), and failures. Policies see only a snapshot of the
cluster and *estimates* (an `Estimator`); they run exactly as in the live worker
(`Policy.schedule` on a `SchedulerView`, committed with `policies.base.commit`).

Events: arrivals, completions, failures, and the wake-ups policies ask for (e.g. Tiresias'
queue demotions). Between events every running job advances at its current rate, once the restart
overhead of a job that started again (wall time, whatever its rate) has run. The run is
deterministic for a given seed: nothing iterates over hashed sets, and randomness comes from
one seeded generator.

Conservation (checked by tests): every admitted job finishes exactly once, and the GPU time the
cluster was busy equals the GPU time the jobs received.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from qosflow.core.cluster import ClusterSpec, ClusterState, PlacementError
from qosflow.core.estimate import Estimator, OracleEstimator
from qosflow.core.job import FailurePlan, Job, JobState, JobStatus
from qosflow.core.speed import SpeedModel
from qosflow.errors import QosflowError
from qosflow.policies.base import Decision, Policy, SchedulerView, commit

EPS = 1e-9
#: work (solo seconds) below which a completion or failure is due; far above the clock's resolution
#: at the simulated times of real traces (~1e-9 s at 1e7 s), so an event is never stuck
TIME_TOL = 1e-6


class SimulationError(QosflowError, RuntimeError):
    pass


@dataclass
class SimConfig:
    #: seconds lost at every restart of a job (after a preemption or a failure): checkpoint restore
    #: and warm-up (Muri profiled 4-46 s). Wall time: as long on GPUs that run the job at 1 % of its
    #: speed (shared, spread, short of cores, a slower model) as alone on its own. Not charged on the
    #: first start: a trace's duration is the job's whole run, its own start-up included, so every
    #: deadline of at least that duration stays feasible for a job that starts at once (the bound's
    #: assumption)
    restart_overhead: float = 10.0
    #: share of jobs that fail part-way (Philly: about 30 % of jobs end failed or killed); 0 disables
    failure_share: float = 0.0
    #: a failed attempt keeps this share of its progress (checkpoints); Philly jobs often lost it all
    checkpoint_fraction: float = 0.5
    #: share of failures that are infrastructure failures (retried elsewhere) rather than user errors
    infra_failure_share: float = 0.3
    #: also run the policy every `tick` seconds (None: only on events and the policy's own wake-ups)
    tick: float | None = None
    #: stop (and report unfinished jobs) after this simulated time
    max_time: float | None = None
    seed: int = 0
    #: check the cluster state's invariants after every round (tests; slows large runs)
    check_invariants: bool = False

    def __post_init__(self) -> None:
        from qosflow.errors import SpecError

        for name in ("failure_share", "checkpoint_fraction", "infra_failure_share"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise SpecError(name, f"must be a fraction in [0, 1], got {v!r}")
        if not (isinstance(self.restart_overhead, (int, float)) and self.restart_overhead >= 0):
            raise SpecError("restart_overhead", f"must be >= 0 seconds, got {self.restart_overhead!r}")


@dataclass
class SimResult:
    policy: str
    estimator: str
    cluster: ClusterSpec
    jobs: list[JobState]
    rejected: list[tuple[str, str]]
    busy_gpu_seconds: float
    received_gpu_seconds: float
    useful_gpu_seconds: float
    wasted_gpu_seconds: float
    start_time: float
    end_time: float
    rounds: int
    decisions: int
    sched_seconds: float
    #: GPU-seconds on GPUs holding two whole-GPU jobs (co-located)
    shared_gpu_seconds: float = 0.0
    #: (time, busy GPUs) samples at every event, for utilisation plots
    timeline: list[tuple[float, float]] = field(default_factory=list)
    #: on a cluster of mixed GPU models: per model, the GPU-seconds allocated on its GPUs
    busy_gpu_seconds_by_model: dict[str, float] = field(default_factory=dict)
    #: per job that ran, the GPU-seconds it held with a GPU shared by k whole-GPU jobs counting 1/k to each
    #: (a fraction of a GPU by its fraction): they add up to `busy_gpu_seconds`. `JobState.gpu_attained`
    #: counts a shared GPU fully for each job (what a job received, as the policies' LAS and fair share take it)
    gpu_seconds_split: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> list[JobState]:
        return [j for j in self.jobs if j.status is JobStatus.DONE]


def _dependant_reason(dep: str, reason: str) -> str:
    """Why a stage is rejected whose dependency `dep` was rejected for `reason` (the first rejection's
    reason, not a chain of them)."""
    root = reason.split(", which was rejected: ", 1)[-1] if reason.startswith("depends on ") else reason
    return f"depends on {dep}, which was rejected: {root}"


def _dependency_cycle(jobs: Sequence[Job]) -> list[str] | None:
    """A cycle of `depends_on` among `jobs` (ids, the first repeated at the end), or None."""
    ids = {j.job_id: j for j in jobs}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in ids:
        if state.get(start):
            continue
        path, stack = [start], [iter(ids[start].depends_on)]
        state[start] = 1
        while stack:
            d = next(stack[-1], None)
            if d is None:
                state[path.pop()] = 2
                stack.pop()
            elif d in ids and state.get(d) == 1:
                return path[path.index(d):] + [d]
            elif d in ids and not state.get(d):
                state[d] = 1
                path.append(d)
                stack.append(iter(ids[d].depends_on))
    return None


def assign_failures(jobs: Sequence[Job], cfg: SimConfig) -> dict[str, FailurePlan]:
    """Failure plans: each job's own, plus a seeded share of the others (Philly: failures repeat
    for the same job). Draws do not depend on the policy, so every policy sees the same failures."""
    plans = {j.job_id: j.failure for j in jobs if j.failure is not None}
    if cfg.failure_share <= 0:
        return plans
    rng = np.random.default_rng(cfg.seed + 7919)
    for job in jobs:
        u = rng.random()
        at = float(rng.uniform(0.05, 0.9))
        times = int(min(3, 1 + rng.geometric(0.6) - 1))
        kind_u = rng.random()
        if job.failure is None and u < cfg.failure_share:
            plans[job.job_id] = FailurePlan(
                at_fraction=at,
                times=max(1, times),
                kind="infra" if kind_u < cfg.infra_failure_share else "user",
                checkpoint_fraction=cfg.checkpoint_fraction,
            )
    return plans


class Simulator:
    def __init__(
        self,
        jobs: Sequence[Job],
        cluster: ClusterSpec,
        policy: Policy,
        *,
        estimator: Estimator | None = None,
        speed: SpeedModel | None = None,
        config: SimConfig | None = None,
    ):
        self.cfg = config or SimConfig()
        self.speed = speed or SpeedModel()
        self.estimator = estimator or OracleEstimator(self.speed)
        self.policy = policy
        self.spec = cluster
        self.state = ClusterState(cluster)
        ids = [j.job_id for j in jobs]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise SimulationError(f"job id {dup!r} appears twice in the workload")
        self.jobs = sorted(jobs, key=lambda j: j.submit_time)  # stable: ties keep workload order
        cycle = _dependency_cycle(self.jobs)
        if cycle is not None:  # (its stages would wait for each other for ever)
            raise SimulationError(f"the workload's dependencies form a cycle: {' -> '.join(cycle)}")
        #: failure plans: the job's own, or one assigned (seeded) for this run; jobs are never mutated
        self.failures = assign_failures(self.jobs, self.cfg)
        self.gpn = max(1, cluster.max_gpus_per_node)
        #: per node, its GPU model -- only on a cluster whose models run jobs at different speeds
        #: (`SpeedModel.gpu_types_matter`); otherwise every job runs at its given speed wherever it is
        models = [n.gpu_model for n in cluster.nodes]
        self._node_models: list[str] | None = models if self.speed.gpu_types_matter(models) else None
        if self._node_models is not None and hasattr(self.estimator, "node_gpu_models"):
            # (a learned estimator reads running jobs' progress against the speed of the GPUs they hold)
            self.estimator.node_gpu_models = self._node_models

    # ------------------------------------------------------------------ run
    def run(self, on_progress: Callable[[int, int], None] | None = None) -> SimResult:
        import time as _time

        cfg = self.cfg
        states: dict[str, JobState] = {}
        pending: dict[str, JobState] = {}  # insertion-ordered: submission order
        running: dict[str, JobState] = {}
        waiting: dict[str, JobState] = {}  # pipeline stages whose inputs are not done
        children: dict[str, list[str]] = {}
        rejected: list[tuple[str, str]] = []
        work_left: dict[str, float] = {}  # remaining solo-seconds of work (the restart overhead apart)
        #: wall seconds of restart overhead still to run (checkpoint load, warm-up): they pass at one
        #: second a second whatever the job's rate, and the job makes no progress meanwhile
        overhead_left: dict[str, float] = {}
        rate: dict[str, float] = {}
        #: per running job, the GPUs it holds with a shared one split between its jobs (`SimResult.gpu_seconds_split`)
        split_gpus: dict[str, float] = {}
        split_seconds: dict[str, float] = {}
        attempt_start_progress: dict[str, float] = {}

        total = len(self.jobs)
        arrivals = self.jobs
        ai = 0
        now = arrivals[0].submit_time if arrivals else 0.0
        start_time = now
        busy = received = useful = wasted = 0.0
        rounds = decisions = 0
        sched_seconds = 0.0
        timeline: list[tuple[float, float]] = []
        finished = 0
        wake_heap: list[float] = []
        last_busy_gpus = 0.0

        st_ = self.state
        milli_cap = float(1000 * int(st_.exists.sum()))

        shared_gpu_seconds = 0.0
        last_shared = 0.0

        def busy_gpus() -> float:
            """GPUs allocated: a GPU holding whole-GPU jobs counts once, shares by their fraction."""
            return (milli_cap - float(st_.milli_free.sum())) / 1000.0

        # what changed since the rates were last worked out: jobs whose own placement is new (started,
        # resized) and GPUs whose occupants changed (a job started on, or left, them). A running job's
        # rate depends only on its job, its placement and who else holds its GPUs, so only the jobs
        # on those GPUs need it again
        dirty_jobs: set[str] = set()
        dirty_gpus: set[tuple[int, int]] = set()

        node_models = self._node_models
        # per model, busy GPU-seconds (a cluster of mixed models only): node -> model index, summed per event
        by_model = sorted(set(node_models)) if node_models is not None else []
        model_idx = np.array([by_model.index(m) for m in node_models]) if node_models is not None else None
        busy_by_model = np.zeros(len(by_model))
        last_by_model = np.zeros(len(by_model))

        def recompute_rates() -> None:
            st = self.state
            todo = dirty_jobs
            for ng in dirty_gpus:
                todo.update(st.gpu_jobs.get(ng, ()))
            for jid in todo:
                js = running.get(jid)
                if js is None:
                    continue
                p = js.placement
                if p.gpu_milli >= 1000:
                    split_gpus[jid] = sum(1.0 / max(1, int(st.whole[ng])) for ng in p.gpus)
                else:
                    split_gpus[jid] = len(p.gpus) * p.gpu_milli / 1000.0
                co: list[Job] = []
                if p.gpu_milli >= 1000 and p.gpus:
                    seen: list[str] = []
                    for ng in p.gpus:
                        for other in st.gpu_jobs.get(ng, ()):
                            if other != jid and other not in seen:
                                seen.append(other)
                    co = [states[o].job for o in seen]
                on = () if node_models is None or not p.gpus else sorted({node_models[n] for n, _ in p.gpus})
                rate[jid] = self.speed.rate(js.job, p, co, gpus_per_node=self.gpn, gpu_models=on)
            dirty_jobs.clear()
            dirty_gpus.clear()

        fplans = self.failures

        #: per admitted or rejected job, the dependencies it waits for (those in the workload)
        job_deps: dict[str, list[str]] = {}

        def reject(js: JobState, reason: str) -> None:
            """`js` can never run: rejected with `reason`, and so is every stage waiting for it (they
            waited for ever, and the run ended blaming the policy for jobs left pending)."""
            js.status = JobStatus.REJECTED
            js.note = reason
            rejected.append((js.job_id, reason))
            for child in children.get(js.job_id, ()):
                cs = waiting.pop(child, None)
                if cs is not None:
                    reject(cs, _dependant_reason(js.job_id, reason))

        def next_fail_work(js: JobState) -> float | None:
            f = fplans.get(js.job_id)
            if f is None or js.failures >= f.times:
                return None
            if js.progress >= f.at_fraction:
                return None
            return (f.at_fraction - js.progress) * js.job.duration

        while finished + len(rejected) < total:
            # ---------------------------------------------------------- next event time
            t_next = math.inf
            if ai < len(arrivals):
                t_next = arrivals[ai].submit_time
            for jid, js in running.items():
                r = rate[jid]
                if r <= EPS:
                    continue
                w = work_left[jid]
                fw = next_fail_work(js)
                if fw is not None and fw < w:
                    w = fw
                t = now + overhead_left[jid] + w / r
                if t < t_next - EPS:
                    t_next = t
            while wake_heap and wake_heap[0] <= now + EPS:
                heapq.heappop(wake_heap)
            if wake_heap and wake_heap[0] < t_next:
                t_next = wake_heap[0]
            if cfg.tick and (running or pending):
                tick_t = (math.floor(now / cfg.tick) + 1) * cfg.tick
                t_next = min(t_next, tick_t)
            if t_next is math.inf:
                if pending or waiting:
                    stuck = list(pending.values())[:5] + list(waiting.values())[:5]
                    raise SimulationError(
                        f"policy {self.policy.name!r} left {len(pending)} jobs pending on an idle cluster "
                        f"with nothing left to happen (first: {[s.job_id for s in stuck]}); "
                        "the policy never places them"
                    )
                if running and cfg.max_time is None:
                    # (running jobs that make no progress: the loop would end with them still running)
                    raise SimulationError(
                        f"{len(running)} running jobs make no progress and nothing else is left to happen "
                        f"(first: {list(running)[:5]}, rates {[rate[j] for j in list(running)[:5]]}); "
                        "the speed model gives them rate 0"
                    )
                break
            if cfg.max_time is not None and t_next > cfg.max_time:
                t_next = cfg.max_time
            # ---------------------------------------------------------- advance
            dt = t_next - now
            if dt > 0:
                bg = last_busy_gpus
                busy += bg * dt
                if model_idx is not None:
                    busy_by_model += last_by_model * dt
                shared_gpu_seconds += last_shared * dt
                for jid, js in running.items():
                    p = js.placement
                    g = len(p.gpus) * p.gpu_milli / 1000.0
                    received += g * dt
                    js.attained += dt
                    js.gpu_attained += g * dt
                    split_seconds[jid] = split_seconds.get(jid, 0.0) + split_gpus[jid] * dt
                    oh = overhead_left[jid]
                    run_dt = dt
                    if oh > 0:  # (wall time: the restart takes as long at any rate)
                        used = min(oh, dt)
                        # (an overhead within a microsecond of its end is over: the event that ends it
                        # may fall a rounding error short of `now + oh` at large simulated times)
                        overhead_left[jid] = 0.0 if oh - used <= TIME_TOL else oh - used
                        run_dt = dt - used
                    w = rate[jid] * run_dt
                    if w > 0:
                        js.progress = min(1.0, js.progress + w / js.job.duration)
                    work_left[jid] = max(0.0, (1.0 - js.progress) * js.job.duration)
                now = t_next
            if cfg.max_time is not None and now >= cfg.max_time:
                break
            changed = False
            # ---------------------------------------------------------- completions and failures
            done_now: list[str] = []
            failed_now: list[str] = []
            for jid, js in running.items():
                f = fplans.get(jid)
                # due once less than a microsecond of work is left before the failure point (a time
                # tolerance: a fraction tolerance can leave work smaller than the clock can resolve)
                if (
                    f is not None
                    and js.failures < f.times
                    and (f.at_fraction - js.progress) * js.job.duration <= TIME_TOL
                    and overhead_left[jid] <= EPS
                ):
                    failed_now.append(jid)
                elif work_left[jid] <= max(TIME_TOL, 1e-9 * js.job.duration) and overhead_left[jid] <= EPS:
                    done_now.append(jid)
            for jid in done_now:
                js = running.pop(jid)
                dirty_gpus.update(js.placement.gpus)
                self.state.release(jid)
                js.status = JobStatus.DONE
                js.finish_time = now
                js.progress = 1.0
                getattr(self.estimator, "observe_finished", lambda *_: None)(js, now)  # learning estimators
                js.placement = None
                useful += js.job.duration * js.job.qos.gpu_demand
                finished += 1
                changed = True
                for child in children.get(jid, ()):
                    cs = waiting.get(child)
                    # (every dependency done, those that have not arrived yet included: a stage submitted
                    # before its input's job was released as soon as its other inputs were done)
                    if cs is not None and all(d in states and states[d].status is JobStatus.DONE for d in job_deps[child]):
                        waiting.pop(child)
                        cs.status = JobStatus.PENDING
                        cs.queued_since = now
                        pending[child] = cs
            for jid in failed_now:
                js = running.pop(jid)
                f = fplans[jid]
                dirty_gpus.update(js.placement.gpus)
                self.state.release(jid)
                lost = (js.progress - attempt_start_progress[jid]) * (1.0 - f.checkpoint_fraction)
                wasted += lost * js.job.duration * js.job.qos.gpu_demand
                js.progress = max(0.0, js.progress - lost)
                js.failures += 1
                js.status = JobStatus.PENDING
                js.placement = None
                js.queued_since = now
                js.note = f"failed ({f.kind}) at {f.at_fraction:.0%}; resubmitted (attempt {js.failures + 1})"
                pending[jid] = js
                changed = True
            # ---------------------------------------------------------- arrivals
            while ai < len(arrivals) and arrivals[ai].submit_time <= now + EPS:
                job = arrivals[ai]
                ai += 1
                js = JobState(job=job, queued_since=job.submit_time)
                states[job.job_id] = js
                # (a job that may start narrower, `min_gpus`, fits if a width the policy may start it on does)
                reason = self.spec.why_never_fits(job.qos, elastic=getattr(self.policy, "elastic_starts", False))
                deps = [d for d in job.depends_on if d in states or any(a.job_id == d for a in arrivals[ai:])]
                job_deps[job.job_id] = deps
                if not reason:
                    dead = next((d for d in deps if states.get(d) is not None and states[d].status is JobStatus.REJECTED), None)
                    if dead is not None:
                        reason = _dependant_reason(dead, states[dead].note)
                if reason:
                    reject(js, reason)
                    continue
                for d in deps:
                    children.setdefault(d, []).append(job.job_id)
                if any(d in states and states[d].status is not JobStatus.DONE for d in deps) or any(d not in states for d in deps):
                    js.status = JobStatus.WAITING
                    waiting[job.job_id] = js
                else:
                    pending[job.job_id] = js
                changed = True
            if wake_heap and wake_heap[0] <= now + EPS:
                changed = True
            if cfg.tick and abs(now / cfg.tick - round(now / cfg.tick)) < 1e-9:
                changed = True
            # ---------------------------------------------------------- schedule
            if changed and (pending or (self.policy.preemptive and running)):
                view = SchedulerView(
                    now=now,
                    cluster=self.state.snapshot(),
                    pending=list(pending.values()),
                    running=list(running.values()),
                    estimator=self.estimator,
                )
                t0 = _time.perf_counter()
                try:
                    decision: Decision = self.policy.schedule(view)
                    sched_seconds += _time.perf_counter() - t0
                    rounds += 1
                    all_states = states
                    commit(self.state, decision, all_states)
                except PlacementError as exc:  # a policy's invalid placement ends its run, not the comparison
                    raise SimulationError(f"policy {self.policy.name!r} at t={now:.0f} s: {exc}") from exc
                if cfg.check_invariants:
                    self.state.check_invariants()
                for jid in decision.preempt:
                    js = running.pop(jid)
                    dirty_gpus.update(js.placement.gpus)
                    js.status = JobStatus.PENDING
                    js.placement = None
                    js.preemptions += 1
                    js.queued_since = now
                    pending[jid] = js
                for p in decision.starts:
                    js = pending.pop(p.job_id)
                    js.status = JobStatus.RUNNING
                    js.placement = p
                    js.started_gpus = len(p.gpus)
                    if js.first_start is None:
                        js.first_start = now
                        overhead = 0.0
                    else:
                        js.restarts += 1
                        overhead = cfg.restart_overhead
                    js.last_start = now
                    overhead_left[p.job_id] = overhead
                    attempt_start_progress[p.job_id] = js.progress
                    work_left[p.job_id] = (1.0 - js.progress) * js.job.duration
                    running[p.job_id] = js
                    dirty_jobs.add(p.job_id)
                    dirty_gpus.update(p.gpus)
                for jid, note in decision.notes.items():
                    if jid in states:
                        states[jid].note = note
                decisions += len(decision.starts)
                for jid, _n, _c in decision.resize:
                    running[jid].placement = self.state.allocs[jid]
                    dirty_jobs.add(jid)
                wk = self.policy.next_wakeup(
                    SchedulerView(now, self.state, list(pending.values()), list(running.values()), self.estimator)
                )
                if wk is not None and wk > now + EPS:
                    heapq.heappush(wake_heap, wk)
            if dirty_jobs or dirty_gpus:  # (otherwise no allocation changed: rates and counts stand)
                recompute_rates()
                last_busy_gpus = busy_gpus()
                last_shared = float((st_.whole >= 2).sum())
                if model_idx is not None:
                    used = np.where(st_.exists, 1000 - st_.milli_free, 0).sum(axis=1) / 1000.0
                    last_by_model = np.bincount(model_idx, weights=used, minlength=len(by_model))
            timeline.append((now, last_busy_gpus))
            if on_progress is not None:
                on_progress(finished + len(rejected), total)

        return SimResult(
            policy=self.policy.name,
            estimator=getattr(self.estimator, "name", type(self.estimator).__name__),
            cluster=self.spec,
            jobs=list(states.values()),
            rejected=rejected,
            busy_gpu_seconds=busy,
            received_gpu_seconds=received,
            useful_gpu_seconds=useful,
            wasted_gpu_seconds=wasted,
            start_time=start_time,
            end_time=now,
            rounds=rounds,
            decisions=decisions,
            sched_seconds=sched_seconds,
            shared_gpu_seconds=shared_gpu_seconds,
            timeline=timeline,
            busy_gpu_seconds_by_model={m: float(v) for m, v in zip(by_model, busy_by_model)},
            gpu_seconds_split=split_seconds,
        )


def simulate(
    jobs: Sequence[Job],
    cluster: ClusterSpec,
    policy: Policy,
    *,
    estimator: Estimator | None = None,
    speed: SpeedModel | None = None,
    config: SimConfig | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    return Simulator(jobs, cluster, policy, estimator=estimator, speed=speed, config=config).run(on_progress)
