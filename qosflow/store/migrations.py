"""Ordered schema migrations. The schema version of a database is the number of migrations applied.

Rules (so that an upgrade never loses data):

* migrations are only ever appended, never edited or reordered once released;
* each one only adds (tables, nullable or defaulted columns, indexes) or copies data -- it never drops
  a column that holds data;
* each migration's table definitions are frozen here (SQLAlchemy Core), independent of the current
  SQLModel classes in `qosflow.store.models`, so that replaying old migrations always gives the old
  schema. A test checks that replaying all of them gives exactly the columns of the models.

All of them run inside one transaction at `Store.open` (SQLite: BEGIN IMMEDIATE; PostgreSQL: with an
advisory lock), so two processes opening the same database at once migrate it exactly once.
"""

from __future__ import annotations

from typing import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qosflow.errors import QosflowError

_META_KW: dict = {}


def _m1_initial(conn: Connection) -> None:
    md = sa.MetaData()
    sa.Table(
        "profile",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("signature", sa.String, nullable=False, index=True),
        sa.Column("gpu_type", sa.String, nullable=False),
        sa.Column("solo_step_time_s", sa.Float, nullable=False),
        sa.Column("cpu_cores", sa.Integer, nullable=True),
        sa.Column("ref_speeds_json", sa.String, nullable=False),
        sa.Column("ref_partner_speeds_json", sa.String, nullable=False),
        sa.Column("source", sa.String, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    sa.Table(
        "sample",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("signature", sa.String, nullable=False, index=True),
        sa.Column("gpu_type", sa.String, nullable=False),
        sa.Column("placement", sa.String, nullable=False),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("cross_node", sa.Boolean, nullable=False),
        sa.Column("cpu_cores", sa.Integer, nullable=True),
        sa.Column("co_runner", sa.String, nullable=True, index=True),
        sa.Column("step_time_s", sa.Float, nullable=False),
        sa.Column("source", sa.String, nullable=False),
        sa.Column("stage_run_id", sa.String, nullable=True, index=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    md.create_all(conn)


def _m2_sample_telemetry(conn: Connection) -> None:
    """Samples gain a weight (steps averaged) and GPU telemetry from NVML."""
    conn.exec_driver_sql("ALTER TABLE sample ADD COLUMN steps INTEGER NOT NULL DEFAULT 1")
    conn.exec_driver_sql("ALTER TABLE sample ADD COLUMN gpu_util_pct FLOAT")
    conn.exec_driver_sql("ALTER TABLE sample ADD COLUMN gpu_mem_mb FLOAT")


def _m3_predictions_outcomes_history(conn: Connection) -> None:
    md = sa.MetaData()
    sa.Table(
        "prediction",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("stage_run_id", sa.String, nullable=True, index=True),
        sa.Column("signature", sa.String, nullable=False, index=True),
        sa.Column("target", sa.String, nullable=False),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("low", sa.Float, nullable=False),
        sa.Column("high", sa.Float, nullable=False),
        sa.Column("n_samples", sa.Integer, nullable=False),
        sa.Column("basis", sa.String, nullable=False),
        sa.Column("context_json", sa.String, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    sa.Table(
        "outcome",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("stage_run_id", sa.String, nullable=False, index=True),
        sa.Column("signature", sa.String, nullable=False),
        sa.Column("target", sa.String, nullable=False),
        sa.Column("actual", sa.Float, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    sa.Table(
        "stage_history",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("stage_run_id", sa.String, nullable=False, index=True),
        sa.Column("flow_run_id", sa.String, nullable=True, index=True),
        sa.Column("stage", sa.String, nullable=False),
        sa.Column("signature", sa.String, nullable=False),
        sa.Column("state", sa.String, nullable=False),
        sa.Column("gpu_type", sa.String, nullable=False),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("placement", sa.String, nullable=False),
        sa.Column("host", sa.String, nullable=True),
        sa.Column("cpu_cores", sa.Integer, nullable=True),
        sa.Column("co_runner", sa.String, nullable=True),
        sa.Column("steps", sa.Integer, nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("duration_s", sa.Float, nullable=True),
        sa.Column("step_time_s", sa.Float, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    md.create_all(conn)


def _m4_stage_history_resumed(conn: Connection) -> None:
    """A stage run resumed from a checkpoint says how many steps an earlier run had done."""
    conn.exec_driver_sql("ALTER TABLE stage_history ADD COLUMN resumed_from INTEGER")


#: (description, function); version N = the first N entries applied. Append only.
MIGRATIONS: list[tuple[str, Callable[[Connection], None]]] = [
    ("initial: profile, sample", _m1_initial),
    ("sample: steps, gpu_util_pct, gpu_mem_mb", _m2_sample_telemetry),
    ("prediction, outcome, stage_history", _m3_predictions_outcomes_history),
    ("stage_history: resumed_from", _m4_stage_history_resumed),
]

LATEST_VERSION = len(MIGRATIONS)

_VERSION_TABLE = sa.Table(
    "schema_version",
    sa.MetaData(),
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("description", sa.String, nullable=False),
    sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False),
)

#: PostgreSQL advisory lock key serialising migrations ("qosf" in ASCII)
PG_LOCK_KEY = 0x716F7366


def current_version(conn: Connection) -> int:
    if not sa.inspect(conn).has_table("schema_version"):
        return 0
    v = conn.execute(sa.select(sa.func.max(_VERSION_TABLE.c.version))).scalar()
    return int(v or 0)


class SchemaTooNew(QosflowError):
    """The database was written by a newer qosflow (Store.open names the database and where its URL came from)."""

    def __init__(self, version: int, known: int):
        self.version, self.known = version, known
        super().__init__(f"the database schema is at version {version}, newer than this qosflow knows ({known}): "
                         "upgrade qosflow, or point QOSFLOW_DATABASE_URL at another database")


def migrate(conn: Connection, target: int | None = None) -> tuple[int, int]:
    """Apply the missing migrations up to `target` (default: latest) in the caller's transaction.

    Returns (version before, version after).
    """
    from qosflow.store.models import utcnow

    target = LATEST_VERSION if target is None else target
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PG_LOCK_KEY})")
    _VERSION_TABLE.create(conn, checkfirst=True)
    before = current_version(conn)
    if before > LATEST_VERSION:
        raise SchemaTooNew(before, LATEST_VERSION)
    for version in range(before + 1, target + 1):
        description, fn = MIGRATIONS[version - 1]
        fn(conn)
        conn.execute(_VERSION_TABLE.insert().values(version=version, description=description, applied_at=utcnow()))
    return before, max(before, target)
