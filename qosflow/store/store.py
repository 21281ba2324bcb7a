"""`Store`: the repository the predictor, the worker and the CLI read and write.

    store = Store.open()                       # QOSFLOW_DATABASE_URL, else SQLite under data_dir()
    store.add_samples([{"signature": "resnet50/bs64", "gpus": 1, "step_time_s": 0.21}])
    store.samples_for("resnet50/bs64", gpus=1)

SQLite runs in WAL mode with a busy timeout, every write transaction starts with BEGIN IMMEDIATE
(so two writers queue instead of failing half-way) and is retried on "database is locked".
PostgreSQL (`postgresql+psycopg://user:pass@host/db`) uses ordinary transactions.
"""

from __future__ import annotations

import json
import math
import os
import random
import sqlite3
import time
import urllib.parse
from array import array
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.exc import OperationalError
from sqlmodel import Session, select

from qosflow.errors import QosflowError, SpecError
from qosflow.store import migrations
from qosflow.store.models import Outcome, PredictionRecord, Profile, Sample, StageHistory

T = TypeVar("T")
#: the retries' jitter: a generator of its own (a store opened in a stage's process must not move its seeded `random`)
_JITTER = random.Random()

ENV_URL = "QOSFLOW_DATABASE_URL"

#: accepted time units -> seconds
TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "min": 60.0}
PLACEMENTS = ("consolidated", "spread")
_SAMPLE_FIELDS = {
    "signature", "gpu_type", "placement", "gpus", "cross_node", "cpu_cores", "co_runner", "step_time_s",
    "steps", "gpu_util_pct", "gpu_mem_mb", "source", "stage_run_id", "created_at",
}
_SAMPLE_ALIASES = {"step_time", "unit", "units"}
#: a stored sample's columns that `validate_sample` checks (all but id and created_at), in Sample's order
SAMPLE_VALUE_COLUMNS = ("signature", "gpu_type", "placement", "gpus", "cross_node", "cpu_cores", "co_runner",
                        "step_time_s", "steps", "gpu_util_pct", "gpu_mem_mb", "source", "stage_run_id")


def sqlite_file(url: str) -> str | None:
    """The file of a SQLite URL (None for PostgreSQL, an in-memory database, a `file:` URI or a URL that
    does not parse, which the caller reports). Its query (`?timeout=5`) is not part of it."""
    try:
        u = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return None
    if u.get_backend_name() != "sqlite" or u.host:  # (sqlite://tmp/x.db: a host, which SQLite refuses)
        return None
    db = u.database or ""
    return None if not db or db == ":memory:" or db.startswith("file:") else db


def _check_sqlite_file(path: str, url: str, origin: str, *, reading: bool) -> None:
    """Refuse a SQLite path that is not a database: a directory, a file of another kind (was a sqlalchemy
    traceback, 'file is not a database'), or, for a reader (`reading`), an empty file, which SQLite would
    quietly turn into a new database. A reader's missing relative path (three slashes) whose absolute
    twin exists gets the four-slash spelling. A missing file is left to the caller."""
    p = Path(path)
    how = "give sqlite:///PATH/qosflow.db (the store a qosflow worker writes to; four slashes for an absolute path)"
    where = f"{url}{origin}"
    if p.is_dir():
        raise QosflowError(f"{where}: {p} is a directory, not a database file; give the file, e.g. sqlite:///{p / 'qosflow.db'}")
    if not p.exists():
        twin = Path("/") / p
        if reading and not p.is_absolute() and twin.exists():
            raise QosflowError(f"{where}: no file {p} in {Path.cwd()} (sqlite:/// with three slashes is a "
                               f"relative path); for {twin} write sqlite:///{twin}")
        return
    try:
        empty = p.stat().st_size == 0
    except OSError as exc:
        raise QosflowError(f"{where}: cannot read {p} ({exc.strerror or exc}); {how}") from None
    if empty:
        if reading:
            raise QosflowError(f"{where}: {p} is an empty file, not a qosflow database; {how}")
        return
    # Read through SQLite, never with open(): closing any other descriptor of the file drops every POSIX lock
    # this process holds on it, SQLite's among them (its documentation, "How To Corrupt An SQLite Database File",
    # 2.2). A worker opens the store while its lease store has the same file open; the next process to close its
    # own connection to it (a stage recording its samples) then took itself for the last, checkpointed and deleted
    # the -wal file, and every commit of the worker after that went to the deleted file: leases released, slots
    # booked, outcomes recorded, lost to every other process (a pipeline's lease and a finished stage's were seen
    # held for ever). SQLite shares its locks between the connections of one process, so this check is safe.
    try:
        con = sqlite3.connect(f"file:{urllib.parse.quote(str(p))}{'?mode=ro' if reading else ''}", uri=True, timeout=30)
        try:
            con.execute("PRAGMA schema_version").fetchone()
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        if "not a database" in str(exc):
            raise QosflowError(f"{where}: {p} is not a SQLite database (a qosflow store); {how}") from None
        if isinstance(exc, sqlite3.OperationalError) and "unable to open" in str(exc):
            raise QosflowError(f"{where}: cannot read {p} (permission denied?); {how}") from None
        # (locked, busy: the engine that opens it next says what is wrong, with the store's own hints)


def default_url() -> str:
    env = os.environ.get(ENV_URL)
    if env:
        return env
    from qosflow.paths import data_dir

    return f"sqlite:///{data_dir() / 'qosflow.db'}"


