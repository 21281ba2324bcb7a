"""The FGD packing experiment (Weng et al., USENIX ATC'23, section 6.1 "workload inflation").

Procedure, as in the authors' simulator (kubernetes-scheduler-simulator, run with
``--shuffle-pod=true -tune 1.3 -tuneseed <seed>``):

1. Arrivals: the pod list in a seeded random order; once it is exhausted, pods are drawn from the
   list uniformly *with replacement* and appended, until the next one would take the GPU
   requested beyond ``ratio`` (130 %) of the cluster's GPU capacity. (Should the list itself ask
   for more than that, the shuffled list is cut there.) The order depends only on the seed, so all
   policies see the same arrivals.
2. The scheduler's node order is a seeded random permutation (the simulator prefixes node names
   with ``rand.Perm``); policies break score ties in favour of the node that comes first.
3. Each pod is placed by the policy or fails (never retried). Nothing leaves.
4. After every arrival we record the arrived GPU request and the allocated GPU milli.
5. The curve: for every integer percentage p of arrived demand (arrived milli / capacity,
   rounded), the mean allocation ratio over the arrivals at that percentage (the authors'
   ``merge_alloc_discrete`` analysis; a percentage with no arrival takes those within +-1).
   The headline is p = 100; "unallocated GPUs" = total GPUs x (1 - allocation ratio), i.e. the
   idle milli summed over all GPUs / 1000. Averaged over seeds (the paper uses 10: 42..51).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from qosflow.errors import SpecError
from qosflow.packing.model import Node, PackState, Pod
from qosflow.packing.policies import PackingPolicy, is_builtin_policy, make_policy
from qosflow.packing.workload import DEFAULT_POPULARITY, WorkloadDistribution

DEFAULT_RATIO = 1.3
PERCENTS = np.arange(0, 131)


def arrival_sequence(pods: Sequence[Pod], capacity_milli: int, seed: int, ratio: float = DEFAULT_RATIO) -> np.ndarray:
    """Indices into ``pods`` in arrival order (see the module docstring)."""
    if not pods:
        raise SpecError("pods", "the pod list is empty")
    if ratio <= 0:
        raise SpecError("ratio", f"must be > 0, got {ratio}")
    req = np.array([p.total_gpu_milli for p in pods], dtype=np.int64)
    if req.sum() == 0:
        raise SpecError("pods", "no pod asks for a GPU; the packing experiment needs GPU requests")
    limit = ratio * capacity_milli
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pods))
    cum = np.cumsum(req[order])
    if cum[-1] > limit:  # the list alone is more than enough: cut it where it would go beyond
        return order[: int(np.searchsorted(cum, limit, side="right"))]
    total = int(cum[-1])
    extra: list[np.ndarray] = []
    batch = max(1024, len(pods))
    while True:
        draws = rng.integers(len(pods), size=batch)
        c = total + np.cumsum(req[draws])
        over = np.flatnonzero(c > limit)
        if over.size:
            extra.append(draws[: over[0]])
            break
        extra.append(draws)
        total = int(c[-1])
    return np.concatenate([order, *extra])


def node_order(num_nodes: int, seed: int) -> np.ndarray:
    """The seeded node order of a run (a permutation of node indices, first = preferred)."""
    return np.random.default_rng([seed, 1]).permutation(num_nodes)


@dataclass
class PackingRun:
    """One policy, one seed: per-arrival records."""

    policy: str
    seed: int
    total_gpus: int
    arrived_milli: np.ndarray  # (E,) cumulative GPU milli requested after each arrival
    allocated_milli: np.ndarray  # (E,) GPU milli allocated after each arrival
    failed: np.ndarray  # (E,) bool, this arrival could not be placed
    seconds: float
    placements: list = field(default_factory=list, repr=False)  # (pod index, node, gpus) if kept

    @property
    def capacity_milli(self) -> int:
        return self.total_gpus * 1000

    def curve(self) -> np.ndarray:
        """Allocation ratio (0..1) at each arrived percentage 0..130 (NaN where undefined)."""
        return allocation_curve(self.arrived_milli, self.allocated_milli, self.capacity_milli)

    def at_percent(self, pct: int = 100) -> dict[str, float]:
        """Headline figures at ``pct`` % arrived demand."""
        curve = self.curve()
        ratio = float(curve[pct]) if pct < len(curve) else float("nan")
        arrived_pct = np.rint(self.arrived_milli / self.capacity_milli * 100)
        upto = arrived_pct <= pct
        failed = int(self.failed[upto].sum())
        return {
            "alloc_ratio": ratio,
            "allocated_gpus": ratio * self.total_gpus,
            "unallocated_gpus": (1.0 - ratio) * self.total_gpus,
            "failed_pods": failed,
            "arrived_pods": int(upto.sum()),
        }


def allocation_curve(arrived_milli: np.ndarray, allocated_milli: np.ndarray, capacity_milli: int) -> np.ndarray:
    """Mean allocation ratio at each integer arrived percentage 0..130 (the reference analysis).

    A percentage no arrival rounds to takes the arrivals within +-1 point (as the reference);
    failing that (coarse lists where one pod is several percent of the cluster), the state after
    the last arrival at or below it. Percentages beyond the last arrival are NaN.
    """
    arrived = np.asarray(arrived_milli) / capacity_milli * 100
    arrived_pct = np.rint(arrived).astype(np.int64)
    alloc = np.asarray(allocated_milli) / capacity_milli
    n = len(PERCENTS)
    inside = (arrived_pct >= 0) & (arrived_pct < n)
    sums = np.bincount(arrived_pct[inside], weights=alloc[inside], minlength=n)[:n]
    counts = np.bincount(arrived_pct[inside], minlength=n)[:n]
    out = np.full(n, np.nan)
    have = counts > 0
    out[have] = sums[have] / counts[have]
    last = arrived[-1] if len(arrived) else -1.0
    for p in np.flatnonzero(~have):
        near = np.abs(arrived_pct - p) <= 1
        if near.any():
            out[p] = alloc[near].mean()
        elif p <= last:
            i = int(np.searchsorted(arrived, p, side="right")) - 1
            out[p] = alloc[i] if i >= 0 else 0.0
    return out


def run_packing(
    pods: Sequence[Pod],
    nodes: Sequence[Node],
    policy: str | PackingPolicy,
    seed: int,
    *,
    ratio: float = DEFAULT_RATIO,
    workload: WorkloadDistribution | None = None,
    knowledge: Mapping[str, Any] | None = None,
    sequence: np.ndarray | None = None,
    seeded_node_order: bool = True,
    keep_placements: bool = False,
) -> PackingRun:
    """Run one policy with one seed (arrivals from `arrival_sequence` unless given).

    ``seeded_node_order=False`` keeps the node list's order for tie-breaking and first-fit.
    """
    pol = make_policy(policy) if isinstance(policy, str) else policy
    state = PackState(nodes, node_order(len(nodes), seed) if seeded_node_order else None)
    if workload is None:
        workload = WorkloadDistribution.from_pods(pods, pol.workload_popularity or DEFAULT_POPULARITY)
    if sequence is None:
        sequence = arrival_sequence(pods, state.total_gpu_milli, seed, ratio)
    # the policy's own randomness gets its own stream, so the arrivals do not depend on the policy
    pol.prepare(state, workload, np.random.default_rng([seed, 7919]), knowledge)
    e = len(sequence)
    arrived = np.empty(e, dtype=np.int64)
    allocated = np.empty(e, dtype=np.int64)
    failed = np.zeros(e, dtype=bool)
    placements = []
    total = 0
    t0 = time.perf_counter()
    for j, i in enumerate(sequence):
        pod = pods[int(i)]
        total += pod.total_gpu_milli
        placement = pol.choose(state, pod)
        if placement is None:
            failed[j] = True
        else:
            state.place(pod, placement)
            pol.notify_placed(state, pod, placement)
            if keep_placements:
                placements.append((int(i), placement.node, placement.gpus))
        arrived[j] = total
        allocated[j] = state.allocated_gpu_milli
    seconds = time.perf_counter() - t0
    return PackingRun(pol.name, seed, state.total_gpus, arrived, allocated, failed, seconds, placements)


@dataclass
class PolicySummary:
    policy: str
    runs: list[PackingRun]

    def curves(self) -> np.ndarray:
        return np.vstack([r.curve() for r in self.runs])

    def to_dict(self, pct: int = 100) -> dict[str, Any]:
        per = [r.at_percent(pct) for r in self.runs]
        ratios = np.array([p["alloc_ratio"] for p in per])
        total = self.runs[0].total_gpus
        # a seed whose arrivals stop short of `pct` % of capacity has no figure there: it is left
        # out of the mean and named, never averaged in silently
        short = [r.seed for r, p in zip(self.runs, per) if not np.isfinite(p["alloc_ratio"])]
        finite = ratios[np.isfinite(ratios)]
        mean = float(finite.mean()) if finite.size else float("nan")
        # the failures up to `pct` % are averaged over the same seeds as the allocation: with the short
        # seeds' (fewer arrivals, so fewer failures) in it, the table paired one seed's allocation with
        # the failures of three
        counted = [p["failed_pods"] for p in per if np.isfinite(p["alloc_ratio"])]
        return {
            "allocated_gpus": round(mean * total, 1),
            "unallocated_gpus": round((1 - mean) * total, 1),
            "alloc_ratio": round(mean, 5),
            "failed_pods": round(float(np.mean(counted)), 1) if counted else float("nan"),
            "alloc_ratio_std": round(float(finite.std()), 5) if finite.size else float("nan"),
            "seeds_short_of_demand": short,
            "total_gpus": total,
            "arrived_percent": pct,
            "failed_pods_130": round(float(np.mean([int(r.failed.sum()) for r in self.runs])), 1),
            "alloc_ratio_130": round(float(np.mean([r.allocated_milli[-1] / r.capacity_milli for r in self.runs])), 5),
            "seconds_per_run": round(float(np.mean([r.seconds for r in self.runs])), 3),
            "per_seed": [
                {"seed": r.seed, "alloc_ratio": round(p["alloc_ratio"], 5), "failed_pods": p["failed_pods"],
                 "seconds": round(r.seconds, 3)}
                for r, p in zip(self.runs, per)
            ],
        }


#: below this many pods x runs (each run sees about 1.3 x the pods arrive) the experiment runs in this process by default:
#: worker processes would take longer to start than the runs
SMALL_EXPERIMENT = 20_000

_WORKER: dict[str, Any] = {}


def _worker_init(_queue, pods, nodes, ratio, knowledge, workloads, sequences) -> None:
    _WORKER.update(pods=pods, nodes=nodes, ratio=ratio, knowledge=knowledge, workloads=workloads, sequences=sequences)


def _worker_run(task: tuple[int, str]) -> tuple[int, str, PackingRun]:
    seed, name = task
    w = _WORKER
    run = run_packing(w["pods"], w["nodes"], name, seed, ratio=w["ratio"], workload=w["workloads"][name],
                      knowledge=w["knowledge"], sequence=w["sequences"][seed])
    return seed, name, run


def run_experiment(
    pods: Sequence[Pod],
    nodes: Sequence[Node],
    policies: Sequence[str],
    seeds: Sequence[int],
    *,
    ratio: float = DEFAULT_RATIO,
    popularity: float = DEFAULT_POPULARITY,
    knowledge: Mapping[str, Any] | None = None,
    on_start: Callable[[], None] | None = None,
    on_run: Callable[[PackingRun], None] | None = None,
    workers: int = 1,
    start_method: str | None = None,
) -> dict[str, PolicySummary]:
    """Every policy on every seed, with the same arrivals per seed for all policies.

    With `workers` > 1 the runs of qosflow's own policies go to that many worker processes
    (`qosflow.workers`; a policy registered by the caller's code runs here). The results are the
    same, in the same order. `on_start` is called once the workers have started (before any run),
    `on_run` with each run as it finishes."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    for name in policies:
        make_policy(name)  # fail fast on an unknown name
    if not seeds:
        raise SpecError("seeds", "need at least one seed")
    workload = WorkloadDistribution.from_pods(pods, popularity)
    # each policy's target workload: the experiment's, or its own (e.g. qosflow: every request type)
    workloads = {}
    for name in policies:
        pop = make_policy(name).workload_popularity
        workloads[name] = workload if pop is None else WorkloadDistribution.from_pods(pods, pop)
    capacity = PackState(nodes).total_gpu_milli
    sequences = {seed: arrival_sequence(pods, capacity, seed, ratio) for seed in seeds}
    tasks = [(seed, name) for seed in seeds for name in policies]
    from qosflow.workers import remote_runs, start_pool

    remote = remote_runs(tasks, workers, lambda t: is_builtin_policy(t[1]))
    runs: dict[tuple[int, str], PackingRun] = {}
    pool = None
    try:
        if remote:
            pool, _queue, _method = start_pool(min(workers, len(remote)), _worker_init,
                                               (list(pods), list(nodes), ratio, knowledge, workloads, sequences), start_method)
            # the costliest first (`qosflow.workers.remote_runs`)
            results = pool.imap_unordered(_worker_run, sorted(remote, key=lambda t: -make_policy(t[1]).relative_cost))
        if on_start is not None:
            on_start()
        here = set(tasks) - set(remote)
        for seed, name in tasks:
            if (seed, name) not in here:
                continue
            run = runs[seed, name] = run_packing(pods, nodes, name, seed, ratio=ratio, workload=workloads[name],
                                                 knowledge=knowledge, sequence=sequences[seed])
            if on_run is not None:
                on_run(run)
        if remote:
            for seed, name, run in results:
                runs[seed, name] = run
                if on_run is not None:
                    on_run(run)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    out = {name: PolicySummary(make_policy(name).name, []) for name in policies}
    for seed, name in tasks:
        out[name].runs.append(runs[seed, name])
    return out
