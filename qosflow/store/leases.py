"""Slot leases: a placement is a lease in the store, so two workers never book the same GPU.

Two tables (SQLModel):

* `qosflow_stage_lease` - one row per live stage attempt: which worker holds it, until when
  (`expires_at`, renewed while the stage runs), its placement and its backend handle (so a restarted
  worker can find the stage again). UNIQUE(pool, stage_key): one live attempt per stage, ever.
* `qosflow_slot_lease` - one row per booked unit of capacity. UNIQUE(pool, node, resource) is the
  database constraint that makes double-booking impossible, whatever the workers believe.

A GPU is 20 units of 50 milli-GPU: an exclusive whole-GPU stage books all 20; a shareable
whole-GPU stage, or the one co-located with it (`colocated_with`), books a free half (10 units), so
at most two share a GPU (and a third can join when the first of a pair ends); a fractional share
books ceil(milli/50) free units. CPU cores are booked one
row per core when the placement comes with cpusets. All rows of an attempt (every GPU of a gang) are
inserted in one transaction: all or nothing.

Expired leases are never silently stolen: a worker that finds one (its holder crashed) calls
`recover()`, which adopts the stage if its backend still runs it and releases it otherwise.

A pipeline run that a Kubernetes pool's worker launched as a Job (or a host-agent pool's with `pipelines_on`, as a
process through an agent) holds a `qosflow_stage_lease` row that books no slot (`acquire_pipeline`, placement role
"pipeline"): it is renewed, recovered and adopted as a stage's is.

A third, `qosflow_pipeline_process`, records the pipeline runs' processes that outlive their worker (pools
whose stages run on host agents, or Kubernetes with pipeline Jobs turned off); `LeaseStore.sweep_pipeline_output` removes the output files
of those that ended once they are older than `QOSFLOW_PIPELINE_OUTPUT_MAX_AGE` (default 30 days).

Engine: `QOSFLOW_DATABASE_URL` (e.g. `postgresql+psycopg://user@host/db`) or SQLite in
`qosflow.paths.data_dir()`. The predictor's store (`qosflow.store`) can pass its own engine;
`create_lease_tables(conn)` is written to be appended to its migration list as-is.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlmodel import Field, Session, SQLModel, select

from qosflow.errors import QosflowError
from qosflow.store.store import default_url, explain_damage, sqlite_file  # one database for leases and the predictor by default

if TYPE_CHECKING:
    from qosflow.backends.base import Backend, LaunchSpec, StageHandle

UNITS_PER_GPU = 20
MILLI_PER_UNIT = 1000 // UNITS_PER_GPU


class StageLeaseRow(SQLModel, table=True):
    __tablename__ = "qosflow_stage_lease"
    __table_args__ = (sa.UniqueConstraint("pool", "stage_key", name="uq_stage_lease_stage"),)

    lease_id: str = Field(primary_key=True, max_length=64)
    pool: str = Field(index=True, max_length=200)
    stage_key: str = Field(max_length=250)
    attempt_id: str = Field(max_length=250)
    holder: str = Field(index=True, max_length=200)
    backend: str = Field(max_length=50)
    nodes_json: str
    placement_json: str
    handle_json: Optional[str] = None
    created_at: float
    expires_at: float = Field(index=True)


class SlotLeaseRow(SQLModel, table=True):
    __tablename__ = "qosflow_slot_lease"
    __table_args__ = (sa.UniqueConstraint("pool", "node", "resource", name="uq_slot_lease_once"),)

    id: Optional[int] = Field(default=None, primary_key=True)
    pool: str = Field(max_length=200)
    node: str = Field(max_length=250)
    resource: str = Field(max_length=50)
    lease_id: str = Field(index=True, max_length=64)


class WorkerPresenceRow(SQLModel, table=True):
    """One running worker process (a lease holder): renewed at its heartbeats, deleted when it stops.
    A second process with the same worker name on the pool is refused while this row is live
    (`LeaseStore.claim_name`), and a restarted worker of that name adopts the leases of a holder whose
    row is gone or whose process is dead on this host (`recover`)."""

    __tablename__ = "qosflow_worker_presence"

    holder: str = Field(primary_key=True, max_length=200)
    pool: str = Field(index=True, max_length=200)
    name: str = Field(max_length=200)
    host: str = Field(max_length=250)
    pid: int
    started_at: float
    expires_at: float


class PipelineProcessRow(SQLModel, table=True):
    """A pipeline run's process that a worker started on its own host and that outlives the worker (its
    stages run on host agents or Kubernetes): a restarted worker of the same name on that host adopts it
    (`LeaseStore.pipeline_processes`), or marks its run Crashed if the process died while no worker ran.
    `start` is the process's start time (`qosflow.backends.local.process_start`): a pid reused by
    another process since is not taken for it. Deleted when a worker saw the process end."""

    __tablename__ = "qosflow_pipeline_process"

    flow_run_id: str = Field(primary_key=True, max_length=64)
    pool: str = Field(index=True, max_length=200)
    name: str = Field(max_length=200)  # the worker's name
    holder: str = Field(max_length=200)  # the worker process watching it (`holder_id`)
    host: str = Field(max_length=250)
    pid: int
    start: str = Field(max_length=100)
    output: Optional[str] = None  # the file its stdout and stderr go to
    stream: bool = True  # its output is copied to the watching worker's stdout (the pool's `stream_output`)
    created_at: float


#: (a table added later is created in an older database by `create_lease_tables`: create_all with checkfirst)
LEASE_TABLES = [StageLeaseRow.__table__, SlotLeaseRow.__table__, WorkerPresenceRow.__table__, PipelineProcessRow.__table__]


#: how long the output file (`$QOSFLOW_HOME/pipeline-output/<flow run id>.log`) of a pipeline process that
#: ended is kept: an age as `qosflow predict prune --older-than` takes it (`parse_age`: 30d, 12w, 36h...), or
#: `never`. The worker removes a completed run's file at once; what is left is that of a run that failed,
#: crashed or was cancelled, whose prints and start-up traceback are only there (the worker forwards none of
#: it to Prefect's logs), so it is kept for weeks, not days
PIPELINE_OUTPUT_MAX_AGE_ENV = "QOSFLOW_PIPELINE_OUTPUT_MAX_AGE"
PIPELINE_OUTPUT_MAX_AGE_DEFAULT = "30d"


def pipeline_output_max_age() -> float | None:
    """Seconds a pipeline's output file is kept after its last write (`QOSFLOW_PIPELINE_OUTPUT_MAX_AGE`,
    default 30 days); None: for ever (`never`). A bad value is an error naming the variable."""
    from qosflow.errors import SpecError
    from qosflow.store.store import parse_age

    raw = os.environ.get(PIPELINE_OUTPUT_MAX_AGE_ENV, "").strip() or PIPELINE_OUTPUT_MAX_AGE_DEFAULT
    if raw.lower() in ("never", "off"):
        return None
    try:
        return parse_age(raw, PIPELINE_OUTPUT_MAX_AGE_ENV).total_seconds()
    except SpecError as exc:
        why = str(exc).removeprefix(f"invalid {PIPELINE_OUTPUT_MAX_AGE_ENV}: ")
        if "too young" in why:  # (parse_age's reason is the predictor's rows)
            why = f"{raw!r} is too short: give at least 1h, e.g. 30d, 12w, 36h"
        raise QosflowError(f"environment variable {PIPELINE_OUTPUT_MAX_AGE_ENV}={raw!r}: {why}; or never (keep them); "
                           f"unset it for the default ({PIPELINE_OUTPUT_MAX_AGE_DEFAULT})") from None


class WorkerNameTaken(QosflowError):
    """A live worker process of the same name already works on the pool."""


#: separates a worker's name from its process instance in a lease holder id
HOLDER_SEP = "#"


def pool_key(pool: str, api_url: str | None) -> str:
    """The key of a work pool's leases: its name and the Prefect server it belongs to
    (`pool@<12 hex of the API URL>`). The store lives in the user's data dir, shared by every Prefect
    server used on the machine: keyed by the name alone, a staging and a production pool `gpu` on one
    host saw (and, once expired, recovered) each other's leases."""
    import hashlib

    url = (api_url or "ephemeral").strip().rstrip("/").lower()
    return f"{pool}@{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def holder_id(name: str) -> str:
    """A lease holder id that two processes never share, even with the same worker name:
    `name#host:pid:random`."""
    import socket
    import uuid

    return f"{name}{HOLDER_SEP}{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _instance(holder: str) -> tuple[str, str, int] | None:
    """(name, host, pid) of a holder id, None for a bare name (stores written before holder ids)."""
    name, sep, inst = holder.rpartition(HOLDER_SEP)
    parts = inst.split(":")
    if not sep or len(parts) != 3 or not parts[1].isdigit():
        return None
    return name, parts[0], int(parts[1])


