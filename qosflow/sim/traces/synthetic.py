"""A synthetic Philly-like workload: Gavel's published job distribution (the embedded default).

Per job (Narayanan et al., OSDI'20, the distribution behind Gavel's generated traces):

* GPUs: 1 (p=0.7), 2 (0.1), 4 (0.15), 8 (0.05);
* duration: ``60 x 10^U(1.5, 3)`` s with p=0.8 (32 min to 16.7 h), else ``60 x 10^U(3, 4)`` s
  (16.7 h to 6.9 days); mean about 16.8 h;
* model: uniform over Gavel's job types measured at that many GPUs (every 1-GPU type; only
  ResNet-18/50, Transformer and LM were measured on 2-8 GPUs), so every job's interference and
  throughput come from the measured table;
* arrivals: Poisson, at `rate_per_hour` jobs per hour; or, given a target `load`, a Poisson process
  stretched so that the sample offers exactly that load: its GPU-seconds equal
  ``load x cluster GPUs x (last arrival - first arrival)``, counting only the jobs that can run on
  the cluster (rejected ones offer it nothing). (The expected rate for a load,
  `rate_for_load`, would leave a 400-job sample anywhere between 0.7x and 1.1x the target, the
  duration tail being that heavy.)

That load is the steady-state one (arrival rate x mean GPU-seconds per job / GPUs): it reaches the
cluster only once the arrival window is long against the long jobs (up to 6.9 days). A sample with
few jobs per GPU arrives within a day or two, so most of its work (that of its few long jobs) runs
after the last arrival: `--jobs 60` on 64 GPUs asks, while its jobs arrive, for a quarter to a half
of the GPUs on average and hardly ever for more than the cluster has, so jobs barely wait and the
policies give nearly the same schedule. A faster arrival rate would not make it a steady load 1.0:
60 jobs ask for about 110 GPUs in all, so however close together they arrive, their mean demand
over the arrival window stays under about half of that (bunched up, they are a burst, not a load).
`offered_load` measures this and `qosflow simulate` warns; about 6 jobs per GPU (the default 400
on 64 GPUs) keep three quarters of the work inside the window.

Deterministic for a seed (numpy's PCG64). QoS as for Gavel's traces: shareable, gang, GPU memory
from the job type, 4 cores per GPU.

Users (`users`, none by default, as in the traces): `users=N` gives each job one of N users `user1` ..
`userN`, drawn with Zipf-like shares (user k: proportional to 1/k, so `user1` submits the most), or
`users=[0.6, 0.2, 0.2]` with those shares; drawn from a stream of their own, so the jobs themselves are
the same as without users (fairness between users: `QosflowPolicy(fair_share=...)`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job
from qosflow.core.qos import QoSSpec
from qosflow.errors import SpecError
from qosflow.sim.interference import GAVEL_GPU_MEM_MB, GavelInterference, gavel_batch_size, gpu_mem_mb
from qosflow.sim.traces._common import CORES_PER_GPU, Rejected, split_rejected

GPU_CHOICES = (1, 2, 4, 8)
GPU_PROBS = (0.7, 0.1, 0.15, 0.05)
SHORT_SHARE = 0.8
SHORT_EXP = (1.5, 3.0)
LONG_EXP = (3.0, 4.0)

DEFAULT_JOBS = 400
DEFAULT_LOAD = 1.0
#: job types Gavel measured on several GPUs (the others only ran on one)
MULTI_GPU_FAMILIES = ("ResNet-18", "ResNet-50", "Transformer", "LM")


def _mean_pow10(lo: float, hi: float) -> float:
    """E[10^U(lo, hi)]."""
    return (10**hi - 10**lo) / ((hi - lo) * math.log(10))


def mean_duration() -> float:
    """Expected duration (s) of a job of the distribution (about 60,400 s)."""
    return 60.0 * (SHORT_SHARE * _mean_pow10(*SHORT_EXP) + (1 - SHORT_SHARE) * _mean_pow10(*LONG_EXP))


def mean_gpus() -> float:
    return float(sum(g * p for g, p in zip(GPU_CHOICES, GPU_PROBS)))


def rate_for_load(load: float, cluster_gpus: int) -> float:
    """Jobs per hour that offer `load` x the cluster's GPU capacity (GPUs and duration independent)."""
    return load * cluster_gpus / (mean_gpus() * mean_duration()) * 3600.0


#: jobs per GPU at which a sample keeps most of its work inside its arrival window (median share
#: of the work inside it for 10 seeds on 64 GPUs: 0.38 at 1 job per GPU, 0.59 at 3, 0.77 at 6,
#: 0.93 at 16)
JOBS_PER_GPU = 6
#: below this share of its load (at most 1) inside the arrival window a sample barely queues (`OfferedLoad.thin`)
THIN_SHARE = 0.5


