"""qosflow policy, step 3a on a cluster of mixed GPU models: which model a job's GPUs are of.

Jobs differ in what a faster GPU is worth to them (Gavel, OSDI'20: on its K80s ResNet-50 runs at
0.14 x a V100, its recommender at 1.4 x). The estimator says how fast a job runs on each model
(`Estimator.gpu_speed`, relative to the GPU its duration is for); the policy then

* reads every time in wall time on the GPUs concerned: a running job's remaining time at the speed
  of the GPUs it holds (a gang at its slowest GPU's), a waiting job's at the speed of the fastest
  model it may use (its best case, by which it is ordered and its deadline judged);
* while no work queues behind a job, looks for GPUs of its own model by model, fastest first
  (models of equal speed for it together), and takes a slower model only if the job is predicted to
  end there sooner than by waiting for GPUs of a faster one to empty (`_consolidated_wait`: when
  their running jobs end), and says so;
* while work queues, takes the slowest model where it runs at most the typical (median) waiting job's
  remaining time longer than on its fastest (`_loaded_gpus`), else as above: short jobs, and jobs
  that lose little on a slow GPU, take the slow GPUs and leave the fast ones to the long jobs. Giving
  every job its fastest free model under load was measured worse on the loaded Gavel traces than
  ignoring models: SJF order then leaves the slow GPUs to the longest jobs (docs/policies.md, "Mixed
  GPU models").

On a cluster of one GPU model, or with an estimator that knows no model (`gpu_speed` 1.0
everywhere), none of this changes a decision.
"""

from __future__ import annotations

from dataclasses import replace

from qosflow.core.cluster import ClusterState
from qosflow.core.estimate import gpu_speed, placement_gpu_speed
from qosflow.core.job import Job, JobState


def _hours(s: float) -> str:
    """A duration as a note says it: minutes under an hour, else hours."""
    return f"{s / 60:.0f} min" if s < 3600 else f"{s / 3600:.1f} h"


