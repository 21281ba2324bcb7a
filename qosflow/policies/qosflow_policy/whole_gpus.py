"""qosflow policy, steps 3a and 3c: GPUs of a job's own -- consolidated best fit (time-aligned with
`align`), around reserved nodes, or spread over nodes once locality is relaxed."""

from __future__ import annotations

import bisect
from dataclasses import replace

import numpy as np

from qosflow.core.cluster import ClusterState
from qosflow.core.job import JobState
from qosflow.core.placement import Placement
from qosflow.policies.placement import find_whole, min_nodes_for, one_node_candidates, place_on_one_node
from qosflow.policies.qosflow_policy.express import EXPRESS

#: "not remembered" in the per-round memos (None is a remembered failure)
_MISS = object()


class WholeGpusMixin:
    """Whole-GPU placement for `QosflowPolicy`. Reads the option `align` and the round's `_now`, `_ver`
    (bumped at every placement), `_whole_memo`, `_gmem_caps`, `_drain`, `_end_max`; around reservations
    it asks the deadline checks (`_finish_high`, `_promised`) and the express lane (`_express_ok`)."""

    def _avoid(self, js: JobState, reserved, finish: float) -> dict[int, bool]:
        """Per reserved node: must `js`, finishing at `finish`, keep off it? Yes if it would still run
        when the reservation starts (at its pessimistic finish where the reservation keeps a deadline
        promise), unless it may use an express node past the lane's reservation (`_express_ok`)."""
        fin_h = None
        ok = None  # `_express_ok(js, finish)`, worked out once if an express node is in the way
        out = {}
        for n, (t, owner) in reserved.items():
            if self._promised(owner):
                if fin_h is None:
                    fin_h = self._finish_high(js, finish)
                end = fin_h
            else:
                end = finish
            if end > t and owner == EXPRESS:
                if ok is None:
                    ok = self._express_ok(js, finish)
                out[n] = not ok
            else:
                out[n] = end > t
        return out

    def _unreserved_whole(self, st: ClusterState, js: JobState, reserved, finish: float, avoid=None, shape=None, job=None) -> Placement | None:
        """Exclusive placement avoiding nodes reserved for others (unless done before they need them:
        `_avoid`, given or worked out); as `_whole_gpus` answers it (`_own` makes it the job's). `job`:
        `js`'s request restricted to some GPU models (`GpuModelsMixin`), if not `js.job` itself."""
        if avoid is None:
            avoid = self._avoid(js, reserved, finish)
        # (a node without an empty GPU offers nothing to hide: leaving it out changes no search, and
        # jobs whose reservations differ only there share one search)
        empty = st.empty
        masked = tuple(n for n in reserved if avoid[n] and empty[n] > 0)
        return self._whole_gpus(st, js.job if job is None else job, "consolidated", finish - self._now, masked=masked, shape=shape)

    def _whole_gpus(self, st: ClusterState, job, locality: str, r: float | None = None, masked: tuple = (), shape: tuple | None = None) -> Placement | None:
        """`find_whole` (best fit; with `align`, consolidated placements ranked by `_align_rank(r)`),
        remembered until the next placement: the search depends on the request's shape and the
        cluster's state only, so jobs of the same shape (GPU memory counted by the nodes it admits)
        share one search per state. Nodes in `masked` are hidden from this search (reservations); they
        are part of the key. With `align` the choice among the candidate nodes depends on the job's
        remaining time, so the candidates are what is remembered and the choice is made per job.

        A remembered placement is returned as it is, made for the first job of the shape: most are
        only looked at (and refused for a reservation in the way), so `_own` makes one the job's own
        when it starts. `shape`: the request's part of the key, if the caller has it already."""
        q = job.qos
        if st.total_empty_gpus() < q.gpus:
            return None  # (find_whole's first test, hidden nodes or not: most waiting jobs stop here)
        if shape is None:
            shape = self._whole_shape(q, q.gpu_model)
        key = (shape, locality, masked)
        hit = self._whole_memo.get(key, _MISS)
        if hit is _MISS or hit[0] != self._ver:
            hit = self._whole_memo[key] = (self._ver, self._whole_search(st, job, locality, masked))
        found = hit[1]
        if found is None or isinstance(found, Placement):
            return found  # (made for the first job of this shape: `_own` makes it this job's)
        # (the candidates exclude the masked nodes, and the choice reads the candidates only)
        return place_on_one_node(st, job, found, fit="best-fit", node_rank=self._align_rank(st, r))

    def _whole_shape(self, q, gpu_model: str | None) -> tuple:
        """Request `q`, on the GPU models `gpu_model` (its own, or a group `GpuModelsMixin` tries), as the
        whole-GPU searches key it: GPUs, cores, memory, GPU memory class, models."""
        return (q.gpus, q.cpu_cores, q.mem_mb, self._cap_class(q), gpu_model)

    def _cap_class(self, q) -> int | None:
        """A request's GPU memory as a whole-GPU search sees it: only through the nodes whose GPUs are
        large enough, so by its class among the cluster's GPU sizes (`_gmem_caps`); None: none asked."""
        return None if q.gpu_mem_mb is None else bisect.bisect_left(self._gmem_caps, q.gpu_mem_mb)

    @staticmethod
    def _own(p: Placement, job) -> Placement:
        """`p` as `job`'s own placement (a placement `_whole_gpus` remembered carries the id and GPU
        memory of the job it was made for; other placements are the job's already)."""
        if p.job_id == job.job_id:
            return p
        q = job.qos
        return replace(p, job_id=job.job_id, gpu_mem_mb=q.gpu_mem_mb if q.gpu_mem_mb is not None else 0.0)

    def _whole_search(self, st: ClusterState, job, locality: str, masked: tuple):
        """What `_whole_gpus` remembers: the placement found (None: none), or with `align` the candidate
        nodes. Nodes in `masked` are hidden from the search (their empty GPUs counted as none)."""
        saved = None
        if masked:
            saved = st.empty.copy()
            st.empty[list(masked)] = 0
        try:
            if self.align and locality == "consolidated":
                # ranked by the job's own remaining time: remember the candidate nodes, not the choice
                cands = one_node_candidates(st, job)
                return cands if cands is not None and cands.size else find_whole(st, job, locality="consolidated", fit="best-fit")
            return find_whole(st, job, locality=locality, fit="best-fit")  # type: ignore[arg-type]
        finally:
            if saved is not None:
                st.empty[:] = saved

    def _align_rank(self, st: ClusterState, r: float) -> np.ndarray | None:
        """Per node: how much later than now it would drain if a job of remaining time `r` joined it.

        Jobs that end at about the same time go to the same node, so nodes empty whole (a gang's
        chance to start without preemption) instead of one straggler at a time."""
        if not self.align:
            return None
        if self._drain[0] != self._ver:
            self._drain = (self._ver, np.where(st.njobs > 0, self._end_max, 0.0).max(axis=1))
        return np.maximum(0.0, r - self._drain[1])

    def _relaxed(self, st, js, rem, est, gpn, reserved, shape=None) -> Placement | None:
        """GPUs spread over nodes (`_whole_gpus`: `_own` makes the placement the job's), if spreading
        costs less than waiting for a consolidated slot."""
        q = js.job.qos
        if shape is None:
            shape = self._whole_shape(q, q.gpu_model)
        # the spread GPUs, and whether they are clear of reservations, depend on the shape and the
        # state only: remembered per `_ver` and number of reserved nodes (a round only adds some)
        hit = self._relaxed_memo.get(shape)
        if hit is None or hit[0] != self._ver or hit[1] != len(reserved):
            p = self._whole_gpus(st, js.job, "spread", shape=shape)
            if p is not None and any(n in reserved for n in p.nodes):
                p = None
            hit = self._relaxed_memo[shape] = (self._ver, len(reserved), p)
        p = hit[2]
        if p is None:
            return None
        nodes = len(p.nodes)
        s = est.spread_slowdown(js.job, nodes, min_nodes_for(js.job.qos.gpus, gpn))
        # the extra time spreading costs must be less than the wait for a consolidated slot, which
        # is at least until the soonest running job on a node frees enough GPUs
        extra = (s - 1.0) * rem[js.job_id]
        wait = self._consolidated_wait(st, js, rem)
        return p if extra < wait else None
