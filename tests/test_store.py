"""The predictor's store: round trips (SQLite, PostgreSQL), schema upgrades, validation, concurrent writers."""

from __future__ import annotations

import math
import multiprocessing as mp
import os

import pytest
import sqlalchemy as sa

from qosflow.errors import QosflowError, SpecError
from qosflow.store import LATEST_VERSION, Store, validate_sample
from qosflow.store.models import Sample, SQLModel



def _sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'qosflow.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    if request.param == "sqlite":
        return _sqlite_url(tmp_path)
    return request.getfixturevalue("pg_url")


def _round_trip(url: str) -> None:
    with Store.open(url) as store:
        assert store.schema_version() == LATEST_VERSION
        ids = store.add_samples(
            [
                {"signature": "resnet50/bs64", "gpus": 1, "step_time_s": 0.25, "cpu_cores": 4, "gpu_type": "v100"},
                {"signature": "resnet50/bs64", "gpus": 4, "placement": "spread", "step_time": 90, "unit": "ms",
                 "gpu_util_pct": 87.5, "gpu_mem_mb": 10240, "steps": 20},
                {"signature": "resnet50/bs64", "gpus": 1, "co_runner": "lm/bs20", "step_time_s": 0.4},
            ]
        )
        assert len(ids) == 3 and all(isinstance(i, int) for i in ids)
        alone = store.samples_for("resnet50/bs64", co_runner=None)
        assert [s.gpus for s in alone] == [1, 4]
        spread = store.samples_for("resnet50/bs64", placement="spread")[0]
        assert spread.cross_node is True and math.isclose(spread.step_time_s, 0.09)
        assert spread.gpu_util_pct == 87.5 and spread.gpu_mem_mb == 10240 and spread.steps == 20
        assert store.samples_for("resnet50/bs64", co_runner="lm/bs20")[0].step_time_s == 0.4
        assert store.signatures() == ["resnet50/bs64"]

        pid = store.add_profile("resnet50/bs64", 0.25, gpu_type="v100", ref_speeds={"lm/bs20": 0.6})
        assert store.profiles_for("resnet50/bs64")[0].id == pid

        class P:  # anything shaped like a Prediction
            value, low, high, n_samples, basis = 100.0, 80.0, 130.0, 3, "samples(n=3)"

        store.record_prediction(P(), signature="resnet50/bs64", target="duration", stage_run_id="run-1",
                                context={"gpus": 4})
        store.record_outcome("run-1", 110.0, signature="resnet50/bs64", target="duration")
        [(pred, out)] = store.prediction_errors("duration")
        assert pred.basis == "samples(n=3)" and pred.n_samples == 3 and out.actual == 110.0

        store.record_stage(stage_run_id="run-1", flow_run_id="flow-1", stage="train", signature="resnet50/bs64",
                           gpus=4, duration_s=110.0)
        assert store.stage_history(flow_run_id="flow-1")[0].duration_s == 110.0

    with Store.open(url) as again:  # reopening neither migrates again nor loses rows
        assert again.count() == 3 and again.schema_version() == LATEST_VERSION


def test_round_trip(url):
    _round_trip(url)


