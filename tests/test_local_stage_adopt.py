"""A local pool's stage process outlives a worker that is killed, and the worker restarted under its name adopts it
(tests/test_journey_prefect_local_restart.py does it against a real Prefect server and worker processes). Here, without
a server: what the local backend records at a stage's launch (pid, start time, output file), where the stage's output
goes, and which recorded processes the worker adopts (`QosflowWorker._take_back_local`: the very process, never another
that got its pid since) and how it settles one that ended (`_settle_adopted_local`)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from procs import alive

from qosflow.backends.base import ExitKind, ExitStatus, LaunchSpec, StageHandle
from qosflow.backends.local import LocalBackend, process_start
from qosflow.core.cluster import ClusterSpec
from qosflow.core.placement import Placement
from qosflow.prefect.worker import QosflowWorker

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_local_stage_writes_to_its_output_file_and_its_handle_records_its_process(tmp_path, capfd):
    """The stage's output goes to a file (the worker's stdout may be gone while it runs on after a SIGKILL of the worker),
    copied to the worker's stdout while it is watched (`stream_output`); its handle, which the worker stores in the
    stage's lease, has its pid, start time and output file. Before, it wrote to the worker's stdout and its handle had
    only its pid, so a restarted worker could not tell it from another process that got the pid."""

    async def go():
        be = LocalBackend(ClusterSpec.uniform(1, 1, virtual=True), stream_output=True, output_dir=str(tmp_path))
        cluster = await be.inventory()
        p = Placement("s1", ((0, 0),), ((0, 1.0),))
        h = await be.launch(LaunchSpec("s1", [sys.executable, "-c", "import os; print('stage says hello', os.getsid(0) == os.getpid())"],
                                       p, cluster))
        ref = dict(h.ref)
        start = process_start(ref["pid"])
        st = await be.wait(h)
        await asyncio.sleep(0.1)  # (the tail copies the rest as it ends)
        await be.aclose()
        return st, ref, start

    st, ref, start = asyncio.run(go())
    assert st.ok
    assert ref["start"] and (start is None or ref["start"] == start)
    assert ref["output"] == str(tmp_path / "s1.log") and ref["progress"].endswith("s1.progress") and ref["stream"] is True
    assert (tmp_path / "s1.log").read_text() == "stage says hello True\n"  # (its own session)
    assert "stage says hello True" in capfd.readouterr().out  # (copied to the worker's stdout)


def _worker(backend, released: list) -> SimpleNamespace:
    return SimpleNamespace(_backend=backend, leases=SimpleNamespace(release=released.append))


def _lease(attempt: str, pid: int, start: str | None) -> tuple[SimpleNamespace, StageHandle]:
    lease = SimpleNamespace(lease_id="L1", stage_key="fr-1", attempt_id=attempt, nodes=["host0"])
    ref = {"pid": pid, "start": start, "output": None, "cpus": [0], "progress": "/nonexistent/fr-1.progress", "stream": False}
    return lease, StageHandle(attempt, "local", "host0", ref=ref)


def test_the_restarted_worker_adopts_the_recorded_process_and_never_another_with_its_pid(tmp_path):
    """The lease's process runs with the start time recorded at its launch: adopted (watched, not killed, its lease kept).
    A live process with that pid but another start time (the pid was reused while no worker ran) is not it: not adopted
    and not killed; the stage's lease is released (its run goes back to the queue). An early check is never adopted (it
    would run on one GPU for good): stopped."""
    p = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        start = process_start(p.pid)
        assert start

        async def go(attempt: str, rec_start: str | None):
            be = LocalBackend(stream_output=False, output_dir=str(tmp_path))
            released: list = []
            lease, handle = _lease(attempt, p.pid, rec_start)
            got = await QosflowWorker._take_back_local(_worker(be, released), lease, handle)
            return got, released, be

        (h, stopped), released, be = asyncio.run(go("fr-1", start))
        assert h is not None and stopped is None and released == []
        assert h.ref["pid"] == p.pid and h.ref["adopted"] and h.ref["cpus"] == [0] and h.node == "host0"
        assert "fr-1" in be._detached and alive(p.pid)

        reused = start.split(":")[0] + ":1"  # (the same boot, another start: another process)
        (h, stopped), released, _ = asyncio.run(go("fr-1", reused))
        assert h is None and stopped is None and released == ["L1"]
        time.sleep(0.2)
        assert alive(p.pid)  # (not killed: it is not the stage's)

        (h, stopped), released, _ = asyncio.run(go("fr-1-check", start))
        assert h is None and stopped == p.pid and released == ["L1"]
        assert p.wait(10) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_an_adopted_local_stage_that_ended_is_settled_by_its_flow_runs_state(tmp_path):
    """An adopted stage is not the worker's child: its exit status is unknown. Its flow run reported its end (Completed):
    nothing is rescheduled nor marked, and its output file goes. Its process ended without a report (killed): its run
    goes back to the queue, and its output file is kept."""
    from prefect.states import Completed, Running

    def run(state):
        out = tmp_path / "fr-1.log"
        out.write_text("x")
        progress = tmp_path / "fr-1.progress"
        progress.write_text("{}")
        rescheduled: list = []

        async def flow_run(fid):
            return SimpleNamespace(state=state)

        async def reschedule(fid, msg):
            rescheduled.append(msg)

        w = SimpleNamespace(_flow_run=flow_run, _reschedule=reschedule, _logger=SimpleNamespace(info=lambda *a: None))
        h = StageHandle("fr-1", "local", "host0", ref={"pid": 4242, "adopted": True, "output": str(out), "progress": str(progress)})
        status = ExitStatus(ExitKind.INFRA, None, "ended (a process of an earlier worker: its exit status is unknown)")
        asyncio.run(QosflowWorker._settle_adopted_local(w, "fr-1", h, status))
        return rescheduled, out.exists(), progress.exists()

    assert run(Completed()) == ([], False, False)
    t = time.monotonic()
    rescheduled, kept, progress = run(Running())
    assert len(rescheduled) == 1 and "process 4242" in rescheduled[0] and kept and not progress
    assert time.monotonic() - t < 10


def test_a_stage_run_again_copies_only_its_own_output_to_the_workers_stdout(tmp_path, capfd):
    """A stage run again under the same attempt id (its run put back in the queue: a stop of its worker, a process that died
    while no worker ran) appends to the output file its failed attempt left (kept for that failure); the worker's stdout gets
    what the new process writes, not the earlier attempt's output again (the tail started at the file's start)."""

    async def go():
        be = LocalBackend(ClusterSpec.uniform(1, 1, virtual=True), stream_output=True, output_dir=str(tmp_path))
        cluster = await be.inventory()
        (tmp_path / "s1.log").write_text("output of the earlier attempt\n")
        h = await be.launch(LaunchSpec("s1", [sys.executable, "-c", "print('output of this attempt')"],
                                       Placement("s1", ((0, 0),), ((0, 1.0),)), cluster))
        st = await be.wait(h)
        await asyncio.sleep(0.2)  # (the tail copies the rest as it ends)
        await be.aclose()
        return st

    assert asyncio.run(go()).ok
    out = capfd.readouterr().out
    assert "output of this attempt" in out and "earlier attempt" not in out, out
    assert (tmp_path / "s1.log").read_text() == "output of the earlier attempt\noutput of this attempt\n"  # (kept, appended)


def test_a_stage_launched_before_its_lease_recorded_its_process_is_stopped_not_run_twice(tmp_path):
    """The worker was killed after the stage's process started but before its lease recorded it (the handle is written
    right after the launch): the lease has no handle. The restarted worker reschedules the stage's run; the process of
    the earlier attempt, found by the flow run its environment names (the stage's own session), is stopped first, or the
    stage ran twice, both on the GPU the lease had booked. A process of another flow run is left alone."""
    import os

    env = dict(os.environ, PREFECT__FLOW_RUN_ID="fr-1")
    p = subprocess.Popen(SLEEP, start_new_session=True, env=env)
    other = subprocess.Popen(SLEEP, start_new_session=True, env=dict(os.environ, PREFECT__FLOW_RUN_ID="fr-2"))
    try:
        deadline = time.monotonic() + 10
        while b"PREFECT__FLOW_RUN_ID=fr-1" not in open(f"/proc/{p.pid}/environ", "rb").read():  # (exec'd)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        released: list = []
        lease = SimpleNamespace(lease_id="L1", stage_key="fr-1", attempt_id="fr-1", nodes=["host0"])
        be = LocalBackend(stream_output=False, output_dir=str(tmp_path))
        h, stopped = asyncio.run(QosflowWorker._take_back_local(_worker(be, released), lease, None))
        assert h is None and stopped == p.pid and released == ["L1"]
        assert p.wait(10) == -signal.SIGKILL
        assert alive(other.pid)
    finally:
        for q in (p, other):
            if q.poll() is None:
                q.kill()
                q.wait()


def test_a_stage_that_ends_as_it_is_adopted_is_not_said_stopped(tmp_path):
    """The stage's process ends between the worker's look at it and its adoption (`adopt_unplaced` finds it gone): nothing
    is killed (its pid may be another process's already) and the worker does not say it stopped a running process of an
    older qosflow: (None, None), its run rescheduled unless it reported its end."""
    p = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        start = process_start(p.pid)
        be = LocalBackend(stream_output=False, output_dir=str(tmp_path))
        real = be.adopt_unplaced

        def adopt(*a, **kw):  # (it ends right then)
            p.kill()
            p.wait()
            return real(*a, **kw)

        be.adopt_unplaced = adopt
        released: list = []
        lease, handle = _lease("fr-1", p.pid, start)
        h, stopped = asyncio.run(QosflowWorker._take_back_local(_worker(be, released), lease, handle))
        assert h is None and stopped is None and released == ["L1"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
