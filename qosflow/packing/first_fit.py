"""First-fit: the first node in the node order where the pod fits.

As the FGD authors' simulator configures it (``FirstFitScore`` plugin: every node scores the
same, so the first feasible node in the scheduler's node order wins -- a seeded random order in
the experiment, the node list's order otherwise; GPU selection left at the simulator's default
``best``): a fractional pod takes the fitting GPU with the least free milli, a whole-GPU pod the
lowest-index free GPUs.
"""

from __future__ import annotations

import numpy as np

from qosflow.packing.model import PackState, Placement, Pod
from qosflow.packing.policies import PackingPolicy, register_policy, share_gpu_tightest, whole_gpus_first


@register_policy("first-fit")
class FirstFit(PackingPolicy):
    description = "first node in node order that fits; tightest GPU"

    def choose(self, state: PackState, pod: Pod) -> Placement | None:
        idx = np.flatnonzero(state.fit_mask(pod))
        if idx.size == 0:
            return None
        n = int(idx[np.argmin(state.node_rank[idx])])
        if pod.num_gpu == 0:
            return Placement(n)
        if pod.is_fractional:
            return Placement(n, (share_gpu_tightest(state, n, pod.gpu_milli),))
        return Placement(n, whole_gpus_first(state, n, pod))