class GpuModelsMixin:
    """Mixed GPU models for `QosflowPolicy`. Reads the option `gpu_models` and the round's `_now`,
    `_rem`, `_end_max`, `_typical_wait_r`, `_ver` (with `_empty_memo`); the search of a model's GPUs
    is `_own_gpus`, the wait for them `_consolidated_wait`."""

    def _node_models(self, st: ClusterState) -> list[str] | None:
        """Per node, its GPU model (lower case) -- None if the cluster has only one, or the option is off."""
        spec = st.spec
        hit = getattr(self, "_models_of", None)
        if hit is None or hit[0] is not spec:
            models = [n.gpu_model.lower() for n in spec.nodes]
            self._models_of = hit = (spec, models if len(set(models)) > 1 else None)
            #: per job id its `_model_groups`; per ("held", job id) its placement and `_held_speed`; per
            #: ("ways", job id, models) its request restricted to those models (`_other_ways`)
            self._groups: dict = {}
        return hit[1] if self.gpu_models else None

    def _model_groups(self, st: ClusterState, est, job: Job, models: list[str]) -> tuple:
        """The GPU models `job` may use, fastest first, as ((speed, the models of that speed `|`-joined,
        the job asking for them only), ...); remembered per job (its speeds are the estimator's at its
        first round). One group: the model does not matter to it."""
        hit = self._groups.get(job.job_id)
        if hit is not None:
            return hit
        q = job.qos
        ok = st.spec.model_mask(q.gpu_model)
        speeds: dict[float, list[str]] = {}
        for m in sorted({m for m, y in zip(models, ok) if y}):
            speeds.setdefault(float(gpu_speed(est, job, m)), []).append(m)
        groups = []
        for s in sorted(speeds, reverse=True):
            ms = "|".join(speeds[s])
            groups.append((s, ms, replace(job, qos=replace(q, gpu_model=ms)) if len(speeds) > 1 else job))
        if len(self._groups) > 4 * len(self._rem) + 1000:  # (forget jobs long gone)
            self._groups = {k: g for k, g in self._groups.items() if (k[1] if isinstance(k, tuple) else k) in self._rem}
        hit = self._groups[job.job_id] = tuple(groups)
        return hit

    def _held_speed(self, est, js: JobState, models: list[str]) -> float:
        """The speed of running `js` on the GPUs it holds: its slowest GPU's (remembered per placement)."""
        p = js.placement
        if p is None or not p.gpus:
            return 1.0
        hit = self._groups.get(("held", js.job.job_id))
        if hit is None or hit[0] is not p:
            hit = self._groups[("held", js.job.job_id)] = (p, placement_gpu_speed(est, js.job, p, models))
        return hit[1]

    def _best_speed(self, st: ClusterState, est, js: JobState, models: list[str]) -> float:
        """The speed of waiting job `js` on the fastest GPU model it may use (1.0 without GPUs of its own)."""
        q = js.job.qos
        if q.gpus <= 0 or q.fractional:
            return 1.0
        groups = self._model_groups(st, est, js.job, models)
        return groups[0][0] if groups else 1.0

    def _empty_on(self, st: ClusterState, models: str) -> int:
        """Empty GPUs on the up nodes of `models` (a `|`-joined group), as of `_ver` (remembered until the
        next placement): a group with fewer than a job asks for needs no search."""
        hit = self._empty_memo.get(models)
        if hit is None or hit[0] != self._ver:
            hit = self._empty_memo[models] = (self._ver, int(st.empty[st.spec.model_mask(models) & ~st.down].sum()))
        return hit[1]

    def _typed_gpus(self, st: ClusterState, js: JobState, groups: tuple, r: float, reserved, failures, none_on=()):
        """GPUs of `js`'s own on the fastest model that pays (see the module docstring): (placement or
        None, held -- free GPUs only on nodes reserved for others --, why it is there or waits).
        `none_on`: model groups already searched in vain for it this round (`_loaded_gpus`)."""
        job = js.job
        q = job.qos
        if st.total_empty_gpus() < q.gpus:
            return None, False, ""  # (no model has the GPUs: most waiting jobs stop here)
        best = groups[0][0]
        held = False
        for i, (s, ms, jv) in enumerate(groups):
            r_here = r * best / s
            if ms in none_on or self._empty_on(st, ms) < q.gpus:
                continue
            p, h = self._own_gpus(st, js, jv, r_here, self._whole_shape(q, ms), reserved, failures)
            held = held or h
            if p is None:
                continue
            if i == 0:
                return p, held, ""
            # a faster model whose GPUs empty soon enough: waiting for them ends sooner. (Empty GPUs of a
            # faster model the search could not have -- reserved for a gang, the node's cores or memory
            # short -- count from when a job on their node ends: taken as "no wait", they sent a job of
            # 9 days on a V100 to a K80 for 100 days while the V100s' jobs ended within hours)
            wait = None
            for s_f, ms_f, jf in groups[:i]:
                w = self._consolidated_wait(st, js, self._rem, q=jf.qos)
                if w <= 0:  # its GPUs are empty, but the search could not have them: until a job there ends
                    w = self._consolidated_wait(st, js, self._rem, q=jf.qos, next_change=True)
                if 0 < w and (wait is None or w + r * best / s_f < wait[0]):
                    wait = (w + r * best / s_f, ms_f, w)
            if wait is not None and wait[0] < r_here:
                return None, held, (
                    f"for a faster GPU model: {wait[1]} free in about {_hours(wait[2])}, done in "
                    f"{_hours(wait[0])}, against {_hours(r_here)} on {ms} now"
                )
            return p, held, f"GPU model {ms} ({s / best:.2f} x the fastest for it): done sooner than waiting for a faster one"
        # no model alone has GPUs for it now (a gang wider than any model's free servers): any GPUs
        p, h = self._own_gpus(st, js, job, r, self._whole_shape(q, q.gpu_model), reserved, failures)
        return p, held or h, ""

    def _loaded_gpus(self, st: ClusterState, js: JobState, groups: tuple, r: float, reserved, failures):
        """GPUs of `js`'s own while work queues behind it: on the slowest model where it takes at most
        the typical waiting job's remaining time (`_typical_wait_r`, the median) longer than on its
        fastest, else as `_typed_gpus` places it. A slow GPU costs a job its time there minus its time
        on a fast one: little for a short job or one that runs almost as fast there, much for a long
        one -- so short jobs take the slow GPUs and leave the fast ones to the long jobs behind them.
        (Placing every job on its fastest free model under load gave the slow GPUs to the long jobs SJF
        orders last.) A job keeps off a model where it would miss a deadline it can still meet
        (`_costing_little`). (placement or None, held, why)."""
        job = js.job
        q = job.qos
        if st.total_empty_gpus() < q.gpus:
            return None, False, ""  # (as `_typed_gpus`)
        best = groups[0][0]
        held = False
        none_on = []
        for s, ms, jv in reversed(self._costing_little(js, groups, r)):
            if self._empty_on(st, ms) < q.gpus:
                continue
            p, h = self._own_gpus(st, js, jv, r * best / s, self._whole_shape(q, ms), reserved, failures)
            held = held or h
            if p is not None:
                why = "" if s == best else (
                    f"GPU model {ms} ({s / best:.2f} x its fastest): {_hours(r * best / s - r)} longer there, within "
                    f"the typical waiting job's {_hours(self._typical_wait_r)}; the faster GPUs are left to longer jobs")
                return p, held, why
            none_on.append(ms)
        # else as without work queued: the fastest model that pays (a long job waits for a fast GPU
        # rather than take a slow one for many times its time)
        p, h, why = self._typed_gpus(st, js, groups, r, reserved, failures, none_on)
        return p, held or h, why

    def _costing_little(self, js: JobState, groups: tuple, r: float) -> list[tuple]:
        """The model groups where `js` (remaining time `r` on its fastest) runs at most the typical
        waiting job's remaining time (`_typical_wait_r`, the median) longer than on its fastest, and
        still meets a deadline it can meet, at the pessimistic estimate; fastest first (the fastest
        always is one)."""
        best = groups[0][0]
        dl = js.job.deadline if self._has_deadline(js) else None
        return [g for g in groups if g[0] == best or (
            r * best / g[0] - r <= self._typical_wait_r and (dl is None or self._finish_high(js, self._now + r * best / g[0]) <= dl))]

    def _other_ways(self, js: JobState, groups: tuple, r: float) -> tuple[JobState, float]:
        """`js` as GPUs it shares, a deadline rescue or relaxed locality may give it on a cluster of
        mixed models: restricted to the models that cost it little (`_costing_little`), and its speed on
        the slowest of them -- also when every model costs it little. (They judged a job by its time on its
        fastest model, and shared a K80 for a deadline job that then ran seven times, or twice, as long.)"""
        ok = self._costing_little(js, groups, r)
        slowest = ok[-1][0]
        if len(ok) == len(groups):
            return js, slowest
        job = js.job
        key = ("ways", job.job_id, tuple(ms for _, ms, _ in ok))
        jv = self._groups.get(key)
        if jv is None:
            jv = self._groups[key] = replace(job, qos=replace(job.qos, gpu_model="|".join(key[2])))
        return replace(js, job=jv), slowest  # (a copy of its state as it is now, asking for those models only)
