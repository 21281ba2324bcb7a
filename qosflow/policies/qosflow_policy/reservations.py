"""qosflow policy, step 3d: when GPUs free up -- the predicted wait for a consolidated slot, and the
node(s) a blocked gang reserves (EASY backfilling)."""

from __future__ import annotations

import math

import numpy as np

from qosflow.core.cluster import ClusterState
from qosflow.core.job import JobState
from qosflow.policies.placement import min_nodes_for


class ReservationsMixin:
    """Waits and reservations for `QosflowPolicy`. Reads the round's `_end_max` (per GPU: when its last
    job is predicted to end)."""

    @staticmethod
    def _gpus_for(st: ClusterState, q) -> np.ndarray:
        """GPUs (node x slot) the job could use: they exist, on an up node of its GPU model, with its GPU
        memory (a 12 GiB K80 is no GPU for a 15000 MB job, however soon it empties) -- the nodes the
        placement search admits (`ClusterState.usable_nodes`)."""
        return st.exists & st.usable_nodes(q)[:, None]

    def _consolidated_wait(self, st: ClusterState, js: JobState, rem, exclude=(), all_nodes: bool = False, q=None,
                           next_change: bool = False) -> float:
        """Predicted wait until some node has enough empty GPUs for `js`, consolidated (no new starts
        assumed; nodes in `exclude` not counted). With `all_nodes`, a gang wider than a node waits
        for as many whole nodes as it needs (otherwise: for the first one -- a lower bound, which is
        what relaxing locality compares against). `q`: its request restricted to some GPU models. With
        `next_change`, a node with enough empty GPUs counts only from when one of its jobs ends: called
        when the search just failed to place the job there (the GPUs are reserved for a gang, or the
        node's cores or memory are short), so "empty now" would be a wait of 0 it cannot have."""
        q = js.job.qos if q is None else q
        gmax = max(1, st.spec.max_gpus_per_node)
        k = min(q.gpus, gmax)
        t = np.where(st.njobs == 0, 0.0, self._end_max)  # a GPU is empty once its last job ends
        t = np.where(self._gpus_for(st, q), t, np.inf)
        t[st.down] = np.inf
        if len(exclude):
            t[list(exclude)] = np.inf
        kth = np.partition(t, k - 1, axis=1)[:, k - 1]
        if next_change:
            kth = np.where(kth > 0, kth, np.where(st.njobs > 0, t, np.inf).min(axis=1))
        need = min_nodes_for(q.gpus, gmax)
        if need <= 1 or not all_nodes:
            return float(kth.min())
        return float(np.partition(kth, need - 1)[need - 1]) if need <= len(kth) else math.inf

    def _reserve(self, st: ClusterState, js: JobState, rem, reserved) -> tuple[list[int], float] | None:
        """The unreserved node(s) where `js` can start soonest if nothing new starts there.

        A GPU becomes usable for the job when it is empty -- even if the job may share: it is only
        reserved for after its share attempt failed this round, and counting GPUs that hold one
        shareable job as usable at once made the reservation start now, so nothing could backfill
        the reserved nodes while the gang waited (on the Muri trace a 32-GPU gang of 6 h held half
        the cluster, two nodes of it empty, for 18 days).
        """
        q = js.job.qos
        gmax = max(1, st.spec.max_gpus_per_node)
        fits = self._gpus_for(st, q)
        count = fits.sum(axis=1)
        t = np.where(st.njobs == 0, 0.0, self._end_max)
        t = np.where(fits, t, np.inf)
        bad = st.down.copy()
        if reserved:
            bad[list(reserved)] = True
        bad |= count == 0  # also every node of another GPU model, or with GPUs too small for the job
        if q.gpus <= gmax:
            ok = ~bad & (count >= q.gpus)
            if not ok.any():
                return None
            kth = np.partition(t, q.gpus - 1, axis=1)[:, q.gpus - 1]
            kth[~ok] = np.inf
            n = int(np.argmin(kth))
            return [n], float(kth[n])
        need = min_nodes_for(q.gpus, gmax)
        full = t.copy()
        full[~fits] = -np.inf
        last = full.max(axis=1)
        last[bad] = np.inf
        order = np.argsort(last, kind="stable")[:need]
        if len(order) < need or not np.isfinite(last[order]).all():
            return None
        return [int(n) for n in order], float(last[order].max())
