"""Fragmentation Gradient Descent (FGD) -- Weng et al., USENIX ATC'23.

Paper: "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient
Descent" (Qizhen Weng, Lingyun Yang, Yinghao Yu, Wei Wang, Xiaochen Tang, Guodong Yang, Liping
Zhang; USENIX ATC 2023). This module follows the paper and the authors' simulator
(kubernetes-scheduler-simulator: ``FGDScore`` plugin, ``NodeGpuShareFragAmount`` in
``pkg/utils/frag.go``); the code here is our own.

Fragmentation of a node against a target workload (paper section 4.1). For each task type m of
the workload (probability p_m, see `WorkloadDistribution`):

* if m cannot run on the node at all -- too little free CPU, not enough GPUs with at least
  m's milli free, a GPU model m does not accept, or m is a CPU-only task -- *all* the node's
  free GPU milli counts as fragment for m;
* otherwise only the free milli on the GPUs that individually have less free than m's per-GPU
  request counts (those GPUs are too small for m).

    F_n(M) = sum_m p_m * F_n(m)

FGD (paper section 4.2) places each task where the *growth* of the node's fragmentation is the
smallest: for a node n (and, for a GPU share, each candidate GPU g of n) it computes
Delta = F_after - F_before and picks the smallest; the simulator turns it into the kube-scheduler
integer score ``int(sigmoid(-Delta / 1000) * 100)`` (higher is better, highest wins, ties to the
node first in the node order -- see `policies`), and inside a node the GPU with the best score
(lowest index on ties). Whole-GPU tasks
take completely free GPUs (which ones does not change F); CPU-only tasks change F through the
node's free CPU only.

Public, reusable pieces (also for the live scheduler placing a fractional-GPU stage):

* `node_fragmentation` -- F of one or many node states;
* `share_fragmentation_increase` -- Delta for every (node, GPU) choice of one fractional request;
* `node_fragmentation_increase` -- Delta per node for any request (best GPU for a share);
* `fgd_score` -- the simulator's integer score from Delta.

The policy class `FGD` caches, per request type, the score of every node and recomputes only the
nodes that changed since (``PackState.version``), which makes a run over the Alibaba list take a
few seconds instead of the reference simulator's minutes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from qosflow.errors import SpecError
from qosflow.packing.model import MILLI, PackState, Placement, Pod
from qosflow.packing.policies import PackingPolicy, register_policy, whole_gpus_first
from qosflow.packing.workload import WorkloadDistribution


class FragModel:
    """The workload as arrays ready for broadcasting, plus which types may use which GPU model."""

    def __init__(self, workload: WorkloadDistribution, models: Sequence[str] = ("",)):
        self.workload = workload
        self.models = tuple(models)
        self.cpu_t = workload.cpu_milli.astype(np.int64)
        self.milli_t = workload.gpu_milli.astype(np.int64)
        self.num_t = workload.num_gpu.astype(np.int64)
        self.prob = workload.prob.astype(np.float64)
        # integer weights: F * scale is an exact integer, so identical node states give identical
        # values and "no change" is exactly 0 (the reference's float sums have that property too)
        self.weights = np.asarray(workload.weights, dtype=np.int64)
        self.scale = int(self.weights.sum())
        self.is_gpu_t = (self.num_t > 0) & (self.milli_t > 0)
        # access[m, t]: type t can use a node of model m *and* is a GPU type (CPU types never
        # count as satisfied: their whole free GPU milli is fragment, as in the reference code)
        self.access = workload.access_matrix(self.models) & self.is_gpu_t[None, :]

    def model_index(self, model: str) -> int:
        try:
            return self.models.index(model)
        except ValueError:
            raise SpecError("model", f"GPU model {model!r} not among {list(self.models)}") from None

    # -- building blocks (all vectorised; leading axes are free) ---------------------------------
    def stats(self, gpu_left: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node and type: GPUs with >= the type's milli free, free milli on the smaller GPUs.

        ``gpu_left`` is (..., G); returns cnt (..., T), below (..., T), total free (...).
        """
        g = np.asarray(gpu_left, dtype=np.int64)
        ge = g[..., :, None] >= self.milli_t
        cnt = ge.sum(axis=-2)
        below = np.where(ge, 0, g[..., :, None]).sum(axis=-2)
        return cnt, below, g.sum(axis=-1)

    def frag(
        self, cnt: np.ndarray, below: np.ndarray, sumg: np.ndarray, cpu_left: np.ndarray, access: np.ndarray
    ) -> np.ndarray:
        """F x `scale` (exact int64) from the stats; ``access`` is (..., T) (rows of `self.access`)."""
        sat = (cnt >= self.num_t) & (np.asarray(cpu_left)[..., None] >= self.cpu_t) & access
        contrib = np.where(sat, below, np.asarray(sumg)[..., None])
        return (contrib * self.weights).sum(axis=-1)

    def frag_after_share(
        self,
        cnt: np.ndarray,
        below: np.ndarray,
        sumg: np.ndarray,
        gpu_left: np.ndarray,
        cpu_left: np.ndarray,
        access: np.ndarray,
        cpu_req: int,
        milli: int,
    ) -> np.ndarray:
        """F after taking ``milli`` from each GPU in turn: (K, G) for K nodes (stats are (K, T))."""
        g = np.asarray(gpu_left, dtype=np.int64)  # (K, G)
        g2 = g - milli
        mt = self.milli_t
        d_cnt = (g2[..., None] >= mt).astype(np.int64) - (g[..., None] >= mt)  # (K, G, T)
        d_below = np.where(g2[..., None] < mt, g2[..., None], 0) - np.where(g[..., None] < mt, g[..., None], 0)
        cnt2 = cnt[:, None, :] + d_cnt
        below2 = below[:, None, :] + d_below
        sumg2 = (sumg - milli)[:, None] + np.zeros(g.shape[-1], dtype=np.int64)
        cpu2 = (np.asarray(cpu_left) - cpu_req)[:, None] + np.zeros(g.shape[-1], dtype=np.int64)
        return self.frag(cnt2, below2, sumg2, cpu2, access[:, None, :])

    def frag_after_whole(
        self,
        cnt: np.ndarray,
        below: np.ndarray,
        sumg: np.ndarray,
        cpu_left: np.ndarray,
        access: np.ndarray,
        cpu_req: int,
        num_gpu: int,
    ) -> np.ndarray:
        """F after taking ``num_gpu`` completely free GPUs (0 for a CPU-only task) and the CPU."""
        mt = self.milli_t
        k = int(num_gpu)
        cnt2 = cnt - k * (MILLI >= mt).astype(np.int64) + k * (0 >= mt).astype(np.int64)
        below2 = below - k * np.where(MILLI < mt, MILLI, 0)
        return self.frag(cnt2, below2, np.asarray(sumg) - k * MILLI, np.asarray(cpu_left) - cpu_req, access)


