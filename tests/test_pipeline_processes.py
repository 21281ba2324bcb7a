"""Pipeline processes that outlive their worker (pools whose stages run on host agents or Kubernetes): the
local backend's `keep_unplaced`, adoption by pid and start time, cancellation of an adopted one, and the lease
store's record of them. Real processes, no Prefect server (tests/test_worker_restart.py runs the whole restart
against one)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive

from qosflow.backends.local import LocalBackend, process_start

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_process_start_tells_a_process_from_another_with_its_pid():
    p = subprocess.Popen(SLEEP)
    try:
        start = process_start(p.pid)
        assert start and start == process_start(p.pid)
        assert start.split(":")[0] == open("/proc/sys/kernel/random/boot_id").read().strip()
        time.sleep(0.05)  # (a tick is 10 ms: two processes started in one tick have the same start time, but not the same pid;
        q = subprocess.Popen(SLEEP)  # one that gets a pid again is started after the whole pid space wrapped around)
        try:
            assert process_start(q.pid) != start
        finally:
            q.kill()
            q.wait()
    finally:
        p.kill()
        p.wait()
    assert process_start(p.pid) is None  # (gone)


def test_a_kept_pipeline_outlives_the_backend_and_a_local_pools_does_not(tmp_path):
    """keep_unplaced (agents, Kubernetes): aclose leaves the pipeline running, in its own session, its output in a
    file. The local backend's own pipeline runs still end with it ("no stage may outlive its worker")."""

    async def go(keep: bool) -> dict:
        be = LocalBackend(keep_unplaced=keep, output_dir=str(tmp_path), stream_output=False)
        h = await be.launch_unplaced("fr-1", [sys.executable, "-c", "print('hello', flush=True); import time; time.sleep(600)"], {})
        await asyncio.sleep(1.0)
        await be.aclose(grace=0.2)
        return h.ref

    ref = asyncio.run(go(True))
    pid = ref["pid"]
    try:
        assert alive(pid) and process_start(pid) == ref["start"]
        assert os.getsid(pid) == pid  # (a session of its own: a signal to the worker's group does not reach it)
        assert ref["output"] == str(tmp_path / "fr-1.log") and open(ref["output"]).read() == "hello\n"
    finally:
        os.killpg(pid, signal.SIGKILL)
    ref = asyncio.run(go(False))
    assert _gone(ref["pid"]) and "start" not in ref


def test_adoption_guards_against_a_reused_pid_and_waits_on_a_process_that_is_not_its_child(tmp_path):
    """A later worker adopts a pipeline process by its pid and the start time recorded at its launch: a pid that
    another process has now is not taken for it, and the adopted one (not its child) is watched by polling."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"], start_new_session=True)
    start = process_start(p.pid)

    async def go():
        be = LocalBackend(keep_unplaced=True, output_dir=str(tmp_path), stream_output=False)
        be.POLL_S = 0.1
        assert be.adopt_unplaced("fr-x", p.pid, "another-boot:123") is None  # (its pid, another process)
        assert be.adopt_unplaced("fr-x", p.pid, None) is None
        h = be.adopt_unplaced("fr-x", p.pid, start)
        assert h is not None and h.ref["adopted"]
        t0 = time.monotonic()
        status = await asyncio.wait_for(be.wait(h), 30)
        # (a zombie of the test, its parent, counts as ended: `process_start` says None)
        return status, time.monotonic() - t0

    try:
        status, took = asyncio.run(go())
    finally:
        p.wait()
    assert status.code is None and "exit status is unknown" in status.reason
    assert took < 10


def test_kill_infrastructure_stops_an_adopted_pipeline(tmp_path):
    """Cancelling a pipeline run (Prefect's kill_infrastructure with the run's infrastructure pid, or the worker's
    cancellation watch) stops an adopted pipeline process, which is not the worker's child."""
    from qosflow.prefect.worker import QosflowJobConfiguration, QosflowWorker

    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "open(sys.argv[1], 'w').close(); time.sleep(600)", str(ready)],
                         start_new_session=True)  # (ignores SIGTERM: killed after the grace)
    end = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < end
        time.sleep(0.05)

    async def go():
        w = QosflowWorker(work_pool_name="adopt-kill", leases=False, create_pool_if_not_found=False)
        be = w._pipelines_here = LocalBackend(keep_unplaced=True, output_dir=str(tmp_path), stream_output=False)
        h = be.adopt_unplaced("fr-k", p.pid, process_start(p.pid))
        w._pipeline_runs_here.add("fr-k")
        w._register("fr-k", h)
        waiter = asyncio.ensure_future(be.wait(h))
        await w.kill_infrastructure(str(p.pid), QosflowJobConfiguration(role="pipeline"))
        return await asyncio.wait_for(waiter, 30)

    t0 = time.monotonic()
    try:
        status = asyncio.run(go())
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert status.kind.value == "cancelled" and p.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 20


