"""A packing experiment where pods leave: what knowing departures is worth.

The FGD experiment only adds pods. In a live cluster pods end, and the scheduler may know when
(the time-based scheduler estimates every job's remaining time). This experiment keeps the pods
and nodes of a list but runs them in time:

* lifetimes: each pod's own lifetime in the trace (``deletion_time - creation_time``; pods
  without both times get the mean of the others), capped at the ``cap_quantile`` (95 %) of all
  lifetimes -- the Alibaba list's tail (up to months, for pods alive at the snapshot) would
  otherwise never reach a steady state in a run of reasonable length;
* warm start: at time 0, pods drawn with probability proportional to their lifetime (the mix a
  steady state holds) until ``load`` x the cluster's GPUs were requested, each with a residual
  lifetime ``lifetime x U(0, 1)``, so the run starts near its steady state;
* arrivals: then a Poisson process; each arrival is a pod drawn uniformly from the list (a fresh
  copy with a unique name) with that pod's lifetime; the rate makes the offered GPU load ``load``
  x the cluster's GPUs (rate = load x capacity / E[GPU milli x lifetime]);
* a pod that fits nowhere is rejected (not queued); a placed pod leaves at its end time, the
  policy is told (`notify_released`);
* knowledge: ``"none"``; ``"oracle"`` (each pod's true end time); ``"noisy"`` (the true lifetime
  times a factor drawn uniformly in [1 - noise, 1 + noise], fixed per pod).

Measured over the Poisson arrivals after a warm-up (their first ``warmup`` share): the share of
the arrived GPU demand that was rejected, and the time-averaged share of GPUs allocated.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from qosflow.errors import SpecError
from qosflow.packing.experiment import node_order
from qosflow.packing.model import Node, PackState, Pod
from qosflow.packing.policies import PackingPolicy, make_policy
from qosflow.packing.workload import DEFAULT_POPULARITY, WorkloadDistribution


@dataclass
class ChurnRun:
    policy: str
    knowledge: str
    seed: int
    arrivals: int
    rejected_gpu_share: float  # of the GPU milli that arrived after the warm-up
    rejected_pods: int
    mean_alloc: float  # time-averaged allocated share of the GPUs after the warm-up
    seconds: float


def lifetimes_of(pods: Sequence[Pod], cap_quantile: float | None = None) -> np.ndarray:
    """Each pod's lifetime (s) from the trace; pods without both times get the mean of the rest;
    capped at the ``cap_quantile`` of all lifetimes if given."""
    life = np.array(
        [
            (p.deletion_time - p.creation_time)
            if p.deletion_time is not None and p.creation_time is not None and p.deletion_time > p.creation_time
            else np.nan
            for p in pods
        ]
    )
    if np.all(np.isnan(life)):
        return np.ones(len(pods))
    life = np.where(np.isnan(life), np.nanmean(life), life)
    if cap_quantile is not None:
        life = np.minimum(life, np.quantile(life, cap_quantile))
    return life


def run_churn(
    pods: Sequence[Pod],
    nodes: Sequence[Node],
    policy: str | PackingPolicy,
    seed: int,
    *,
    load: float = 1.1,
    arrivals: int = 20000,
    warmup: float = 0.1,
    cap_quantile: float = 0.95,
    knowledge: str = "none",
    noise: float = 0.3,
    workload: WorkloadDistribution | None = None,
) -> ChurnRun:
    if knowledge not in ("none", "oracle", "noisy"):
        raise SpecError("knowledge", f"must be none, oracle or noisy, got {knowledge!r}")
    if load <= 0 or arrivals < 1 or not 0 <= warmup < 1:
        raise SpecError("churn", f"need load > 0, arrivals >= 1, 0 <= warmup < 1 (got {load}, {arrivals}, {warmup})")
    pol = make_policy(policy) if isinstance(policy, str) else policy
    state = PackState(nodes, node_order(len(nodes), seed))
    life = lifetimes_of(pods, cap_quantile)
    gpu = np.array([p.total_gpu_milli for p in pods], dtype=np.float64)
    rate = load * state.total_gpu_milli / float(np.mean(gpu * life))
    rng = np.random.default_rng([seed, 31])
    idx = rng.integers(len(pods), size=arrivals)
    gaps = rng.exponential(1.0 / rate, size=arrivals)
    factor = rng.uniform(1 - noise, 1 + noise, size=arrivals) if knowledge == "noisy" else np.ones(arrivals)
    clock = {"now": 0.0}
    expected: dict[str, float] = {}
    know = None if knowledge == "none" else {"expected_end": expected, "clock": lambda: clock["now"]}
    if workload is None:
        workload = WorkloadDistribution.from_pods(pods, pol.workload_popularity or DEFAULT_POPULARITY)
    pol.prepare(state, workload, np.random.default_rng([seed, 7919]), know)
    running: list[tuple[float, int, Pod, object]] = []
    # warm start: the steady-state mix (probability ~ lifetime), residual lifetimes
    wrng = np.random.default_rng([seed, 37])
    draws = wrng.choice(len(pods), size=4 * len(pods) + 64, p=life / life.sum())
    total = 0.0
    j = 0
    while total + 1e-9 < load * state.total_gpu_milli and j < len(draws):
        i = int(draws[j])
        total += pods[i].total_gpu_milli
        pod = replace(pods[i], name=f"{pods[i].name}#w{j}")
        end = float(life[i]) * float(wrng.uniform())
        f = float(wrng.uniform(1 - noise, 1 + noise))
        expected[pod.name] = end * f if knowledge == "noisy" else end
        j += 1
        pl = pol.choose(state, pod)
        if pl is None:
            expected.pop(pod.name, None)
            continue
        state.place(pod, pl)
        pol.notify_placed(state, pod, pl)
        heapq.heappush(running, (end, -j, pod, pl))
    t = 0.0
    start = int(warmup * arrivals)
    arrived = rejected = 0.0
    rejected_pods = 0
    area, t_measure = 0.0, None
    t0 = time.perf_counter()
    for k in range(arrivals):
        t_next = t + gaps[k]
        # departures up to the arrival, integrating the allocation in between
        while running and running[0][0] <= t_next:
            end, _, pod, pl = heapq.heappop(running)
            if t_measure is not None:
                area += state.allocated_gpu_milli * (end - t)
            t = end
            state.release(pod, pl)
            pol.notify_released(state, pod, pl)
            expected.pop(pod.name, None)
        if t_measure is not None:
            area += state.allocated_gpu_milli * (t_next - t)
        t = t_next
        clock["now"] = t
        if k == start:
            t_measure = t
        src = pods[int(idx[k])]
        pod = replace(src, name=f"{src.name}#{k}")
        end = t + float(life[idx[k]])
        expected[pod.name] = t + float(life[idx[k]]) * float(factor[k])
        pl = pol.choose(state, pod)
        if k >= start:
            arrived += pod.total_gpu_milli
        if pl is None:
            expected.pop(pod.name, None)
            if k >= start:
                rejected += pod.total_gpu_milli
                rejected_pods += 1
            continue
        state.place(pod, pl)
        pol.notify_placed(state, pod, pl)
        heapq.heappush(running, (end, k, pod, pl))
    span = t - (t_measure or 0.0)
    mean_alloc = area / span / state.total_gpu_milli if span > 0 else float("nan")
    return ChurnRun(
        pol.name, knowledge, seed, arrivals, rejected / arrived if arrived else 0.0, rejected_pods, mean_alloc,
        time.perf_counter() - t0,
    )
