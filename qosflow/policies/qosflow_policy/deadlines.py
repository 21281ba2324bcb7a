"""qosflow policy: deadline promises -- the deadline rescue (a gang that can still meet its deadline
spreads and shares at once), and the checks of a promise on the estimator's error band
(`deadline_band`)."""

from __future__ import annotations

import bisect

import numpy as np

from qosflow.core.cluster import ClusterState
from qosflow.core.estimate import pair_slowdown_high, remaining_high
from qosflow.core.job import JobState
from qosflow.core.placement import Placement
from qosflow.policies.placement import min_nodes_for
from qosflow.policies.qosflow_policy.express import EXPRESS


class DeadlinesMixin:
    """Deadline promises for `QosflowPolicy`. Reads the option `deadline_band` and the round's `_rem`,
    `_rem_hi` (memo of pessimistic remaining times), `_promises` (memo of `_promised`), `_est`,
    `_states`, `_now`, `_st`, `_express`, `_ver`, `_elig_cache`; the rescue weighs partners with the
    co-location search's `_partner_value`."""

    def _deadline_rescue(self, st: ClusterState, js: JobState, rem, states, est, now: float, gpn: int):
        """A gang with a deadline it can still meet takes free and shareable GPUs on any nodes, if the
        predicted slowdown of spreading and sharing together still meets the deadline (locality is
        relaxed at once for it rather than after a wait)."""
        job = js.job
        q = job.qos
        k = q.gpus
        dl = job.deadline
        r = rem[js.job_id]
        per_gpu_cpu = q.cpu_cores / k
        can_share = q.shareable and q.gpu_mem_mb is not None
        # the GPUs on offer depend on the request's shape and the cluster only: one search per state
        # (the memory asked for counts by its class among the GPUs on offer: `_mem_class`)
        mem_class = None if q.gpu_mem_mb is None else self._mem_class(st, q.gpu_model, q.gpu_mem_mb)
        key = ("rescue", q.gpu_model, can_share, mem_class, per_gpu_cpu)
        hit = self._elig_cache.get(key)
        if hit is None or hit[0] != self._ver:
            free, single = self._gpu_masks(st, q.gpu_model)
            if q.gpu_mem_mb is not None:  # a free GPU too small for the job (e.g. a 12 GiB K80) is no offer
                mem_ok = self._mem_ok(st, q.gpu_mem_mb)
                free = free & mem_ok
            single = single & mem_ok if can_share else np.zeros_like(single)
            # a node gives as many GPUs as its free cores can feed
            cap = np.floor((st.cpu_free + 1e-9) / max(per_gpu_cpu, 1e-9)).astype(np.int64) if per_gpu_cpu > 0 else np.full(st.num_nodes, 1 << 30)
            usable = np.minimum(free.sum(axis=1) + single.sum(axis=1), cap)
            # the nodes with usable GPUs, most first; their GPU lists are read when first reached
            order = [(n, int(usable[n])) for n in np.argsort(-usable, kind="stable").tolist() if usable[n] > 0]
            hit = self._elig_cache[key] = (self._ver, (order, free, single, {}, int(usable.sum())))
        order, free, single, rows, total = hit[1]
        if total < k:
            return None
        take: list[tuple[int, int]] = []
        partners: dict[str, float] = {}
        worst = 1.0
        for n, use_n in order:
            if len(take) >= k:
                break
            free_n = rows.get(("free", n))
            if free_n is None:  # node n's free GPUs, as of `_ver`
                free_n = rows[("free", n)] = np.flatnonzero(free[n]).tolist()
            start = len(take)  # GPUs taken on node n so far: len(take) - start
            budget = min(use_n, k - len(take))
            for g in free_n[:budget]:
                take.append((n, g))
            if len(take) >= k or len(take) - start >= use_n:
                continue  # (the loop below would take no shared GPU)
            single_n = rows.get(("single", n))
            if single_n is None:  # node n's GPUs holding one shareable job, as of `_ver`
                single_n = rows[("single", n)] = np.flatnonzero(single[n]).tolist()
            for g in single_n:
                if len(take) >= k or len(take) - start >= use_n:
                    break
                pid = st.gpu_jobs[(n, g)][0]
                if pid not in states:
                    continue
                if pid not in partners:
                    v = self._known_partner_value(js, states[pid], rem, est, now)
                    if v is None:
                        continue
                    partners[pid] = v[1]
                worst = max(worst, partners[pid])
                take.append((n, g))
        if len(take) < k:
            return None
        nodes = sorted({n for n, _ in take})
        spread = est.spread_slowdown(job, len(nodes), min_nodes_for(k, gpn))
        slow = worst * spread
        if now + r * slow > dl:
            return None
        if self.deadline_band:
            worst_h = max([1.0] + [pair_slowdown_high(est, job, states[pid].job)[0] for pid in partners])
            if not self._band_ok(js, worst_h * spread):
                return None
        cpu: dict[int, float] = {}
        for n, _ in take:
            cpu[n] = cpu.get(n, 0.0) + per_gpu_cpu
        if q.mem_mb > 0 and any(st.mem_free[n] < q.mem_mb / len(cpu) - 1e-6 for n in cpu):
            return None  # (its host memory, split evenly over its nodes, does not fit)
        used = tuple(dict.fromkeys(st.gpu_jobs[x][0] for x in take if st.njobs[x] == 1))
        p = Placement(job.job_id, tuple(take), cpu=tuple(cpu.items()), gpu_mem_mb=float(q.gpu_mem_mb or 0.0), mem_mb=q.mem_mb, colocated_with=used)
        where = "on 1 node" if len(nodes) == 1 else f"spread over {len(nodes)} nodes"
        why = f"deadline rescue: {where}" + (f", sharing with {', '.join(used)}" if used else "") + f"; predicted slowdown {slow:.2f} still meets the deadline"
        return p, why

    def _known_partner_value(self, js: JobState, partner: JobState, rem, est, now: float):
        """`_partner_value`, reusing what this round's sharing search for `js` found (`_last_values`,
        set by `_score_partners`, reset at every round's start)."""
        last_js, values, why = self._last_values
        pid = partner.job.job_id
        if last_js is js and pid in values:
            v = values[pid]
            if v is None:
                self._reject = why[pid]
            return v
        return self._partner_value(js, partner, rem, est, now)

    def _gpu_masks(self, st: ClusterState, gpu_model: str | None):
        """(empty GPUs, GPUs holding one shareable job) on the up nodes of `gpu_model` (any: None), as
        of `_ver` (cached until the next placement; the callers -- the deadline rescue and the sharing
        search -- combine them into new arrays, never in place)."""
        key = ("gpu-masks", gpu_model)
        hit = self._elig_cache.get(key)
        if hit is None or hit[0] != self._ver:
            node_ok = ~st.down
            if gpu_model is not None:
                node_ok &= st.spec.model_mask(gpu_model)
            ok = st.exists & node_ok[:, None]
            single = ok & (st.njobs == 1) & (st.whole == 1) & st.share_ok
            if self._kept is not None:  # (GPUs reserved for a waiting 1-GPU job: no one joins them)
                single &= ~self._kept
            hit = self._elig_cache[key] = (self._ver, ok & (st.njobs == 0), single)
        return hit[1], hit[2]

    def _mem_class(self, st: ClusterState, gpu_model: str | None, gpu_mem_mb: float) -> int:
        """Which of the GPUs in `_gpu_masks(gpu_model)` have `gpu_mem_mb` free (the test `_mem_ok` and
        the sharing search make) is the same for every amount between two successive free amounts of
        those GPUs: the class of `gpu_mem_mb` among them, as of `_ver`, so that searches that differ
        only in the memory asked for are made once per class."""
        key = ("mem-levels", gpu_model)
        hit = self._elig_cache.get(key)
        if hit is None or hit[0] != self._ver:
            free, single = self._gpu_masks(st, gpu_model)
            hit = self._elig_cache[key] = (self._ver, sorted(set(st.gmem_free[free | single].tolist())))
        return bisect.bisect_left(hit[1], gpu_mem_mb - 1e-6)

    def _mem_ok(self, st: ClusterState, gpu_mem_mb: float):
        """GPUs with `gpu_mem_mb` free, as of `_ver` (cached until the next placement; not to be
        changed in place)."""
        key = ("mem-ok", gpu_mem_mb)
        hit = self._elig_cache.get(key)
        if hit is None or hit[0] != self._ver:
            hit = self._elig_cache[key] = (self._ver, st.gmem_free >= gpu_mem_mb - 1e-6)
        return hit[1]

    def _r_high(self, js: JobState) -> float:
        """The pessimistic remaining time of `js` (the point estimate without `deadline_band`)."""
        r = self._rem[js.job_id]
        if not self.deadline_band:
            return r
        h = self._rem_hi.get(js.job_id)
        if h is None:
            # (in wall time where it runs or would run best, as `_rem`: `GpuModelsMixin`)
            h = remaining_high(self._est, js) / self._rspeed.get(js.job_id, 1.0) / self._wfrac.get(js.job_id, 1.0)
            h = self._rem_hi[js.job_id] = max(r, h)
        return h

    def _promised(self, owner: str) -> bool:
        """Is a reservation a deadline promise (the express lane's, or a deadline job's)? (Remembered
        for the round, in `_promises`: the answer depends on the round's estimates only.)"""
        hit = self._promises.get(owner)
        if hit is None:
            hit = self._promises[owner] = owner == EXPRESS or (owner in self._states and self._has_deadline(self._states[owner]))
        return hit

    def _finish_high(self, js: JobState, finish: float) -> float:
        """`finish` (a predicted end of `js`) at its pessimistic remaining time, where a reservation
        that keeps a deadline promise is checked (the point estimate otherwise)."""
        r = self._rem[js.job_id]
        if not self.deadline_band or r <= 0:
            return finish
        return self._now + (finish - self._now) * self._r_high(js) / r

    def _band_ok(self, js: JobState, slow_high: float) -> bool:
        """May deadline job `js` (which meets its deadline at the point estimates) start slowed by
        `slow_high` (pessimistic)? Yes if it meets its deadline at the pessimistic remaining time too,
        or if waiting for GPUs of its own would not meet it pessimistically either (then starting now
        is its best chance)."""
        dl = js.job.deadline
        r_h = self._r_high(js)
        if self._now + slow_high * r_h <= dl:
            return True
        wait = self._consolidated_wait(self._st, js, self._rem, exclude=self._express, all_nodes=True)
        return self._now + wait + r_h > dl

    def _has_deadline(self, js: JobState) -> bool:
        dl = js.job.deadline
        return dl is not None and self._now + self._rem[js.job_id] <= dl