def _safe_url(url: str) -> str:
    """The URL with its password masked ('***'). The scheme and user stay: a message about a URL that does not
    parse showed only what followed the '@' ('127.0.0.1/h3' for postgres//qosflow@127.0.0.1/h3), so not the
    mistake."""
    if "@" not in url:
        return url
    head, host = url.rsplit("@", 1)
    scheme, sep, cred = head.rpartition("://")
    if ":" in cred:
        cred = cred.split(":", 1)[0] + ":***"
    return f"{scheme}{sep}{cred}@{host}"


def _normalise_url(url: str) -> str:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        # psycopg 3 is the driver we ship
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


# --------------------------------------------------------------------------------------- validation


def _finite(field: str, value: Any, where: str, *, positive: bool = False, allow_zero: bool = True) -> float:
    if isinstance(value, bool) or value is None:
        raise SpecError(field, f"expected a number, got {value!r}", where=where)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise SpecError(field, f"expected a number, got {value!r}", where=where) from None
    if math.isnan(x) or math.isinf(x):
        raise SpecError(field, f"{value!r} is not a finite number", where=where)
    if x < 0 or (positive and x == 0 and not allow_zero) or (positive and x <= 0):
        raise SpecError(field, f"must be {'> 0' if positive else '>= 0'}, got {value!r}", where=where)
    return x


def _int(field: str, value: Any, where: str, *, minimum: int) -> int:
    if isinstance(value, bool) or value is None:
        raise SpecError(field, f"expected an integer, got {value!r}", where=where)
    if isinstance(value, float):
        if not value.is_integer():
            raise SpecError(field, f"expected an integer, got {value!r}", where=where)
        value = int(value)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise SpecError(field, f"expected an integer, got {value!r}", where=where) from None
    if n < minimum:
        raise SpecError(field, f"must be >= {minimum}, got {value!r}", where=where)
    return n


def validate_sample(raw: Mapping[str, Any] | Sample, where: str = "sample") -> dict[str, Any]:
    """Check one sample and return clean column values; raise SpecError naming the bad field.

    The step time is given either as `step_time_s` (seconds) or as `step_time` with `unit`
    (one of s, ms, us, ns, min).
    """
    if isinstance(raw, Sample):
        dump = raw.model_dump(exclude={"id"}, exclude_none=True)
        if raw.model_fields_set:  # built in code (rows read back from the database have an empty set):
            for key in ("placement", "cross_node"):  # a field left at its default says nothing about the sample
                if key not in raw.model_fields_set:
                    dump.pop(key, None)
        raw = dump
    if not isinstance(raw, Mapping):
        raise SpecError("sample", f"expected a mapping of field -> value, got {type(raw).__name__}", where=where)
    unknown = set(raw) - _SAMPLE_FIELDS - _SAMPLE_ALIASES
    if unknown:
        raise SpecError(
            sorted(unknown)[0], f"unknown field(s) {sorted(unknown)}; known: {sorted(_SAMPLE_FIELDS)}", where=where
        )
    out: dict[str, Any] = {}
    sig = raw.get("signature")
    if not isinstance(sig, str) or not sig.strip():
        raise SpecError("signature", f"expected a non-empty string, got {sig!r}", where=where)
    if len(sig) > 500:
        raise SpecError("signature", "longer than 500 characters", where=where)
    out["signature"] = sig.strip()

    unit = raw.get("unit", raw.get("units"))
    if "unit" in raw and "units" in raw and raw["unit"] != raw["units"]:
        raise SpecError("unit", f"unit={raw['unit']!r} and units={raw['units']!r} disagree; give one", where=where)
    if "step_time_s" in raw:
        if "step_time" in raw:
            raise SpecError("step_time", "give either step_time_s or step_time with unit, not both", where=where)
        if unit not in (None, "s", "sec"):
            raise SpecError("unit", f"step_time_s is in seconds, but unit={unit!r} was given", where=where)
        out["step_time_s"] = _finite("step_time_s", raw["step_time_s"], where, positive=True)
    elif "step_time" in raw:
        if unit is None:
            raise SpecError("unit", f"step_time needs a unit, one of {sorted(TIME_UNITS)}", where=where)
        if unit not in TIME_UNITS:
            raise SpecError("unit", f"unknown time unit {unit!r}; use one of {sorted(TIME_UNITS)}", where=where)
        t = _finite("step_time", raw["step_time"], where, positive=True) * TIME_UNITS[unit]
        if math.isinf(t) or t == 0:  # overflow/underflow of the unit conversion (1e308 min)
            raise SpecError("step_time", f"{raw['step_time']!r} {unit} is out of range in seconds", where=where)
        out["step_time_s"] = t
    else:
        raise SpecError("step_time_s", "missing (give step_time_s in seconds, or step_time with unit)", where=where)

    out["gpus"] = _int("gpus", raw.get("gpus", 1), where, minimum=0)
    placement = raw.get("placement")
    cross = raw.get("cross_node")
    if cross is not None and not isinstance(cross, bool):
        raise SpecError("cross_node", f"expected true or false, got {cross!r}", where=where)
    if placement is None:
        placement = "spread" if cross else "consolidated"
    if placement not in PLACEMENTS:
        raise SpecError("placement", f"{placement!r} is not one of {list(PLACEMENTS)}", where=where)
    if cross is None:
        cross = placement == "spread"
    elif cross != (placement == "spread"):
        raise SpecError(
            "cross_node",
            f"cross_node={cross} contradicts placement={placement!r} ('consolidated' is all GPUs on one node, "
            f"'spread' is over nodes): give placement={'spread' if cross else 'consolidated'!r} "
            f"{'for a sample spread over nodes' if cross else 'for a sample on one node'}, "
            "or give only one of the two fields",
            where=where,
        )
    if placement == "spread" and out["gpus"] < 2:
        raise SpecError(
            "placement",
            f"'spread' (over nodes) needs at least 2 GPUs, but gpus={out['gpus']}: give placement='consolidated' "
            "(or leave it out) for a sample on fewer than 2 GPUs",
            where=where,
        )
    out["placement"], out["cross_node"] = placement, bool(cross)
    if raw.get("cpu_cores") is not None:
        out["cpu_cores"] = _int("cpu_cores", raw["cpu_cores"], where, minimum=1)
    out["steps"] = _int("steps", raw.get("steps", 1), where, minimum=1)
    if raw.get("gpu_util_pct") is not None:
        u = _finite("gpu_util_pct", raw["gpu_util_pct"], where)
        if u > 100:
            raise SpecError("gpu_util_pct", f"a percentage must be <= 100, got {u!r}", where=where)
        out["gpu_util_pct"] = u
    if raw.get("gpu_mem_mb") is not None:
        out["gpu_mem_mb"] = _finite("gpu_mem_mb", raw["gpu_mem_mb"], where)
    for key in ("gpu_type", "co_runner", "source", "stage_run_id"):
        v = raw.get(key)
        if v is not None:
            if not isinstance(v, str) or not v.strip():
                raise SpecError(key, f"expected a non-empty string, got {v!r}", where=where)
            out[key] = v.strip()
    if raw.get("created_at") is not None:
        out["created_at"] = _aware(raw["created_at"], "created_at", where)
    return out


