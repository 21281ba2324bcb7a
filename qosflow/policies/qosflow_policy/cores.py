"""qosflow policy, step 4: CPU cores (CODA) -- a GPU job gets spare cores up to where its speed stops
growing; a CPU-only job leaves the cores a node's idle GPUs need."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from qosflow.core.cluster import ClusterState
from qosflow.core.job import JobState
from qosflow.core.placement import Placement
from qosflow.policies.placement import find_cpu_only

#: cores per GPU kept free for a node's idle GPUs when a CPU-only job is placed (CODA: a training
#: job needs a few cores per GPU to feed it)
GPU_FEED_CORES = 2.0


class CpuCoresMixin:
    """CPU cores for `QosflowPolicy`. Reads the round's `_gpu_jobs_waiting` (does a GPU job wait?)."""

    def _with_cores(self, st: ClusterState, job, p: Placement, est) -> Placement:
        """CODA: give a single-node GPU job spare cores up to where its predicted speed stops growing.

        Spare means beyond what the node's other idle GPUs need to be fed (GPU_FEED_CORES each)."""
        if job.qos.gpus == 0 or len(p.cpu) != 1:
            return p
        n, base = p.cpu[0]
        spare = float(st.cpu_free[n]) - base - GPU_FEED_CORES * max(0, int(st.empty[n]) - len(p.gpus))
        if spare < 1.0:
            return p
        top = est.cpu_factor(job, base + spare)
        if top <= est.cpu_factor(job, base) * 1.01:
            return p  # more cores would not help (or the estimator knows no curve for it)
        cores = base
        while cores < base + spare and est.cpu_factor(job, cores) < 0.99 * top:
            cores += 1.0
        return replace(p, cpu=((n, min(cores, base + spare)),), note=f"{cores:g} cores (asked {base:g}): faster up to there")

    def _cpu_only(self, st: ClusterState, js: JobState) -> Placement | None:
        """A CPU-only stage, keeping enough cores on each node to feed its idle GPUs (CODA) -- as
        long as some GPU job waits for them; otherwise the cores would only sit idle."""
        if not self._gpu_jobs_waiting:
            return find_cpu_only(st, js.job)
        saved = st.cpu_free.copy()
        try:
            # never more than half a node's cores, so small hosts still run CPU stages
            total = np.array([s.cpu_cores for s in st.spec.nodes])
            st.cpu_free -= np.minimum(st.empty * GPU_FEED_CORES, 0.5 * total)
            p = find_cpu_only(st, js.job)
        finally:
            st.cpu_free[:] = saved
        return p
