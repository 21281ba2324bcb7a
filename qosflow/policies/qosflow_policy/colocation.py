"""qosflow policy, step 3b: GPU co-location -- the search for GPUs that each hold one shareable job, the
test of whether a pair pays, the pairing plan, and why a job did not share (in words, for its note)."""

from __future__ import annotations

import numpy as np

from qosflow.core.cluster import ClusterState
from qosflow.core.estimate import pair_slowdown_high
from qosflow.core.job import JobState
from qosflow.core.placement import Placement
from qosflow.policies.base import SchedulerView
from qosflow.policies.sharing import FIXED_MEMORY_SHARE, MAX_ACCUMULATION, bsbf_times, memory_plan

#: a job on the critical path shares its GPUs only with jobs done within this share of its own time
CRITICAL_SHARE = 0.05
#: a running job within this share of the longest remaining time counts as the one that ends last
LAST_END_SHARE = 0.98
#: what `_shared_slot` returns when the placement it found is in a reservation's way (`keep_off`)
KEPT_OFF = "kept off"


class CoLocationMixin:
    """GPU co-location for `QosflowPolicy`. Reads the options `makespan_beta`, `sub_batch`,
    `partner_rank`, `throughput_gain`, `deadline_band`, `use_plan`, `plan_interval` and the plan
    (`_plan`, `_plan_at`, kept across rounds), and the round's `_rem`, `_now`, `_est`, `_states`,
    `_backlog`, `_max_rem`, `_ver` with the memos `_elig_cache`, `_partners_cache`,
    `_nofit`, `_nofit_why`, and asks the deadline checks (`_has_deadline`, `_band_ok`) and the per-state GPU masks (`_gpu_masks`); it leaves why
    it refused in `_reject`, `_refused` and `_why_not`."""

    #: nodes examined per sharing search (the ones with most shareable GPUs), bounding a round's cost
    SHARE_NODES = 16

    def _partner_value(self, js: JobState, partner: JobState, rem, est, now: float):
        """(GPU-throughput balance of `js` joining `partner` on one of its GPUs, the slowdowns xi_a and
        xi_b, SJF-BSBF's gain: the pair's completion time saved, the partner's gang size counted at
        least 1), or None with `_reject` saying why not."""
        xi_a, xi_b = est.pair_slowdown(js.job, partner.job)
        t_a, t_b = rem[js.job_id], rem[partner.job_id]
        if self.makespan_beta is not None:
            # jobs on the critical path (long against the backlog) are not slowed for long: a critical
            # partner only takes newcomers done within a small share of its own time, and a critical
            # newcomer does not share (two long jobs would lock both slots of the GPUs for long)
            limit = self.makespan_beta * self._backlog
            if t_a >= limit and not self._has_deadline(js):
                self._reject = "LONG"
                return None
            if t_b >= limit and xi_a * t_a > CRITICAL_SHARE * t_b:
                self._reject = "CRITICAL"
                return None
            # the job that ends last (the longest, and at least as long as the whole backlog) sets
            # the makespan: any slowdown of it lengthens the makespan one for one
            if t_b >= self._backlog and t_b >= LAST_END_SHARE * self._max_rem and xi_b > 1.0:
                self._reject = "CRITICAL"
                return None
        lp = self.long_pairs
        if lp is not None and t_a > lp and t_b > lp:
            # (`long_pairs`) two jobs both longer than it would hold both slots of the GPU for that long:
            # the second slot stays for the shorter jobs that may come
            self._reject = "LONG_PAIR"
            return None
        dl_b = partner.job.deadline
        if dl_b is not None and now + t_b <= dl_b:
            a_hat, b_hat = xi_a * t_a, xi_b * t_b
            fin_b = now + (b_hat if a_hat >= b_hat else a_hat + (t_b - a_hat / xi_b))
            if fin_b > dl_b:
                self._reject = "PARTNER_DEADLINE"
                return None
        t_con, t_seq = bsbf_times(t_a, t_b, xi_a, xi_b)
        g_b = max(1, partner.job.qos.gpus)
        # GPU-throughput balance: the newcomer's GPU at 1/xi_a, minus what the partner's whole gang loses
        tput = 1.0 / xi_a - g_b * (1.0 - 1.0 / xi_b)
        return tput, xi_a, xi_b, t_seq - t_con, g_b

    def _shared_slot(self, st: ClusterState, js: JobState, rem, states, est, now: float, queued: bool, keep_off=None) -> tuple[Placement, str] | None:
        """Co-locate `js` on GPUs that each hold one shareable job, where it pays (see module doc):
        the nodes whose GPUs could take it, each GPU scored by its occupant, the best set of GPUs, and
        the placement with its memory plan. On None, `_why_not` says why. `keep_off(nodes)`: if it
        says the nodes of the placement found are in the way of a reservation, the placement is not
        made and `KEPT_OFF` is returned instead."""
        q = js.job.qos
        self._why_not = None
        if not q.shareable or q.gpu_mem_mb is None:
            self._why_not = "it may not share a GPU" if not q.shareable else "it declares no GPU memory, so no partner is known to fit"
            return None
        found = self._share_candidates(st, js)
        if found is None:
            return None
        elig, min_mem, cand = found
        node_choices, rejects = self._score_partners(st, js, cand, elig, min_mem, rem, states, est, now)
        best, tried = self._pick_gpus(st, js, node_choices, queued)
        if best is None:
            self._why_not = self._share_refusal(js, tried, rejects)
            return None
        return self._share_placement(st, js, *best, keep_off=keep_off)

    def _share_candidates(self, st: ClusterState, js: JobState):
        """(eligible GPUs, the least memory the job could run in, candidate nodes) for `js`, or None
        with `_why_not` set. Cached per request shape until the next placement."""
        job = js.job
        q = job.qos
        k = q.gpus
        sig = (k, q.gpu_model, q.gpu_mem_mb, job.batch_size is not None, q.cpu_cores)
        if self._nofit.get(sig) == self._ver:
            # nothing changed since the same request found no shareable slot this round
            self._why_not = self._nofit_why.get(sig)
            return None
        # the same for every request of this shape (and batch or not) until the next placement
        rkey = ("share-cands", sig, bool(job.batch_size))
        hit = self._elig_cache.get(rkey)
        if hit is not None and hit[0] == self._ver:
            return hit[1]
        elig = self._gpu_masks(st, q.gpu_model)[1]
        # the smallest memory the job could run in (with the smallest sub-batch tried)
        min_mem = q.gpu_mem_mb if not (self.sub_batch and job.batch_size) else q.gpu_mem_mb * (FIXED_MEMORY_SHARE + (1 - FIXED_MEMORY_SHARE) / MAX_ACCUMULATION)
        mkey = ("share-mem", q.gpu_model, self._mem_class(st, q.gpu_model, min_mem))
        mc = self._elig_cache.get(mkey)
        if mc is None or mc[0] != self._ver:
            e = elig & (st.gmem_free >= min_mem - 1e-6)
            mc = (self._ver, e, e.sum(axis=1))
            self._elig_cache[mkey] = mc
        elig, per_node = mc[1], mc[2]
        cpu_need = q.cpu_cores
        ckey = (mkey, k, cpu_need)
        cc = self._elig_cache.get(ckey)
        if cc is None or cc[0] != self._ver:
            if k <= max(1, st.spec.max_gpus_per_node):
                cand = np.flatnonzero((per_node >= k) & (st.cpu_free >= cpu_need - 1e-9))
            else:
                full = (per_node == st.gpu_count) & (st.gpu_count > 0) & (st.cpu_free >= cpu_need / k * st.gpu_count - 1e-9)
                cand = np.flatnonzero(full)
                if st.gpu_count[cand].sum() < k:
                    cand = None
            if cand is not None and cand.size > self.SHARE_NODES:
                cand = cand[np.argsort(-per_node[cand], kind="stable")[: self.SHARE_NODES]]
            cc = self._elig_cache[ckey] = (self._ver, None if cand is None else cand.tolist())
        cand = cc[1]
        if cand is None:
            return self._no_slot(sig, f"no {k} GPUs on whole nodes each hold a single shareable job with {min_mem:.0f} MB free")
        if not cand:
            return self._no_slot(sig, f"no {'GPU holds' if k == 1 else f'{k} GPUs on one node hold'} a single shareable job with {min_mem:.0f} MB free")
        self._elig_cache[rkey] = (self._ver, (elig, min_mem, cand))
        return elig, min_mem, cand

    def _score_partners(self, st: ClusterState, js: JobState, cand, elig, min_mem: float, rem, states, est, now: float):
        """Per candidate node, its shareable occupants that `js` may join, best first; and how many
        were refused, by reason code. A partner's penalty is counted once per partner."""
        values: dict[str, tuple | None] = {}  # partner -> `_partner_value` (None: refused) ...
        why: dict[str, str | None] = {}  # ... and why it was refused
        rank_key = (lambda x: -x[5]) if self.partner_rank == "benefit" else (lambda x: -x[0])
        plan = self._plan
        node_choices = []
        rejects: dict[str, int] = {}
        for n in cand:
            by_partner = self._node_partners(st, n, elig, min_mem, states)
            scored = []
            for pid, gpus in by_partner.items():
                if pid in values:
                    v = values[pid]
                else:
                    v = values[pid] = self._partner_value(js, states[pid], rem, est, now)
                    if v is None:
                        why[pid] = self._reject
                if v is None:
                    code = why[pid]
                    rejects[code] = rejects.get(code, 0) + 1
                    continue
                tput, xi_a, xi_b, gain, g_b = v
                per_gpu = 1.0 / xi_a - g_b * (1.0 - 1.0 / xi_b) / len(gpus)
                if plan and not self._in_plan(js.job.model, states[pid].job.model):
                    if not self._has_deadline(js):
                        continue  # leave this partner for the type the pairing plan saves it for
                scored.append((per_gpu, pid, gpus, xi_a, xi_b, gain, g_b))
            # partners in order of SJF-BSBF's sharing benefit (the pair's average completion time
            # saved), or of the GPU-throughput balance
            scored.sort(key=rank_key)
            node_choices.append((n, scored))
        # the deadline rescue of the same job (this round) weighs partners again: they are worth the
        # same (a partner's value depends on the round's estimates, not on the GPUs taken)
        self._last_values = (js, values, why)
        return node_choices, rejects

    def _pick_gpus(self, st: ClusterState, js: JobState, node_choices, queued: bool):
        """The best (total gain, GPUs, partners) for `js`, or None; and the (gain per GPU, slowdown,
        why) of the sets refused. A job that fits on one node takes the best node's best partners; a
        wider gang takes whole nodes, the best first."""
        k = js.job.qos.gpus
        best = None
        tried: list[tuple[float, float, str | None]] = []
        if k <= max(1, st.spec.max_gpus_per_node):
            for n, scored in node_choices:
                taken = 0
                uses: list[list[int]] = []  # the GPUs of node n taken beside each partner
                partners = []
                for per_gpu, pid, gpus, xi_a, xi_b, gain, g_b in scored:
                    if taken >= k:
                        break
                    use = gpus[: k - taken]
                    uses.append(use)
                    taken += len(use)
                    partners.append((pid, len(use), xi_a, xi_b, gain, g_b))
                if taken < k:
                    continue
                total = self._accept(js, partners, k, queued)
                if total is not None and (best is None or total > best[0]):
                    best = (total, [(n, g) for use in uses for g in use], partners)
                elif total is None:
                    tried.append((*self._refused, self._reject))
        else:
            nodes_sorted = sorted(node_choices, key=lambda x: -sum(s[0] * len(s[2]) for s in x[1]))
            take, partners = [], []
            for n, scored in nodes_sorted:
                if len(take) >= k:
                    break
                for per_gpu, pid, gpus, xi_a, xi_b, gain, g_b in scored:
                    take.extend((n, g) for g in gpus)
                    partners.append((pid, len(gpus), xi_a, xi_b, gain, g_b))
            if len(take) >= k:
                take = take[:k]
                total = self._accept(js, partners, k, queued)
                if total is not None:
                    best = (total, take, partners)
                else:
                    tried.append((*self._refused, self._reject))
        return best, tried

    def _share_placement(self, st: ClusterState, js: JobState, total: float, take, partners, keep_off=None) -> tuple[Placement, str] | None:
        """The placement of `js` on the GPUs `take` beside `partners`: its memory (a sub-batch with
        gradient accumulation if the full batch does not fit) and cores; None with `_why_not` set if
        either does not fit after all; `KEPT_OFF` if `keep_off` refuses its nodes."""
        job = js.job
        q = job.qos
        k = q.gpus
        free_mem = float(min(st.gmem_free[n, g] for n, g in take))
        plan = memory_plan(job, free_mem, allow_sub_batch=self.sub_batch)
        if plan is None:
            self._why_not = f"the best partner's GPUs have {free_mem:.0f} MB free, too little even with the smallest sub-batch"
            return None
        mem, sb = plan
        cpu: dict[int, float] = {}
        for n, _ in take:
            cpu[n] = cpu.get(n, 0.0) + q.cpu_cores / k
        for n, c in cpu.items():
            if st.cpu_free[n] < c - 1e-9:
                self._why_not = f"the best partner's node has {st.cpu_free[n]:g} free cores, it needs {c:g}"
                return None
        if q.mem_mb > 0:  # (host memory, split evenly over its nodes as `ClusterState.allocate` does)
            for n in cpu:
                if st.mem_free[n] < q.mem_mb / len(cpu) - 1e-6:
                    self._why_not = f"the best partner's node has {st.mem_free[n]:g} MB of host memory free, it needs {q.mem_mb / len(cpu):g}"
                    return None
        if keep_off is not None and keep_off(tuple(cpu)):  # (the placement's nodes, in its order)
            return KEPT_OFF
        pids = tuple(dict.fromkeys(p[0] for p in partners))
        p = Placement(job.job_id, tuple(take), cpu=tuple(cpu.items()), gpu_mem_mb=float(mem), mem_mb=q.mem_mb, colocated_with=pids, sub_batch=sb)
        xa = max(x[2] for x in partners)
        why = (
            f"sharing GPUs with {', '.join(pids)}: predicted slowdown {xa:.2f}, GPU-throughput {total / k:+.0%} per GPU"
            + (f", sub-batch {sb.sub_batch} x {sb.accumulation_steps} steps" if sb else "")
        )
        return p, why

    def _node_partners(self, st: ClusterState, n: int, elig, min_mem: float, states) -> dict[str, list[int]]:
        """Shareable occupants of node n and the GPUs they hold there (cached until the next placement)."""
        key = (n, id(elig))  # elig is cached per (GPU model, memory class, version), so its id is stable
        hit = self._partners_cache.get(key)
        if hit is not None and hit[0] == self._ver:
            return hit[1]
        by_partner: dict[str, list[int]] = {}
        for g in np.flatnonzero(elig[n]).tolist():
            occ = st.gpu_jobs.get((n, g), ())
            if len(occ) == 1 and occ[0] in states:
                by_partner.setdefault(occ[0], []).append(g)
        self._partners_cache[key] = (self._ver, by_partner)
        return by_partner

    def _in_plan(self, a: str, b: str) -> bool:
        return (min(a, b), max(a, b)) in self._plan

    def _update_plan(self, view: SchedulerView, rem) -> None:
        if not self.use_plan or view.now - self._plan_at < self.plan_interval:
            return
        from qosflow.policies.pairing_plan import pairing_plan

        work: dict[str, float] = {}
        rep = {}
        for js in list(view.pending) + list(view.running):
            q = js.job.qos
            if q.fractional or q.gpus == 0 or not q.shareable:
                continue
            work[js.job.model] = work.get(js.job.model, 0.0) + rem[js.job_id] * q.gpus
            rep.setdefault(js.job.model, js.job)
        est = view.estimator
        plan, _alone, _speedup = pairing_plan(work, lambda a, b: est.pair_slowdown(rep[a], rep[b]))
        self._plan = plan
        self._plan_at = view.now

    def _accept(self, js: JobState, partners, k: int, queued: bool) -> float | None:
        """Total GPU-throughput gain of the co-location, or None if it does not pay.

        It pays when the pair's average completion time improves for every partner (SJF-BSBF's test:
        share now rather than wait for the partner), or, while work is queued, when the GPUs do more
        work shared than alone by `throughput_gain` per GPU."""
        xa = max([p[2] for p in partners])
        total = self._pair_total(partners, k, xa)
        self._refused = (total / k, xa)  # what the refusal note quotes if this pair is not taken
        dl = js.job.deadline
        r = self._rem[js.job.job_id]
        if dl is not None and self._now + r <= dl:
            # a job that can still meet its deadline joins if it still meets it shared
            if self._now + xa * r <= dl and total > self.DL_COST_FLOOR * k:
                if self.deadline_band:
                    xa_h = max(pair_slowdown_high(self._est, js.job, self._states[p[0]].job)[0] for p in partners)
                    if not self._band_ok(js, xa_h):
                        self._reject = "DL_BAND"
                        return None
                return total + k
            self._reject = "DL_MISS" if self._now + xa * r > dl else "DL_COST"
            return None
        if total > 0 and all(p[4] > 0 for p in partners):
            return total
        if queued and total >= self.throughput_gain * k:
            return total
        sa = self.share_after
        if (sa is not None and total > self.DL_COST_FLOOR * k and all(p[4] > 0 for p in partners)
                and self._now - js.queued_since >= sa * r):
            # (`share_after`) a job that has waited `share_after` times its own time already: the pair's
            # average completion still improves for every partner (SJF-BSBF's test), and the GPUs lose
            # less than the floor a deadline job may cost them
            return total
        self._reject = "NO_GAIN"
        return None

    def _pair_total(self, partners, k: int, xa: float | None = None) -> float:
        """GPU-throughput balance of a co-location: the newcomer's k GPUs at 1/xi_a, minus what each
        partner's whole gang loses (`xa`: the largest xi_a of `partners`, if known)."""
        total = k / (max([p[2] for p in partners]) if xa is None else xa)
        for _pid, _n, _xa, xb, _gain, g_b in partners:
            total -= g_b * (1.0 - 1.0 / xb)
        return total

    def _no_slot(self, sig: tuple, why: str) -> None:
        """Remember (until the next placement) that requests shaped `sig` find no GPU to share."""
        self._nofit[sig] = self._ver
        self._nofit_why[sig] = why
        self._why_not = why
        return None

    #: a deadline job shares only if the GPUs lose less than this GPU-throughput per GPU it takes
    DL_COST_FLOOR = -0.5

    #: why a partner was refused (`_partner_value`), in words for the job's note
    REJECT_WORDS = {
        "LONG": "it is long against the backlog (on the critical path), and two long jobs would hold both slots of a GPU for long",
        "CRITICAL": "the jobs it could join are on the critical path (the longest ones) and take only short partners",
        "PARTNER_DEADLINE": "joining would push a partner past a deadline it can still meet",
        "LONG_PAIR": "it and the jobs it could join are all long (`long_pairs`): the second slot of a GPU holding a long job is kept for shorter jobs",
    }

    def _share_refusal(self, js: JobState, tried, rejects: dict[str, int]) -> str:
        """Why `js` found no GPUs to share, in words (for `Decision.notes`)."""
        if tried:
            gain, xa, _code = max(tried)
            codes = {c for _g, _x, c in tried}
            if "DL_BAND" in codes:
                return "sharing meets its deadline at the predicted slowdown, not at the estimator's pessimistic one"
            if "DL_COST" in codes:
                worst = max(g for g, _x, c in tried if c == "DL_COST")
                return f"sharing meets its deadline but slows its partners' gangs too much ({worst:+.0%} GPU-throughput per GPU)"
            if "DL_MISS" in codes:
                least = min(x for _g, x, _c in tried)
                r = self._rem[js.job_id]
                return (
                    f"sharing would miss its deadline: the least slowdown on offer is {least:.2f}x "
                    f"({least * r:.0f}s to run, {js.job.deadline - self._now:.0f}s left)"
                )
            return (
                f"no pair pays: the best does {gain:+.0%} GPU-throughput per GPU at slowdown {xa:.2f}x "
                f"(needs {self.throughput_gain:+.0%} while jobs queue, or a shorter average completion of the pair)"
            )
        if rejects:
            top = sorted(rejects, key=lambda c: -rejects[c])[:2]
            return "; ".join(self.REJECT_WORDS.get(c, c) for c in top)
        if self._plan:
            return "no partner left: the pairing plan keeps the shareable GPUs for other job types"
        return "no GPU it could share has room for it"