def _aware(value: Any, field: str, where: str) -> datetime:
    """A datetime in UTC; naive ones are taken as UTC."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise SpecError(field, f"not an ISO 8601 time: {value!r}", where=where) from None
    if not isinstance(value, datetime):
        raise SpecError(field, f"expected a datetime, got {value!r}", where=where)
    return value if value.utcoffset() is not None else value.replace(tzinfo=timezone.utc)


# --------------------------------------------------------------------------------------- retention

#: `qosflow predict prune`'s defaults: what is kept of rows older than the cut-off
KEEP_SAMPLES = 50
KEEP_RUNS = 50
#: the least of either that can be kept: `qosflow.predict.predictor.MIN_SAMPLES` (a test checks they agree),
#: from which the predictor answers from the measurements alone; keeping fewer would change its answers
KEEP_MIN = 3
#: the shortest --older-than: a stage's prediction, outcome, history row and sample are written one after
#: the other (separate transactions), so a younger cut-off could take a prediction whose run is being written
MIN_AGE = timedelta(hours=1)


def parse_age(text: str, option: str = "--older-than") -> timedelta:
    """'90d', '12w', '36h', '1y' (365 days), '30min' or '45m' (minutes), '90 days', '1d12h' as a timedelta, at
    least MIN_AGE; anything else raises SpecError naming `option` and the accepted form. The durations of a
    @qos_task's deadline (`qosflow.core.qos.parse_duration`, one parser for both)."""
    from qosflow.core.qos import parse_duration

    form = ("a number and a unit: s, m or min (minutes), h, d, w or y (365 days), e.g. 90d, 12w, 36h, 1d12h; "
            f"at least {int(MIN_AGE.total_seconds() // 3600)}h")
    seconds = parse_duration(str(text))
    if seconds is None and str(text).strip().startswith("-"):
        raise SpecError(option, f"{text!r} is negative: an age is how long ago; give {form}")
    if seconds is None:
        raise SpecError(option, f"{text!r} is not an age: give {form}")
    if not seconds < 1000 * 365 * 86400.0:  # (timedelta and the cut-off's date overflowed: an OverflowError traceback)
        raise SpecError(option, f"{text!r} is more than 1000 years: every row is younger; give {form}")
    age = timedelta(seconds=seconds)
    if age < MIN_AGE:
        raise SpecError(option, f"{text!r} is too young: rows of stages still being written could go; give {form}")
    return age


@dataclass
class PruneReport:
    """What `Store.prune` deleted (or, dry run, would delete) and kept, per table."""

    cutoff: datetime
    dry_run: bool
    #: table -> rows deleted (dry run: that would be)
    deleted: dict[str, int] = field(default_factory=dict)
    #: table -> rows older than the cut-off that were kept (a configuration's or a kept run's)
    kept_old: dict[str, int] = field(default_factory=dict)
    #: table -> rows before the prune
    before: dict[str, int] = field(default_factory=dict)
    #: SQLite file size before and after (VACUUM), bytes; None for PostgreSQL or without --vacuum
    file_bytes: tuple[int, int] | None = None
    vacuumed: bool = False
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"cutoff": self.cutoff.isoformat(), "dry_run": self.dry_run, "deleted": self.deleted,
                "kept_old": self.kept_old, "before": self.before, "vacuumed": self.vacuumed,
                "file_bytes": list(self.file_bytes) if self.file_bytes else None, "note": self.note}


def _old_ranked(table: Any, cutoff: datetime, partition: Sequence[Any]) -> Any:
    """(id, stage_run_id, rank) of the rows older than `cutoff`; rank 1 is the most recent row of its partition,
    counting the younger rows too."""
    rn = sa.func.row_number().over(partition_by=list(partition),
                                   order_by=[table.created_at.desc(), table.id.desc()]).label("rn")
    ranked = sa.select(table.id, table.stage_run_id, table.created_at, rn).subquery()
    return sa.select(ranked.c.id, ranked.c.stage_run_id, ranked.c.rn).where(ranked.c.created_at < cutoff)