def test_default_url_comes_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", _sqlite_url(tmp_path))
    with Store.open() as store:
        assert store.url.endswith("qosflow.db") and store.dialect == "sqlite"
    monkeypatch.delenv("QOSFLOW_DATABASE_URL")
    monkeypatch.setenv("QOSFLOW_HOME", str(tmp_path / "home"))
    with Store.open() as store:
        assert str(tmp_path / "home" / "qosflow.db") in store.url


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"signature": "a", "step_time_s": -1.0}, "step_time_s"),
        ({"signature": "a", "step_time_s": 0.0}, "step_time_s"),
        ({"signature": "a", "step_time_s": float("nan")}, "step_time_s"),
        ({"signature": "a", "step_time_s": float("inf")}, "step_time_s"),
        ({"signature": "a", "step_time": 3.0, "unit": "fortnights"}, "unit"),
        ({"signature": "a", "step_time": 3.0}, "unit"),
        ({"signature": "a", "step_time_s": 3.0, "unit": "ms"}, "unit"),
        ({"signature": "a"}, "step_time_s"),
        ({"signature": "", "step_time_s": 1.0}, "signature"),
        ({"signature": "a", "step_time_s": 1.0, "gpus": -2}, "gpus"),
        ({"signature": "a", "step_time_s": 1.0, "gpus": 1.5}, "gpus"),
        ({"signature": "a", "step_time_s": 1.0, "placement": "diagonal"}, "placement"),
        ({"signature": "a", "step_time_s": 1.0, "gpu_util_pct": 140}, "gpu_util_pct"),
        ({"signature": "a", "step_time_s": 1.0, "gpu_mem_mb": float("nan")}, "gpu_mem_mb"),
        ({"signature": "a", "step_time_s": 1.0, "cpu_cores": 0}, "cpu_cores"),
        ({"signature": "a", "step_time_s": 1.0, "cross_node": "yes"}, "cross_node"),
        ({"signature": "a", "step_time_s": 1.0, "gpus": 2, "cross_node": True, "placement": "consolidated"},
         "cross_node"),  # was stored as is: a contradiction the predictor then read as consolidated
        ({"signature": "a", "step_time_s": 1.0, "gpus": 2, "cross_node": False, "placement": "spread"}, "cross_node"),
        ({"signature": "a", "step_time_s": 1.0, "gpus": 1, "placement": "spread"}, "placement"),  # one GPU cannot be spread
        ({"signature": "a", "step_time_s": 1.0, "cross_node": True}, "placement"),  # nor can the default 1 GPU
        ({"signature": "a", "step_time_s": 1.0, "step_tme": 2}, "step_tme"),
        ({"signature": "a", "step_time": 1e308, "unit": "min"}, "step_time"),  # overflowed to inf and was stored
        ({"signature": "a", "step_time": 1e-320, "unit": "ns"}, "step_time"),  # underflowed to 0
        ({"signature": "a", "step_time": 5.0, "unit": "ms", "units": "s"}, "unit"),  # was taken as ms
    ],
)
def test_bad_samples_are_rejected_naming_the_field(tmp_path, bad, field):
    with Store.open(_sqlite_url(tmp_path)) as store:
        good = {"signature": "ok", "step_time_s": 1.0}
        with pytest.raises(SpecError) as err:
            store.add_samples([good, bad])
        assert err.value.field == field
        assert "sample 1" in str(err.value) and field in str(err.value)
        assert store.count() == 0  # all or nothing


def test_contradictory_placement_names_the_fix(tmp_path):
    with Store.open(_sqlite_url(tmp_path)) as store:
        with pytest.raises(SpecError) as err:
            store.add_sample(signature="a", step_time_s=1.0, gpus=2, cross_node=True, placement="consolidated")
        msg = str(err.value)
        assert "cross_node=True contradicts placement='consolidated'" in msg and "give placement='spread'" in msg


def test_sample_objects_default_placement_follows_the_field_given(tmp_path):
    """A Sample built in code states only the fields given: the other one follows (was: the default
    cross_node=False stored beside placement='spread')."""
    with Store.open(_sqlite_url(tmp_path)) as store:
        store.add_samples([Sample(signature="s", step_time_s=1.0, gpus=2, placement="spread"),
                           Sample(signature="x", step_time_s=1.0, gpus=2, cross_node=True),
                           Sample(signature="c", step_time_s=1.0, gpus=2)])
        got = {r.signature: (r.placement, r.cross_node) for r in store.samples_for()}
        assert got == {"s": ("spread", True), "x": ("spread", True), "c": ("consolidated", False)}
        with pytest.raises(SpecError, match="cross_node"):
            store.add_samples([Sample(signature="a", step_time_s=1.0, gpus=2, cross_node=True, placement="consolidated")])
        for row in store.samples_for():  # rows read back validate as they are
            assert validate_sample(row)["placement"] == row.placement


def _old_v1_database(url: str) -> None:
    """A database as the first release left it, with rows in it."""
    with Store.open(url, migrate_to=1) as old:
        assert old.schema_version() == 1
        cols = {c["name"] for c in sa.inspect(old.engine).get_columns("sample")}
        assert "gpu_util_pct" not in cols
        assert not sa.inspect(old.engine).has_table("prediction")
        with old.engine.begin() as conn:
            for i in range(5):
                conn.execute(
                    sa.text(
                        "INSERT INTO sample (signature, gpu_type, placement, gpus, cross_node, step_time_s, source, "
                        "created_at) VALUES (:s, 'v100', 'consolidated', 1, false, :t, 'stage', :c)"
                    ),
                    {"s": f"job{i}", "t": 0.1 * (i + 1), "c": "2024-01-01 00:00:00"},
                )


