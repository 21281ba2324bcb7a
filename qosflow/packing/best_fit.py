"""Best-fit: the node with the least free resources left after placing the pod.

Follows the FGD authors' simulator (``BestFitScore`` plugin, USENIX ATC'23 artifact): the
leftover is a weighted sum over CPU and GPU, each normalised by the largest node spec,

    leftover = 0.5 * (cpu_free - cpu_req) / max_cpu + 0.5 * (gpu_free - gpu_req) / max_gpu

with ``gpu_free`` the node's total free milli-GPU (all GPUs together) and ``gpu_req`` the pod's
total milli-GPU; memory is not scored (it is only a filter). The node score is
``int((1 - leftover) * 100)`` -- an integer, as kube-scheduler scores are -- and the highest
score wins, ties going to the node that comes first in the node order (see `policies`). The
integer truncation is part of the baseline's behaviour: nodes within about 1 % of each other tie.
Within the node, a fractional pod takes the fitting GPU with the least free milli (the
simulator's default ``best`` GPU selection); a whole-GPU pod the lowest-index free GPUs.

``max_cpu``/``max_gpu`` default to the cluster's largest node (128 CPUs and 8 GPUs on the
Alibaba list, the simulator's ``MaxSpecCpu``/``MaxSpecGpu``).
"""

from __future__ import annotations

import numpy as np

from qosflow.packing.model import MILLI, PackState, Placement, Pod
from qosflow.packing.policies import (
    PackingPolicy,
    register_policy,
    share_gpu_tightest,
    whole_gpus_first,
)


def best_fit_scores(state: PackState, pod: Pod, max_cpu: float, max_gpu_milli: float) -> np.ndarray:
    """Integer best-fit score (0..100, higher = tighter) of every node for the pod."""
    # same float operations, in the same order, as the reference Go code
    s = (state.cpu_left - pod.cpu_milli) / max_cpu * 0.5
    s = s + (state.gpu_left_total - pod.total_gpu_milli) / max_gpu_milli * 0.5
    return np.trunc((1.0 - s) * 100.0).astype(np.int64)


@register_policy("best-fit")
class BestFit(PackingPolicy):
    description = "node with the least CPU+GPU left (integer score); tightest GPU"

    def __init__(self, max_cpu: float | None = None, max_gpus: int | None = None, random_ties: bool = False):
        super().__init__(random_ties)
        self._max_cpu_arg, self._max_gpus_arg = max_cpu, max_gpus
        self.max_cpu = 0.0
        self.max_gpu_milli = 0.0

    def setup(self, state: PackState) -> None:
        self.max_cpu = float(self._max_cpu_arg or max(1, int(state.cpu_cap.max())))
        self.max_gpu_milli = float((self._max_gpus_arg or max(1, int(state.gpu_count.max()))) * MILLI)

    def choose(self, state: PackState, pod: Pod) -> Placement | None:
        if not self.max_cpu:
            self.prepare(state)
        fit = state.fit_mask(pod)
        n = self.pick(state, best_fit_scores(state, pod, self.max_cpu, self.max_gpu_milli), fit)
        if n is None:
            return None
        if pod.num_gpu == 0:
            return Placement(n)
        if pod.is_fractional:
            return Placement(n, (share_gpu_tightest(state, n, pod.gpu_milli),))
        return Placement(n, whole_gpus_first(state, n, pod))
