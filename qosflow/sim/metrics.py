"""Metrics of a simulation run, and the lower bounds they are judged against.

* DSR (deadline satisfaction ratio): share of jobs with a deadline that finished by it.
* JCT: finish - submit (average, median, p99); queueing delay: first start - submit.
* makespan: last finish - first submission.
* GPU utilisation: GPU-seconds allocated / (GPUs x makespan). This is *allocation*, the only
  utilisation a simulator can honestly report; it is not a measured SM utilisation.
* bounds: the mean isolated duration (no scheduler can beat it on average JCT) and the DSR of
  deadlines that are feasible at all (deadline >= isolated duration).
* DSR by job class (`dsr_by_class`): the deadline jobs grouped by GPU count and isolated duration,
  and how many of each group met their deadline -- which jobs a policy loses (short gangs, say,
  that a non-preemptive policy cannot start in time) rather than only how many.
* per user (`per_user`, when the jobs carry two users or more, `Job.user`; the jobs with none count as
  one user, as the qosflow policy's fair share counts them): each user's jobs, average JCT and slowdown
  (JCT / duration alone), deadlines met and GPU-hours held (a GPU two jobs share counting half to each,
  so that the users' GPU-hours add up to the GPU-hours allocated); and Jain's index over the users'
  average slowdowns (`jain_index`: 1 when every user is slowed alike, 1/n when one user bears it all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from qosflow.core.job import JobStatus
from qosflow.policies.qosflow_policy.ordering import job_user  # (who a job's user is, as the fair share takes it)
from qosflow.sim.engine import SimResult


@dataclass
class Metrics:
    policy: str
    estimator: str
    jobs: int
    finished: int
    rejected: int
    avg_jct: float
    median_jct: float
    p99_jct: float
    makespan: float
    avg_queue: float
    dsr: float
    deadline_jobs: int
    gpu_util: float
    #: share of allocated GPU-time on GPUs shared by two jobs
    shared_share: float
    avg_slowdown: float
    preemptions: int
    #: jobs whose last start was on fewer GPUs than they asked for (elastic starts, `QoSSpec.min_gpus`)
    elastic_starts: int
    restarts: int
    failures: int
    wasted_gpu_hours: float
    sched_seconds: float
    decisions: int
    #: on a cluster of mixed GPU models: per model, the share of its GPU-time allocated over the makespan
    gpu_util_by_model: dict[str, float] = field(default_factory=dict)
    #: deadline jobs per class (`job_class`), in class order: {"4 GPUs, < 1 h": {"jobs": n, "met": m}}
    dsr_by_class: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per user, when the jobs carry two or more (`user_metrics`; empty otherwise): {"alice": {"jobs": n, ...}};
    #: its "gpu_hours" count a GPU shared by k jobs as 1/k to each
    per_user: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    #: Jain's index over the users' average slowdowns (`jain_index`); None with fewer than two users
    jain_slowdown: float | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        if not self.deadline_jobs:  # no deadline to meet: no ratio (the table shows "-"), not 100 %
            d["dsr"] = None
        # {"per_user": {"users": {...}, "jain_slowdown": x}}, only when the jobs carry two users or more
        users, jain = d.pop("per_user"), d.pop("jain_slowdown")
        if users:
            d["per_user"] = {"users": users, "jain_slowdown": jain}
        return d


@dataclass
class Bounds:
    avg_jct: float
    dsr: float
    #: max(span, total work over the GPUs); the work part assumes exclusive GPUs, so a policy that
    #: shares GPUs (two jobs at more than half speed each) can beat it, while no policy beats `span`
    makespan: float
    #: the last arrival plus its own duration (no job runs faster than alone)
    span: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


#: GPU-count groups of `job_class`: (largest count in the group, label)
GPU_CLASSES = ((0, "no GPU"), (1, "1 GPU"), (2, "2 GPUs"), (4, "3-4 GPUs"), (8, "5-8 GPUs"), (float("inf"), "> 8 GPUs"))
#: duration groups of `job_class` (the job's isolated duration): (upper end in seconds, label)
DURATION_CLASSES = ((3600.0, "< 1 h"), (6 * 3600.0, "1-6 h"), (86400.0, "6 h-1 d"), (3 * 86400.0, "1-3 d"), (float("inf"), "> 3 d"))


def job_class(job) -> tuple[int, int, str]:
    """(GPU group, duration group, label) of `job`: its GPU demand (a fraction of a GPU counts as one; a
    CPU-only stage is "no GPU") and its isolated duration, e.g. (3, 0, "3-4 GPUs, < 1 h")."""
    g = job.qos.gpu_demand
    g = 1.0 if 0 < g < 1 else g
    gi = next(i for i, (top, _) in enumerate(GPU_CLASSES) if g <= top)
    di = next(i for i, (top, _) in enumerate(DURATION_CLASSES) if job.duration < top)
    return gi, di, class_label(gi, di)


def class_label(gi: int, di: int) -> str:
    """The label of GPU group `gi` and duration group `di`, e.g. "3-4 GPUs, < 1 h"."""
    return f"{GPU_CLASSES[gi][1]}, {DURATION_CLASSES[di][1]}"


#: label -> (GPU group, duration group): the order classes are listed in
CLASS_ORDER = {class_label(gi, di): (gi, di) for gi in range(len(GPU_CLASSES)) for di in range(len(DURATION_CLASSES))}


def _dsr_by_class(with_dl, met) -> dict[str, dict[str, int]]:
    counts: dict[tuple[int, int, str], list[int]] = {}
    for j in with_dl:
        c = counts.setdefault(job_class(j.job), [0, 0])
        c[0] += 1
        c[1] += j.job_id in met
    return {k[2]: {"jobs": v[0], "met": v[1]} for k, v in sorted(counts.items())}


def jain_index(xs) -> float:
    """Jain's fairness index of `xs`: (sum x)^2 / (n x sum x^2), 1 when all are equal, 1/n when one holds
    everything (Jain, Chiu and Hawe, 1984); 1.0 for no values or only zeros (nothing to share unevenly)."""
    xs = [float(x) for x in xs]
    sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * sq) if xs and sq > 0 else 1.0


#: the name `user_metrics` gives the jobs that carry no user (`Job.user` None), counted as one user
NO_USER = "(no user)"


def user_metrics(jobs, gpu_seconds: Mapping[str, float] | None = None) -> dict[str, dict[str, float | int | None]]:
    """Per user of `jobs` (a run's `JobState`s; rejected ones left out), in the order of their names:
    "jobs" (not rejected), "finished", "avg_jct" and "avg_slowdown" (over the finished jobs; None if
    none finished), "deadline_jobs" and "met" (finished by the deadline), "gpu_hours" (GPU-time the
    user's jobs held, restarts and overheads included, a GPU shared by k jobs counting 1/k to each: the
    users' GPU-hours add up to the GPU-hours allocated). The jobs without a user are one user, `NO_USER`.

    `gpu_seconds`: per job id, its GPU-seconds so counted (the run's `SimResult.gpu_seconds_split`; a job
    not in it held none). Without it, each job's `JobState.gpu_attained`, which counts a shared GPU fully
    for each of its jobs: the same only when no GPU was shared."""
    acc: dict[str | None, dict[str, list | float | int]] = {}
    for js in jobs:
        if js.status is JobStatus.REJECTED:
            continue
        a = acc.setdefault(job_user(js.job), {"jobs": 0, "jct": [], "slow": [], "dl": 0, "met": 0, "gpu_s": 0.0})
        a["jobs"] += 1
        a["gpu_s"] += js.gpu_attained if gpu_seconds is None else gpu_seconds.get(js.job_id, 0.0)
        done = js.status is JobStatus.DONE and js.finish_time is not None
        if done:
            jct = js.finish_time - js.job.submit_time
            a["jct"].append(jct)
            a["slow"].append(jct / js.job.duration if js.job.duration > 0 else 1.0)
        if js.job.deadline is not None:
            a["dl"] += 1
            a["met"] += done and js.finish_time <= js.job.deadline + 1e-6
    out = {}
    for u in sorted(acc, key=lambda u: _natural(NO_USER if u is None else u)):
        a = acc[u]
        out[NO_USER if u is None else u] = {
            "jobs": a["jobs"],
            "finished": len(a["jct"]),
            "avg_jct": float(np.mean(a["jct"])) if a["jct"] else None,
            "avg_slowdown": float(np.mean(a["slow"])) if a["slow"] else None,
            "deadline_jobs": a["dl"],
            "met": int(a["met"]),
            "gpu_hours": a["gpu_s"] / 3600.0,
        }
    return out


def _natural(name: str) -> list:
    """Sort key putting user2 before user10."""
    import re

    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t]


def users_jain(per_user: dict[str, dict]) -> float | None:
    """Jain's index over the average slowdowns of the users in `per_user` (`user_metrics`) that finished a
    job; None with fewer than two such users."""
    xs = [u["avg_slowdown"] for u in per_user.values() if u["avg_slowdown"] is not None]
    return jain_index(xs) if len(xs) > 1 else None


def compute_metrics(res: SimResult) -> Metrics:
    done = [j for j in res.jobs if j.status is JobStatus.DONE]
    jct = np.array([j.finish_time - j.job.submit_time for j in done]) if done else np.array([0.0])
    queue = np.array([(j.first_start if j.first_start is not None else j.finish_time) - j.job.submit_time for j in done]) if done else np.array([0.0])
    slow = np.array([(j.finish_time - j.job.submit_time) / j.job.duration for j in done]) if done else np.array([0.0])
    with_dl = [j for j in res.jobs if j.job.deadline is not None and j.status is not JobStatus.REJECTED]
    met_ids = {j.job_id for j in with_dl if j.status is JobStatus.DONE and j.finish_time <= j.job.deadline + 1e-6}
    met = len(met_ids)
    first_submit = min((j.job.submit_time for j in res.jobs), default=0.0)
    last_finish = max((j.finish_time for j in done), default=first_submit)
    makespan = last_finish - first_submit
    n_gpus = res.cluster.num_gpus
    util = res.busy_gpu_seconds / (n_gpus * makespan) if makespan > 0 and n_gpus else 0.0
    return Metrics(
        policy=res.policy,
        estimator=res.estimator,
        jobs=len(res.jobs),
        finished=len(done),
        rejected=len(res.rejected),
        avg_jct=float(jct.mean()),
        median_jct=float(np.median(jct)),
        p99_jct=float(np.percentile(jct, 99)),
        makespan=float(makespan),
        avg_queue=float(queue.mean()),
        dsr=float(met / len(with_dl)) if with_dl else 1.0,
        deadline_jobs=len(with_dl),
        gpu_util=float(util),
        shared_share=float(res.shared_gpu_seconds / res.busy_gpu_seconds) if res.busy_gpu_seconds else 0.0,
        avg_slowdown=float(slow.mean()),
        preemptions=sum(j.preemptions for j in res.jobs),
        elastic_starts=sum(1 for j in res.jobs if j.started_gpus is not None and 0 < j.started_gpus < j.job.qos.gpus),
        restarts=sum(j.restarts for j in res.jobs),
        failures=sum(j.failures for j in res.jobs),
        wasted_gpu_hours=res.wasted_gpu_seconds / 3600.0,
        sched_seconds=res.sched_seconds,
        decisions=res.decisions,
        gpu_util_by_model=_util_by_model(res, makespan),
        dsr_by_class=_dsr_by_class(with_dl, met_ids),
        **_per_user(res.jobs, res.gpu_seconds_split),
    )


def _per_user(jobs, gpu_seconds: Mapping[str, float]) -> dict:
    """Metrics' `per_user` and `jain_slowdown`: filled when the jobs carry two users or more."""
    if len({job_user(js.job) for js in jobs if js.status is not JobStatus.REJECTED}) < 2:
        return {}
    users = user_metrics(jobs, gpu_seconds)
    return {"per_user": users, "jain_slowdown": users_jain(users)}


def _util_by_model(res: SimResult, makespan: float) -> dict[str, float]:
    """Per GPU model, its GPUs' allocated share of the makespan (empty unless the engine ran jobs at
    per-model speeds, i.e. on a cluster of mixed models)."""
    gpus: dict[str, int] = {}
    for n in res.cluster.nodes:
        gpus[n.gpu_model] = gpus.get(n.gpu_model, 0) + n.gpus
    return {m: float(v / (gpus[m] * makespan)) for m, v in res.busy_gpu_seconds_by_model.items()
            if makespan > 0 and gpus.get(m)}


def compute_bounds(jobs, cluster, speed=None) -> Bounds:
    """Lower bounds on this workload: for any policy (average JCT, DSR, `span`), and for any
    policy on exclusive GPUs (`makespan`, which counts the total work at one job per GPU). On a
    cluster of mixed GPU models (`speed`: the simulator's `SpeedModel`), each job counts at its speed
    on the fastest model it may use.

    A job whose full width never fits the cluster but a narrower one of its widths does (`QoSSpec.min_gpus`)
    counts as a policy that starts jobs narrower runs it (`Policy.elastic_starts`; the others reject it): on
    the widest width that fits, w of its g GPUs, at w/g of its speed, so its time alone is g/w x its
    duration, and its work as many GPU-seconds as on all g. Only a job that fits at no width is left out. (A
    policy that rejects such a job is measured without it, its average JCT and DSR over the jobs it ran, while
    the bounds count it.)"""
    # (elastic jobs change no bound otherwise: on w of g GPUs a job runs at w/g of its speed, ending no sooner
    # than on all g, as many GPU-seconds)
    width: dict[str, int] = {}  # (its GPU count when that fits: a rigid job, a fractional or CPU-only one)
    for j in jobs:
        w = cluster.widest_width(j.qos)
        if w is not None:
            width[j.job_id] = w
    admitted = [j for j in jobs if j.job_id in width]
    if not admitted:
        return Bounds(0.0, 1.0, 0.0)
    # per job, its duration alone on all its GPUs at its best speed (the work it holds GPUs for, per GPU)
    solo = {j.job_id: j.duration for j in admitted}
    if speed is not None and speed.gpu_types_matter([n.gpu_model for n in cluster.nodes]):
        for j in admitted:
            if j.qos.gpus > 0:
                ok = cluster.model_mask(j.qos.gpu_model)
                solo[j.job_id] = j.duration / max(speed.gpu_speed(j, m) for m in {n.gpu_model for n, y in zip(cluster.nodes, ok) if y})
    # its time alone: on w of its g GPUs, g/w x that
    best = {j.job_id: solo[j.job_id] * (j.qos.gpus / width[j.job_id] if 0 < width[j.job_id] < j.qos.gpus else 1.0)
            for j in admitted}
    avg = float(np.mean([best[j.job_id] for j in admitted]))
    dl = [j for j in admitted if j.qos.deadline is not None]
    feasible = sum(1 for j in dl if j.qos.deadline >= best[j.job_id])
    first = min(j.submit_time for j in admitted)
    # the last arrival plus its own duration, and total work over capacity
    span = max(j.submit_time + best[j.job_id] for j in admitted) - first
    work = sum(solo[j.job_id] * j.qos.gpu_demand for j in admitted) / max(1, cluster.num_gpus)
    return Bounds(avg_jct=avg, dsr=feasible / len(dl) if dl else 1.0, makespan=float(max(span, work)), span=float(span))