def holder_name(holder: str) -> str:
    """The worker name of a holder id (a bare name is its own)."""
    got = _instance(holder)
    return holder if got is None else got[0]


def _process_gone(host: str, pid: int) -> bool:
    """Is the process certainly not running (on this host, no such pid)? Other hosts: unknown (False)."""
    import socket

    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _age_text(seconds: float) -> str:
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds / 3600:g} hours"


def create_lease_tables(conn: sa.engine.Connection) -> None:
    """Create the lease tables if missing (usable as a store migration)."""
    SQLModel.metadata.create_all(conn, tables=LEASE_TABLES, checkfirst=True)


class LeaseError(QosflowError):
    pass


class SlotTaken(LeaseError):
    """Another lease holds a slot this placement needs (the placement was made on stale state)."""

    def __init__(self, pool: str, conflicts: list[tuple[str, str, str, float]]):
        self.conflicts = conflicts  # (node, resource, holder, expires_at)
        now = time.time()
        shown = ", ".join(
            f"{n}/{r} held by {h}" + (" (EXPIRED: run recovery)" if e < now else "") for n, r, h, e in conflicts[:4]
        )
        super().__init__(f"pool {pool!r}: slot already leased: {shown or 'taken by a concurrent worker'}; re-plan from fresh state")