def fgd_score(increase: np.ndarray | float, scale: int = 1) -> np.ndarray:
    """The simulator's integer node score: ``int(sigmoid(-increase / 1000) * 100)`` (0..100).

    ``increase`` in milli-GPU, or in milli-GPU x ``scale`` (the exact integers of `FragModel`).
    """
    x = -np.asarray(increase, dtype=np.float64) / scale / 1000.0
    return np.trunc(1.0 / (1.0 + np.exp(-x)) * 100.0).astype(np.int64)


def _as_states(cpu_left: Any, gpu_left: Any) -> tuple[np.ndarray, np.ndarray, bool]:
    g = np.asarray(gpu_left, dtype=np.int64)
    single = g.ndim == 1
    if single:
        g = g[None, :]
    c = np.atleast_1d(np.asarray(cpu_left, dtype=np.int64))
    if c.shape[0] != g.shape[0]:
        raise SpecError("cpu_left", f"has {c.shape[0]} nodes, gpu_left has {g.shape[0]}")
    if np.any(g < 0) or np.any(g > MILLI):
        raise SpecError("gpu_left", "per-GPU free milli must be within 0..1000")
    return c, g, single


def _access_rows(fm: FragModel, models: Sequence[str] | str | None, k: int) -> np.ndarray:
    if models is None:
        return np.broadcast_to(fm.is_gpu_t, (k, len(fm.prob)))
    if isinstance(models, str):
        models = [models] * k
    return fm.access[[fm.model_index(m) for m in models]]


