"""qosflow's packing policy for GPU-sharing clusters (``qosflow`` in the packing registry).

It keeps FGD's idea -- place each pod where it destroys the least capacity the *expected
workload* could still use (Weng et al., "Beware of Fragmentation", USENIX ATC'23) -- and fixes
three blind spots of FGD's measure that cost GPUs on real pod lists:

1. **Memory and CPU as well as GPUs.** For each task type m of the workload, the capacity of a
   node that m can use is the free milli-GPU on the GPUs with at least m's share free (FGD's rule),
   but only if the node also has m's CPU *and memory* (the type's median memory; FGD ignores
   memory, so it happily fills a node's memory and strands its GPUs).
2. **Stranded GPUs.** A node whose free CPU (or memory) is short of what its free GPUs need, at the
   workload's average CPU (memory) per GPU, will keep GPUs idle whatever arrives; FGD only notices
   this when not even one pod fits. The packer counts the GPU milli the node's free CPU and memory
   cannot feed, ``max(0, free_gpu - min(free_cpu / rho_cpu, free_mem / rho_mem))``, as a fragment
   for every type (``rho`` = the workload's CPU and memory per milli-GPU, CPU-only pods included:
   they eat the same cores).
3. **Availability-weighted types.** Losing capacity that many types can use is cheap; losing the
   last capacity a type can use is not. Each type's weight is its frequency p_m times
   ``free capacity / capacity usable by m`` (both over the whole cluster, updated after every
   placement). Types that fit everywhere keep FGD's weight; types that need a scarce GPU model, a
   fully free 8-GPU node, a node with 120 cores, or a large share of one GPU gain weight as their
   options shrink -- so the packer keeps scarce capacity for the pods that can use nothing else.

Score and ties follow FGD: the growth of the weighted fragmentation Delta (in milli-GPU, averaged
over the types) is turned into the simulator's integer score ``int(sigmoid(-Delta/1000) * 100)``;
the highest score wins, ties go to the first node in the node order (which consolidates, as
first-fit). Inside a node a share takes the GPU with the best score (lowest index on ties), whole
GPUs the lowest-index free ones.

**Pods that leave soon** (optional, ``prepare(..., knowledge=...)``): given each pod's expected end
time and a clock, the packer treats the resources of running pods as partly free -- fully when
the pod ends now, not at all when it ends a ``horizon`` or more from now (linear in between, in
quarter steps) -- and measures fragmentation on that *effective* state. A node about to empty
then counts as (almost) whole again, so long-running shares stay off it; capacity that frees soon
is no longer treated as lost. The arrival-only FGD experiment has no departures, so this is off
there. Knowledge keys:

* ``expected_end``: mapping pod name -> expected end time, or a callable ``pod -> time | None``;
* ``clock``: callable returning the current time (or ``now``: a fixed time);
* ``horizon``: seconds over which "soon" fades (default: a tenth of the median expected lifetime
  of the last 1,024 pods placed). Long horizons hurt: the packer then plans for a cluster that
  does not exist yet -- it keeps nodes that will empty "later" clean and crowds the pods that
  arrive now onto the rest (see the churn experiment in docs/packing.md).

``explain(state, pod)`` says why a pod goes where it goes (cost by type, stranding, the runner-up
and what decided between them). `fractional_scorer` in `qosflow.packing.scorer` exposes the same
measure to the time-based scheduler (`qosflow.policies.placement.find_share`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from qosflow.errors import SpecError
from qosflow.packing.fgd import fgd_score
from qosflow.packing.model import MILLI, PackState, Placement, Pod
from qosflow.packing.policies import PackingPolicy, register_policy, whole_gpus_first
from qosflow.packing.workload import WorkloadDistribution

#: how many request types keep a cached loss table (least recently used ones are dropped);
#: a share's table is nodes x GPUs x (types + 1) float64, ~2.4 MB on the Alibaba list
CACHE_KEYS = 64
#: departure weights are rounded to this step, so that node caches do not churn every second
LAMBDA_STEP = 0.25
#: default departure horizon, as a fraction of the median expected lifetime of recently placed
#: pods. In the churn experiment (docs/packing.md) horizons of 0.1-0.5 x the median lifetime
#: changed rejections by -0.5..0 points, horizons >= 1 x made them 0.7-1.4 points worse.
DEFAULT_HORIZON_FRACTION = 0.1


class CapacityModel:
    """The expected workload as arrays, and how much of a node each type of it can still use.

    Only GPU types are kept as columns (CPU-only types can use no GPU capacity; as in FGD they
    count all free GPU milli as fragment, which moves every placement of a pod by the same amount
    and only enters through the normalisation `cpu_prob`).
    """

    def __init__(
        self,
        workload: WorkloadDistribution,
        models: Sequence[str],
        *,
        memory: bool = True,
        balance: bool = True,
    ):
        gpu = (workload.num_gpu > 0) & (workload.gpu_milli > 0)
        if not gpu.any():
            raise SpecError("workload", "has no GPU task type; the packer needs GPU requests to measure fragmentation")
        self.workload = workload
        self.models = tuple(models)
        self.cpu_t = workload.cpu_milli[gpu].astype(np.int64)
        self.num_t = workload.num_gpu[gpu].astype(np.int64)
        self.milli_t = workload.gpu_milli[gpu].astype(np.int64)
        mem = workload.memory_mib if (memory and workload.memory_mib is not None) else None
        self.mem_t = np.zeros_like(self.cpu_t) if mem is None else mem[gpu].astype(np.int64)
        self.prob_t = workload.prob[gpu].astype(np.float64)
        self.cpu_prob = float(workload.prob[~gpu].sum())
        self.spec_t = tuple(s for s, g in zip(workload.gpu_spec, gpu) if g)
        self.access = workload.access_matrix(self.models)[:, gpu]
        self.balance = balance
        # the workload's CPU and memory per milli-GPU (CPU-only pods included: same cores)
        gpu_total = float((workload.prob * workload.num_gpu * workload.gpu_milli).sum())
        self.rho_cpu = float((workload.prob * workload.cpu_milli).sum()) / gpu_total
        self.rho_mem = float((workload.prob * mem).sum()) / gpu_total if mem is not None else 0.0
        self.labels = tuple(
            f"{n}x{m}m/{c / 1000:g}c" + (f"[{'|'.join(s)}]" if s else "")
            for n, m, c, s in zip(self.num_t, self.milli_t, self.cpu_t, self.spec_t)
        )

    def __len__(self) -> int:
        return len(self.prob_t)

    # -- per node ---------------------------------------------------------------------------------
    def stats(self, gpu_left: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cnt, above, total): GPUs with >= each type's milli free, their free milli, all free milli."""
        g = np.asarray(gpu_left)
        ge = g[..., :, None] >= self.milli_t
        return ge.sum(axis=-2), np.where(ge, g[..., :, None], 0).sum(axis=-2), g.sum(axis=-1)

    def usable(self, cnt, above, cpu, mem, access) -> np.ndarray:
        """Milli-GPU each type can use: its GPUs' free milli if the node can host one such pod."""
        ok = (cnt >= self.num_t) & (np.asarray(cpu)[..., None] >= self.cpu_t) & access
        ok &= np.asarray(mem)[..., None] >= self.mem_t
        return np.where(ok, above, 0)

    def stranded(self, total, cpu, mem) -> np.ndarray:
        """Free milli-GPU the node's free CPU / memory cannot feed at the workload's ratios."""
        if not self.balance:
            return np.zeros(np.shape(total))
        cpu = np.asarray(cpu, dtype=np.float64)
        feed = cpu / self.rho_cpu if self.rho_cpu > 0 else np.full(cpu.shape, np.inf)
        if self.rho_mem > 0:
            feed = np.minimum(feed, np.asarray(mem, dtype=np.float64) / self.rho_mem)
        return np.maximum(0.0, np.asarray(total, dtype=np.float64) - feed)

    def after_share(self, cnt, above, total, v, cpu2, mem2, access, milli):
        """Usable (K, G, T) and stranded (K, G) after taking ``milli`` from GPU g (free ``v``[k, g])."""
        mt = self.milli_t
        v = np.asarray(v)
        v2 = v - milli
        old = v[..., None] >= mt
        new = v2[..., None] >= mt
        cnt2 = cnt[:, None, :] - old + new
        above2 = above[:, None, :] - np.where(old, v[..., None], 0) + np.where(new, v2[..., None], 0)
        u2 = self.usable(cnt2, above2, np.asarray(cpu2)[:, None], np.asarray(mem2)[:, None], access[:, None, :])
        s2 = self.stranded((total - milli)[:, None], np.asarray(cpu2)[:, None], np.asarray(mem2)[:, None])
        return u2, np.broadcast_to(s2, v.shape)

    def after_whole(self, cnt, above, total, cpu2, mem2, access, num):
        """Usable (K, T) and stranded (K,) after taking ``num`` completely free GPUs (0: CPU only)."""
        cnt2 = cnt - num  # every type's milli is <= 1000, so a free GPU counted for all of them
        above2 = above - num * MILLI
        return self.usable(cnt2, above2, cpu2, mem2, access), self.stranded(total - num * MILLI, cpu2, mem2)


