"""Jobs (pipeline stages or trace jobs) and their runtime state.

A `Job` is what was submitted: its QoS spec and what is known about its work. Its `duration` is the
*true* isolated running time (alone on consolidated GPUs with enough CPU cores). The simulator
advances jobs with the true values; policies only ever see estimates, through an `Estimator`.

A `JobState` is the runtime record the simulator or the live worker keeps for a job: status,
placement, service received, progress. Policies read it and never write it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from qosflow.core.qos import QoSSpec
from qosflow.errors import SpecError

if TYPE_CHECKING:
    from qosflow.core.placement import Placement


@dataclass(frozen=True, slots=True)
class FailurePlan:
    """How a job fails in a simulation (Philly: failures repeat for the same job).

    The job fails after `at_fraction` of its work on each of its first `times` attempts; work since
    its last checkpoint is lost (`checkpoint_fraction`=0 loses the attempt entirely).
    `kind` is "user" (its own code) or "infra" (node lost, OOM, eviction).
    """

    at_fraction: float
    times: int = 1
    kind: str = "user"
    checkpoint_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.at_fraction < 1.0:
            raise SpecError("failure.at_fraction", f"must be in (0, 1), got {self.at_fraction}")
        if self.times < 1:
            raise SpecError("failure.times", f"must be >= 1, got {self.times}")
        if self.kind not in ("user", "infra"):
            raise SpecError("failure.kind", f"must be 'user' or 'infra', got {self.kind!r}")


@dataclass(slots=True, eq=False)
class Job:
    """One schedulable unit: a pipeline stage or a trace job."""

    job_id: str
    submit_time: float
    qos: QoSSpec
    duration: float
    model: str = "generic"
    batch_size: int | None = None
    iterations: int | None = None
    #: per-iteration seconds spent on each resource (Muri's resource_time_*: data/CPU, GPU, network)
    resource_profile: tuple[float, ...] | None = None
    #: cores per GPU beyond which adding cores stops helping (CODA); None: the speed model's default
    cpu_saturation: float | None = None
    #: who submitted it (fairness between users: `QosflowPolicy(fair_share=...)`); None: not known. Taken
    #: from the QoS spec's `user` when not given (a stage's: `@qos_task(user=...)`, its run's `user:` tag)
    user: str | None = None
    pipeline: str | None = None
    depends_on: tuple[str, ...] = ()
    failure: FailurePlan | None = None
    #: what the submitter declared (e.g. @qos_task(expected_duration=...)); an estimate, not the truth
    expected_duration: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.job_id:
            raise SpecError("job_id", "must be a non-empty string")
        if not math.isfinite(self.submit_time) or self.submit_time < 0:
            raise SpecError("submit_time", f"must be >= 0 seconds, got {self.submit_time!r}", where=f"job {self.job_id}")
        if not math.isfinite(self.duration) or self.duration <= 0:
            raise SpecError("duration", f"must be > 0 seconds, got {self.duration!r}", where=f"job {self.job_id}")
        if self.user is None and self.qos.user is not None:
            self.user = self.qos.user
        if self.expected_duration is not None and (
            not math.isfinite(self.expected_duration) or self.expected_duration <= 0
        ):
            raise SpecError("expected_duration", f"must be > 0 seconds, got {self.expected_duration!r}", where=f"job {self.job_id}")

    @property
    def deadline(self) -> float | None:
        """Absolute deadline (simulation or wall-clock seconds), or None."""
        d = self.qos.deadline
        return None if d is None else self.submit_time + d

    @property
    def num_gpus(self) -> int:
        return self.qos.gpus

    def __repr__(self) -> str:
        return f"Job({self.job_id!r}, gpus={self.qos.gpus}, model={self.model!r}, duration={self.duration:.0f}s)"


class JobStatus(str, Enum):
    WAITING = "waiting"  # submitted, dependencies not finished (pipelines)
    PENDING = "pending"  # ready, queued for the scheduler
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # gave up (user failure beyond its retries)
    REJECTED = "rejected"  # can never fit this cluster


@dataclass(slots=True, eq=False)
class JobState:
    """What the simulator or worker knows of a job at run time. Policies treat it as read-only."""

    job: Job
    status: JobStatus = JobStatus.PENDING
    placement: "Placement | None" = None
    #: fraction of the job's work done (0..1); observable in practice through progress reports
    progress: float = 0.0
    #: wall seconds the job has run (all attempts), and GPU-seconds received (for LAS policies)
    attained: float = 0.0
    gpu_attained: float = 0.0
    #: fraction of the work done before the time counted in `attained` began: a live stage run that
    #: resumed from a checkpoint (`qosflow.report_resumed`); `progress - progress_start` is the work
    #: `attained` paid for. 0 in the simulator, whose `attained` counts every attempt
    progress_start: float = 0.0
    queued_since: float = 0.0
    first_start: float | None = None
    last_start: float | None = None
    finish_time: float | None = None
    restarts: int = 0
    failures: int = 0
    preemptions: int = 0
    #: GPUs of its last start: fewer than `job.qos.gpus` after an elastic start (`QoSSpec.min_gpus`); set
    #: by the simulator
    started_gpus: int | None = None
    #: policy-private scratch space (e.g. Tiresias queue index); cleared never
    tags: dict[str, Any] = field(default_factory=dict)
    #: why the job waits or shares, as the policy last explained it
    note: str = ""

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def running(self) -> bool:
        return self.status is JobStatus.RUNNING

    def __repr__(self) -> str:
        return f"JobState({self.job.job_id!r}, {self.status.value}, progress={self.progress:.3f})"
