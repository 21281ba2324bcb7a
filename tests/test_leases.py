"""Slot leases: the database constraint that keeps two workers off the same GPU.

The SQLite tests always run; the PostgreSQL ones run when QOSFLOW_TEST_POSTGRES_URL is set, e.g.
`postgresql+psycopg://qosflow:qosflow@127.0.0.1:5432/qosflow_test`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from qosflow.backends.base import LaunchSpec, StageHandle
from qosflow.core.cluster import ClusterSpec
from qosflow.core.placement import Placement
from qosflow.store.leases import LeaseStore, SlotTaken, StageBusy

pytestmark = pytest.mark.timeout(120)

PG_URL = os.environ.get("QOSFLOW_TEST_POSTGRES_URL")
CLUSTER = ClusterSpec.uniform(2, 2, virtual=True, prefix="h")


def spec(job: str, gpus, *, milli: int = 1000, colocated=(), cpusets=None, shareable=False) -> LaunchSpec:
    p = Placement(job, tuple(gpus), ((gpus[0][0], 1.0),), gpu_milli=milli, colocated_with=tuple(colocated), extra={"shareable": shareable})
    return LaunchSpec(job, ["true"], p, CLUSTER, cpusets=cpusets or {})


def _urls():
    yield pytest.param("sqlite", id="sqlite")
    yield pytest.param("postgres", id="postgres", marks=[pytest.mark.postgres, pytest.mark.skipif(not PG_URL, reason="QOSFLOW_TEST_POSTGRES_URL is not set")])


@pytest.fixture(params=list(_urls()))
def db_url(request, tmp_path):
    return f"sqlite:///{tmp_path / 'leases.db'}" if request.param == "sqlite" else PG_URL


@pytest.fixture
def pool(db_url):
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    store = LeaseStore(url=db_url)
    for le in store.leases(name):
        store.release(le.lease_id)
    store.engine.dispose()


def test_exclusive_gang_is_all_or_nothing(db_url, pool):
    st = LeaseStore(url=db_url)
    a = st.acquire(pool, "a", spec("a", [(0, 0)]), holder="w1")
    with pytest.raises(SlotTaken, match=r"h0/gpu0:u\d\d held by w1"):
        st.acquire(pool, "b", spec("b", [(0, 1), (0, 0)]), holder="w2")
    # the gang booked nothing: GPU 0/1 is still free
    assert {r[0] + "/" + r[1].split(":")[0] for r in st.booked(pool)} == {"h0/gpu0"}
    st.acquire(pool, "c", spec("c", [(0, 1), (1, 0), (1, 1)]), holder="w2")
    st.release(a.lease_id)
    st.acquire(pool, "b", spec("b", [(0, 0)]), holder="w2")
    assert len(st.leases(pool)) == 2 and len(st.leases(pool, holder="w2")) == 2


def test_stage_never_has_two_live_attempts(db_url, pool):
    st = LeaseStore(url=db_url)
    st.acquire(pool, "train", spec("train-r0", [(0, 0)]), holder="w1")
    with pytest.raises(StageBusy, match="must not run twice"):
        st.acquire(pool, "train", spec("train-r1", [(1, 0)]), holder="w2")
    assert st.booked(pool) and all(r[0] == "h0" for r in st.booked(pool))


def test_sharing_rules(db_url, pool):
    st = LeaseStore(url=db_url)
    st.acquire(pool, "x", spec("x", [(0, 0)], shareable=True), holder="w1")
    st.acquire(pool, "y", spec("y", [(0, 0)], colocated=["x"]), holder="w1")  # at most two share a GPU
    with pytest.raises(SlotTaken):
        st.acquire(pool, "z", spec("z", [(0, 0)], colocated=["x"]), holder="w2")
    with pytest.raises(SlotTaken):
        st.acquire(pool, "e", spec("e", [(0, 0)]), holder="w2")  # exclusive on a shared GPU
    # fractional shares fill a GPU up to 1000 milli
    for i, m in enumerate([500, 250, 250]):
        st.acquire(pool, f"f{i}", spec(f"f{i}", [(1, 1)], milli=m), holder="w1")
    with pytest.raises(SlotTaken):
        st.acquire(pool, "f3", spec("f3", [(1, 1)], milli=50), holder="w2")


def test_cpu_cores_are_leased_too(db_url, pool):
    st = LeaseStore(url=db_url)
    st.acquire(pool, "a", spec("a", [(0, 0)], cpusets={0: [0, 1]}), holder="w1")
    with pytest.raises(SlotTaken, match="cpu1"):
        st.acquire(pool, "b", spec("b", [(0, 1)], cpusets={0: [1, 2]}), holder="w2")


class _Backend:
    """A backend stub that still runs one of two stages."""

    name = "stub"

    def __init__(self, alive: set[str]):
        self.alive = alive

    async def adopt(self, stage_id, hosts):
        return StageHandle(stage_id, "stub", hosts[0], {"adopted": True}) if stage_id in self.alive else None


def test_restart_recovers_from_leases(db_url, pool):
    """A crashed worker's expired leases: the live stage is adopted (not relaunched), the dead one freed."""
    st = LeaseStore(url=db_url)
    st.acquire(pool, "live", spec("live-a1", [(0, 0)]), holder="dead-worker", ttl_s=-1, backend="stub")
    st.acquire(pool, "gone", spec("gone-a1", [(1, 0)]), holder="dead-worker", ttl_s=-1, backend="stub")
    st.acquire(pool, "other", spec("other-a1", [(1, 1)]), holder="live-worker", ttl_s=60, backend="stub")
    got = asyncio.run(st.recover(_Backend({"live-a1"}), pool, "new-worker"))
    by = {le.stage_key: h for le, h in got}
    assert set(by) == {"live", "gone"}  # the live worker's lease is left alone
    assert by["live"] is not None and by["live"].ref == {"adopted": True} and by["gone"] is None
    left = {le.stage_key: le.holder for le in st.leases(pool)}
    assert left == {"live": "new-worker", "other": "live-worker"}
    # a second recovering worker finds nothing to take
    assert asyncio.run(st.recover(_Backend({"live-a1"}), pool, "third-worker")) == []


