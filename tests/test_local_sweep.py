"""What a local pool's worker leaves on its host is swept, with real processes:

* without a lease store (`QOSFLOW_LEASES=0`) the output file a failed, cancelled or stop-killed local stage leaves in
  `$QOSFLOW_HOME/pipeline-output` (kept for its failure) was never removed: the sweep was the lease store's. The
  worker sweeps them itself now (`QosflowWorker._sweep_output_without_leases`: by age, never a file of a process it
  watches or one a process of the host has open);
* a SIGKILLed worker's `/tmp/qosflow-local-*` work directory (its stages' progress files) was left behind for good:
  a starting worker removes those whose owner process is gone (`sweep_stale_workdirs`), never a live worker's, nor one a
  stage of the dead worker still writes its progress to."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from qosflow.backends.base import LaunchSpec
from qosflow.backends.local import LocalBackend
from qosflow.core.cluster import ClusterSpec
from qosflow.core.placement import Placement

DAY = 86400.0


def _age(path, days: float, now: float) -> str:
    os.utime(path, (now - days * DAY, now - days * DAY))
    return os.path.realpath(path)


def _worker():
    from qosflow.prefect.worker import QosflowWorker

    return QosflowWorker(work_pool_name="local-sweep", name="me", leases=False, create_pool_if_not_found=False)


# ------------------------------------------------------------------------------------------------ output files
def test_without_a_lease_store_the_worker_sweeps_old_output_of_local_stages(tmp_path, monkeypatch):
    """A local stage that failed leaves its output file (kept for its failure). 40 days later, with leases off, the
    worker removes it at its start or a heartbeat (`_adopt_pipelines`), and another old file of the directory; it keeps
    the file of a stage it still runs (quiet for 40 days), one that another process of the host has open, and one
    younger than the retention. (Before, `_adopt_pipelines` returned at once without a lease store: nothing was swept.)"""
    monkeypatch.setenv("QOSFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QOSFLOW_PIPELINE_OUTPUT_MAX_AGE", raising=False)
    out = tmp_path / "home" / "pipeline-output"
    holder = None

    async def go():
        nonlocal holder
        be = LocalBackend(ClusterSpec.uniform(1, 2, virtual=True), stream_output=False, workdir=str(tmp_path / "work"))
        os.makedirs(tmp_path / "work")
        cluster = await be.inventory()
        failed = await be.launch(LaunchSpec("att-failed", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                                            Placement("a", ((0, 0),), ((0, 1.0),)), cluster))
        st = await be.wait(failed)
        assert st.code == 3
        running = await be.launch(LaunchSpec("att-running", [sys.executable, "-c", "import time; time.sleep(600)"],
                                             Placement("b", ((0, 1),), ((0, 1.0),)), cluster))
        now = time.time()
        failed_log = _age(failed.ref["output"], 40, now)
        running_log = _age(running.ref["output"], 40, now)  # (a quiet stage: nothing written for 40 days)
        other_old = out / "att-older.log"
        other_old.write_text("an older failure\n")
        other_old = _age(other_old, 31, now)
        young = out / "att-young.log"
        young.write_text("a failure of last week\n")
        young = _age(young, 7, now)
        held = out / "att-held.log"  # (a process that is no stage of this worker has it open: a pipeline of another)
        with open(held, "ab") as fh:
            holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=fh)
        held = _age(held, 40, now)
        try:
            w = _worker()
            w._backend = be
            w._handles["fr-running"] = running
            assert w.leases is None
            await w._adopt_pipelines()
            gone = {p for p in (failed_log, running_log, other_old, young, held) if not os.path.exists(p)}
            assert gone == {failed_log, other_old}, gone
            # at most every 10 minutes
            again = out / "att-again.log"
            again.write_text("x\n")
            again = _age(again, 40, now)
            await w._adopt_pipelines()
            assert os.path.exists(again)
            w._output_swept_at -= w.OUTPUT_SWEEP_EVERY_S
            await w._adopt_pipelines()
            assert not os.path.exists(again)
            assert os.path.exists(running_log) and os.path.exists(held)
            # `never` keeps them all
            monkeypatch.setenv("QOSFLOW_PIPELINE_OUTPUT_MAX_AGE", "never")
            w._output_swept_at -= w.OUTPUT_SWEEP_EVERY_S
            await w._adopt_pipelines()
            assert os.path.exists(young) and os.path.exists(running_log)
        finally:
            await be.kill(running, grace=0)
            await be.wait(running)
            await be.aclose()
            holder.kill()
            holder.wait()

    asyncio.run(go())


def test_sweep_old_output_spares_kept_and_open_files(tmp_path):
    from qosflow.backends.local import sweep_old_output

    now = time.time()
    a, b, c = (tmp_path / f"{n}.log" for n in "abc")
    for p in (a, b, c):
        p.write_text("x")
        _age(p, 40, now)
    (tmp_path / "d.txt").write_text("not a log")
    _age(tmp_path / "d.txt", 40, now)
    with open(c, "rb"):  # (this process has it open)
        removed = sweep_old_output(str(tmp_path), max_age_s=30 * DAY, keep=[str(b)], now=now)
    assert removed == [os.path.realpath(a)]
    assert sweep_old_output(str(tmp_path), max_age_s=None, now=now) == []
    assert sweep_old_output(str(tmp_path / "none"), max_age_s=DAY, now=now) == []


# ------------------------------------------------------------------------------------------------ work directories
_BACKEND_WORKDIR = r"""
import sys, time
from qosflow.backends.local import LocalBackend
be = LocalBackend()
print(be.progress_file("s1"), flush=True)
time.sleep(600)
"""


def _workdir_of_a_process(tmp_path) -> tuple[subprocess.Popen, str]:
    """A process whose local backend made its work directory in `tmp_path` (TMPDIR), as a worker's does for its
    first stage; the directory."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-c", _BACKEND_WORKDIR], env=env, stdout=subprocess.PIPE, text=True)
    progress = p.stdout.readline().strip()
    d = os.path.dirname(progress)
    assert d.startswith(str(tmp_path)) and os.path.basename(d).startswith(f"qosflow-local-{p.pid}-"), d
    owner = json.loads(open(os.path.join(d, ".owner")).read())
    assert owner["pid"] == p.pid and owner["start"], owner
    return p, d