def test_an_older_lease_database_gains_the_pipeline_table(tmp_path):
    """A lease store written before pipeline processes were recorded (its three tables only) keeps working and
    gets the new table when a worker opens it."""
    import sqlalchemy as sa
    from sqlmodel import SQLModel

    from qosflow.store.leases import LeaseStore, SlotLeaseRow, StageLeaseRow, WorkerPresenceRow

    url = f"sqlite:///{tmp_path / 'old.db'}"
    eng = sa.create_engine(url)
    with eng.begin() as conn:
        SQLModel.metadata.create_all(conn, tables=[StageLeaseRow.__table__, SlotLeaseRow.__table__, WorkerPresenceRow.__table__])
        conn.execute(sa.text("INSERT INTO qosflow_worker_presence VALUES ('w#h:1:aa', 'p@1', 'w', 'h', 1, 0, 0)"))
    eng.dispose()
    store = LeaseStore(url=url)
    assert sa.inspect(store.engine).has_table("qosflow_pipeline_process")
    assert len(store.leases("p@1")) == 0  # (its tables are read as before)
    store.record_pipeline("p@1", "fr", "w#h:2:bb", 42, "boot:7", "/x.log", stream=False)
    [row] = store.pipeline_processes("p@1", "w")
    assert (row.pid, row.start, row.output, row.holder, row.stream) == (42, "boot:7", "/x.log", "w#h:2:bb", False)
    assert store.take_pipeline("fr", "w#h:2:bb", "w#h:3:cc") and not store.take_pipeline("fr", "w#h:2:bb", "w#h:4:dd")
    store.forget_pipeline("fr")
    assert store.pipeline_processes("p@1") == []


def test_kill_infrastructure_leaves_a_process_that_does_not_run_the_flow_run_alone():
    """kill_infrastructure with a pid that the worker does not watch killed whatever process had that pid: after a
    restart, the flow run's process may have ended and its pid be another process's. It is killed only if its
    environment names the flow run."""
    from prefect.exceptions import InfrastructureNotFound

    from qosflow.prefect.worker import QosflowJobConfiguration, QosflowWorker

    other = subprocess.Popen(SLEEP, start_new_session=True)
    mine = subprocess.Popen(SLEEP, start_new_session=True, env={**os.environ, "PREFECT__FLOW_RUN_ID": "fr-mine"})
    try:
        # Popen returns once the child's execve has closed its close-on-exec pipe, which is before the kernel has
        # set up the new program's argument and environment area: /proc/PID/environ may read empty for a moment.
        # A process the worker meets after a restart has run for long; wait until both have started their program.
        for p in (other, mine):
            deadline = time.monotonic() + 10
            while b"time.sleep(600)" not in Path(f"/proc/{p.pid}/cmdline").read_bytes():
                assert time.monotonic() < deadline, "the test's sleep process did not start"
                time.sleep(0.01)
        w = QosflowWorker(work_pool_name="kill-guard", leases=False, create_pool_if_not_found=False)
        cfg = QosflowJobConfiguration(role="pipeline", env={"PREFECT__FLOW_RUN_ID": "fr-mine"})
        with pytest.raises(InfrastructureNotFound, match="does not run flow run fr-mine"):
            asyncio.run(w.kill_infrastructure(str(other.pid), cfg))
        assert other.poll() is None
        asyncio.run(w.kill_infrastructure(str(mine.pid), cfg))
        assert mine.wait(10) == -signal.SIGTERM
    finally:
        for p in (other, mine):
            if p.poll() is None:
                p.kill()
            p.wait()


def _log(d, fid: str, age_s: float, now: float) -> str:
    p = d / f"{fid}.log"
    p.write_text(f"output of {fid}\n")
    os.utime(p, (now - age_s, now - age_s))
    return str(p)


