"""The predictor's tables (latest schema), as SQLModel classes.

The database is created and upgraded only by the ordered migrations in `qosflow.store.migrations`;
these classes describe the schema those migrations produce (a test checks that the two agree).
To add a table (e.g. `leases` for slot leases, issue 6): add its class here *and* a new migration
that creates it (copy the pattern of `_m3_stage_history`), then bump nothing else: the version is
the number of migrations.

Units: every time is in seconds (`*_s`), memory in MiB (`*_mb`), utilisation in per cent (0-100).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class SchemaVersion(SQLModel, table=True):
    __tablename__ = "schema_version"

    version: int = Field(primary_key=True)
    description: str = ""
    applied_at: datetime = Field(default_factory=utcnow)


class Profile(SQLModel, table=True):
    """A job signature's lightweight profile on one GPU type (or on CPU only: gpu_type='cpu')."""

    __tablename__ = "profile"

    id: Optional[int] = Field(default=None, primary_key=True)
    signature: str = Field(index=True)
    gpu_type: str = "unknown"
    #: solo step time at 1 GPU (or on CPU with cpu_cores cores), seconds
    solo_step_time_s: float
    cpu_cores: Optional[int] = None
    #: JSON object {reference signature: co-located speed of this job, normalised to solo}
    ref_speeds_json: str = "{}"
    #: JSON object {reference signature: the reference job's co-located speed with this job}
    ref_partner_speeds_json: str = "{}"
    #: 'profile' (qosflow profile), 'reference' (a shipped table), 'import'
    source: str = "profile"
    created_at: datetime = Field(default_factory=utcnow)


class Sample(SQLModel, table=True):
    """One measurement of a job's step time in a given placement."""

    __tablename__ = "sample"

    id: Optional[int] = Field(default=None, primary_key=True)
    signature: str = Field(index=True)
    gpu_type: str = "unknown"
    #: 'consolidated' (all GPUs on one node) or 'spread' (over nodes)
    placement: str = "consolidated"
    gpus: int = 1
    cross_node: bool = False
    cpu_cores: Optional[int] = None
    #: signature of the job sharing the GPUs, or None when running alone
    co_runner: Optional[str] = Field(default=None, index=True)
    step_time_s: float
    #: number of steps the step time is averaged over (weight)
    steps: int = 1
    gpu_util_pct: Optional[float] = None
    gpu_mem_mb: Optional[float] = None
    #: 'profile', 'stage' (a finished stage), 'reference', 'import'
    source: str = "stage"
    stage_run_id: Optional[str] = Field(default=None, index=True)
    created_at: datetime = Field(default_factory=utcnow)


class PredictionRecord(SQLModel, table=True):
    """A prediction the scheduler acted on (kept so its error can be measured later)."""

    __tablename__ = "prediction"

    id: Optional[int] = Field(default=None, primary_key=True)
    stage_run_id: Optional[str] = Field(default=None, index=True)
    signature: str = Field(index=True)
    #: 'solo_step_time', 'slowdown', 'cpu_speedup', 'remaining', 'duration'
    target: str
    value: float
    low: float
    high: float
    n_samples: int = 0
    basis: str = ""
    context_json: str = "{}"
    created_at: datetime = Field(default_factory=utcnow)


class Outcome(SQLModel, table=True):
    """What actually happened to a stage (the truth to compare predictions with)."""

    __tablename__ = "outcome"

    id: Optional[int] = Field(default=None, primary_key=True)
    stage_run_id: str = Field(index=True)
    signature: str = ""
    target: str = "duration"
    actual: float
    created_at: datetime = Field(default_factory=utcnow)


class StageHistory(SQLModel, table=True):
    """One run of one pipeline stage: where it ran and how it went."""

    __tablename__ = "stage_history"

    id: Optional[int] = Field(default=None, primary_key=True)
    stage_run_id: str = Field(index=True)
    flow_run_id: Optional[str] = Field(default=None, index=True)
    stage: str = ""
    signature: str = ""
    state: str = "COMPLETED"
    gpu_type: str = "unknown"
    gpus: int = 0
    placement: str = "consolidated"
    host: Optional[str] = None
    cpu_cores: Optional[int] = None
    co_runner: Optional[str] = None
    #: steps this run did (of a resumed run: after `resumed_from`)
    steps: Optional[int] = None
    started_at: Optional[datetime] = None
    finished_at: Optional[datetime] = None
    duration_s: Optional[float] = None
    step_time_s: Optional[float] = None
    created_at: datetime = Field(default_factory=utcnow)
    #: steps an earlier run had done when this one started (resumed from a checkpoint); None: from the start
    resumed_from: Optional[int] = None