def node_fragmentation(
    cpu_left: Any,
    gpu_left: Any,
    workload: WorkloadDistribution,
    models: Sequence[str] | str | None = None,
) -> np.ndarray | float:
    """F_n(M) in milli-GPU for one node (``gpu_left`` (G,)) or many (``gpu_left`` (K, G)).

    ``gpu_left`` holds the free milli of each GPU (pad nodes with fewer GPUs with 0);
    ``models`` the nodes' GPU models, for workloads with GPU-model constraints.
    """
    c, g, single = _as_states(cpu_left, gpu_left)
    fm = FragModel(workload, _model_list(models, workload))
    cnt, below, sumg = fm.stats(g)
    out = fm.frag(cnt, below, sumg, c, _access_rows(fm, models, g.shape[0])) / fm.scale
    return float(out[0]) if single else out


def share_fragmentation_increase(
    cpu_left: Any,
    gpu_left: Any,
    cpu_req: int,
    gpu_milli: int,
    workload: WorkloadDistribution,
    models: Sequence[str] | str | None = None,
    gpu_exists: np.ndarray | None = None,
) -> np.ndarray:
    """Delta F for placing a ``gpu_milli`` share on each GPU of each node: (K, G), or (G,) for one.

    Entries where the GPU cannot take the share (too little free milli, padding slot, node CPU
    too small) are ``inf``. Lower is better; FGD picks the minimum.
    """
    if not 0 < gpu_milli < MILLI:
        raise SpecError("gpu_milli", f"a GPU share is 1..999 milli, got {gpu_milli}")
    c, g, single = _as_states(cpu_left, gpu_left)
    fm = FragModel(workload, _model_list(models, workload))
    acc = _access_rows(fm, models, g.shape[0])
    cnt, below, sumg = fm.stats(g)
    before = fm.frag(cnt, below, sumg, c, acc)
    after = fm.frag_after_share(cnt, below, sumg, g, c, acc, cpu_req, gpu_milli)
    inc = (after - before[:, None]) / fm.scale
    ok = (g >= gpu_milli) & (c >= cpu_req)[:, None]
    if gpu_exists is not None:
        ok &= np.asarray(gpu_exists, dtype=bool).reshape(g.shape)
    inc = np.where(ok, inc, np.inf)
    return inc[0] if single else inc


def node_fragmentation_increase(
    cpu_left: Any,
    gpu_left: Any,
    pod: Pod,
    workload: WorkloadDistribution,
    models: Sequence[str] | str | None = None,
) -> np.ndarray | float:
    """Delta F per node for any request (for a share: its best GPU); ``inf`` where it does not fit.

    Memory and the pod's own GPU-model constraint are not checked here (filter first).
    """
    c, g, single = _as_states(cpu_left, gpu_left)
    if pod.is_fractional:
        inc = share_fragmentation_increase(c, g, pod.cpu_milli, pod.gpu_milli, workload, models)
        out = np.min(np.atleast_2d(inc), axis=1)
    else:
        fm = FragModel(workload, _model_list(models, workload))
        acc = _access_rows(fm, models, g.shape[0])
        cnt, below, sumg = fm.stats(g)
        before = fm.frag(cnt, below, sumg, c, acc)
        after = fm.frag_after_whole(cnt, below, sumg, c, acc, pod.cpu_milli, pod.num_gpu)
        fits = ((g == MILLI).sum(axis=1) >= pod.num_gpu) & (c >= pod.cpu_milli)
        out = np.where(fits, (after - before) / fm.scale, np.inf)
    return float(out[0]) if single else out


def _model_list(models: Sequence[str] | str | None, workload: WorkloadDistribution) -> tuple[str, ...]:
    if models is None:
        return ("",)
    if isinstance(models, str):
        return (models,)
    return tuple(sorted(set(models)))


@dataclass
class _TypeCache:
    stamp: np.ndarray  # (N,) node version the entries were computed at
    score: np.ndarray  # (N,) int64, -1 = no GPU fit / model not allowed
    gpu: np.ndarray  # (N,) best GPU for a share, -1 otherwise


