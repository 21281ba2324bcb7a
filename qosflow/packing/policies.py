"""One interface for packing policies, and the registry name -> policy.

A policy answers one question: where does this pod go now?

    policy.prepare(state, workload, rng, knowledge)   # once, before the first pod
    policy.choose(state, pod) -> Placement | None      # None: the pod fits nowhere (it fails)

``choose`` must not change ``state``; the caller applies the placement with
`PackState.place`, which checks every invariant. Policies may cache per-node results keyed by
``state.version`` (bumped whenever a node changes).

Ties: scores are integers (kube-scheduler's), so many nodes tie. `pick_best` takes the tied node
that comes first in the state's node order (``PackState.node_rank``). This is what the FGD
authors' simulator does: it names the nodes with a seeded random prefix and runs a patched
kube-scheduler (``github.com/mental2008/kubernetes v1.20.5-minor``) whose ``FirstFitScore``
plugin relies on "the Kubernetes default node list order" to break ties -- a fixed order for the
whole run, not a fresh random pick per pod. It matters: with per-decision random ties, FGD
allocates ~89 % of the GPUs on the Alibaba list instead of the published 95.2 % (best-fit barely
changes). ``random_ties=True`` gives the stock kube-scheduler behaviour for comparison.

Extra knowledge: ``prepare`` takes an optional ``knowledge`` mapping (e.g. ``{"departures":
...}`` telling which pods leave soon) that the three baselines ignore; a smarter policy can read it,
and `notify_placed` / `notify_released` let it follow pods through their life.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from qosflow.errors import SpecError, UnknownNameError
from qosflow.packing.model import MILLI, PackState, Placement, Pod
from qosflow.packing.workload import WorkloadDistribution


class PackingPolicy:
    """Base class; subclasses implement `choose`."""

    name = "base"
    #: short description for tables and docs
    description = ""
    #: if set, experiments derive this policy's target workload from the pod list with this
    #: popularity (share of pods the kept types cover) instead of the shared FGD one (95 %)
    workload_popularity: float | None = None
    #: rough time of a run against first fit (1): only the order in which parallel runs start
    #: (`run_experiment`: the costliest first), never a result
    relative_cost: float = 1.0

    def __init__(self, random_ties: bool = False) -> None:
        #: break ties uniformly at random (stock kube-scheduler) instead of by node order
        self.random_ties = random_ties
        self.rng: np.random.Generator = np.random.default_rng(0)
        self.workload: WorkloadDistribution | None = None
        self.knowledge: Mapping[str, Any] = {}

    def prepare(
        self,
        state: PackState,
        workload: WorkloadDistribution | None = None,
        rng: np.random.Generator | None = None,
        knowledge: Mapping[str, Any] | None = None,
    ) -> None:
        """Called once before the first pod. ``knowledge`` is the hook for extra information.

        Records the workload, rng and knowledge, then calls `setup` for the policy's own set-up."""
        self.workload = workload
        if rng is not None:
            self.rng = rng
        self.knowledge = dict(knowledge or {})
        self.setup(state)

    def setup(self, state: PackState) -> None:
        """A policy's own set-up for ``state``, called by `prepare` once ``self.workload``,
        ``self.rng`` and ``self.knowledge`` are set (no-op by default)."""

    def required_workload(self, who: str) -> WorkloadDistribution:
        """``self.workload``, or a SpecError saying that ``who`` needs the target workload."""
        if self.workload is None:
            raise SpecError("workload", f"{who} needs the target workload (WorkloadDistribution.from_pods(pods))")
        return self.workload

    def choose(self, state: PackState, pod: Pod) -> Placement | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def pick(self, state: PackState, scores: np.ndarray, feasible: np.ndarray) -> int | None:
        """`pick_best` with this policy's tie rule."""
        return pick_best(scores, feasible, state.node_rank, self.rng if self.random_ties else None)

    def notify_placed(self, state: PackState, pod: Pod, placement: Placement) -> None:
        """Called after the placement was applied (no-op by default)."""

    def notify_released(self, state: PackState, pod: Pod, placement: Placement) -> None:
        """Called after a pod left (no-op by default)."""


def pick_best(
    scores: np.ndarray, feasible: np.ndarray, rank: np.ndarray, rng: np.random.Generator | None = None
) -> int | None:
    """Index of the highest score among feasible entries, None if there is none.

    Ties go to the lowest ``rank`` (the node order), or uniformly at random if ``rng`` is given.
    """
    idx = np.flatnonzero(feasible)
    if idx.size == 0:
        return None
    s = scores[idx]
    top = idx[s == s.max()]
    if top.size == 1:
        return int(top[0])
    if rng is not None:
        return int(top[rng.integers(top.size)])
    return int(top[np.argmin(rank[top])])


def share_gpu_tightest(state: PackState, node: int, milli: int) -> int:
    """The GPU with the least free milli that still fits ``milli`` (lowest index on ties).

    This is the simulator's default GPU selection (Open-Gpu-Share ``allocateGpuIdBasedOnBestFit``)
    for a fractional pod.
    """
    left = state.gpu_left[node]
    cand = np.where(left >= milli, left, MILLI + 1)
    return int(np.argmin(cand))


def whole_gpus_first(state: PackState, node: int, pod: Pod) -> tuple[int, ...]:
    """The first ``num_gpu`` completely free GPUs by index (``AllocateExclusiveGpuId``)."""
    return state.free_whole_gpus(node, pod.num_gpu)


_REGISTRY: dict[str, Callable[[], PackingPolicy]] = {}


def register_policy(name: str) -> Callable[[type[PackingPolicy]], type[PackingPolicy]]:
    """Class decorator: make a policy available as ``name`` in `make_policy` and the CLI."""

    def deco(cls: type[PackingPolicy]) -> type[PackingPolicy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtin() -> None:
    # importing the modules registers them
    from qosflow.packing import best_fit, fgd, first_fit, qosflow_pack, random_fit  # noqa: F401


def is_builtin_policy(name: str) -> bool:
    """Is `name` one of qosflow's own packing policies (so that a fresh interpreter has it too)?"""
    _load_builtin()
    cls = _REGISTRY.get(name.strip().lower())
    return cls is not None and getattr(cls, "__module__", "").startswith("qosflow.packing.")


def policy_names() -> list[str]:
    _load_builtin()
    return list(_REGISTRY)


def make_policy(name: str) -> PackingPolicy:
    """A fresh policy by registry name; `UnknownNameError` lists the known names."""
    _load_builtin()
    key = name.strip().lower()
    if key not in _REGISTRY:
        raise UnknownNameError("packing policy", name, list(_REGISTRY))
    return _REGISTRY[key]()
