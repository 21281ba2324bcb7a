"""qosflow policy, step 3b': an elastic start -- a deadline gang that declared `min_gpus` starts on
fewer GPUs, with gradient accumulation, when its full width is not free and the slower run still
meets its deadline.

Without preemption a gang of 4 or 8 GPUs with an hour of slack rarely finds that many GPUs free in
time (docs/policies.md, "Deadlines without preemption"). Half of them free up far more often. On `w`
of its `g` GPUs the job accumulates `g / w` passes of the same per-GPU batch per optimizer step, so
its global batch and its convergence stay as declared, and it runs at about `w / g` of its speed
(`qosflow.core.speed.width_fraction`). The width is fixed at the start: a job is never resized while
it runs (that would be a preemption).

A job whose full width never fits the cluster (admitted because a narrower width does) starts on the
widest width that does, deadline or not, and narrower only as above (`top` of `_narrow_start`).

Only a job that declared it may be started so (`QoSSpec.min_gpus`, `@qos_task(min_gpus=...)`); a
trace job does only when the workload says so (`qosflow simulate --min-gpus-share`).
"""

from __future__ import annotations

from dataclasses import replace

from qosflow.core.job import JobState
from qosflow.core.placement import Placement


class ElasticStartMixin:
    """Elastic starts for `QosflowPolicy` (the round calls it with the option `elastic` on, for a job that
    declared `min_gpus` and can still meet its deadline). Reads the round's `_now`; finds GPUs
    with `_own_gpus` (clear of reservations) and checks the deadline at the pessimistic remaining
    time (`_r_high`) with `deadline_band`."""

    def _narrow_start(self, st, js: JobState, r: float, reserved, failures, top: int | None = None) -> tuple[Placement, object, str] | None:
        """GPUs for deadline job `js` (remaining time `r` on all its GPUs) on fewer of them: the widest
        of its `widths` below its full width that is free (and clear of reservations) and on which
        it still meets its deadline, at the pessimistic remaining time too where the estimator
        states one. Returns (placement as the narrowed request's, the narrowed job, why), or None; the
        caller counts its remaining time at that width (x gpus / width).

        `top`: for a job whose full width never fits the cluster, the widest width that does, which
        takes the part of its full width (`r` is its remaining time there): it starts on `top` GPUs
        when they are free, deadline or not, and narrower only as above (a deadline it still meets)."""
        job = js.job
        q = job.qos
        dl = job.deadline
        now = self._now
        r_h = self._r_high(js)
        full = q.gpus if top is None else top
        for w in q.widths:
            if w > full or w == q.gpus:
                continue
            stretch = full / w
            r_w = r * stretch
            if w < full and (dl is None or now + r_w > dl or now + r_h * stretch > dl):
                return None  # narrower is slower still
            qn = q.narrowed(w)
            jn = replace(job, qos=qn)
            p, _held = self._own_gpus(st, js, jn, r_w, self._whole_shape(qn, qn.gpu_model), reserved, failures)
            if p is not None:
                if w == full:
                    why = (
                        f"started on {w} of its {q.gpus} GPUs (gradient accumulation x{q.gpus // w}): all {q.gpus} never fit "
                        f"this cluster, and {w} is the widest of its widths that does"
                    )
                else:
                    why = (
                        f"elastic start on {w} of its {q.gpus} GPUs (gradient accumulation x{q.gpus // w}): all {full} "
                        f"{'are' if top is None else f'it may get here (all {q.gpus} never fit) are'} not free, and at {w / q.gpus:.0%} "
                        f"speed it still meets its deadline ({(dl - now - r_w) / 3600:.1f} h of slack)"
                    )
                return p, jn, why
        return None