class StageBusy(LeaseError):
    """The stage already has a live attempt (possibly held by another worker)."""


@dataclass(frozen=True)
class Lease:
    lease_id: str
    pool: str
    stage_key: str
    attempt_id: str
    holder: str
    backend: str
    nodes: list[str]
    placement: dict[str, Any]
    handle: dict[str, Any] | None
    created_at: float
    expires_at: float

    @classmethod
    def _of(cls, r: StageLeaseRow) -> "Lease":
        return cls(
            r.lease_id, r.pool, r.stage_key, r.attempt_id, r.holder, r.backend, json.loads(r.nodes_json),
            json.loads(r.placement_json), json.loads(r.handle_json) if r.handle_json else None, r.created_at, r.expires_at,
        )

    @property
    def expired(self) -> bool:
        return self.expires_at < time.time()

    @property
    def is_pipeline(self) -> bool:
        """A pipeline run's lease (`LeaseStore.acquire_pipeline`): it books no slot, and its `attempt_id` is the
        run's Job's (or agent process's) stage id (the flow run id)."""
        return (self.placement or {}).get("role") == "pipeline"


log = logging.getLogger("qosflow.leases")
_warned_modes: set[str] = set()


def private_sqlite_file(path: str | os.PathLike[str], holds: str = "the stages' commands and slot leases") -> bool:
    """Create the SQLite database file `path` readable and writable by its owner alone (0600), and the
    directories missing above it 0700, before SQLite opens it (SQLite gives its -wal and -shm files the
    database file's mode). The lease store holds the commands of the stages, and anyone who may write
    it can free or book slots: created under the default umask it was 0644, readable by every user of
    the machine. An existing file is left as it is, with a warning (once per process and file) if other
    users may read or write it (`holds`: what the warning says it holds): it may be shared on purpose.
    Returns whether the file was created here."""
    p = Path(os.path.abspath(os.fspath(path)))
    missing = []
    d = p.parent
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:  # a concurrent creator (its own mode stands)
            pass
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            mode = p.stat().st_mode
        except OSError:
            return False
        if mode & 0o077 and str(p) not in _warned_modes and p.is_file():
            _warned_modes.add(str(p))
            log.warning("the database %s is %s by other users of this machine (mode %o): it holds %s; unless it is "
                        "shared on purpose, run: chmod 600 %s", p, "writable" if mode & 0o022 else "readable",
                        mode & 0o777, holds, p)
        return False
    os.close(fd)
    return True


def make_engine(url: str | None = None) -> sa.engine.Engine:
    url = url or default_url()
    if url.startswith("sqlite"):
        path = sqlite_file(url)
        if path:
            private_sqlite_file(path)
        eng = sa.create_engine(url, connect_args={"timeout": 30})
        explain_damage(eng, url)  # ('database disk image is malformed' names the file and the repair)

        @sa.event.listens_for(eng, "connect")
        def _wal(dbapi_conn, _):  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return eng
    return sa.create_engine(url, pool_pre_ping=True)