def _sample_config(t: Any) -> list[Any]:
    """A sample's configuration as the predictor keys it (`Predictor.observe`), and its source."""
    return [t.signature, t.gpu_type, t.gpus, t.placement, t.cpu_cores, t.co_runner, t.source]


def _run_config(t: Any) -> list[Any]:
    """A stage run's group for the duration history (`LearnedEstimator._load_history`: signature, GPUs, GPU
    model; completed solo runs apart from the others)."""
    return [t.signature, t.gpu_type, t.gpus, t.state, t.co_runner.is_(None)]



def utc_now() -> datetime:
    return datetime.now(timezone.utc)


# --------------------------------------------------------------------------------------- the store


def _is_busy(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return "database is locked" in msg or "database is busy" in msg or "deadlock detected" in msg or (
        "could not serialize" in msg
    )


def damaged_database(exc: BaseException, url: str) -> QosflowError | None:
    """A QosflowError that says how to repair a SQLite database SQLite calls damaged ('database disk image
    is malformed', e.g. an index short of entries), or None for any other error. Was a raw traceback at
    whatever query met the damage (a worker's start, a profile)."""
    msg = str(exc)
    if "malformed" not in msg.lower():
        return None
    path = sqlite_file(url) or url
    check = (f"python3 -c \"import sqlite3; c = sqlite3.connect('{path}'); c.execute('REINDEX'); "
             f"print(c.execute('PRAGMA integrity_check').fetchone()[0])\"")
    return QosflowError(
        f"the qosflow database {path} is damaged (SQLite: {msg}). Stop every qosflow worker and command that uses it, then "
        f"rebuild its indexes, where such damage usually is: {check} -- 'ok' means repaired. Otherwise move it aside "
        f"(mv {path} {path}.damaged): a new one is made at the next start; the predictor's samples and the stages' "
        "history in the old one are lost (a PostgreSQL database, QOSFLOW_DATABASE_URL, suits several workers better)")


def explain_damage(engine: sa.Engine, url: str) -> None:
    """Turn SQLite's 'database disk image is malformed', from any query on `engine`, into `damaged_database`'s error."""

    @event.listens_for(engine, "handle_error")
    def _damaged(ctx):  # pragma: no cover - exercised by test_a_damaged_database_says_how_to_repair_it
        return damaged_database(ctx.original_exception, url)


class Store:
    """Repository over the qosflow database (SQLite or PostgreSQL)."""

    RETRIES = 12

    def __init__(self, engine: sa.Engine, url: str):
        self.engine = engine
        self.url = url
        #: the engine for reads that write nothing: on SQLite their transactions begin DEFERRED (a snapshot
        #: in WAL mode), not with the write lock that every other transaction takes up front, so a long read
        #: (a worker loading every sample at its start, `qosflow predict stages`) does not hold up writers
        self._reader = engine.execution_options(qosflow_read_only=True)

    @property
    def safe_url(self) -> str:
        """The URL without its user and password, for messages."""
        return _safe_url(self.url)

    # ---- opening

    @classmethod
    def open(cls, url: str | None = None, *, migrate_to: int | None = None, echo: bool = False,
             must_exist: bool = False) -> "Store":
        """Open (and create or upgrade) the database at `url`.

        `url` defaults to $QOSFLOW_DATABASE_URL, else `sqlite:///<data_dir>/qosflow.db`.
        `migrate_to` stops at an older schema version (tests of upgrades use it). `must_exist` (commands
        that only read) refuses a SQLite file that is not there rather than create an empty one.
        """
        from_env = url is None and bool(os.environ.get(ENV_URL))
        if not url:
            try:
                url = default_url()
            except OSError as exc:
                raise QosflowError(f"cannot create qosflow's data directory {exc.filename or ''} "
                                   f"({exc.strerror or exc}): set QOSFLOW_HOME to a writable directory, or "
                                   f"${ENV_URL} to a database URL") from None
        url = _normalise_url(url)
        safe = _safe_url(url)
        origin = f" (from ${ENV_URL})" if from_env else ""
        how = (f"give sqlite:///PATH/qosflow.db or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB"
               f"{' in $' + ENV_URL if from_env else ''}")
        try:
            backend = sa.engine.make_url(url).get_backend_name()
        except sa.exc.ArgumentError:
            raise QosflowError(f"{safe!r}{origin} is not a database URL: {how}") from None
        except ValueError:  # postgresql://u:p@host:543x/db: was a traceback, "invalid literal for int()"
            raise QosflowError(f"{safe!r}{origin} is not a database URL: its port is not a number (a password with "
                               f"':', '/' or '@' in it must be URL-encoded: %3A, %2F, %40); {how}") from None
        if backend not in ("sqlite", "postgresql"):
            raise QosflowError(f"cannot open {safe}{origin}: qosflow stores its data in SQLite or PostgreSQL, "
                               f"not {backend!r}: {how}")
        path = sqlite_file(url) if backend == "sqlite" else None
        if path:
            _check_sqlite_file(path, safe, origin, reading=must_exist)
        if must_exist and path and not os.path.exists(path):
            raise QosflowError(f"no qosflow database at {path}{origin}, so nothing to read: {how}, the store a qosflow "
                               "worker writes to (the qosflow.db in its QOSFLOW_HOME by default)")
        try:
            engine = cls._make_engine(url, echo=echo)
        except ModuleNotFoundError as exc:
            raise QosflowError(f"cannot open {safe}{origin}: database driver missing ({exc.name}); "
                               "postgresql+psycopg:// uses psycopg 3 (pip install 'psycopg[binary]')") from exc
        except sa.exc.NoSuchModuleError as exc:
            raise QosflowError(f"cannot open {safe}{origin}: unknown database driver ({exc}): {how}") from None
        except sa.exc.ArgumentError:  # e.g. sqlite://tmp/x.db: was sqlalchemy's traceback, 'Invalid SQLite URL'
            how_sqlite = how
            if backend == "sqlite":
                how_sqlite = "sqlite:///RELATIVE/PATH or sqlite:////ABSOLUTE/PATH (three slashes, then the path)"
                rest = url.split("://", 1)[-1].lstrip("/")
                if rest:
                    how_sqlite += f": for /{rest} write sqlite:////{rest}, for ./{rest} sqlite:///{rest}"
            raise QosflowError(f"{safe!r}{origin} is not a valid {backend} URL: give {how_sqlite}") from None
        except OSError as exc:
            raise QosflowError(f"cannot open {safe}{origin}: cannot create the directory "
                               f"{exc.filename or ''} ({exc.strerror or exc}): {how} in a writable place") from None
        store = cls(engine, url)
        try:
            store._retry(lambda: store._migrate(migrate_to))
        except OperationalError as exc:
            engine.dispose()
            hint = ""
            if backend == "sqlite":
                hint = ("; the database file and its directory must be writable (SQLite also writes -wal and -shm "
                        f"files beside it): fix the permissions or {how}")
                if must_exist and path:  # a reader (`qosflow predict stages`) of a store it may not write
                    hint += (f"; to read a store you may not write, copy {os.path.basename(path)} (with its -wal "
                             "file, if there is one) to a writable directory and give the copy")
            else:  # was libpq's message alone: what failed, not what to check
                hint = (f"; check that the PostgreSQL server at {engine.url.host or 'localhost'}:{engine.url.port or 5432} is running and reachable, and the "
                        f"URL's user, password and database{' in $' + ENV_URL if from_env else ''} (the database must "
                        f"exist: createdb); or {how}")
            raise QosflowError(f"cannot open the qosflow database {safe}{origin}: {exc.orig}{hint}") from exc
        except migrations.SchemaTooNew as exc:  # named the variable even for --db, and not the database
            engine.dispose()
            other = f"point ${ENV_URL} at another database" if from_env else "give another database"
            raise QosflowError(f"{safe}{origin}: the database schema is at version {exc.version}, newer than this "
                               f"qosflow knows ({exc.known}): upgrade qosflow, or {other}") from None
        except BaseException:  # no pooled connection left behind
            engine.dispose()
            raise
        return store

    @staticmethod
    def _make_engine(url: str, echo: bool = False) -> sa.Engine:
        if url.startswith("sqlite"):
            path = sqlite_file(url)
            if path and not os.path.exists(path):
                # 0600 in 0700 directories, as the lease store does (the default is one qosflow.db for both):
                # under the default umask the store was 0644, so whichever opened it first decided whether
                # other users could read the stages' history. An existing file keeps its mode
                from qosflow.store.leases import private_sqlite_file

                private_sqlite_file(path, "the stages' history and profiles")
            engine = sa.create_engine(url, echo=echo, connect_args={"timeout": 30, "check_same_thread": False})

            @event.listens_for(engine, "connect")
            def _on_connect(dbapi_conn, _rec):  # pragma: no cover - exercised by every sqlite test
                dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA busy_timeout=30000")
                if path and path != ":memory:":
                    cur.execute("PRAGMA journal_mode=WAL")
                    cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()

            explain_damage(engine, url)

            @event.listens_for(engine, "begin")
            def _on_begin(conn):  # pragma: no cover
                # take the write lock up front: two writers queue on busy_timeout instead of
                # deadlocking on a read->write lock upgrade -- except in a transaction that only reads
                # (`Store._reader`), which never upgrades, and which held writers up for as long as it read
                conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("qosflow_read_only") else "BEGIN IMMEDIATE")

            return engine
        return sa.create_engine(url, echo=echo, pool_pre_ping=True)

    def _migrate(self, target: int | None) -> tuple[int, int]:
        with self.engine.begin() as conn:
            return migrations.migrate(conn, target)

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return migrations.current_version(conn)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _retry(self, fn: Callable[[], T]) -> T:
        delay = 0.01
        for attempt in range(self.RETRIES):
            try:
                return fn()
            except OperationalError as exc:
                if attempt == self.RETRIES - 1 or not _is_busy(exc):
                    raise
                time.sleep(delay * (1 + _JITTER.random()))
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    def _write(self, rows: Sequence[Any]) -> list[int]:
        def txn() -> list[int]:
            with Session(self.engine, expire_on_commit=False) as s:
                fresh = [type(r).model_validate(r.model_dump()) for r in rows]
                s.add_all(fresh)
                s.commit()
                return [r.id for r in fresh]

        return self._retry(txn)

    # ---- samples

    def add_samples(self, samples: Iterable[Mapping[str, Any] | Sample]) -> list[int]:
        """Validate every sample first (nothing is written if one is bad), then insert all in one transaction."""
        clean = [Sample(**validate_sample(s, where=f"sample {i}")) for i, s in enumerate(samples)]
        if not clean:
            return []
        return self._write(clean)

    def add_sample(self, **fields: Any) -> int:
        return self.add_samples([fields])[0]

    def samples_for(
        self,
        signature: str | None = None,
        *,
        gpu_type: str | None = None,
        gpus: int | None = None,
        placement: str | None = None,
        co_runner: str | None | type(Ellipsis) = ...,
        cpu_cores: int | None = None,
        since_id: int = 0,
        limit: int | None = None,
    ) -> list[Sample]:
        """Samples matching the filters, oldest first. `co_runner=None` means "ran alone"."""
        q = select(Sample).where(Sample.id > since_id)
        if signature is not None:
            q = q.where(Sample.signature == signature)
        if gpu_type is not None:
            q = q.where(Sample.gpu_type == gpu_type)
        if gpus is not None:
            q = q.where(Sample.gpus == gpus)
        if placement is not None:
            q = q.where(Sample.placement == placement)
        if cpu_cores is not None:
            q = q.where(Sample.cpu_cores == cpu_cores)
        if co_runner is None:
            q = q.where(Sample.co_runner.is_(None))
        elif co_runner is not ...:
            q = q.where(Sample.co_runner == co_runner)
        q = q.order_by(Sample.id)
        if limit is not None:
            q = q.limit(limit)
        with Session(self._reader) as s:
            return list(s.exec(q).all())

    def iter_samples(self, since_id: int = 0, batch: int = 20_000) -> Iterator[Sample]:
        last = since_id
        while True:
            rows = self.samples_for(since_id=last, limit=batch)
            if not rows:
                return
            yield from rows
            last = rows[-1].id

    def sample_rows(self, *columns: str, signature: str | None = None, since_id: int = 0,
                    batch: int = 20_000) -> Iterator[sa.Row]:
        """Every sample (of `signature`) as a row of its id and `columns` (names of Sample's columns;
        none: all of them), oldest first, read `batch` rows per query. A row is a tuple whose values are
        also its attributes (`row.signature`) and `row._mapping`: the values a `Sample` read back would
        have, without building one (SQLAlchemy's ORM instances were most of a worker's start)."""
        t = Sample.__table__.c
        cols = [t.id] + [t[c] for c in (columns or [c.name for c in t]) if c != "id"]
        q = sa.select(*cols).order_by(t.id).limit(batch)
        if signature is not None:
            q = q.where(t.signature == signature)
        last = since_id
        while True:
            with self._reader.connect() as conn:
                rows = conn.execute(q.where(t.id > last)).all()
                conn.rollback()
            yield from rows
            if len(rows) < batch:  # (the last batch: no query more to find nothing)
                return
            last = rows[-1].id

    def count(self, table: type = Sample) -> int:
        with Session(self._reader) as s:
            return int(s.exec(select(sa.func.count()).select_from(table)).one())

    def signatures(self) -> list[str]:
        with Session(self._reader) as s:
            return sorted(s.exec(select(Sample.signature).distinct()).all())

    # ---- profiles

    def add_profile(
        self,
        signature: str,
        solo_step_time_s: float,
        *,
        gpu_type: str = "unknown",
        cpu_cores: int | None = None,
        ref_speeds: Mapping[str, float] | None = None,
        ref_partner_speeds: Mapping[str, float] | None = None,
        source: str = "profile",
    ) -> int:
        where = f"profile of {signature!r}"
        if not isinstance(signature, str) or not signature.strip():
            raise SpecError("signature", f"expected a non-empty string, got {signature!r}", where="profile")
        t = _finite("solo_step_time_s", solo_step_time_s, where, positive=True)
        for name, d in (("ref_speeds", ref_speeds), ("ref_partner_speeds", ref_partner_speeds)):
            for k, v in (d or {}).items():
                _finite(f"{name}[{k!r}]", v, where)
        row = Profile(
            signature=signature.strip(),
            gpu_type=gpu_type,
            solo_step_time_s=t,
            cpu_cores=cpu_cores,
            ref_speeds_json=json.dumps(dict(ref_speeds or {}), sort_keys=True),
            ref_partner_speeds_json=json.dumps(dict(ref_partner_speeds or {}), sort_keys=True),
            source=source,
        )
        return self._write([row])[0]

    def profiles_for(self, signature: str | None = None, *, since_id: int = 0) -> list[Profile]:
        """The profiles (of `signature`; with ids above `since_id`: those stored since), oldest first."""
        q = select(Profile)
        if since_id:
            q = q.where(Profile.id > since_id)
        if signature is not None:
            q = q.where(Profile.signature == signature)
        with Session(self._reader) as s:
            return list(s.exec(q.order_by(Profile.id)).all())

    # ---- predictions and outcomes

    def record_prediction(
        self,
        prediction: Any,
        *,
        signature: str,
        target: str,
        stage_run_id: str | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> int:
        """Keep a `qosflow.predict.Prediction` (or anything with value/low/high/n_samples/basis)."""
        where = f"prediction for {signature!r}"
        for f in ("value", "low", "high"):
            _finite(f, getattr(prediction, f), where)
        row = PredictionRecord(
            stage_run_id=stage_run_id,
            signature=signature,
            target=target,
            value=float(prediction.value),
            low=float(prediction.low),
            high=float(prediction.high),
            n_samples=int(getattr(prediction, "n_samples", 0)),
            basis=str(getattr(prediction, "basis", "")),
            context_json=json.dumps(dict(context or {}), sort_keys=True, default=str),
        )
        return self._write([row])[0]

    def record_outcome(self, stage_run_id: str, actual: float, *, signature: str = "", target: str = "duration") -> int:
        _finite("actual", actual, f"outcome of {stage_run_id!r}")
        return self._write([Outcome(stage_run_id=stage_run_id, actual=float(actual), signature=signature, target=target)])[0]

    def prediction_errors(self, target: str | None = None) -> list[tuple[PredictionRecord, Outcome]]:
        """Every recorded prediction that has an outcome for the same stage run and target."""
        q = select(PredictionRecord, Outcome).join(
            Outcome,
            sa.and_(Outcome.stage_run_id == PredictionRecord.stage_run_id, Outcome.target == PredictionRecord.target),
        )
        if target is not None:
            q = q.where(PredictionRecord.target == target)
        with Session(self._reader) as s:
            return [(p, o) for p, o in s.exec(q.order_by(PredictionRecord.id)).all()]

    def duration_errors(self, signature: str | None = None) -> list[sa.Row]:
        """`prediction_errors("duration")` (of `signature`) as rows (signature, value, basis, actual) in the
        same order: what `qosflow predict stages` scores, without the two ORM instances per pair."""
        P, O = PredictionRecord.__table__.c, Outcome.__table__.c
        q = sa.select(P.signature, P.value, P.basis, O.actual).select_from(PredictionRecord.__table__).join(
            Outcome.__table__, sa.and_(O.stage_run_id == P.stage_run_id, O.target == P.target)
        ).where(P.target == "duration")
        if signature is not None:
            q = q.where(P.signature == signature)
        with self._reader.connect() as conn:
            rows = conn.execute(q.order_by(P.id, O.id)).all()
            conn.rollback()
        return rows

    # ---- stage history

    def record_stage(self, **fields: Any) -> int:
        if not fields.get("stage_run_id"):
            raise SpecError("stage_run_id", "missing", where="stage history")
        for f in ("duration_s", "step_time_s"):
            if fields.get(f) is not None:
                _finite(f, fields[f], f"stage {fields['stage_run_id']!r}")
        for f in ("started_at", "finished_at", "created_at"):
            if fields.get(f) is not None:
                fields[f] = _aware(fields[f], f, f"stage {fields['stage_run_id']!r}")
        return self._write([StageHistory(**fields)])[0]

    def stage_history(self, *, signature: str | None = None, flow_run_id: str | None = None) -> list[StageHistory]:
        q = select(StageHistory)
        if signature is not None:
            q = q.where(StageHistory.signature == signature)
        if flow_run_id is not None:
            q = q.where(StageHistory.flow_run_id == flow_run_id)
        with Session(self._reader) as s:
            return list(s.exec(q.order_by(StageHistory.id)).all())

    def history_rows(self, *columns: str, signature: str | None = None, state: str | None = None,
                     ids: Iterable[int] | None = None, since_id: int = 0) -> list[sa.Row]:
        """`stage_history`'s runs (of `signature`, in `state`, or those of `ids`; with ids above `since_id`:
        those stored since) as rows of their id and `columns` (names of StageHistory's columns), oldest
        first: values, not ORM instances (as `sample_rows`)."""
        t = StageHistory.__table__.c
        q = sa.select(t.id, *[t[c] for c in columns if c != "id"]).order_by(t.id)
        if since_id:
            q = q.where(t.id > since_id)
        if signature is not None:
            q = q.where(t.signature == signature)
        if state is not None:
            q = q.where(t.state == state)
        parts = [None]
        if ids is not None:  # (a thousand at a time: SQLite limits the parameters of one statement)
            ids = sorted(set(ids))
            parts = [ids[i:i + 1000] for i in range(0, len(ids), 1000)]
        rows: list[sa.Row] = []
        with self._reader.connect() as conn:
            for part in parts:
                rows += conn.execute(q if part is None else q.where(t.id.in_(part))).all()
            conn.rollback()
        return rows

    # ---- retention

    def prune(self, older_than: timedelta | None = None, *, before: datetime | None = None,
              keep_samples: int = KEEP_SAMPLES, keep_runs: int = KEEP_RUNS, dry_run: bool = False,
              vacuum: bool = False, batch: int = 2000, pause: float | None = None,
              now: datetime | None = None) -> PruneReport:
        """Delete rows older than `older_than` (or than the time `before`), keeping what the predictor needs.

        * samples: every configuration (signature, GPU model, GPUs, placement, CPU cores, co-runner, source)
          keeps its `keep_samples` (>= KEEP_MIN) most recent samples, however old; older ones beyond those
          go. So no configuration, and no signature, loses its last samples, and one the predictor answered
          from its measurements alone still has enough for that;
        * stage history: every (signature, GPU model, GPUs, state, solo or shared) keeps its `keep_runs` most
          recent runs (>= KEEP_MIN: the durations the learned estimator plans with at a start); older ones go;
        * predictions and outcomes older than the cut-off go, except those of a stage run whose history row is
          kept (so `qosflow predict stages` still scores the runs it lists) and each signature's latest
          prediction on its declared duration alone (basis 'declared': the store's only record of it);
        * profiles are kept (one row per `qosflow profile`).

        What goes is chosen in one read at the start, then deleted `batch` rows per short transaction (each
        retried on a busy SQLite database), `pause` seconds apart (SQLite: 0.02 s, PostgreSQL: 0), so a worker
        writing meanwhile waits milliseconds, not the whole prune (SQLite's busy handler sleeps before it
        tries again: without the pause, back-to-back batches kept a writer out until the end); its rows are
        younger than the cut-off and are never chosen. `dry_run`: choose and count only.
        `vacuum`: SQLite only, rewrite the file afterwards so that it shrinks (VACUUM: the database is locked
        meanwhile, and it needs free space of the file's size); PostgreSQL: VACUUM ANALYZE of the four tables
        (space reused, the files do not shrink).
        """
        if (older_than is None) == (before is None):
            raise SpecError("older_than", "give exactly one of older_than (a timedelta) or before (a time)")
        for name, k in (("keep_samples", keep_samples), ("keep_runs", keep_runs)):
            if _int(name, k, "prune", minimum=1) < KEEP_MIN:
                raise SpecError(name, f"must be >= {KEEP_MIN}, got {k}: the predictor answers a configuration from its "
                                      f"own samples (and a signature's duration from its runs) from {KEEP_MIN} on, and "
                                      "blends in a model below that", where="prune")
        _int("batch", batch, "prune", minimum=1)
        now = now or utc_now()
        if older_than is not None:
            if not isinstance(older_than, timedelta) or older_than < MIN_AGE:
                raise SpecError("older_than", f"must be a timedelta of at least {MIN_AGE}, got {older_than!r}", where="prune")
            cutoff = now - older_than
        else:
            cutoff = _aware(before, "before", "prune")
        cutoff = cutoff.astimezone(timezone.utc)
        rep = PruneReport(cutoff=cutoff, dry_run=dry_run)
        S, H, P, O = (t.__table__.c for t in (Sample, StageHistory, PredictionRecord, Outcome))
        names = {"sample": Sample, "stage_history": StageHistory, "prediction": PredictionRecord, "outcome": Outcome}

        def choose() -> dict[str, array]:
            # read through the store's reader, whose transactions take no lock on SQLite (WAL: a worker writes
            # on meanwhile), while the store's other transactions begin with the write lock
            chosen: dict[str, array] = {}
            with self._reader.connect() as conn:
                for name, t in names.items():
                    rep.before[name] = conn.execute(sa.select(sa.func.count()).select_from(t.__table__)).scalar_one()
                kept_runs: set[str] = set(conn.execute(sa.select(H.stage_run_id).where(H.created_at >= cutoff)).scalars())
                for name, c, keep, config in (("sample", S, keep_samples, _sample_config(S)),
                                              ("stage_history", H, keep_runs, _run_config(H))):
                    drop, kept = array("q"), 0
                    for rid, run, rank in conn.execute(_old_ranked(c, cutoff, config)):
                        if rank > keep:
                            drop.append(rid)
                        else:
                            kept += 1
                            if name == "stage_history":  # its predictions and outcomes stay too
                                kept_runs.add(run)
                    chosen[name], rep.kept_old[name] = drop, kept
                # a signature's latest prediction made on its declared duration alone (basis 'declared'): the
                # only record of that declaration, which `qosflow predict stages` blends in as the worker does
                declared = dict(conn.execute(
                    sa.select(P.signature, sa.func.max(P.id)).where(P.basis == "declared").group_by(P.signature)).all())
                keep_ids = set(declared.values())
                for name, c in (("prediction", P), ("outcome", O)):
                    drop, kept = array("q"), 0
                    for rid, run in conn.execute(sa.select(c.id, c.stage_run_id).where(c.created_at < cutoff)):
                        if (run is not None and run in kept_runs) or (name == "prediction" and rid in keep_ids):
                            kept += 1
                        else:
                            drop.append(rid)
                    chosen[name], rep.kept_old[name] = drop, kept
                conn.rollback()
            return {name: array("q", sorted(ids)) for name, ids in chosen.items()}

        chosen = self._retry(choose)
        rep.deleted = {name: len(ids) for name, ids in chosen.items()}
        if dry_run:
            return rep
        if pause is None:
            pause = 0.02 if self.dialect == "sqlite" else 0.0
        for name, ids in chosen.items():
            t = names[name].__table__
            for i in range(0, len(ids), batch):
                part = list(ids[i:i + batch])

                def txn(part=part) -> None:
                    with self.engine.begin() as conn:
                        conn.execute(sa.delete(t).where(t.c.id.in_(part)))

                self._retry(txn)
                if pause:
                    time.sleep(pause)
        if vacuum:
            self._vacuum(rep)
        return rep


    def _vacuum(self, rep: PruneReport) -> None:
        if self.dialect == "sqlite":
            path = sqlite_file(self.url)
            size = (lambda: os.path.getsize(path) + (os.path.getsize(path + "-wal") if os.path.exists(path + "-wal") else 0)) \
                if path else (lambda: 0)
            was = size()

            def run() -> None:
                raw = self.engine.raw_connection()  # outside a transaction (the engine's begin is BEGIN IMMEDIATE)
                try:
                    raw.driver_connection.execute("VACUUM")
                    if path:
                        raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                finally:
                    raw.close()

            self._retry(run)
            rep.vacuumed, rep.file_bytes = True, (was, size())
        else:
            try:
                with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    for t in ("sample", "stage_history", "prediction", "outcome"):
                        conn.exec_driver_sql(f"VACUUM ANALYZE {t}")
                rep.vacuumed = True
                rep.note = "PostgreSQL: VACUUM ANALYZE makes the space reusable; the files do not shrink (VACUUM FULL does, locking the tables)"
            except sa.exc.DBAPIError as exc:
                rep.note = f"PostgreSQL VACUUM ANALYZE was refused ({exc.orig}); autovacuum reclaims the space in time"
