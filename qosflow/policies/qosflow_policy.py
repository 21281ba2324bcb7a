"""qosflow's own policy: QoS first, sharing where it pays, no preemption.

One round, in Blox's stages, over a snapshot of the cluster:

1. **Admission.** A deadline job whose deadline can no longer be met even alone and at once is
   demoted to best effort (and says so): serving hopeless jobs first is how allowance-ordered
   schedulers lose their DSR under load.
2. **Ordering.** Jobs whose waiting allowance (GENIE: deadline - now - predicted remaining time)
   is smaller than their own remaining time are *urgent* and go first, least allowance first.
   Everyone else goes shortest-predicted-remaining first, aged by waiting time
   (key = remaining / (1 + wait / aging)) so no job waits forever; a job past the starvation
   bound also gets a reservation (below).
3. **Placement**, job by job in that order:
   a. free GPUs, consolidated (best fit: least fragmentation of whole nodes); fractional shares
      by FGD's fragmentation gradient (ATC'23) when a target workload is known, best fit otherwise;
   b. otherwise join a running job on its GPUs (SJF-BSBF): only partners whose co-location the
      estimator predicts (from measured pairs or the jobs' per-iteration resource profiles, so
      that jobs with different bottlenecks pair up, as Muri interleaves them) improves the
      pair's average completion time (t_con < t_seq: share now rather than wait for the partner),
      or raises the pair's combined throughput by `throughput_gain` while work is queued; never
      one that would make a partner miss a deadline it can still meet; if their GPU memory does
      not fit, with a smaller sub-batch and gradient accumulation (same global batch);
   c. otherwise, once the job has waited `relax_after` (Philly: locality relaxed after a bounded
      wait), spread it over nodes -- only if the predicted spread slowdown finishes it sooner
      than waiting for a consolidated slot would;
   d. otherwise it waits; the note says why.
4. **CPU cores** (CODA): each GPU job gets its request, plus spare cores up to where its speed
   saturates when the estimator knows that point; CPU-only jobs never take the cores that the
   node's free GPUs will need to be fed.

Every choice is explained in `Decision.notes`.
"""

from __future__ import annotations

import math

from qosflow.core.cluster import ClusterState
from qosflow.core.job import JobState
from qosflow.core.placement import Placement
from qosflow.policies import register
from qosflow.policies.base import Decision, Policy, SchedulerView
from qosflow.policies.common import why_waiting
import numpy as np

from qosflow.policies.placement import find_cpu_only, find_share, find_whole, min_nodes_for
from qosflow.policies.sharing import FIXED_MEMORY_SHARE, MAX_ACCUMULATION, bsbf_times, memory_plan

#: cores per GPU kept free for a node's idle GPUs when a CPU-only job is placed (CODA: a training
#: job needs a few cores per GPU to feed it)
GPU_FEED_CORES = 2.0