@dataclass
class _KeyCache:
    stamp: np.ndarray  # (N,) node version the rows were computed at
    loss: np.ndarray  # (N, C, T+1) float64 whole milli: lost usable milli per type, then the change of stranded milli
    #: (N, C) for shares: the GPUs worth scoring -- the first of each group of equal GPUs that fit
    rep: np.ndarray | None = None


@dataclass
class Explanation:
    """Why a pod goes where it goes (or why it fits nowhere)."""

    pod: str
    placement: Placement | None
    score: int | None
    delta: float | None  # weighted fragmentation growth (milli-GPU)
    feasible_nodes: int
    reason: str
    #: (type label, weight, lost usable milli, weighted cost) for the types that cost most here
    costs: list[tuple[str, float, float, float]] = field(default_factory=list)
    stranded_change: float = 0.0
    runner_up: tuple[int, int, float] | None = None  # (node, score, delta) of the best other node

    def __str__(self) -> str:
        return self.reason


@register_policy("qosflow")
class QosflowPacker(PackingPolicy):
    """FGD's gradient on a CPU/memory-aware, stranding-aware, availability-weighted measure."""

    description = "fragmentation + stranded GPUs vs the expected workload, scarce types weighted up; departures-aware"
    #: FGD's target workload (types covering 95 % of the pods). 99 % left 4 GPUs fewer idle in the
    #: arrival experiment but rejected 1.6 points more GPU demand in the churn experiment
    #: (docs/packing.md), so the packer keeps FGD's setting.
    workload_popularity = None
    #: about 9 x first fit's time per run on the Alibaba default lists
    relative_cost = 9.0

    def __init__(
        self,
        *,
        memory: bool = True,
        balance: bool = True,
        scarcity: bool = True,
        random_ties: bool = False,
    ):
        super().__init__(random_ties)
        self.use_memory = memory
        self.use_balance = balance
        self.use_scarcity = scarcity
        self.model: CapacityModel | None = None

    # -- setup ------------------------------------------------------------------------------------
    def setup(self, state: PackState) -> None:
        workload = self.required_workload("the qosflow packer")
        self.model = CapacityModel(workload, state.models, memory=self.use_memory, balance=self.use_balance)
        n, t = len(state), len(self.model)
        self._state_id = id(state)
        self._acc = self.model.access[state.model_idx]  # (N, T)
        self._stamp = np.full(n, -1, dtype=np.int64)
        # per node: float64 (exact for the integer milli of the real state; departures make fractions)
        self._cnt = np.zeros((n, t), dtype=np.int64)
        self._above = np.zeros((n, t))
        self._total = np.zeros(n)
        self._usable = np.zeros((n, t))
        self._strand = np.zeros(n)
        self._usable_sum = np.zeros(t)
        self._keys: dict[tuple, _KeyCache] = {}
        # departures
        self._eff_version = np.zeros(n, dtype=np.int64)
        self._bonus_cpu = np.zeros(n)
        self._bonus_mem = np.zeros(n)
        self._bonus_gpu = np.zeros((n, state.max_gpus))
        self._dep = _Departures.from_knowledge(self.knowledge, state.max_gpus)

    def _ensure(self, state: PackState) -> None:
        if self.model is None or getattr(self, "_state_id", None) != id(state):
            self.prepare(state, self.workload, self.rng, self.knowledge)

    # -- node state (real, or effective with departures) -------------------------------------------
    def _versions(self, state: PackState) -> np.ndarray:
        return state.version + self._eff_version

    def _node_arrays(self, state: PackState, rows: np.ndarray):
        cpu, mem, g = state.cpu_left[rows], state.mem_left[rows], state.gpu_left[rows]
        if self._dep is None:
            return cpu, mem, g
        return (
            cpu + self._bonus_cpu[rows],
            mem + self._bonus_mem[rows],
            np.minimum(MILLI, g + self._bonus_gpu[rows]) * state.gpu_exists[rows],
        )

    def _refresh_departures(self, state: PackState) -> None:
        if self._dep is None:
            return
        cpu, mem, gpu = self._dep.bonus(len(state), state.max_gpus)
        changed = (cpu != self._bonus_cpu) | (mem != self._bonus_mem) | (gpu != self._bonus_gpu).any(axis=1)
        if changed.any():
            self._bonus_cpu, self._bonus_mem, self._bonus_gpu = cpu, mem, gpu
            self._eff_version[changed] += 1

    def _refresh_nodes(self, state: PackState) -> np.ndarray:
        ver = self._versions(state)
        rows = np.flatnonzero(self._stamp != ver)
        if rows.size:
            m = self.model
            cpu, mem, g = self._node_arrays(state, rows)
            cnt, above, total = m.stats(g)
            u = m.usable(cnt, above, cpu, mem, self._acc[rows])
            self._usable_sum += (u - self._usable[rows]).sum(axis=0)
            self._cnt[rows], self._above[rows], self._total[rows] = cnt, above, total
            self._usable[rows] = u
            self._strand[rows] = m.stranded(total, cpu, mem)
            self._stamp[rows] = ver[rows]
        return ver

    # -- costs ------------------------------------------------------------------------------------
    def weights(self, state: PackState) -> np.ndarray:
        """Per-type weights (T,): frequency x (free capacity / capacity usable by the type)."""
        self._ensure(state)
        self._refresh_departures(state)
        self._refresh_nodes(state)
        return self._weights()

    def _weights(self) -> np.ndarray:
        m = self.model
        if not self.use_scarcity:
            return m.prob_t.copy()
        free = float(self._total.sum())
        return m.prob_t * (free / np.maximum(self._usable_sum, MILLI))

    def _losses(self, state: PackState, pod: Pod, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(K, C, T+1) lost usable milli per type and change of stranded milli, for rows; for a share
        also (K, C) which GPUs represent their group of equal GPUs (the others are left at 0)."""
        m = self.model
        cpu, mem, g = self._node_arrays(state, rows)
        cpu2, mem2 = cpu - pod.cpu_milli, mem - pod.memory_mib
        cnt, above, total, acc = self._cnt[rows], self._above[rows], self._total[rows], self._acc[rows]
        before_u, before_s = self._usable[rows], self._strand[rows]
        if pod.is_fractional:
            # only one GPU per distinct free value and node (equal GPUs give equal results), and
            # only GPUs that can take the share; the others stay 0 (never read: masked as unfit)
            k, c = g.shape
            real = state.gpu_left[rows]  # equal effective and real free milli: equal loss and fit
            key = np.where((real >= pod.gpu_milli) & state.gpu_exists[rows], g * 4096.0 + real, -1.0)
            order = np.argsort(key, axis=1, kind="stable")
            sk = np.take_along_axis(key, order, axis=1)
            valid = sk >= 0
            first = valid.copy()
            first[:, 1:] &= sk[:, 1:] != sk[:, :-1]
            gid = (np.cumsum(first.ravel()) - 1).reshape(k, c)
            rk, cj = np.nonzero(first)
            u2, s2 = m.after_share(
                cnt[rk], above[rk], total[rk], g[rk, order[rk, cj]][:, None], cpu2[rk], mem2[rk], acc[rk], pod.gpu_milli
            )
            rep = np.rint(np.concatenate([before_u[rk] - u2[:, 0, :], (s2[:, 0] - before_s[rk])[:, None]], axis=1))
            srt = np.zeros((k, c, rep.shape[1]))
            srt[valid] = rep[gid[valid]]
            out = np.empty_like(srt)
            out[np.arange(k)[:, None], order] = srt
            is_rep = np.zeros((k, c), dtype=bool)
            is_rep[rk, order[rk, cj]] = True
            return out, is_rep
        else:
            u2, s2 = m.after_whole(cnt, above, total, cpu2, mem2, acc, pod.num_gpu)
            lost = (before_u - u2)[:, None, :]
            ds = (s2 - before_s)[:, None]
        # whole milli: identical node states give bit-identical costs, ties stay ties
        return np.rint(np.concatenate([lost, ds[..., None]], axis=-1)), None

    def _key_cache(self, state: PackState, pod: Pod, fit: np.ndarray, ver: np.ndarray) -> _KeyCache:
        key = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli)
        entry = self._keys.pop(key, None)  # re-inserted below: the dict order is the LRU order
        if entry is None:
            if len(self._keys) >= CACHE_KEYS:
                self._keys.pop(next(iter(self._keys)))
            c = state.max_gpus if pod.is_fractional else 1
            entry = _KeyCache(
                np.full(len(state), -1, dtype=np.int64),
                np.zeros((len(state), c, len(self.model) + 1)),
                np.zeros((len(state), c), dtype=bool) if pod.is_fractional else None,
            )
        self._keys[key] = entry
        stale = np.flatnonzero((entry.stamp != ver) & fit)
        if stale.size:
            loss, rep = self._losses(state, pod, stale)
            entry.loss[stale] = loss
            if rep is not None:
                entry.rep[stale] = rep
            entry.stamp[stale] = ver[stale]
        return entry

    def _scores(self, state: PackState, pod: Pod):
        """(fit mask, per-node score, per-node GPU for a share, per-node delta, weights)."""
        self._ensure(state)
        self._refresh_departures(state)
        ver = self._refresh_nodes(state)
        fit = state.fit_mask(pod)
        rows = np.flatnonzero(fit)
        n = len(state)
        score = np.full(n, -1, dtype=np.int64)
        gpu = np.full(n, -1, dtype=np.int64)
        delta = np.full(n, np.inf)
        w = self._weights()
        if rows.size == 0:
            return fit, score, gpu, delta, w
        entry = self._key_cache(state, pod, fit, ver)
        tw = float(w.sum()) + self.model.cpu_prob
        wall = np.append(w, 1.0 if self.use_balance else 0.0)
        if pod.is_fractional:
            # the representative GPUs of the fitting nodes (a GPU equal to a lower-index one ties with it)
            ki, ci = np.nonzero(entry.rep[rows])
            d = np.round((entry.loss[rows[ki], ci] @ wall - pod.total_gpu_milli * tw) / tw, 6)  # no float noise
            sc = fgd_score(d)
            o = np.lexsort((ci, -sc, ki))  # per node: best score, then lowest GPU index
            o = o[np.r_[True, ki[o][1:] != ki[o][:-1]]] if o.size else o
            nodes = rows[ki[o]]
            score[nodes], gpu[nodes], delta[nodes] = sc[o], ci[o], d[o]
        else:
            d = np.round(((entry.loss[:, 0] @ wall)[rows] - pod.total_gpu_milli * tw) / tw, 6)  # no copy of the table
            score[rows], delta[rows] = fgd_score(d), d
        return fit, score, gpu, delta, w

    # -- the interface ----------------------------------------------------------------------------
    def choose(self, state: PackState, pod: Pod) -> Placement | None:
        fit, score, gpu, _, _ = self._scores(state, pod)
        node = self.pick(state, score, fit & (score >= 0))
        if node is None:
            return None
        return self._placement(state, pod, node, gpu)

    @staticmethod
    def _placement(state: PackState, pod: Pod, node: int, gpu: np.ndarray) -> Placement:
        if pod.num_gpu == 0:
            return Placement(node)
        if pod.is_fractional:
            return Placement(node, (int(gpu[node]),))
        return Placement(node, whole_gpus_first(state, node, pod))

    def explain(self, state: PackState, pod: Pod, top: int = 3) -> Explanation:
        """Where `choose` would put the pod and why (does not change the state or the choice)."""
        fit, score, gpu, delta, w = self._scores(state, pod)
        ok = fit & (score >= 0)
        node = self.pick(state, score, ok)
        nfit = int(ok.sum())
        if node is None:
            why = _why_no_fit(state, pod)
            return Explanation(pod.name, None, None, None, 0, f"{pod.name} fits nowhere: {why}")
        pl = self._placement(state, pod, node, gpu)
        m = self.model

        def breakdown(n: int) -> tuple[list[tuple[str, float, float, float]], float]:
            loss = self._losses(state, pod, np.array([n]))[0][0]
            lost = loss[int(gpu[n]) if pod.is_fractional else 0]
            weighted = lost[:-1] * w
            order = np.argsort(-weighted)[:top]
            return [(m.labels[t], float(w[t]), float(lost[t]), float(weighted[t])) for t in order if weighted[t] > 0], float(lost[-1])

        def describe(costs, dstrand) -> str:
            out = []
            if costs:
                out.append("costs most to " + ", ".join(f"{lab} (loses {lo:.0f} milli, weight {wt:.3g})" for lab, wt, lo, _ in costs))
            if abs(dstrand) >= 1:
                out.append(f"GPUs the node's CPU/memory cannot feed {dstrand:+.0f} milli")
            return "; ".join(out)

        costs, dstrand = breakdown(node)
        others = np.flatnonzero(ok)
        others = others[others != node]
        runner = None
        if others.size:
            r = int(others[np.lexsort((state.node_rank[others], -score[others]))[0]])
            runner = (r, int(score[r]), float(delta[r]))
        name = state.nodes[node].name
        if pod.is_fractional:
            g0 = pl.gpus[0]
            left = int(state.gpu_left[node, g0])
            where = f"{name} GPU {g0} ({left} -> {left - pod.gpu_milli} milli free)"
        else:
            where = name
        parts = [
            f"{pod.name} -> {where}: score {score[node]} (fragmentation {delta[node]:+.0f} milli-GPU, "
            f"weighted over {len(m)} task types), best of {nfit} nodes that fit"
        ]
        here = describe(costs, dstrand)
        if here:
            parts.append("here it " + here)
        if runner is not None:
            rname = state.nodes[runner[0]].name
            if runner[1] < score[node]:
                there = describe(*breakdown(runner[0]))
                parts.append(
                    f"next best {rname}: score {runner[1]} (fragmentation {runner[2]:+.0f}" + (f"; there it {there})" if there else ")")
                )
            else:
                how = "at random" if self.random_ties else "by node order (consolidates, as first-fit)"
                parts.append(f"tied with {rname} (score {runner[1]}), broken {how}")
        return Explanation(
            pod.name, pl, int(score[node]), float(delta[node]), nfit, "; ".join(parts), costs, dstrand, runner
        )

    def notify_placed(self, state: PackState, pod: Pod, placement: Placement) -> None:
        if self._dep is not None:
            self._dep.add(pod, placement)

    def notify_released(self, state: PackState, pod: Pod, placement: Placement) -> None:
        if self._dep is not None:
            self._dep.remove(pod, placement)


def _why_no_fit(state: PackState, pod: Pod) -> str:
    cpu = state.cpu_left >= pod.cpu_milli
    mem = state.mem_left >= pod.memory_mib
    model = state.model_mask(pod.gpu_spec) if pod.num_gpu else np.ones(len(state), dtype=bool)
    gpus = state.gpu_fit_mask(pod)
    what = "a GPU with" if pod.is_fractional else f"{pod.num_gpu} free GPU(s)" if pod.num_gpu else ""
    checks = [
        (f"{pod.cpu_milli} milli-CPU", cpu),
        (f"{pod.memory_mib} MiB", mem),
    ]
    if pod.num_gpu:
        checks.insert(0, (f"{what} {pod.gpu_milli} milli free" if pod.is_fractional else what, gpus & model))
    out = [f"{int(mask.sum())} nodes have {label}" for label, mask in checks]
    both = cpu & mem & model & gpus
    return ", ".join(out) + f", {int(both.sum())} all of it"


class _Departures:
    """Running pods with expected end times -> the resources that free soon, per node."""

    def __init__(self, expected_end, clock: Callable[[], float], horizon: float | None, max_gpus: int):
        self.expected_end = expected_end
        self.clock = clock
        self.horizon = horizon
        size = 1024
        self.node = np.zeros(size, dtype=np.int64)
        self.cpu = np.zeros(size)
        self.mem = np.zeros(size)
        self.gpu = np.zeros((size, max_gpus))
        self.end = np.full(size, np.inf)
        self.active = np.zeros(size, dtype=bool)
        self.slots: dict[tuple[str, int], list[int]] = {}
        self.free: list[int] = list(range(size - 1, -1, -1))
        #: expected lifetimes of the last placed pods (for the default horizon)
        self.lifetimes: deque[float] = deque(maxlen=1024)

    @classmethod
    def from_knowledge(cls, knowledge: Mapping[str, Any], max_gpus: int) -> "_Departures | None":
        ends = knowledge.get("expected_end") if knowledge else None
        if ends is None:
            return None
        if "clock" in knowledge:
            clock = knowledge["clock"]
            if not callable(clock):
                raise SpecError("knowledge.clock", "must be a callable returning the current time")
        elif "now" in knowledge:
            now = float(knowledge["now"])
            clock = lambda: now  # noqa: E731
        else:
            raise SpecError("knowledge", "expected_end needs a 'clock' (callable) or 'now' (time) to compare with")
        if not callable(ends) and not isinstance(ends, Mapping):
            raise SpecError("knowledge.expected_end", "must map pod names to end times or be a callable pod -> time")
        horizon = knowledge.get("horizon")
        if horizon is not None and not horizon > 0:
            raise SpecError("knowledge.horizon", f"must be > 0 seconds, got {horizon}")
        return cls(ends, clock, horizon, max_gpus)

    def _end_of(self, pod: Pod) -> float | None:
        e = self.expected_end(pod) if callable(self.expected_end) else self.expected_end.get(pod.name)
        return None if e is None else float(e)

    def _grow(self) -> None:
        old = len(self.end)
        for name in ("node", "cpu", "mem", "end", "active"):
            arr = getattr(self, name)
            fill = np.inf if name == "end" else 0
            setattr(self, name, np.concatenate([arr, np.full(old, fill, dtype=arr.dtype)]))
        self.gpu = np.concatenate([self.gpu, np.zeros_like(self.gpu)])
        self.free.extend(range(2 * old - 1, old - 1, -1))

    def add(self, pod: Pod, placement: Placement) -> None:
        end = self._end_of(pod)
        if end is None:
            return
        life = end - float(self.clock())
        if life > 0:
            self.lifetimes.append(life)
        if not self.free:
            self._grow()
        i = self.free.pop()
        self.node[i], self.cpu[i], self.mem[i], self.end[i] = placement.node, pod.cpu_milli, pod.memory_mib, end
        self.gpu[i] = 0
        for g in placement.gpus:
            self.gpu[i, g] = pod.gpu_milli
        self.active[i] = True
        self.slots.setdefault((pod.name, placement.node), []).append(i)

    def remove(self, pod: Pod, placement: Placement) -> None:
        lst = self.slots.get((pod.name, placement.node))
        if not lst:
            return
        i = lst.pop()
        if not lst:
            del self.slots[(pod.name, placement.node)]
        self.active[i] = False
        self.end[i] = np.inf
        self.free.append(i)

    def bonus(self, n: int, max_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node: CPU, memory and per-GPU milli counted as free because their pods end soon."""
        idx = np.flatnonzero(self.active)
        cpu, mem, gpu = np.zeros(n), np.zeros(n), np.zeros((n, max_gpus))
        if idx.size == 0:
            return cpu, mem, gpu
        now = float(self.clock())
        left = np.maximum(0.0, self.end[idx] - now)
        h = self.horizon
        if h is None:  # a tenth of a typical new pod's lifetime (see DEFAULT_HORIZON_FRACTION)
            typical = float(np.median(self.lifetimes)) if self.lifetimes else float(np.median(left))
            h = DEFAULT_HORIZON_FRACTION * typical
        if h <= 0:
            lam = (left <= 0).astype(np.float64)
        else:
            lam = np.clip(1.0 - left / h, 0.0, 1.0)
        lam = np.round(lam / LAMBDA_STEP) * LAMBDA_STEP
        sel = lam > 0
        if sel.any():
            i, lam = idx[sel], lam[sel]
            nodes = self.node[i]
            cpu = np.bincount(nodes, weights=lam * self.cpu[i], minlength=n)
            mem = np.bincount(nodes, weights=lam * self.mem[i], minlength=n)
            for g in range(max_gpus):
                gpu[:, g] = np.bincount(nodes, weights=lam * self.gpu[i, g], minlength=n)
        return cpu, mem, gpu