@dataclass(frozen=True)
class OfferedLoad:
    """The load a workload offers `gpus` GPUs, as if every job started on arrival (`offered_load`)."""

    gpus: int
    jobs: int
    #: seconds from the first arrival to the last
    window: float
    #: all the jobs' GPU-seconds over gpus x window: what `generate_synthetic`'s `load` sets
    load: float
    #: the GPU-seconds that fall inside the window, over gpus x window: the cluster's mean demand while
    #: jobs arrive (the rest, mostly long jobs' work, runs after the last arrival)
    during_arrivals: float
    #: most GPUs asked for at once
    peak_gpus: int
    #: share of the window in which more GPUs are asked for than the cluster has
    over_capacity: float

    @property
    def thin(self) -> bool:
        """Too few jobs for the GPUs: jobs will hardly wait, whatever the policy. They never ask for
        more than the GPUs, or less than half their load (at most the whole cluster) while they arrive."""
        return self.peak_gpus <= self.gpus or self.during_arrivals < THIN_SHARE * min(self.load, 1.0)

    def to_json(self) -> dict:
        return {**asdict(self), "thin": self.thin}


def offered_load(jobs: Sequence[Job], gpus: int) -> OfferedLoad:
    """How much of `gpus` GPUs `jobs` ask for if each starts on arrival and runs its duration alone."""
    if gpus <= 0:
        raise SpecError("gpus", f"must be > 0, got {gpus}")
    if not jobs:
        return OfferedLoad(gpus, 0, 0.0, 0.0, 0.0, 0, 0.0)
    a = np.array([j.submit_time for j in jobs], dtype=float)
    d = np.array([j.duration for j in jobs], dtype=float)
    g = np.array([j.qos.gpus for j in jobs], dtype=float)
    start, end = float(a.min()), float(a.max())
    window = end - start
    # demand over time: +g at arrival, -g at arrival + duration (ends before starts at the same time)
    times = np.concatenate([a, a + d])
    steps = np.concatenate([g, -g])
    order = np.lexsort((steps, times))
    times, level = times[order], np.cumsum(steps[order])
    peak = int(level.max())
    if window <= 0:
        return OfferedLoad(gpus, len(jobs), 0.0, math.inf, math.inf, peak, 1.0 if peak > gpus else 0.0)
    inside = float(np.sum(g * np.minimum(d, end - a)))
    # time in [start, end] during which the level after an event exceeds the GPUs
    nxt = np.minimum(np.append(times[1:], end), end)
    over = float(np.sum(np.clip(nxt - np.clip(times, start, end), 0.0, None)[level > gpus]))
    return OfferedLoad(
        gpus=gpus,
        jobs=len(jobs),
        window=window,
        load=float(np.sum(g * d)) / (gpus * window),
        during_arrivals=inside / (gpus * window),
        peak_gpus=peak,
        over_capacity=over / window,
    )


def job_types(table: GavelInterference | None = None) -> dict[int, tuple[str, ...]]:
    """Gavel job types by GPU count, from the table if given, else from the built-in type list."""
    if table is not None:
        out = {g: tuple(t for t in table.job_types if g in table.scales(t)) for g in GPU_CHOICES}
        if all(out.values()):
            return out
    one = tuple(sorted(GAVEL_GPU_MEM_MB))
    multi = tuple(t for t in one if t.split(" (", 1)[0] in MULTI_GPU_FAMILIES)
    return {1: one, 2: multi, 4: multi, 8: multi}


def _user_shares(users) -> np.ndarray | None:
    """The users' shares of the jobs (`generate_synthetic`'s `users`), summing to 1; None: no users."""
    if users is None:
        return None
    if isinstance(users, bool) or not (isinstance(users, int) or (isinstance(users, Sequence) and not isinstance(users, str))):
        raise SpecError("users", f"give a number of users (Zipf-like shares) or a list of shares, got {users!r}")
    if isinstance(users, int):
        if users < 1:
            raise SpecError("users", f"must be at least 1 user, got {users}")
        w = 1.0 / np.arange(1, users + 1)
    else:
        if not users or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0 for x in users):
            raise SpecError("users", f"shares must be positive numbers, got {users!r}")
        w = np.asarray(users, dtype=float)
    return w / w.sum()


