"""Reproducible deadlines for traces that carry none.

Rule (docs/workloads.md): a share of the jobs (default 0.5) gets a deadline
``lambda x isolated duration`` after its submission, with ``lambda ~ U[lam_lo, lam_hi]`` (default
U[1.2, 3]); those jobs become `guaranteed`. The other jobs become `best-effort`, unless the trace
gave them a priority (``job.meta["priority_from_trace"]``), which they keep.

A trace may also decide per job (``job.meta["wants_deadline"]``): True always gets a deadline
(Alibaba's latency-sensitive pods), False never (its best-effort pods); None is drawn with the share.
A trace that gives the factor itself (``job.meta["trace_deadline_factor"]``: Gavel's SLO field, the
deadline as a multiple of the job's duration) gets that deadline instead of a drawn one.

Every draw is a hash of (seed, job id), not a position in a random stream: a job gets the same
decision and the same lambda whatever the other jobs are, so truncating or filtering a trace does
not reshuffle the deadlines of the jobs that remain.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from typing import Iterable

from qosflow.core.job import Job
from qosflow.core.qos import PriorityClass
from qosflow.errors import SpecError

DEFAULT_SHARE = 0.5
DEFAULT_LAMBDA = (1.2, 3.0)


def _unit(seed: int, key: str) -> float:
    """A number in [0, 1) fixed by (seed, key), the same on every machine and Python version."""
    h = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


def deadline_factor(job_id: str, seed: int, lam: tuple[float, float] = DEFAULT_LAMBDA) -> float:
    """The lambda job `job_id` gets for this seed (whether or not it is chosen)."""
    lo, hi = lam
    return lo + (hi - lo) * _unit(seed, "deadline-lambda:" + job_id)


def gets_deadline(job: Job, share: float, seed: int) -> bool:
    forced = job.meta.get("wants_deadline")
    if forced is not None:
        return bool(forced)
    return _unit(seed, "deadline-pick:" + job.job_id) < share


def assign_deadlines(
    jobs: Iterable[Job],
    *,
    share: float = DEFAULT_SHARE,
    seed: int = 0,
    lam: tuple[float, float] = DEFAULT_LAMBDA,
) -> list[Job]:
    """New jobs with deadlines and priorities assigned (the inputs are not changed).

    The deadline is relative to submission (`QoSSpec.deadline`): ``lambda x job.duration``, the
    job's isolated running time. The chosen lambda is recorded in ``meta["deadline_lambda"]``.
    """
    if not (isinstance(share, (int, float)) and math.isfinite(share) and 0.0 <= share <= 1.0):
        raise SpecError("deadline_share", f"must be a fraction in [0, 1], got {share!r}")
    lo, hi = (float(x) for x in lam)
    if not (math.isfinite(lo) and math.isfinite(hi) and 1.0 <= lo <= hi):
        raise SpecError("deadline_lambda", f"need 1 <= low <= high (a deadline no shorter than the job), got {lam!r}")
    out: list[Job] = []
    for job in jobs:
        meta = dict(job.meta)
        if gets_deadline(job, share, seed):
            f = meta.get("trace_deadline_factor") or deadline_factor(job.job_id, seed, (lo, hi))
            meta["deadline_lambda"] = f
            qos = job.qos.with_(deadline=f * job.duration, priority=PriorityClass.GUARANTEED)
        else:
            meta.pop("deadline_lambda", None)
            prio = job.qos.priority if meta.get("priority_from_trace") else PriorityClass.BEST_EFFORT
            qos = job.qos.with_(deadline=None, priority=prio)
        out.append(replace(job, qos=qos, meta=meta))
    return out