def placement_units(spec: "LaunchSpec", shareable: bool | None = None) -> tuple[list[tuple[str, str]], list[tuple[str, int, int]]]:
    """Rows a placement books: fixed (node, resource) units, and fractional (node, gpu, n units) to pick."""
    p = spec.placement
    if shareable is None:
        shareable = bool(p.extra.get("shareable", False))
    fixed: list[tuple[str, str]] = []
    frac: list[tuple[str, int, int]] = []
    for n, g in p.gpus:
        node = spec.cluster.nodes[n].name
        if p.gpu_milli < 1000:
            frac.append((node, g, max(1, math.ceil(p.gpu_milli / MILLI_PER_UNIT))))
            continue
        if p.colocated_with or shareable:
            # either free half: the first of a pair may end and a third stage join the second
            frac.append((node, g, UNITS_PER_GPU // 2))
            continue
        fixed.extend((node, f"gpu{g}:u{u:02d}") for u in range(UNITS_PER_GPU))
    for n, cores in spec.cpusets.items():
        node = spec.cluster.nodes[n].name
        fixed.extend((node, f"cpu{c}") for c in cores)
    return fixed, frac


def _placement_json(spec: "LaunchSpec") -> str:
    p = spec.placement
    names = spec.cluster.node_names
    return json.dumps(
        {
            "job_id": p.job_id,
            "gpus": [[names[n], g] for n, g in p.gpus],
            "cpu": [[names[n], c] for n, c in p.cpu],
            "gpu_milli": p.gpu_milli,
            "gpu_mem_mb": p.gpu_mem_mb,
            "mem_mb": p.mem_mb,
            "colocated_with": list(p.colocated_with),
            "cpusets": {names[n]: c for n, c in spec.cpusets.items()},
            "command": spec.command,
        }
    )


class LeaseStore:
    """Leases in a SQL database (SQLite or PostgreSQL)."""

    def __init__(self, engine: sa.engine.Engine | None = None, url: str | None = None):
        self.engine = engine or make_engine(url)
        self._swept_at: dict[str, float] = {}  # output directory -> when `sweep_pipeline_output` last looked at it
        for attempt in range(5):
            try:
                with self.engine.begin() as conn:
                    create_lease_tables(conn)
                break
            except (OperationalError, IntegrityError):  # a concurrent creator won the race
                if attempt == 4:  # (or the database cannot be opened at all: say so here, not later)
                    raise
                time.sleep(0.1)

    @classmethod
    def existing(cls, url: str | None = None) -> "LeaseStore | None":
        """The lease store at `url` (default: the one workers use here) opened to read it, or None when it is a
        SQLite file that does not exist: nothing is created, no table either (`qosflow status` run on a
        machine where no worker has run must not leave an empty database behind)."""
        url = url or default_url()
        if url.startswith("sqlite"):
            path = sqlite_file(url)
            if path is None or not os.path.isfile(path):
                return None
        store = cls.__new__(cls)
        store.engine = make_engine(url)
        store._swept_at = {}
        return store

    # ------------------------------------------------------------------ acquire / release
    def acquire(
        self,
        pool: str,
        stage_key: str,
        spec: "LaunchSpec",
        *,
        holder: str,
        ttl_s: float = 30.0,
        backend: str = "",
        shareable: bool | None = None,
    ) -> Lease:
        """Book every slot of `spec.placement` for `holder`, atomically, or raise SlotTaken/StageBusy."""
        fixed, frac = placement_units(spec, shareable)
        now = time.time()
        nodes = [spec.cluster.nodes[i].name for i in spec.placement.nodes]
        for attempt in range(5):
            lease_id = uuid.uuid4().hex
            row = StageLeaseRow(
                lease_id=lease_id, pool=pool, stage_key=stage_key, attempt_id=spec.stage_id, holder=holder, backend=backend,
                nodes_json=json.dumps(nodes), placement_json=_placement_json(spec), handle_json=None, created_at=now,
                expires_at=now + ttl_s,
            )
            try:
                with Session(self.engine) as s:
                    units = list(fixed)
                    for node, g, k in frac:
                        taken = set(
                            s.exec(
                                select(SlotLeaseRow.resource).where(
                                    SlotLeaseRow.pool == pool, SlotLeaseRow.node == node, SlotLeaseRow.resource.like(f"gpu{g}:u%")
                                )
                            ).all()
                        )
                        free = [f"gpu{g}:u{u:02d}" for u in range(UNITS_PER_GPU) if f"gpu{g}:u{u:02d}" not in taken]
                        if len(free) < k:
                            raise SlotTaken(pool, self._conflicts(s, pool, [(node, f"gpu{g}:u{u:02d}") for u in range(UNITS_PER_GPU)]))
                        units.extend((node, r) for r in free[:k])
                    s.add(row)
                    s.flush()  # the stage row first: a second live attempt of the stage fails here
                    s.add_all([SlotLeaseRow(pool=pool, node=n, resource=r, lease_id=lease_id) for n, r in units])
                    s.commit()
                    return Lease._of(row)
            except IntegrityError:
                with Session(self.engine) as s:
                    other = s.exec(select(StageLeaseRow).where(StageLeaseRow.pool == pool, StageLeaseRow.stage_key == stage_key)).first()
                    if other is not None:
                        raise StageBusy(
                            f"stage {stage_key!r} already has a live attempt {other.attempt_id!r} held by {other.holder} "
                            f"(expires in {other.expires_at - time.time():.0f}s): it must not run twice"
                        ) from None
                    conflicts = self._conflicts(s, pool, fixed)
                if conflicts or not frac:
                    raise SlotTaken(pool, conflicts) from None
                continue  # a fractional unit was taken between our read and insert: pick again
            except OperationalError:  # SQLite busy under heavy contention
                time.sleep(0.05 * (attempt + 1))
        raise LeaseError(f"pool {pool!r}: could not book stage {stage_key!r} after 5 tries (heavy contention)")

    def acquire_pipeline(self, pool: str, flow_run_id: str, *, holder: str, ttl_s: float = 30.0, backend: str = "",
                         command: list[str] | None = None, namespace: str = "", nodes: list[str] | None = None,
                         cpu: list[tuple[str, float]] | None = None) -> Lease:
        """A lease for a pipeline run that its worker launched through the backend (a Kubernetes Job), booking no
        slot: the row says which worker watches the run, renewed at its heartbeats like a stage's, and `recover`
        hands it to the next worker of the pool (of the same name at once, of another once it expired), which
        finds the Job again (`backend.adopt`). `nodes`: where its process runs, when the backend needs it to find it
        (host agents: the host); `cpu`: the (host, cores) it takes there, which the pool's workers count as taken.
        StageBusy if the run already has one (it must not run twice)."""
        now = time.time()
        placement = {"role": "pipeline", "job_id": flow_run_id, "gpus": [], "cpu": [[n, float(c)] for n, c in cpu or []], "gpu_milli": 0, "gpu_mem_mb": 0.0,
                     "mem_mb": 0.0, "colocated_with": [], "cpusets": {}, "command": list(command or []), "namespace": namespace}
        row = StageLeaseRow(lease_id=uuid.uuid4().hex, pool=pool, stage_key=flow_run_id, attempt_id=flow_run_id, holder=holder,
                            backend=backend, nodes_json=json.dumps(list(nodes or [])), placement_json=json.dumps(placement), handle_json=None, created_at=now,
                            expires_at=now + ttl_s)
        try:
            with Session(self.engine) as s:
                s.add(row)
                s.commit()
                return Lease._of(row)
        except IntegrityError:
            with Session(self.engine) as s:
                other = s.exec(select(StageLeaseRow).where(StageLeaseRow.pool == pool, StageLeaseRow.stage_key == flow_run_id)).first()
            if other is None:
                raise
            raise StageBusy(f"pipeline run {flow_run_id!r} already has a live Job {other.attempt_id!r} watched by {other.holder} "
                            f"(expires in {other.expires_at - time.time():.0f}s): it must not run twice") from None

    def pipeline_leases(self, pool: str) -> list[Lease]:
        """The pool's pipeline runs that run as Jobs of its backend (`acquire_pipeline`), oldest first."""
        return sorted((le for le in self.leases(pool) if le.is_pipeline), key=lambda le: le.created_at)

    def _conflicts(self, s: Session, pool: str, units: list[tuple[str, str]]) -> list[tuple[str, str, str, float]]:
        out = []
        by_node: dict[str, list[str]] = {}
        for n, r in units:
            by_node.setdefault(n, []).append(r)
        for node, res in by_node.items():
            rows = s.exec(
                select(SlotLeaseRow.node, SlotLeaseRow.resource, StageLeaseRow.holder, StageLeaseRow.expires_at)
                .join(StageLeaseRow, StageLeaseRow.lease_id == SlotLeaseRow.lease_id)
                .where(SlotLeaseRow.pool == pool, SlotLeaseRow.node == node, SlotLeaseRow.resource.in_(res))
            ).all()
            out.extend((a, b, c, d) for a, b, c, d in rows)
        return out

    def release(self, lease_id: str) -> None:
        with Session(self.engine) as s:
            s.exec(sa.delete(SlotLeaseRow).where(SlotLeaseRow.lease_id == lease_id))  # type: ignore[call-overload]
            s.exec(sa.delete(StageLeaseRow).where(StageLeaseRow.lease_id == lease_id))  # type: ignore[call-overload]
            s.commit()

    # ------------------------------------------------------------------ keep alive
    def set_handle(self, lease_id: str, handle: "StageHandle") -> None:
        data = {"stage_id": handle.stage_id, "backend": handle.backend, "node": handle.node, "ref": handle.ref}
        with Session(self.engine) as s:
            s.exec(sa.update(StageLeaseRow).where(StageLeaseRow.lease_id == lease_id).values(handle_json=json.dumps(data)))  # type: ignore[call-overload]
            s.commit()

    def renew_lease(self, lease_id: str, ttl_s: float) -> bool:
        with Session(self.engine) as s:
            r = s.exec(sa.update(StageLeaseRow).where(StageLeaseRow.lease_id == lease_id).values(expires_at=time.time() + ttl_s))  # type: ignore[call-overload]
            s.commit()
            return r.rowcount == 1

    def renew_holder(self, holder: str, ttl_s: float) -> int:
        """Extend every lease a worker holds, and its presence (call it from the worker's heartbeat)."""
        with Session(self.engine) as s:
            r = s.exec(sa.update(StageLeaseRow).where(StageLeaseRow.holder == holder).values(expires_at=time.time() + ttl_s))  # type: ignore[call-overload]
            s.exec(sa.update(WorkerPresenceRow).where(WorkerPresenceRow.holder == holder).values(expires_at=time.time() + ttl_s))  # type: ignore[call-overload]
            s.commit()
            return r.rowcount

    def rekey(self, old_pool: str, new_pool: str, name: str) -> int:
        """Move the leases a worker of this name holds under `old_pool` (a store written when leases
        were keyed by the pool's name alone) to `new_pool`; returns how many. Only its own: a bare
        pool name does not say which Prefect server another holder's lease belongs to."""
        with Session(self.engine) as s:
            ids = [r.lease_id for r in s.exec(select(StageLeaseRow).where(StageLeaseRow.pool == old_pool)).all()
                   if holder_name(r.holder) == name]
            if not ids:
                return 0
            s.exec(sa.update(StageLeaseRow).where(StageLeaseRow.lease_id.in_(ids)).values(pool=new_pool))  # type: ignore[call-overload,attr-defined]
            s.exec(sa.update(SlotLeaseRow).where(SlotLeaseRow.lease_id.in_(ids)).values(pool=new_pool))  # type: ignore[call-overload,attr-defined]
            s.commit()
            return len(ids)

    # ------------------------------------------------------------------ worker presence
    def live_workers(self, pool: str, name: str | None = None) -> list[WorkerPresenceRow]:
        """The worker processes on `pool` (of that name) whose presence is live: not expired, and not a
        process known to be gone (this host, pid not running)."""
        now = time.time()
        with Session(self.engine) as s:
            q = select(WorkerPresenceRow).where(WorkerPresenceRow.pool == pool, WorkerPresenceRow.expires_at >= now)
            if name is not None:
                q = q.where(WorkerPresenceRow.name == name)
            rows = list(s.exec(q).all())
        return [r for r in rows if not _process_gone(r.host, r.pid)]

    def claim_name(self, pool: str, holder: str, ttl_s: float) -> None:
        """Record this worker process (`holder`, from `holder_id`) on `pool`; raise WorkerNameTaken if a
        live process of the same worker name is there already (two workers of one name took each
        other's leases for their own and re-planned in a loop)."""
        got = _instance(holder)
        name, host, pid = got if got is not None else (holder, "", 0)
        now = time.time()
        for _ in range(5):
            others = [r for r in self.live_workers(pool, name) if r.holder != holder]
            if others:
                o = others[0]
                raise WorkerNameTaken(
                    f"a worker named {name!r} is already running on pool {pool!r} (pid {o.pid} on host {o.host}, started "
                    f"{time.strftime('%H:%M:%S', time.localtime(o.started_at))}, last seen {max(0.0, now - (o.expires_at - ttl_s)):.0f}s ago): "
                    "start this one with another --name, or stop that one first")
            try:
                with Session(self.engine) as s:
                    # (a stale row of the same name -- a process that died -- goes)
                    s.exec(sa.delete(WorkerPresenceRow).where(WorkerPresenceRow.pool == pool, WorkerPresenceRow.name == name))  # type: ignore[call-overload]
                    s.add(WorkerPresenceRow(holder=holder, pool=pool, name=name, host=host, pid=pid, started_at=now, expires_at=now + ttl_s))
                    s.commit()
                return
            except IntegrityError:  # (a concurrent claim: look again)
                time.sleep(0.05)

    def leave(self, holder: str) -> None:
        """The worker process stops: its presence goes (a worker of its name may adopt its leases at once)."""
        with Session(self.engine) as s:
            s.exec(sa.delete(WorkerPresenceRow).where(WorkerPresenceRow.holder == holder))  # type: ignore[call-overload]
            s.commit()

    def take_over(self, lease_id: str, old_holder: str, new_holder: str, ttl_s: float, *, force: bool = False) -> bool:
        """Move an expired lease (or one of our own, or with `force` one of a stopped process of our
        name) to `new_holder`; exactly one contender wins."""
        now = time.time()
        cond = StageLeaseRow.expires_at < now if old_holder != new_holder and not force else sa.true()
        with Session(self.engine) as s:
            r = s.exec(
                sa.update(StageLeaseRow)  # type: ignore[call-overload]
                .where(StageLeaseRow.lease_id == lease_id, StageLeaseRow.holder == old_holder, cond)
                .values(holder=new_holder, expires_at=now + ttl_s)
            )
            s.commit()
            return r.rowcount == 1

    # ------------------------------------------------------------------ pipeline processes
    def record_pipeline(self, pool: str, flow_run_id: str, holder: str, pid: int, start: str, output: str | None = None,
                        stream: bool = True) -> None:
        """A worker (`holder`) started pipeline run `flow_run_id` as process `pid` (started at `start`) on its host."""
        import socket

        got = _instance(holder)
        name = got[0] if got is not None else holder
        with Session(self.engine) as s:
            s.exec(sa.delete(PipelineProcessRow).where(PipelineProcessRow.flow_run_id == flow_run_id))  # type: ignore[call-overload]
            s.add(PipelineProcessRow(flow_run_id=flow_run_id, pool=pool, name=name, holder=holder, host=socket.gethostname(), pid=int(pid),
                                     start=start, output=output, stream=bool(stream), created_at=time.time()))
            s.commit()

    def forget_pipeline(self, flow_run_id: str) -> None:
        """The pipeline's process has ended and a worker has dealt with its run."""
        with Session(self.engine) as s:
            s.exec(sa.delete(PipelineProcessRow).where(PipelineProcessRow.flow_run_id == flow_run_id))  # type: ignore[call-overload]
            s.commit()

    def pipeline_processes(self, pool: str, name: str | None = None, host: str | None = None) -> list[PipelineProcessRow]:
        """The pipeline processes recorded on `pool` (started by workers named `name`, on `host`)."""
        with Session(self.engine) as s:
            q = select(PipelineProcessRow).where(PipelineProcessRow.pool == pool)
            if name is not None:
                q = q.where(PipelineProcessRow.name == name)
            if host is not None:
                q = q.where(PipelineProcessRow.host == host)
            rows = list(s.exec(q).all())
            for r in rows:
                s.expunge(r)
            return rows

    def take_pipeline(self, flow_run_id: str, old_holder: str, new_holder: str) -> bool:
        """A worker takes over the watch of a pipeline process from an earlier process of its name; exactly one wins."""
        with Session(self.engine) as s:
            r = s.exec(
                sa.update(PipelineProcessRow)  # type: ignore[call-overload]
                .where(PipelineProcessRow.flow_run_id == flow_run_id, PipelineProcessRow.holder == old_holder)
                .values(holder=new_holder)
            )
            s.commit()
            return r.rowcount == 1

    def sweep_pipeline_output(self, directory: str | os.PathLike[str] | None = None, *, max_age_s: float | None = None,
                              now: float | None = None, every_s: float = 600.0) -> list[str]:
        """Remove the output files (`<flow run id>.log`) of pipeline processes in `directory` (default
        `$QOSFLOW_HOME/pipeline-output`) last written more than `max_age_s` ago (default
        `QOSFLOW_PIPELINE_OUTPUT_MAX_AGE`, 30 days; `never` keeps them all). Never the file of a process
        recorded in `qosflow_pipeline_process` (any pool, any host: running, or ended and not yet dealt
        with by a worker of its name), nor one that a process of this host has open (a pipeline still
        running, recorded or not: a quiet one writes nothing for days); where open files cannot be seen
        (no /proc) nothing is removed. Looks at most every `every_s` seconds (a worker calls it at its
        start and at its heartbeats). Returns the paths removed."""
        from qosflow.backends.local import sweep_old_output
        from qosflow.paths import pipeline_output_dir

        now = time.time() if now is None else now

        d = Path(directory) if directory is not None else pipeline_output_dir()
        key = str(d)
        swept = self._swept_at
        if every_s > 0 and key in swept and now - swept[key] < every_s:
            return []
        swept[key] = now
        age = pipeline_output_max_age() if max_age_s is None else float(max_age_s)
        if age is None or not d.is_dir():
            return []

        def recorded() -> set[str] | None:
            """The files of the processes the store records (by their name in `d`, or their recorded path)."""
            try:
                with Session(self.engine) as s:
                    rows = s.exec(select(PipelineProcessRow.flow_run_id, PipelineProcessRow.output)).all()
            except Exception as exc:  # (no record to go by: remove nothing)
                log.warning("pipeline output in %s: cannot read the pipeline processes in the lease store (%s); nothing removed", d, exc)
                return None
            names = {f"{fid}.log" for fid, _ in rows} | {os.path.basename(out) for _, out in rows if out}
            return {str(d / n) for n in names} | {out for _, out in rows if out}

        removed = sweep_old_output(str(d), max_age_s=age, now=now, also_keep=recorded,
                                   on_error=lambda why: log.warning("pipeline output in %s: %s; nothing removed", d, why))
        if removed:
            log.info("pipeline output: removed %d file(s) in %s last written more than %s ago (%s)", len(removed), d,
                     _age_text(age), PIPELINE_OUTPUT_MAX_AGE_ENV)
        return removed

    # ------------------------------------------------------------------ queries
    def leases(self, pool: str | None = None, holder: str | None = None) -> list[Lease]:
        with Session(self.engine) as s:
            q = select(StageLeaseRow)
            if pool is not None:
                q = q.where(StageLeaseRow.pool == pool)
            if holder is not None:
                q = q.where(StageLeaseRow.holder == holder)
            return [Lease._of(r) for r in s.exec(q).all()]

    def booked(self, pool: str) -> list[tuple[str, str, str]]:
        """(node, resource, lease_id) of every booked unit in a pool."""
        with Session(self.engine) as s:
            return [tuple(r) for r in s.exec(select(SlotLeaseRow.node, SlotLeaseRow.resource, SlotLeaseRow.lease_id).where(SlotLeaseRow.pool == pool)).all()]  # type: ignore[misc]

    # ------------------------------------------------------------------ recovery
    async def recover(self, backend: "Backend", pool: str, holder: str, ttl_s: float = 30.0) -> list[tuple[Lease, "StageHandle | None"]]:
        """After a (re)start: take over our own and expired leases of `pool`, and find their stages.

        Returns (lease, handle) for each stage still known to the backend (wait on it, do not
        relaunch it: it must not run twice) and (lease, None) for leases whose stage is gone; those
        leases are released, and the caller reschedules the stage.
        """
        from qosflow.backends.base import StageHandle

        out: list[tuple[Lease, StageHandle | None]] = []
        # the processes whose presence is live (a holder written before holder ids, a bare name, has none)
        live = {r.holder for r in self.live_workers(pool)}
        for lease in self.leases(pool):
            if lease.backend and lease.backend != backend.name:
                continue
            # an earlier process of this worker's name (stopped, or dead on this host) left it: ours at once
            mine = lease.holder == holder or (holder_name(lease.holder) == holder_name(holder) and lease.holder not in live)
            if not mine and not lease.expired:
                continue  # a live worker holds it (another name, or another live process of this name)
            if not self.take_over(lease.lease_id, lease.holder, holder, ttl_s, force=mine):
                continue  # another worker recovered it first
            handle = None
            adopt = getattr(backend, "adopt", None)
            if adopt is not None:
                handle = await adopt(lease.attempt_id, lease.nodes)
            elif lease.handle:
                handle = StageHandle(**lease.handle)
            if handle is None:
                self.release(lease.lease_id)
            else:
                self.set_handle(lease.lease_id, handle)
            out.append((replace(lease, holder=holder), handle))
        return out