WORKER = textwrap.dedent(
    """
    import json, os, random, sys, time
    from qosflow.backends.base import LaunchSpec
    from qosflow.core.cluster import ClusterSpec
    from qosflow.core.placement import Placement
    from qosflow.store.leases import LeaseStore, LeaseError
    url, pool, name, n, seed, gate = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    rnd = random.Random(seed)
    cluster = ClusterSpec.uniform(2, 2, virtual=True, prefix="h")
    st = LeaseStore(url=url)
    st.leases(pool)  # connected
    open(f"{gate}.{name}", "w").close()  # ready: both start their loops together
    end = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < end:
        time.sleep(0.005)
    held, conflicts = [], 0
    for i in range(n):
        k = rnd.choice([1, 1, 2])
        gpus = rnd.sample([(0, 0), (0, 1), (1, 0), (1, 1)], k)
        p = Placement(f"{name}-{i}", tuple(gpus), ((gpus[0][0], 1.0),))
        try:
            lease = st.acquire(pool, f"{name}-{i}", LaunchSpec(p.job_id, ["true"], p, cluster), holder=name)
        except LeaseError:
            conflicts += 1
            continue
        t0 = time.time()
        time.sleep(rnd.uniform(0.001, 0.01))
        t1 = time.time()
        st.release(lease.lease_id)
        held.append({"gpus": gpus, "t0": t0, "t1": t1})
    print(json.dumps({"held": held, "conflicts": conflicts}))
    """
)