def test_upgrade_keeps_rows(url):
    _old_v1_database(url)
    with Store.open(url) as new:
        assert new.schema_version() == LATEST_VERSION
        rows = new.samples_for()
        assert [r.signature for r in rows] == [f"job{i}" for i in range(5)]
        assert [round(r.step_time_s, 3) for r in rows] == [0.1, 0.2, 0.3, 0.4, 0.5]
        assert all(r.steps == 1 and r.gpu_util_pct is None for r in rows)  # new columns get their defaults
        new.add_sample(signature="job9", step_time_s=1.0, gpu_util_pct=50.0)  # and the new schema works
        assert new.count() == 6


def test_migrations_give_exactly_the_models_schema(url):
    with Store.open(url) as store:
        insp = sa.inspect(store.engine)
        for name, table in SQLModel.metadata.tables.items():
            if name not in {"schema_version", "profile", "sample", "prediction", "outcome", "stage_history"}:
                continue  # another module's table
            db_cols = {c["name"] for c in insp.get_columns(name)}
            assert db_cols == {c.name for c in table.columns}, name


def test_newer_database_is_refused(tmp_path):
    url = _sqlite_url(tmp_path)
    Store.open(url).close()
    eng = sa.create_engine(url)
    with eng.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO schema_version (version, description, applied_at) VALUES ({LATEST_VERSION + 1}, 'future', '2099-01-01')"
        )
    eng.dispose()
    with pytest.raises(QosflowError, match="newer than this qosflow"):
        Store.open(url)
    # the database is named, and where its URL came from: the advice was always "point QOSFLOW_DATABASE_URL at
    # another database", also to `--db`/Store.open(url), and no database was named
    with pytest.raises(QosflowError) as err:
        Store.open(url)
    assert str(err.value).startswith(f"{url}: the database schema is at version {LATEST_VERSION + 1}, newer")
    assert str(err.value).endswith("upgrade qosflow, or give another database")


def _writer(url: str, tag: str, n: int, batch: int) -> None:
    store = Store.open(url)
    for i in range(0, n, batch):
        store.add_samples(
            [{"signature": f"{tag}", "step_time_s": 0.001 * (j + 1), "stage_run_id": f"{tag}-{j}"} for j in range(i, i + batch)]
        )
        store.add_sample(signature=f"{tag}-single", step_time_s=1.0)
    store.close()


def _run_two_writers(url: str, tag: str, n: int, batch: int) -> None:
    """`_writer` in two processes at once (tags tag0 and tag1); both must succeed."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(url, f"{tag}{k}", n, batch)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0


def test_concurrent_writers_lose_nothing(url):
    Store.open(url).close()
    n, batch = 200, 10
    _run_two_writers(url, "w", n, batch)
    with Store.open(url) as store:
        for k in range(2):
            rows = store.samples_for(f"w{k}")
            assert sorted(int(r.stage_run_id.split("-")[1]) for r in rows) == list(range(n))
            assert len(store.samples_for(f"w{k}-single")) == n // batch
        assert store.count() == 2 * (n + n // batch)


def test_concurrent_first_open_migrates_once(tmp_path):
    url = _sqlite_url(tmp_path)
    _run_two_writers(url, "x", 20, 10)
    with Store.open(url) as store:
        with store.engine.connect() as conn:
            versions = [r[0] for r in conn.exec_driver_sql("SELECT version FROM schema_version ORDER BY version")]
        assert versions == list(range(1, LATEST_VERSION + 1))
        assert store.count() == 2 * (20 + 2)


def test_unreachable_postgres_is_a_clear_error():
    port = 1  # nothing listens there
    with pytest.raises(QosflowError, match="cannot open the qosflow database"):
        Store.open(f"postgresql+psycopg://nobody:x@127.0.0.1:{port}/nothing?connect_timeout=2")


@pytest.mark.parametrize("url, said", [
    ("foo://bar", "not 'foo'"),                      # was sqlalchemy's NoSuchModuleError traceback
    ("notaurl", "is not a database URL"),            # was ArgumentError traceback
    ("mysql://u:secret@localhost/db", "not 'mysql'"),
    ("postgresql+nodriver://u@localhost/db", "unknown database driver"),
    ("postgresql+psycopg://u:secret@localhost:54x2/db", "its port is not a number"),  # was a ValueError traceback
])
def test_bad_database_url_says_what_and_how(url, said):
    with pytest.raises(QosflowError) as err:
        Store.open(url)
    msg = str(err.value)
    assert said in msg and "sqlite:///PATH" in msg and "postgresql+psycopg://" in msg and "secret" not in msg


def test_sqlite_url_with_two_slashes_names_the_spellings(tmp_path, monkeypatch):
    """sqlite://tmp/x.db (a slash short) ended in sqlalchemy's traceback, 'Invalid SQLite URL'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(QosflowError) as err:
        Store.open("sqlite://data/q.db")
    msg = str(err.value)
    assert "'sqlite://data/q.db' is not a valid sqlite URL" in msg
    assert "for /data/q.db write sqlite:////data/q.db, for ./data/q.db sqlite:///data/q.db" in msg
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", "sqlite://data/q.db")
    with pytest.raises(QosflowError, match=r"from \$QOSFLOW_DATABASE_URL\) is not a valid sqlite URL"):
        Store.open()
    assert not (tmp_path / "data").exists()


