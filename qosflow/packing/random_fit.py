"""Random-fit: a uniformly random node among those where the pod fits (FGD's "Random" baseline).

As the authors' simulator configures it (``RandomScore`` plugin with GPU selection ``random``):
a fractional pod goes to a random GPU with enough free milli, a whole-GPU pod to the
lowest-index free GPUs.
"""

from __future__ import annotations

import numpy as np

from qosflow.packing.model import PackState, Placement, Pod
from qosflow.packing.policies import PackingPolicy, register_policy, whole_gpus_first


@register_policy("random")
class RandomFit(PackingPolicy):
    description = "uniformly random node that fits; random fitting GPU for a share"

    def choose(self, state: PackState, pod: Pod) -> Placement | None:
        idx = np.flatnonzero(state.fit_mask(pod))
        if idx.size == 0:
            return None
        n = int(idx[self.rng.integers(idx.size)])
        if pod.num_gpu == 0:
            return Placement(n)
        if pod.is_fractional:
            gpus = np.flatnonzero(state.gpu_left[n] >= pod.gpu_milli)
            return Placement(n, (int(gpus[self.rng.integers(gpus.size)]),))
        return Placement(n, whole_gpus_first(state, n, pod))