def test_two_workers_never_double_book(db_url, pool, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    LeaseStore(url=db_url).engine.dispose()  # create tables before the race
    gate = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, str(script), db_url, pool, f"w{i}", "150", str(i), str(gate)], stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    # both loops start together: on a loaded machine one process's start-up (imports, connecting) could
    # take longer than the other's whole loop, and nothing was contended
    end = time.monotonic() + 60
    while not all(os.path.exists(f"{gate}.w{i}") for i in range(2)):
        assert time.monotonic() < end and all(p.poll() is None for p in procs), "the workers did not start"
        time.sleep(0.01)
    gate.touch()
    outs = [json.loads(p.communicate(timeout=100)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(o["held"] for o in outs), "each worker booked something"
    assert sum(o["conflicts"] for o in outs) > 0, "the workers really contended"
    intervals: dict[tuple, list[tuple[float, float, int]]] = {}
    for w, o in enumerate(outs):
        for h in o["held"]:
            for g in h["gpus"]:
                intervals.setdefault(tuple(g), []).append((h["t0"], h["t1"], w))
    for g, iv in intervals.items():
        iv.sort()
        for (a0, a1, wa), (b0, b1, wb) in zip(iv, iv[1:]):
            assert b0 >= a1, f"GPU {g} double-booked by workers {wa} and {wb}"
    assert LeaseStore(url=db_url).booked(pool) == []


def test_a_second_live_worker_of_the_same_name_is_refused_and_cannot_take_its_leases(db_url, pool):
    """Two processes with one worker name: the second is refused while the first is live (it used to
    adopt the first's leases at once, and both re-planned 'slot already leased ... held by w1' every
    60 ms). Holder ids carry the process, so even two that raced past the check hold distinct leases;
    once the first stops, a worker of its name adopts its leases at once (restarts stay immediate)."""
    import subprocess

    from qosflow.store.leases import WorkerNameTaken, holder_id, holder_name

    st = LeaseStore(url=db_url)
    h1, h2 = holder_id("w1"), holder_id("w1")
    assert h1 != h2 and holder_name(h1) == holder_name(h2) == "w1"
    st.claim_name(pool, h1, 30.0)
    with pytest.raises(WorkerNameTaken, match=r"a worker named 'w1' is already running on pool .*another --name, or stop that one"):
        st.claim_name(pool, h2, 30.0)
    st.claim_name(pool, holder_id("w2"), 30.0)  # another name is fine
    a = st.acquire(pool, "a", spec("a", [(0, 0)]), holder=h1)

    class B:
        name = "local"

    # a live same-name process (raced past the check) does not take h1's live lease
    assert asyncio.run(st.recover(B(), pool, h2, 30.0)) == []
    assert [le.holder for le in st.leases(pool)] == [h1]
    # h1 stops (its presence goes): its name's next process adopts its lease at once, not after the TTL
    st.leave(h1)
    st.claim_name(pool, h2, 30.0)
    got = asyncio.run(st.recover(B(), pool, h2, 30.0))
    assert [le.lease_id for le, _ in got] == [a.lease_id]
    # a process that died without a word (its pid is gone on this host) frees its name too
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    import socket

    dead = f"w3#{socket.gethostname()}:{p.pid}:abcdef"
    st.claim_name(pool, dead, 30.0)
    st.claim_name(pool, holder_id("w3"), 30.0)  # not refused: the holder's process is gone
    # a bare-name holder (a store written before holder ids) stays its name's to adopt, as before
    st.acquire(pool, "b", spec("b", [(1, 0)]), holder="w4")
    got = asyncio.run(st.recover(B(), pool, holder_id("w4"), 30.0))
    assert [le.stage_key for le, _ in got] == ["b"]


def test_leases_are_keyed_by_the_prefect_server_and_the_pool(db_url, pool):
    """One store (the user's data dir) serves every Prefect server used on the machine: a staging and
    a production pool `gpu` must not see, book against nor recover each other's leases (they were keyed
    by the pool's name alone). A store of the old layout keeps working: a worker's own bare-name leases
    move to the new key (`rekey`), another holder's are left alone."""
    from qosflow.store.leases import holder_id, pool_key

    staging, prod = pool_key(pool, "http://staging:4200/api"), pool_key(pool, "http://prod:4200/api/")
    assert staging != prod and pool_key(pool, "http://PROD:4200/api") == prod  # (trailing slash, case: one server)
    st = LeaseStore(url=db_url)
    a = st.acquire(staging, "a", spec("a", [(0, 0)]), holder=holder_id("w1"))
    b = st.acquire(prod, "b", spec("b", [(0, 0)]), holder=holder_id("w1"))  # the same GPU name on another server's cluster
    assert [le.lease_id for le in st.leases(staging)] == [a.lease_id] and [le.lease_id for le in st.leases(prod)] == [b.lease_id]

    class B:
        name = "local"

    st.renew_lease(a.lease_id, -1.0)  # staging's lease expired: production's worker does not take it
    assert asyncio.run(st.recover(B(), prod, holder_id("w9"), 30.0)) == []
    # old layout: keyed by the bare pool name
    old_mine = st.acquire(pool, "c", spec("c", [(1, 0)]), holder="w1")
    old_other = st.acquire(pool, "d", spec("d", [(1, 1)]), holder="w2")
    assert st.rekey(pool, prod, "w1") == 1
    assert {le.lease_id for le in st.leases(prod)} == {b.lease_id, old_mine.lease_id}
    assert [le.lease_id for le in st.leases(pool)] == [old_other.lease_id]
    with pytest.raises(SlotTaken):  # its slots moved with it
        st.acquire(prod, "e", spec("e", [(1, 0)]), holder="w3")
    for k in (staging, prod):
        for le in st.leases(k):
            st.release(le.lease_id)


def test_the_sqlite_lease_database_is_private_to_its_user(tmp_path, caplog):
    """The lease store holds the stages' commands, and whoever may write it frees or books slots: it was
    created 0644 (under the usual umask 022), readable by every user of the machine. A database file
    qosflow creates is 0600 (SQLite gives its -wal and -shm files the same mode), the directories it
    creates for it 0700; a file that exists already keeps its mode, with a warning."""
    import logging
    import stat

    old = os.umask(0o022)
    try:
        path = tmp_path / "home" / "sub" / "leases.db"
        st = LeaseStore(url=f"sqlite:///{path}")
        st.acquire("p", "a", spec("a", [(0, 0)]), holder="w1")
        with st.engine.connect() as conn:  # (a connection open: the -wal and -shm files are there)
            conn.exec_driver_sql("SELECT 1")
            files = [path, path.with_name("leases.db-wal"), path.with_name("leases.db-shm")]
            assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o600 for f in files}
        st.engine.dispose()
        assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o700
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

        shared = tmp_path / "shared.db"
        LeaseStore(url=f"sqlite:///{shared}").engine.dispose()
        shared.chmod(0o664)  # the user's own choice: left as it is, and said
        with caplog.at_level(logging.WARNING, logger="qosflow.leases"):
            LeaseStore(url=f"sqlite:///{shared}").engine.dispose()
        assert stat.S_IMODE(shared.stat().st_mode) == 0o664
        assert "writable by other users" in caplog.text and f"chmod 600 {shared}" in caplog.text
    finally:
        os.umask(old)


def test_a_lease_database_that_cannot_be_opened_fails_at_once(tmp_path):
    """LeaseStore swallowed every error of its table creation (meant for a concurrent creator's race):
    a database SQLite cannot open made a store whose every booking then failed 'could not book stage
    ... after 5 tries (heavy contention)', the cause lost."""
    from sqlalchemy.exc import OperationalError

    with pytest.raises(OperationalError, match="unable to open database file"):
        LeaseStore(url=f"sqlite:///{tmp_path}")  # a directory


def test_a_damaged_lease_database_names_the_file_and_the_repair(tmp_path):
    """'database disk image is malformed' (seen once in the presence table's index, after many workers
    and demos shared one qosflow.db) stopped `qosflow worker start` with a raw traceback."""
    import sqlite3

    from qosflow.errors import QosflowError

    path = tmp_path / "leases.db"
    store = LeaseStore(url=f"sqlite:///{path}")
    store.claim_name("p", "w#host:1:abc", 30.0)
    store.engine.dispose()
    c = sqlite3.connect(path)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page = c.execute("PRAGMA page_size").fetchone()[0]
    root = c.execute("SELECT rootpage FROM sqlite_master WHERE name = 'ix_qosflow_worker_presence_pool'").fetchone()[0]
    c.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xff" * 64)
    store = LeaseStore(url=f"sqlite:///{path}")
    with pytest.raises(QosflowError, match=rf"the qosflow database {path} is damaged .*REINDEX"):
        store.live_workers("p")
    store.engine.dispose()