def test_a_store_that_cannot_be_written_tells_a_reader_to_read_a_copy(tmp_path, monkeypatch):
    """`qosflow predict stages` (a reader) on a store in a directory it may not write (a worker's, a read-only
    share) was told only "must be writable: fix the permissions", which a reader often cannot do."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'q.db'}"
    Store.open(url).close()

    def read_only(self, target):
        raise sa.exc.OperationalError("PRAGMA journal_mode=WAL", {}, sqlite3.OperationalError("unable to open database file"))

    monkeypatch.setattr(Store, "_migrate", read_only)
    with pytest.raises(QosflowError) as err:
        Store.open(url, must_exist=True)
    assert "must be writable" in str(err.value) and "copy q.db (with its -wal file" in str(err.value)
    with pytest.raises(QosflowError) as err:  # a writer gets no such advice
        Store.open(url)
    assert "must be writable" in str(err.value) and "copy" not in str(err.value)


def test_bad_database_url_from_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", "foo://bar")
    with pytest.raises(QosflowError, match=r"from \$QOSFLOW_DATABASE_URL"):
        Store.open()


def test_sqlite_in_a_place_that_cannot_be_created_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(QosflowError, match="cannot create the directory .*file"):  # was a PermissionError/NotADirectoryError traceback
        Store.open(f"sqlite:///{tmp_path / 'file' / 'sub' / 'q.db'}")
    with pytest.raises(QosflowError, match="is a directory, not a database file"):  # said 'must be writable'
        Store.open(f"sqlite:///{tmp_path}")


def test_store_refuses_a_file_that_is_not_a_sqlite_database(tmp_path, monkeypatch):
    """Every user of the store (the worker too, through $QOSFLOW_DATABASE_URL), not only the CLI, gets the
    clear error; the file is left as it was, and an empty file is a new database only for a writer."""
    csv = tmp_path / "samples.csv"
    csv.write_text("a,b\n1,2\n")
    monkeypatch.setenv("QOSFLOW_DATABASE_URL", f"sqlite:///{csv}")
    with pytest.raises(QosflowError, match=r"samples.csv is not a SQLite database .*\(from \$QOSFLOW_DATABASE_URL\)|"
                                           r"from \$QOSFLOW_DATABASE_URL\).*samples.csv is not a SQLite database"):
        Store.open()
    assert csv.read_text() == "a,b\n1,2\n"
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(QosflowError, match="is an empty file, not a qosflow database"):
        Store.open(f"sqlite:///{empty}", must_exist=True)
    Store.open(f"sqlite:///{empty}").close()  # a writer may start a database there
    assert empty.read_bytes().startswith(b"SQLite format 3")


def test_predictor_loads_a_store_with_an_invalid_old_row(tmp_path, caplog):
    # an older qosflow stored inf (a unit conversion that overflowed): Predictor.open failed on it
    from qosflow.predict.predictor import Predictor

    with Store.open(_sqlite_url(tmp_path)) as store:
        store.add_samples([{"signature": "ok/bs8", "step_time_s": 0.5, "gpus": 1}] * 3)
        with store.engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO sample (signature, gpu_type, placement, gpus, cross_node, step_time_s, steps, source, created_at)"
                " VALUES ('bad/bs8', 'unknown', 'consolidated', 1, 0, 9e999, 1, 'stage', '2024-01-01 00:00:00')")
        with caplog.at_level("WARNING"):
            p = Predictor.open(store, reference=None)
        [(bad_id, msg)] = p.skipped_samples
        assert bad_id == 4 and "step_time_s" in msg
        assert "id=4" in caplog.text and "skipped 1 invalid sample" in caplog.text
        assert p.predict_solo_step_time("ok/bs8", 1, True, None).value == pytest.approx(0.5)


def test_upgrade_from_v3_keeps_stage_history(url):
    """Version 4 adds `stage_history.resumed_from`: the runs recorded before read as runs from the start."""
    with Store.open(url, migrate_to=3) as old:
        assert "resumed_from" not in {c["name"] for c in sa.inspect(old.engine).get_columns("stage_history")}
        with old.engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO stage_history (stage_run_id, stage, signature, state, gpu_type, gpus, placement, steps, "
                "duration_s, created_at) VALUES ('r1', 'train', 'flows.train', 'COMPLETED', 'v100', 1, 'consolidated', "
                "100, 50.0, '2026-01-01 00:00:00')"))
    with Store.open(url) as new:
        assert new.schema_version() == LATEST_VERSION
        [row] = new.stage_history(signature="flows.train")
        assert (row.stage_run_id, row.steps, row.duration_s, row.resumed_from) == ("r1", 100, 50.0, None)
        new.record_stage(stage_run_id="r2", signature="flows.train", steps=40, duration_s=20.0, resumed_from=60)
        assert [h.resumed_from for h in new.stage_history(signature="flows.train")] == [None, 60]


def test_the_default_store_and_its_data_dir_are_private(tmp_path, monkeypatch):
    """Under a 022 umask the predictor store was created 0644 and the data directory 0755, so any user
    of the machine could read the stages' history; a store the user keeps elsewhere keeps its mode."""
    monkeypatch.delenv("QOSFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("QOSFLOW_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o022)
    try:
        home = tmp_path / "xdg" / "qosflow"
        with Store.open():
            assert (home.stat().st_mode & 0o777) == 0o700
            assert ((home / "qosflow.db").stat().st_mode & 0o777) == 0o600
            wal = [home / extra for extra in ("qosflow.db-wal", "qosflow.db-shm") if (home / extra).exists()]
            assert wal and all((f.stat().st_mode & 0o077) == 0 for f in wal)
        shared = tmp_path / "shared.db"
        shared.touch(mode=0o644)
        os.chmod(shared, 0o644)
        with Store.open(f"sqlite:///{shared}"):
            pass
        assert (shared.stat().st_mode & 0o777) == 0o644
    finally:
        os.umask(old)