@register
class QosflowPolicy(Policy):
    name = "qosflow"
    preemptive = False
    description = "QoS-aware, sharing-aware, CPU-aware, non-preemptive (qosflow)"

    def __init__(
        self,
        *,
        aging: float = 4 * 3600.0,
        starvation_bound: float = 48 * 3600.0,
        throughput_gain: float = 0.15,
        relax_after: float = 600.0,
        sub_batch: bool = True,
        share: bool = True,
        urgent: str = "sjf",
        be_throughput_gain: float | None = None,
        aging_mode: str = "hrrn",
        reserve_share: float = 0.25,
        fractional_scorer=None,
    ):
        self.reserve_share = reserve_share
        self.urgent = urgent
        self.be_throughput_gain = throughput_gain if be_throughput_gain is None else be_throughput_gain
        self.aging_factor = 10.0
        self.aging_mode = aging_mode
        self.aging = aging
        self.starvation_bound = starvation_bound
        self.throughput_gain = throughput_gain
        self.relax_after = relax_after
        self.sub_batch = sub_batch
        self.share = share
        self.fractional_scorer = fractional_scorer

    def options(self):
        return {
            "aging": self.aging,
            "starvation_bound": self.starvation_bound,
            "throughput_gain": self.throughput_gain,
            "relax_after": self.relax_after,
            "sub_batch": self.sub_batch,
            "share": self.share,
        }

    # ------------------------------------------------------------------ ordering
    def _order(self, view: SchedulerView, rem: dict[str, float], notes: dict[str, str]):
        now = view.now
        keyed = []
        for js in view.pending:
            r = rem[js.job_id]
            dl = js.job.deadline
            wait = max(0.0, now - js.queued_since)
            if dl is not None:
                allowance = dl - now - r
                if allowance < 0:
                    notes[js.job_id] = f"deadline out of reach (needs {r:.0f}s, {max(0.0, dl - now):.0f}s left): best effort"
                elif self.urgent == "allowance" and allowance < r:
                    keyed.append(((0, allowance, js.job.submit_time), js))
                    continue
                elif self.urgent == "sjf":
                    keyed.append(((0, r, js.job.submit_time), js))
                    continue
                elif self.urgent == "boost":
                    keyed.append(((2, r * 0.25, js.job.submit_time), js))
                    continue
            starving = wait >= self.starvation_bound
            if self.aging_mode == "hrrn":
                key = r / (1.0 + wait / (self.aging_factor * r))
            elif self.aging_mode == "linear":
                key = r / (1.0 + wait / self.aging)
            else:
                key = r
            keyed.append(((1 if starving else 2, -wait if starving else key, js.job.submit_time), js))
        keyed.sort(key=lambda kv: kv[0])
        return [js for _, js in keyed], [js for k, js in keyed if k[0] == 1]

    # ------------------------------------------------------------------ sharing
    #: nodes examined per sharing search (the ones with most shareable GPUs), bounding a round's cost
    SHARE_NODES = 48

    def _partner_value(self, js: JobState, partner: JobState, n_gpus_here: int, rem, est, now: float, queued: bool, sb_penalty: float):
        """(ok, gain in GPU-throughput, xi_a, xi_b, bsbf gain) of `js` joining `partner` on `n_gpus_here` GPUs."""
        xi_a, xi_b = est.pair_slowdown(js.job, partner.job)
        xi_a *= sb_penalty
        t_a, t_b = rem[js.job_id], rem[partner.job_id]
        dl_b = partner.job.deadline
        if dl_b is not None and now + t_b <= dl_b:
            a_hat, b_hat = xi_a * t_a, xi_b * t_b
            fin_b = now + (b_hat if a_hat >= b_hat else a_hat + (t_b - a_hat / xi_b))
            if fin_b > dl_b:
                return None
        t_con, t_seq = bsbf_times(t_a, t_b, xi_a, xi_b)
        g_b = max(1, partner.job.qos.gpus)
        # GPU-throughput balance: the newcomer's GPUs at 1/xi_a, minus what the partner's whole gang loses
        tput = n_gpus_here / xi_a - g_b * (1.0 - 1.0 / xi_b)
        return tput, xi_a, xi_b, t_seq - t_con

    def _shared_slot(self, st: ClusterState, js: JobState, rem, states, est, now: float, queued: bool) -> tuple[Placement, str] | None:
        """Co-locate `js` on GPUs that each hold one shareable job, where it pays (see module doc)."""
        job = js.job
        q = job.qos
        if not q.shareable or q.gpu_mem_mb is None:
            return None
        k = q.gpus
        gmax = max(1, st.spec.max_gpus_per_node)
        node_ok = ~st.down
        if q.gpu_model is not None:
            node_ok &= np.fromiter((s.gpu_model == q.gpu_model for s in st.spec.nodes), bool, st.num_nodes)
        elig = st.exists & (st.njobs == 1) & (st.whole == 1) & st.share_ok & node_ok[:, None]
        # the smallest memory the job could run in (with the smallest sub-batch tried)
        min_mem = q.gpu_mem_mb if not (self.sub_batch and job.batch_size) else q.gpu_mem_mb * (FIXED_MEMORY_SHARE + (1 - FIXED_MEMORY_SHARE) / MAX_ACCUMULATION)
        elig &= st.gmem_free >= min_mem - 1e-6
        per_node = elig.sum(axis=1)
        cpu_need = q.cpu_cores
        if k <= gmax:
            cand = np.flatnonzero((per_node >= k) & (st.cpu_free >= cpu_need - 1e-9))
        else:
            full = (per_node == st.gpu_count) & (st.gpu_count > 0) & (st.cpu_free >= cpu_need / k * st.gpu_count - 1e-9)
            cand = np.flatnonzero(full)
            if st.gpu_count[cand].sum() < k:
                return None
        if cand.size == 0:
            return None
        if cand.size > self.SHARE_NODES:
            cand = cand[np.argsort(-per_node[cand], kind="stable")[: self.SHARE_NODES]]
        cache: dict[str, tuple | None] = {}

        def value(pid: str, n_here: int, sbp: float):
            key = pid
            if key not in cache:
                cache[key] = self._partner_value(js, states[pid], n_here, rem, est, now, queued, sbp)
            return cache[key]

        # score every candidate GPU by its occupant (a partner's penalty is counted once per partner)
        node_choices = []
        for n in cand.tolist():
            gl = np.flatnonzero(elig[n]).tolist()
            by_partner: dict[str, list[int]] = {}
            for g in gl:
                occ = st.gpu_jobs.get((n, g), ())
                if len(occ) != 1 or occ[0] not in states:
                    continue
                by_partner.setdefault(occ[0], []).append(g)
            scored = []
            for pid, gpus in by_partner.items():
                v = value(pid, 1, 1.0)
                if v is None:
                    continue
                tput, xi_a, xi_b, gain = v
                per_gpu = 1.0 / xi_a - max(1, states[pid].job.qos.gpus) * (1.0 - 1.0 / xi_b) / len(gpus)
                scored.append((per_gpu, pid, gpus, xi_a, xi_b, gain))
            scored.sort(key=lambda x: -x[0])
            node_choices.append((n, scored))
        best = None
        if k <= gmax:
            for n, scored in node_choices:
                take: list[tuple[int, int]] = []
                partners = []
                for per_gpu, pid, gpus, xi_a, xi_b, gain in scored:
                    if len(take) >= k:
                        break
                    use = gpus[: k - len(take)]
                    take.extend((n, g) for g in use)
                    partners.append((pid, len(use), xi_a, xi_b, gain))
                if len(take) < k:
                    continue
                total = self._accept(js, partners, k, queued)
                if total is not None and (best is None or total > best[0]):
                    best = (total, take, partners)
        else:
            nodes_sorted = sorted(node_choices, key=lambda x: -sum(s[0] * len(s[2]) for s in x[1]))
            take, partners = [], []
            for n, scored in nodes_sorted:
                if len(take) >= k:
                    break
                for per_gpu, pid, gpus, xi_a, xi_b, gain in scored:
                    take.extend((n, g) for g in gpus)
                    partners.append((pid, len(gpus), xi_a, xi_b, gain))
            if len(take) >= k:
                take = take[:k]
                total = self._accept(js, partners, k, queued)
                if total is not None:
                    best = (total, take, partners)
        if best is None:
            return None
        total, take, partners = best
        free_mem = float(min(st.gmem_free[n, g] for n, g in take))
        plan = memory_plan(job, free_mem, allow_sub_batch=self.sub_batch)
        if plan is None:
            return None
        mem, sb = plan
        cpu: dict[int, float] = {}
        for n, _ in take:
            cpu[n] = cpu.get(n, 0.0) + q.cpu_cores / k
        for n, c in cpu.items():
            if st.cpu_free[n] < c - 1e-9:
                return None
        pids = tuple(dict.fromkeys(p[0] for p in partners))
        p = Placement(job.job_id, tuple(take), cpu=tuple(cpu.items()), gpu_mem_mb=float(mem), mem_mb=q.mem_mb, colocated_with=pids, sub_batch=sb)
        xa = max(x[2] for x in partners)
        why = (
            f"sharing GPUs with {', '.join(pids)}: predicted slowdown {xa:.2f}, GPU-throughput {total / k:+.0%} per GPU"
            + (f", sub-batch {sb.sub_batch} x {sb.accumulation_steps} steps" if sb else "")
        )
        return p, why

    def _accept(self, js: JobState, partners, k: int, queued: bool) -> float | None:
        """Total GPU-throughput gain of the co-location, or None if it does not pay.

        It pays when the pair's average completion time improves for every partner (SJF-BSBF's test:
        share now rather than wait for the partner), or, while work is queued, when the GPUs do more
        work shared than alone by `throughput_gain` per GPU."""
        xa = max(p[2] for p in partners)
        total = k / xa
        all_gain = True
        for pid, n_here, _xa, xb, gain in partners:
            g_b = self._gpus_of(pid)
            total -= g_b * (1.0 - 1.0 / xb)
            all_gain &= gain > 0
        dl = js.job.deadline
        r = self._rem[js.job_id]
        if dl is not None and self._now + r <= dl:
            # a job that can still meet its deadline joins if it still meets it shared
            if self._now + xa * r <= dl and total > -0.5 * k:
                return total + k
            return None
        if all_gain and total > 0:
            return total
        if queued and total >= self.be_throughput_gain * k:
            return total
        return None

    # ------------------------------------------------------------------ round
    def schedule(self, view: SchedulerView) -> Decision:
        est = view.estimator
        st = view.cluster
        now = view.now
        gpn = view.gpus_per_node
        d = Decision()
        rem: dict[str, float] = {}
        states: dict[str, JobState] = {}
        for js in view.running:
            rem[js.job_id] = est.remaining(js)
            states[js.job_id] = js
        for js in view.pending:
            rem[js.job_id] = est.remaining(js)
            states[js.job_id] = js
        order, starving = self._order(view, rem, d.notes)
        self._gpus_of = lambda jid: max(1, states[jid].job.qos.gpus)
        self._rem, self._now = rem, now
        # GPU demand still waiting behind each job: sharing for throughput only pays while work queues
        queued_gpus = sum(js.job.qos.gpu_demand for js in view.pending)
        #: node -> (time the reservation starts, job holding it): EASY backfilling -- others may use a
        #: reserved node only if they are predicted to be done before the reservation starts
        reserved: dict[int, tuple[float, str]] = {}
        max_res = max(1, int(round(self.reserve_share * st.num_nodes)))
        failed_k: dict[tuple, int] = {}

        def blocked(p: Placement, finish: float) -> bool:
            return any(n in reserved and finish > reserved[n][0] for n in p.nodes)

        for rank, js in enumerate(order):
            q = js.job.qos
            queued_gpus -= q.gpu_demand
            r = rem[js.job_id]
            p: Placement | None = None
            why = ""
            if q.gpus == 0:
                p = self._cpu_only(st, js)
            elif q.fractional:
                p = find_share(st, js.job, scorer=self.fractional_scorer)
            else:
                sig = (q.gpu_model, q.gpu_mem_mb, q.cpu_cores / q.gpus)
                if st.total_empty_gpus() >= q.gpus and failed_k.get(sig, 1 << 30) > q.gpus:
                    p = find_whole(st, js.job, locality="consolidated", fit="best-fit")
                    if p is not None and reserved and blocked(p, now + r):
                        p = self._unreserved_whole(st, js, reserved, now + r)
                    if p is None and not reserved:
                        failed_k[sig] = min(failed_k.get(sig, 1 << 30), q.gpus)
                if p is None and self.share:
                    found = self._shared_slot(st, js, rem, states, est, now, queued_gpus > 0)
                    if found is not None and not (reserved and blocked(found[0], now + r * 1.5)):
                        p, why = found
                if p is None and q.gpus > 1 and now - js.queued_since >= self.relax_after:
                    p = self._relaxed(st, js, rem, est, gpn, reserved)
                    if p is not None:
                        why = "locality relaxed after waiting: spread over nodes"
            if p is None:
                d.notes.setdefault(js.job_id, why_waiting(st, js))
                important = js.job.deadline is not None and now + r <= js.job.deadline or js in starving
                if q.gpus > 1 and not q.fractional and len(reserved) < max_res and (important or rank < 3):
                    got = self._reserve(st, js, rem, reserved)
                    if got is not None:
                        nodes, ready = got
                        for n in nodes:
                            reserved[n] = (now + ready, js.job_id)
                        d.notes[js.job_id] += (
                            f"; reserved {', '.join(st.spec.nodes[n].name for n in nodes)} "
                            f"(free for it in about {ready / 3600:.1f} h)"
                        )
                continue
            st.allocate(p, q)
            d.starts.append(p)
            if why:
                d.notes[js.job_id] = why
        return d

    def _unreserved_whole(self, st: ClusterState, js: JobState, reserved, finish: float) -> Placement | None:
        """Exclusive placement avoiding nodes reserved for others (unless done before they need them)."""
        saved = st.empty.copy()
        try:
            for n, (t, _) in reserved.items():
                if finish > t:
                    st.empty[n] = 0
            return find_whole(st, js.job, locality="consolidated", fit="best-fit")
        finally:
            st.empty[:] = saved

    # ------------------------------------------------------------------ helpers
    def _cpu_only(self, st: ClusterState, js: JobState) -> Placement | None:
        """A CPU-only stage, keeping enough cores on each node to feed its idle GPUs (CODA)."""
        q = js.job.qos
        saved = st.cpu_free.copy()
        try:
            st.cpu_free -= st.empty * GPU_FEED_CORES
            p = find_cpu_only(st, js.job)
        finally:
            st.cpu_free[:] = saved
        return p

    def _relaxed(self, st, js, rem, est, gpn, reserved) -> Placement | None:
        p = find_whole(st, js.job, locality="spread", fit="best-fit")
        if p is None or any(n in reserved for n in p.nodes):
            return None
        nodes = len(p.nodes)
        s = est.spread_slowdown(js.job, nodes, min_nodes_for(js.job.qos.gpus, gpn))
        # the extra time spreading costs must be less than the wait for a consolidated slot, which
        # is at least until the soonest running job on a node frees enough GPUs
        extra = (s - 1.0) * rem[js.job_id]
        wait = self._consolidated_wait(st, js, rem)
        return p if extra < wait else None

    @staticmethod
    def _consolidated_wait(st: ClusterState, js: JobState, rem) -> float:
        k = min(js.job.qos.gpus, st.spec.max_gpus_per_node)
        best = math.inf
        for n in range(st.num_nodes):
            if st.down[n] or st.gpu_count[n] < k:
                continue
            ends = sorted(rem.get(jid, math.inf) for jid, p in st.allocs.items() if n in p.nodes)
            free = int(st.empty[n])
            t = 0.0
            for e in ends:
                if free >= k:
                    break
                t = e
                free += 1
            if free >= k:
                best = min(best, t)
        return best

    def _reserve(self, st: ClusterState, js: JobState, rem, reserved) -> tuple[list[int], float] | None:
        """The unreserved node(s) where `js` can start soonest if nothing new starts there.

        A GPU becomes usable for the job when it is empty, or -- if the job may share -- when it holds
        one shareable job; a GPU shared by two becomes usable when the first of them ends.
        """
        q = js.job.qos
        gmax = max(1, st.spec.max_gpus_per_node)
        can_share = q.shareable and q.gpu_mem_mb is not None
        per_node: list[tuple[float, int]] = []
        for n in range(st.num_nodes):
            if st.down[n] or n in reserved or st.gpu_count[n] == 0:
                continue
            if q.gpu_model is not None and st.spec.nodes[n].gpu_model != q.gpu_model:
                continue
            times = []
            for g in range(int(st.gpu_count[n])):
                occ = st.gpu_jobs.get((n, g), ())
                ends = sorted(rem.get(j, 0.0) for j in occ)
                if not occ:
                    times.append(0.0)
                elif can_share and st.whole[n, g] >= 1:
                    times.append(0.0 if len(occ) == 1 and st.share_ok[n, g] else ends[0])
                else:
                    times.append(ends[-1])
            times.sort()
            k = min(q.gpus, len(times))
            per_node.append((times[k - 1] if q.gpus <= gmax else times[-1], n))
        if not per_node:
            return None
        per_node.sort()
        if q.gpus <= gmax:
            t, n = per_node[0]
            return [n], t
        need = -(-q.gpus // gmax)
        if len(per_node) < need:
            return None
        chosen = per_node[:need]
        return [n for _, n in chosen], max(t for t, _ in chosen)