@register_policy("fgd")
class FGD(PackingPolicy):
    """Fragmentation Gradient Descent with the reference simulator's integer scores."""

    description = "least growth of fragmentation against the target workload (ATC'23)"
    #: about 5 x first fit's time per run on the Alibaba default lists
    relative_cost = 5.0

    def setup(self, state: PackState) -> None:
        workload = self.required_workload("FGD")
        self.fm = FragModel(workload, state.models)
        n, t = len(state), len(workload)
        self._state_id = id(state)
        self._stats_stamp = np.full(n, -1, dtype=np.int64)
        self._cnt = np.zeros((n, t), dtype=np.int64)
        self._below = np.zeros((n, t), dtype=np.int64)
        self._sumg = np.zeros(n, dtype=np.int64)
        self._frag = np.zeros(n, dtype=np.int64)  # F x scale
        self._types: dict[tuple, _TypeCache] = {}

    def node_fragmentation(self, state: PackState) -> np.ndarray:
        """Current F of every node in milli-GPU (cached)."""
        self._refresh_stats(state)
        return self._frag / self.fm.scale

    def _refresh_stats(self, state: PackState) -> None:
        rows = np.flatnonzero(self._stats_stamp != state.version)
        if rows.size == 0:
            return
        cnt, below, sumg = self.fm.stats(state.gpu_left[rows])
        self._cnt[rows], self._below[rows], self._sumg[rows] = cnt, below, sumg
        self._frag[rows] = self.fm.frag(cnt, below, sumg, state.cpu_left[rows], self.fm.access[state.model_idx[rows]])
        self._stats_stamp[rows] = state.version[rows]

    def _score_rows(self, state: PackState, pod: Pod, rows: np.ndarray, entry: _TypeCache) -> None:
        self._refresh_stats(state)
        fm = self.fm
        cnt, below, sumg = self._cnt[rows], self._below[rows], self._sumg[rows]
        cpu = state.cpu_left[rows]
        acc = fm.access[state.model_idx[rows]]
        before = self._frag[rows]
        allowed = state.model_mask(pod.gpu_spec)[rows] if pod.num_gpu else np.ones(rows.size, dtype=bool)
        if pod.is_fractional:
            g = state.gpu_left[rows]
            after = fm.frag_after_share(cnt, below, sumg, g, cpu, acc, pod.cpu_milli, pod.gpu_milli)
            sc = fgd_score(after - before[:, None], fm.scale)
            ok = (g >= pod.gpu_milli) & state.gpu_exists[rows] & allowed[:, None]
            sc = np.where(ok, sc, -1)
            best = np.argmax(sc, axis=1)  # first maximum = lowest GPU index on ties, as the reference
            entry.score[rows] = sc[np.arange(rows.size), best]
            entry.gpu[rows] = np.where(entry.score[rows] >= 0, best, -1)
        else:
            after = fm.frag_after_whole(cnt, below, sumg, cpu, acc, pod.cpu_milli, pod.num_gpu)
            sc = fgd_score(after - before, fm.scale)
            if pod.num_gpu:
                ok = ((state.gpu_left[rows] == MILLI).sum(axis=1) >= pod.num_gpu) & allowed
                sc = np.where(ok, sc, -1)
            entry.score[rows] = sc
            entry.gpu[rows] = -1
        entry.stamp[rows] = state.version[rows]

    def scores(self, state: PackState, pod: Pod) -> tuple[np.ndarray, np.ndarray]:
        """(score per node, chosen GPU per node) for the pod; score -1 where its GPUs do not fit."""
        if getattr(self, "_state_id", None) != id(state):
            self.prepare(state, self.workload, self.rng, self.knowledge)
        key = pod.request_key
        entry = self._types.get(key)
        n = len(state)
        if entry is None:
            entry = _TypeCache(np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64))
            self._types[key] = entry
        stale = np.flatnonzero(entry.stamp != state.version)
        if stale.size:
            self._score_rows(state, pod, stale, entry)
        return entry.score, entry.gpu

    def choose(self, state: PackState, pod: Pod) -> Placement | None:
        score, gpu = self.scores(state, pod)
        fit = (score >= 0) & (state.cpu_left >= pod.cpu_milli) & (state.mem_left >= pod.memory_mib)
        n = self.pick(state, score, fit)
        if n is None:
            return None
        if pod.num_gpu == 0:
            return Placement(n)
        if pod.is_fractional:
            return Placement(n, (int(gpu[n]),))
        return Placement(n, whole_gpus_first(state, n, pod))