def _hide_index_while(path, index: str, table: str, other: str, sql: str) -> None:
    """Damage as SQLite's integrity_check reports it ('wrong # of entries in index ...'): run `sql` while
    the index `index` of `table` is declared on the table `other`, so its entries for the new rows are missing."""
    import sqlite3

    c = sqlite3.connect(path)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    orig = c.execute("SELECT sql FROM sqlite_master WHERE name = ?", (index,)).fetchone()[0]
    c.execute("PRAGMA writable_schema=ON")
    c.execute("UPDATE sqlite_master SET tbl_name = ?, sql = ? WHERE name = ?",
              (other, orig.replace(f"ON {table} ", f"ON {other} "), index))
    c.commit()
    c.close()
    c = sqlite3.connect(path)
    c.execute(sql)
    c.commit()
    c.close()
    c = sqlite3.connect(path)
    c.execute("PRAGMA writable_schema=ON")
    c.execute("UPDATE sqlite_master SET tbl_name = ?, sql = ? WHERE name = ?", (table, orig, index))
    c.commit()
    c.close()


def test_a_damaged_database_says_how_to_repair_it(tmp_path):
    """A SQLite file with a damaged index (seen once after many workers and demos shared one qosflow.db:
    'wrong # of entries in index ix_qosflow_worker_presence_pool') gave a raw 'database disk image is
    malformed' traceback at whatever query met it. The error now names the file and how to repair it,
    and the repair it gives mends an index short of entries."""
    import sqlite3
    import subprocess
    import sys

    path = tmp_path / "q.db"
    with Store.open(f"sqlite:///{path}") as store:
        store.add_sample(signature="a", step_time_s=0.1, gpus=1)
    c = sqlite3.connect(path)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page = c.execute("PRAGMA page_size").fetchone()[0]
    root = c.execute("SELECT rootpage FROM sqlite_master WHERE name = 'ix_sample_signature'").fetchone()[0]
    c.close()
    broken = tmp_path / "broken.db"
    broken.write_bytes(path.read_bytes())
    with open(broken, "r+b") as f:  # (a damaged page: no query may read the index)
        f.seek((root - 1) * page)
        f.write(b"\xff" * 64)
    with Store.open(f"sqlite:///{broken}") as store:
        with pytest.raises(QosflowError, match=rf"the qosflow database {broken} is damaged .*malformed.*REINDEX.*mv ") as err:
            store.samples_for("a")
    # the repair the message gives, on the damage seen in the field
    _hide_index_while(path, "ix_sample_signature", "sample", "profile",
                      "INSERT INTO sample (signature, gpu_type, placement, gpus, cross_node, cpu_cores, step_time_s, steps, "
                      "source, created_at) SELECT signature, gpu_type, placement, gpus, cross_node, cpu_cores, 0.2, steps, "
                      "source, created_at FROM sample")
    c = sqlite3.connect(path)
    assert "wrong # of entries in index ix_sample_signature" in str(c.execute("PRAGMA integrity_check").fetchall())
    c.close()
    fix = str(err.value).replace(str(broken), str(path)).split("rebuild its indexes, where such damage usually is: ", 1)[1]
    fix = fix.split(" -- ", 1)[0]
    out = subprocess.run(["bash", "-c", fix.replace("python3", sys.executable, 1)], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", (fix, out.stdout, out.stderr)
    with Store.open(f"sqlite:///{path}") as store:
        assert sorted(s.step_time_s for s in store.samples_for("a")) == [0.1, 0.2]


def test_a_long_read_does_not_hold_up_a_writer(tmp_path):
    """Every transaction of the store began with SQLite's write lock (BEGIN IMMEDIATE), reads too, so while
    one process read (a worker loading every sample at its start, `qosflow predict stages` reading the whole
    history) every writer waited for it. A read transaction now begins deferred: in WAL mode it reads a
    snapshot, and a writer in another process goes on meanwhile. (The read is held open here by hand: the
    store's own reads are one query each, as long as the table is large.)"""
    import threading

    from sqlmodel import Session, select

    SAMPLE = {"signature": "resnet50/bs64", "gpus": 1, "step_time_s": 0.25}
    url = f"sqlite:///{tmp_path / 'q.db'}"
    reader, writer = Store.open(url), Store.open(url)
    reader.add_sample(**SAMPLE)
    writer.engine.dispose()
    writer.engine = sa.create_engine(url, connect_args={"timeout": 2})  # (a writer that gives up after 2 s)
    wrote: list = []

    def write() -> None:
        try:
            wrote.append(writer.add_sample(**SAMPLE))
        except Exception as exc:  # noqa: BLE001 - the old code: 'database is locked' after the timeout
            wrote.append(exc)

    read_engine = getattr(reader, "_reader", reader.engine)
    with Session(read_engine) as s:
        assert len(s.exec(select(Sample)).all()) == 1  # (the read transaction is open from here)
        t = threading.Thread(target=write)
        t.start()
        t.join(20)
        assert wrote and isinstance(wrote[0], int), f"the writer waited for the reader: {wrote}"
        assert len(s.exec(select(Sample)).all()) == 1  # (its snapshot: the new row is not in it)
    assert reader.count() == 2
    reader.close()
    writer.close()


def test_rows_of_values_are_what_the_orm_reads(url):
    """`sample_rows`, `history_rows` and `duration_errors` (what a worker's start and `qosflow predict stages`
    read now: the values of the columns asked for, not SQLAlchemy ORM instances, which were about half of a
    worker's start at 100k stages) give what `samples_for`, `stage_history` and `prediction_errors` give."""
    from qosflow.predict.prediction import Prediction
    from qosflow.store.models import StageHistory
    from qosflow.store.store import SAMPLE_VALUE_COLUMNS

    # every column `validate_sample` checks but created_at (always a valid time when read back)
    assert set(SAMPLE_VALUE_COLUMNS) == {c.name for c in Sample.__table__.c} - {"id", "created_at"}
    with Store.open(url) as store:
        store.add_samples([{"signature": f"net{i % 2}/bs8", "gpus": 1 + i % 3, "step_time_s": 0.1 * (i + 1),
                            "co_runner": "lm/bs20" if i == 3 else None, "cpu_cores": 4 if i % 2 else None,
                            "gpu_type": "a100" if i == 4 else "v100"} for i in range(7)])
        orm = store.samples_for()
        for batch in (2, 7, 20_000):
            rows = list(store.sample_rows(batch=batch))
            assert [tuple(r) for r in rows] == [tuple(getattr(s, c.name) for c in Sample.__table__.c) for s in orm]
        rows = list(store.sample_rows("step_time_s", "co_runner", signature="net1/bs8", since_id=orm[1].id, batch=1))
        assert [(r.id, r.step_time_s, r.co_runner) for r in rows] == [
            (s.id, s.step_time_s, s.co_runner) for s in orm if s.signature == "net1/bs8" and s.id > orm[1].id]
        for i, (state, run) in enumerate((("COMPLETED", "a"), ("FAILED", "b"), ("COMPLETED", "c"))):
            store.record_stage(stage_run_id=run, signature=f"net{i % 2}/bs8", state=state, duration_s=10.0 + i, gpus=2)
            store.record_prediction(Prediction(12.0, 6.0, 24.0, 0, "declared"), signature=f"net{i % 2}/bs8",
                                    target="duration", stage_run_id=run)
            store.record_outcome(run, 11.0 + i, signature=f"net{i % 2}/bs8")
        store.record_prediction(Prediction(1.0, 0.5, 2.0, 3, "samples(n=3)"), signature="net0/bs8",
                                target="solo_step_time", stage_run_id="a")
        cols = [c.name for c in StageHistory.__table__.c]
        runs = store.stage_history()
        assert [tuple(r) for r in store.history_rows(*cols)] == [tuple(getattr(h, c) for c in cols) for h in runs]
        done = store.history_rows("duration_s", state="COMPLETED", signature="net0/bs8")
        assert [(r.id, r.duration_s) for r in done] == [(h.id, h.duration_s) for h in runs
                                                          if h.state == "COMPLETED" and h.signature == "net0/bs8"]
        # by id, a thousand at a time (SQLite's limit on one statement's parameters)
        assert [r.id for r in store.history_rows(ids=[runs[2].id, *range(10_000, 12_500), runs[0].id])] == \
            [runs[0].id, runs[2].id]
        pairs = store.prediction_errors("duration")
        assert [tuple(r) for r in store.duration_errors()] == [
            (p.signature, p.value, p.basis, o.actual) for p, o in pairs]
        assert [tuple(r) for r in store.duration_errors("net1/bs8")] == [
            (p.signature, p.value, p.basis, o.actual) for p, o in pairs if p.signature == "net1/bs8"]


def test_opening_the_store_again_in_a_process_loses_no_write_of_its_other_connections(tmp_path):
    """A worker holds the lease store's connections to a SQLite file and opens the store on the same file again
    (`Store.open`: its check that the file is a database). That check read the file with open() and closed it,
    which drops every POSIX lock the process holds on the file, SQLite's among them; the next other process to
    close its connection (a stage recording its samples) took itself for the last one and deleted the -wal file,
    and the worker's later commits went to the deleted file, lost to everyone else (CI: a released lease still
    seen held a minute later). Here a write after such a re-open must be seen by a new process."""
    import subprocess
    import sys

    from qosflow.store.leases import LeaseStore

    db = tmp_path / "qosflow.db"
    url = f"sqlite:///{db}"
    leases = LeaseStore(url=url)  # this process: a connection stays open in the engine's pool
    leases.claim_name("pool-a", "w#host:1:a", 30.0)
    Store.open(url).close()  # (the worker opens the store too)
    other = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA journal_mode=WAL'); "
             "c.execute('CREATE TABLE IF NOT EXISTS other_process (x)'); c.execute('INSERT INTO other_process VALUES (1)'); "
             "c.commit(); c.close()")
    subprocess.run([sys.executable, "-c", other, str(db)], check=True, timeout=60)
    leases.claim_name("pool-b", "w#host:1:b", 30.0)  # after the other process closed its connection
    seen = subprocess.run([sys.executable, "-c", "import sqlite3, sys; print(sorted(r[0] for r in sqlite3.connect(sys.argv[1])"
                           ".execute('SELECT pool FROM qosflow_worker_presence')))", str(db)],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    assert seen == "['pool-a', 'pool-b']", f"another process sees {seen}: a commit of this process was lost"
    leases.engine.dispose()