def generate_synthetic(
    num_jobs: int = DEFAULT_JOBS,
    *,
    seed: int = 0,
    rate_per_hour: float | None = None,
    load: float | None = DEFAULT_LOAD,
    cluster_gpus: int = 64,
    cluster: ClusterSpec | None = None,
    table: GavelInterference | None = None,
    cores_per_gpu: float = CORES_PER_GPU,
    users: int | Sequence[float] | None = None,
) -> tuple[list[Job], list[Rejected]]:
    """`num_jobs` Philly-like jobs; rejected (id, reason) for those that never fit `cluster`.

    Give `rate_per_hour` (it wins if both are given), or `load`: the GPU load this sample offers
    over its arrival window, relative to `cluster_gpus` (or to the cluster's GPUs when `cluster` is
    given); only the jobs that can run on `cluster` count. The first job (that can run, given a
    `load`) arrives at t=0.
    """
    if isinstance(num_jobs, bool) or not isinstance(num_jobs, int) or num_jobs <= 0:
        raise SpecError("num_jobs", f"must be a positive number of jobs, got {num_jobs!r}")
    if cluster is not None:
        cluster_gpus = cluster.num_gpus
    if rate_per_hour is None:
        if load is None or not (math.isfinite(load) and load > 0):
            raise SpecError("load", f"give a positive offered load or an arrival rate, got load={load!r}")
        if cluster_gpus <= 0:
            raise SpecError("cluster_gpus", f"must be > 0 to turn a load into arrivals, got {cluster_gpus}")
    elif not (math.isfinite(rate_per_hour) and rate_per_hour > 0):
        raise SpecError("rate_per_hour", f"must be > 0 jobs per hour, got {rate_per_hour!r}")
    shares = _user_shares(users)
    types = job_types(table)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, size=num_jobs)  # unit-rate Poisson process, scaled below
    gaps[0] = 0.0
    unit_arrivals = np.cumsum(gaps)
    gpu_idx = rng.choice(len(GPU_CHOICES), size=num_jobs, p=GPU_PROBS)
    short = rng.random(num_jobs) < SHORT_SHARE
    u = rng.random(num_jobs)
    exps = np.where(short, SHORT_EXP[0] + u * (SHORT_EXP[1] - SHORT_EXP[0]), LONG_EXP[0] + u * (LONG_EXP[1] - LONG_EXP[0]))
    durations = 60.0 * np.power(10.0, exps)
    gpu_counts = np.array(GPU_CHOICES)[gpu_idx]
    picks = rng.random(num_jobs)
    # (users from a stream of their own: the jobs are the same with or without them)
    who = None if shares is None else np.random.default_rng([seed, 0x75736572]).choice(len(shares), size=num_jobs, p=shares)
    jobs: list[Job] = []
    for i in range(num_jobs):
        g = int(gpu_counts[i])
        choices = types[g]
        model = choices[min(int(picks[i] * len(choices)), len(choices) - 1)]
        qos = QoSSpec(gpus=g, gpu_mem_mb=gpu_mem_mb(model), cpu_cores=cores_per_gpu * g, shareable=True, gang=True)
        meta = {"trace": "synthetic", "seed": seed, "priority_from_trace": False, "long": not bool(short[i])}
        steps = None
        if table is not None:
            tput = table.throughput(model, g)
            if tput:
                steps = max(1, int(tput * float(durations[i])))
                meta["throughput"] = tput
        jobs.append(
            Job(
                job_id=f"syn-{i}",
                submit_time=float(unit_arrivals[i]),  # scaled below
                qos=qos,
                duration=float(durations[i]),
                model=model,
                batch_size=gavel_batch_size(model),
                iterations=steps,
                user=None if who is None else f"user{int(who[i]) + 1}",
                meta=meta,
            )
        )
    index = {j.job_id: i for i, j in enumerate(jobs)}
    jobs, rejected = split_rejected(jobs, cluster)
    if rate_per_hour is not None:
        for j in jobs:
            j.submit_time *= 3600.0 / rate_per_hour
    elif jobs:
        # the heavy duration tail makes one sample's load stray far from its expectation (0.7-1.1x
        # for 400 jobs): stretch the Poisson process so that this sample offers exactly `load`, i.e.
        # its GPU-seconds equal load x GPUs x its arrival window (first to last arrival). Only the
        # jobs that can run on the cluster count: the rejected ones offer it nothing (8-GPU jobs on
        # 4-GPU nodes left 60 jobs at 0.54-0.97 of the target), and the first of them arrives at 0
        kept = np.array([index[j.job_id] for j in jobs])
        work = float(np.sum(gpu_counts[kept] * durations[kept]))
        first = float(unit_arrivals[kept[0]])
        span = float(unit_arrivals[kept[-1]]) - first
        stretch = work / (load * cluster_gpus) / span if span > 0 else 1.0
        for j in jobs:
            j.submit_time = (j.submit_time - first) * stretch
    return jobs, rejected