def test_a_starting_worker_removes_the_workdir_of_a_killed_worker_only(tmp_path, monkeypatch):
    """Worker processes A, B and C each made their work directory; A is SIGKILLed (its `aclose`, which removed it, never
    ran), C too, but a stage C started still runs, its progress file in C's directory. A starting worker removes A's
    directory and one recorded in an earlier boot; it keeps B's (alive: two workers may run on one host), C's (a stage
    of it runs on, adopted or to be adopted, writing its progress there), and one that names no owner (an older
    qosflow's, or one being made)."""
    from qosflow.backends.local import sweep_stale_workdirs

    procs = []
    try:
        a, da = _workdir_of_a_process(tmp_path)
        b, db = _workdir_of_a_process(tmp_path)
        c, dc = _workdir_of_a_process(tmp_path)
        procs += [a, b, c]
        stage = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 env={**os.environ, "QOSFLOW_PROGRESS_FILE": os.path.join(dc, "s1.progress")}, start_new_session=True)
        procs.append(stage)
        for p in (a, c):
            p.send_signal(signal.SIGKILL)
            p.wait()
        legacy = tempfile.mkdtemp(prefix="qosflow-local-", dir=tmp_path)  # (no owner recorded)
        other_boot = tempfile.mkdtemp(prefix=f"qosflow-local-{os.getpid()}-", dir=tmp_path)
        with open(os.path.join(other_boot, ".owner"), "w") as fh:
            json.dump({"pid": os.getpid(), "start": "an-earlier-boot:12345", **_here()}, fh)
        unrelated = tmp_path / "something-else"
        unrelated.mkdir()

        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        removed = asyncio.run(_worker()._sweep_stale_workdirs())
        assert sorted(removed) == sorted([da, other_boot]), removed
        assert not os.path.exists(da) and not os.path.exists(other_boot)
        assert all(os.path.isdir(x) for x in (db, dc, legacy, unrelated))

        # C's stage ends: its directory goes at the next start; B's stays while B runs, goes once B is gone
        stage.kill()
        stage.wait()
        assert sweep_stale_workdirs(str(tmp_path)) == [dc]
        b.send_signal(signal.SIGKILL)
        b.wait()
        assert sweep_stale_workdirs(str(tmp_path)) == [db]
        assert os.path.isdir(legacy)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _here() -> dict:
    import socket

    return {"host": socket.gethostname(), "pidns": os.readlink("/proc/self/ns/pid")}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_starting_worker_leaves_the_workdirs_of_other_containers_and_hosts_sharing_tmp(tmp_path, monkeypatch):
    """A temporary directory can be shared by processes a recorded pid means nothing to: two worker containers with one
    /tmp (a volume, a Kubernetes pod's emptyDir: same host name and boot id, another PID namespace), hosts whose TMPDIR
    is on a shared file system. The other's live worker has a pid that is no process here (or another one): its
    directory was taken for a dead worker's and removed under it (its stages' progress files gone). Only a directory
    whose owner was recorded on this host and in this PID namespace is judged; one recorded here whose owner is gone
    still goes."""
    from qosflow.backends.local import boot_id, sweep_stale_workdirs

    dead = _dead_pid()

    def owned(**owner):
        d = tempfile.mkdtemp(prefix=f"qosflow-local-{dead}-", dir=tmp_path)
        with open(os.path.join(d, ".owner"), "w") as fh:
            json.dump({"pid": dead, "start": f"{boot_id()}:12345", **owner}, fh)
        return d

    other_container = owned(host=_here()["host"], pidns="pid:[4026599999]")
    other_host = owned(host="another-host", pidns=_here()["pidns"])
    ours = owned(**_here())
    assert sweep_stale_workdirs(str(tmp_path)) == [ours]
    assert os.path.isdir(other_container) and os.path.isdir(other_host)


def test_a_backend_that_stops_removes_its_own_workdir(tmp_path, monkeypatch):
    from qosflow.backends.local import sweep_stale_workdirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    be = LocalBackend()
    d = os.path.dirname(be.progress_file("s"))
    assert os.path.basename(d).startswith(f"qosflow-local-{os.getpid()}-") and os.path.exists(os.path.join(d, ".owner"))
    assert sweep_stale_workdirs(str(tmp_path)) == []  # (its owner, this process, runs)
    asyncio.run(be.aclose())
    assert not os.path.exists(d)