def test_the_sweep_removes_old_pipeline_output_but_never_that_of_a_running_or_recorded_process(tmp_path):
    """`pipeline-output/<run>.log` files were never removed (the worker removes a completed run's at once, a failed,
    crashed or cancelled run's never). `LeaseStore.sweep_pipeline_output` removes those last written longer ago
    than the retention, and keeps a recent one, that of a process recorded in the lease store (running, or ended
    and not yet dealt with by a worker) and that of a process which has it open (a quiet pipeline, recorded or not)."""
    from qosflow.store.leases import LeaseStore

    store = LeaseStore(url=f"sqlite:///{tmp_path / 'leases.db'}")
    d = tmp_path / "pipeline-output"
    d.mkdir()
    now = time.time()
    day = 86400.0
    old = _log(d, "fr-failed-long-ago", 40 * day, now)
    recent = _log(d, "fr-failed-yesterday", 1 * day, now)
    recorded = _log(d, "fr-recorded", 40 * day, now)  # (recorded as running: its process ended, no worker saw it yet)
    moved = _log(d, "fr-moved", 40 * day, now)  # (recorded by its path, under another flow run id)
    running = _log(d, "fr-running-unrecorded", 40 * day, now)
    not_a_log = d / "notes.txt"
    not_a_log.write_text("x")
    os.utime(not_a_log, (now - 40 * day, now - 40 * day))
    store.record_pipeline("p@1", "fr-recorded", "w#h:1:aa", 1, "boot:1", recorded)
    store.record_pipeline("p@1", "fr-other-name", "w#h:1:aa", 1, "boot:1", moved)
    with open(running, "ab") as out:  # a pipeline still running whose record could not be written: its log is open
        p = subprocess.Popen(SLEEP, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    os.utime(running, (now - 40 * day, now - 40 * day))
    try:
        removed = store.sweep_pipeline_output(d, max_age_s=30 * day, now=now)
        assert removed == [os.path.realpath(old)], removed
        assert not os.path.exists(old)
        for kept in (recent, recorded, moved, running, str(not_a_log)):
            assert os.path.exists(kept), kept
        assert store.sweep_pipeline_output(d, max_age_s=0.5 * day, now=now + 60) == []  # (at most every 10 min)
        assert store.sweep_pipeline_output(d, max_age_s=0.5 * day, now=now + 700) == [os.path.realpath(recent)]
    finally:
        p.kill()
        p.wait()
    store.forget_pipeline("fr-recorded")  # (a worker dealt with it; the other process has ended)
    removed = store.sweep_pipeline_output(d, max_age_s=30 * day, now=now, every_s=0)
    assert sorted(removed) == sorted(os.path.realpath(x) for x in (recorded, running)), removed
    assert os.path.exists(moved) and not_a_log.exists()
    assert store.sweep_pipeline_output(tmp_path / "none", max_age_s=day, every_s=0) == []  # (no directory: nothing made)
    assert not (tmp_path / "none").exists()
    store.engine.dispose()


def test_the_retention_of_pipeline_output_is_set_by_an_environment_variable(tmp_path, monkeypatch):
    """QOSFLOW_PIPELINE_OUTPUT_MAX_AGE: an age as `qosflow predict prune --older-than` takes it (default 30d), or
    never; a bad value is an error naming the variable."""
    from qosflow.errors import QosflowError
    from qosflow.store.leases import LeaseStore, pipeline_output_max_age

    assert pipeline_output_max_age() == 30 * 86400
    store = LeaseStore(url=f"sqlite:///{tmp_path / 'leases.db'}")
    d = tmp_path / "out"
    d.mkdir()
    now = time.time()
    ten_days = _log(d, "fr-10d", 10 * 86400, now)
    assert store.sweep_pipeline_output(d, every_s=0) == []  # (30 days)
    monkeypatch.setenv("QOSFLOW_PIPELINE_OUTPUT_MAX_AGE", "never")
    assert pipeline_output_max_age() is None and store.sweep_pipeline_output(d, every_s=0) == []
    monkeypatch.setenv("QOSFLOW_PIPELINE_OUTPUT_MAX_AGE", "1w")
    assert store.sweep_pipeline_output(d, every_s=0) == [os.path.realpath(ten_days)]
    for bad in ("7", "-3d", "10min"):
        monkeypatch.setenv("QOSFLOW_PIPELINE_OUTPUT_MAX_AGE", bad)
        with pytest.raises(QosflowError, match=f"environment variable QOSFLOW_PIPELINE_OUTPUT_MAX_AGE='{bad}': .*unset it for the default"):
            pipeline_output_max_age()
    store.engine.dispose()


def test_the_worker_sweeps_pipeline_output_and_a_kept_log_counts_from_its_run_s_end(tmp_path, monkeypatch):
    """The worker calls the sweep where it looks for pipelines to adopt (at its start and at heartbeats), and a
    failed run's log it keeps is touched then: a pipeline quiet for weeks that then failed keeps its log for
    the whole retention from its end, not from its last line."""
    from qosflow.prefect.worker import QosflowWorker
    from qosflow.store.leases import LeaseStore

    monkeypatch.setenv("QOSFLOW_HOME", str(tmp_path / "home"))
    d = tmp_path / "home" / "pipeline-output"
    d.mkdir(parents=True)
    now = time.time()
    old = _log(d, "fr-old-failure", 40 * 86400, now)
    quiet = _log(d, "fr-quiet-then-failed", 40 * 86400, now)

    async def go():
        w = QosflowWorker(work_pool_name="sweep-test", name="me", leases=False, create_pool_if_not_found=False)
        w.leases = LeaseStore(url=f"sqlite:///{tmp_path / 'leases.db'}")
        w.leases.record_pipeline(w._pool_key, "fr-quiet-then-failed", "me#h:1:aa", 1, "boot:1", quiet)
        await w._forget_pipeline("fr-quiet-then-failed", None, remove_output=False, output=quiet)
        await w._adopt_pipelines()
        w.leases.engine.dispose()

    asyncio.run(go())
    assert not os.path.exists(old)
    assert os.path.exists(quiet) and os.stat(quiet).st_mtime > now - 60
