"""qosflow policy, step 3b': an elastic start -- a deadline gang that declared `min_gpus` starts on
fewer GPUs, with gradient accumulation, when its full width is not free and the slower run still
meets its deadline.

Without preemption a gang of 4 or 8 GPUs with an hour of slack rarely finds that many GPUs free in
time (docs/policies.md, "Deadlines without preemption"). Half of them free up far more often. On `w`
of its `g` GPUs the job accumulates `g / w` passes of the same per-GPU batch per optimizer step, so
its global batch and its convergence stay as declared, and it runs at about `w / g` of its speed
(`qosflow.core.speed.width_fraction`). The width is fixed at the start: a job is never resized while
it runs (that would be a preemption).

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

    def _narrow_start(self, st, js: JobState, r: float, reserved, failures) -> tuple[Placement, object, str] | None:
        """GPUs for deadline job `js` (remaining time `r` on all its GPUs) on fewer of them: the widest
        of its `widths` below its full width that is free (and clear of reservations) and on which
        it still meets its deadline, at the pessimistic remaining time too where the estimator
        states one. Returns (placement as the narrowed request's, the narrowed job, why), or None; the
        caller counts its remaining time at that width (x gpus / width)."""
        job = js.job
        q = job.qos
        dl = job.deadline
        now = self._now
        r_h = self._r_high(js)
        for w in q.widths[1:]:
            stretch = q.gpus / w
            r_w = r * stretch
            if now + r_w > dl or now + r_h * stretch > dl:
                return None  # narrower is slower still
            qn = q.narrowed(w)
            jn = replace(job, qos=qn)
            p, _held = self._own_gpus(st, js, jn, r_w, self._whole_shape(qn, qn.gpu_model), reserved, failures)
            if p is not None:
                why = (
                    f"elastic start on {w} of its {q.gpus} GPUs (gradient accumulation x{q.gpus // w}): "
                    f"all {q.gpus} are not free, and at {w / q.gpus:.0%} speed it still meets its deadline "
                    f"({(dl - now - r_w) / 3600:.1f} h of slack)"
                )
                return p, jn, why
        return None
