"""The worker's QoS queue and the local backend, without a Prefect server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time

import pytest

from qosflow.backends.base import ExitKind, LaunchSpec
from qosflow.backends.local import LocalBackend, local_inventory
from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job, JobState
from qosflow.core.placement import Placement
from qosflow.core.qos import QoSSpec
from qosflow.policies.base import Decision, Policy, SchedulerView
from qosflow.policies.placement import find_for
from qosflow.prefect.scheduler import HistoryEstimator, QoSScheduler, StageCancelled, StageEntry


class PriorityFirstFit(Policy):
    """Test-local policy: highest priority first, then arrival; first fit; backfills."""

    name = "test-priority"

    def schedule(self, view: SchedulerView) -> Decision:
        d = Decision()
        for js in sorted(view.pending, key=lambda j: (-j.job.qos.priority.rank, j.job.submit_time)):
            p = find_for(view.cluster, js.job, fit="first-fit")
            if p is None:
                d.notes[js.job_id] = "waiting"
                continue
            view.cluster.allocate(p, js.job.qos)
            d.starts.append(p)
        return d


class ShareEverything(Policy):
    """Test-local policy that tries to put every whole-GPU job on GPU 0 of node 0 (co-location)."""

    name = "test-share"

    def schedule(self, view: SchedulerView) -> Decision:
        d = Decision()
        for js in view.pending:
            d.starts.append(Placement(js.job_id, ((0, 0),), cpu=((0, 1.0),), gpu_mem_mb=1000.0))
        return d


def entry(jid: str, *, gpus=1, cpu=1.0, prio="normal", expected=5.0, deadline_at=None, shareable=False, mem=None) -> StageEntry:
    job = Job(jid, time.time(), QoSSpec(gpus=gpus, cpu_cores=cpu, priority=prio, shareable=shareable, gpu_mem_mb=mem), expected, expected_duration=expected, model=f"sig-{jid}")
    return StageEntry(JobState(job), jid, flow_run_id=jid, deadline_at=deadline_at)


CL = ClusterSpec.uniform(2, 2, cpu_cores=4, virtual=True)


async def enqueue(s: QoSScheduler, e: StageEntry) -> asyncio.Future:
    t = asyncio.ensure_future(s.request(e))
    await asyncio.sleep(0)  # let it reach the queue
    return t


async def grant_each(s: QoSScheduler, *entries: StageEntry) -> None:
    """Queue the entries one by one, each granted by a round of its own."""
    for e in entries:
        t = await enqueue(s, e)
        s.round()
        await t


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_queue_grants_in_policy_order_and_waits_for_release():
    async def main():
        s = QoSScheduler(CL, PriorityFirstFit(), HistoryEstimator(), coda=False)  # rounds driven by hand
        first = [await enqueue(s, entry(f"a{i}")) for i in range(4)]
        s.round()
        await settle()
        grants = [t.result() for t in first]
        assert len({g.placement.gpus for g in grants}) == 4
        t_low = await enqueue(s, entry("low", prio="best-effort"))
        t_high = await enqueue(s, entry("high", prio="critical"))
        s.round()
        await settle()
        assert not t_low.done() and not t_high.done()  # the cluster is full: both wait in the QoS queue
        s.release("a0")
        s.round()
        await settle()
        assert t_high.done() and not t_low.done()  # the critical one gets the freed GPU first
        assert t_high.result().placement.gpus == grants[0].placement.gpus
        s.release("a1")
        s.round()
        await settle()
        assert t_low.done()
        s.state.check_invariants()

    asyncio.run(main())


def test_background_loop_grants_without_help():
    async def main():
        s = QoSScheduler(CL, PriorityFirstFit(), round_interval=0.05, coda=False)
        s.start()
        g = await asyncio.wait_for(s.request(entry("x")), 30)
        assert g.placement.num_gpus == 1
        await s.stop()

    asyncio.run(main())


def test_a_cpu_only_stage_is_described_with_no_gpu_share():
    """The `qosflow.stage.placed` payload said gpu_milli 1000 for a CPU-only stage, while its
    `qosflow.gpu_milli` label said 0."""
    async def main():
        s = QoSScheduler(CL, PriorityFirstFit(), HistoryEstimator(), coda=False)
        cpu, gpu = entry("cpu", gpus=0), entry("gpu")
        tasks = [await enqueue(s, e) for e in (cpu, gpu)]
        s.round()
        await settle()
        assert all(t.done() for t in tasks)
        assert (s.describe_grant(cpu)["gpu_milli"], s.describe_grant(cpu)["gpus"]) == (0, [])
        assert s.describe_grant(gpu)["gpu_milli"] == 1000

    asyncio.run(main())


def test_rejects_a_stage_that_can_never_fit():
    async def main():
        s = QoSScheduler(CL, PriorityFirstFit(), coda=False)
        with pytest.raises(Exception, match="can never be placed"):
            await s.request(entry("huge", gpus=5))

    asyncio.run(main())


def test_policy_cannot_put_three_stages_on_one_gpu():
    async def main():
        s = QoSScheduler(CL, ShareEverything(), coda=False)
        tasks = [await enqueue(s, entry(f"s{i}", shareable=True, mem=1000.0)) for i in range(3)]
        s.round()
        await settle()
        assert sum(t.done() for t in tasks) == 2  # two may share a GPU, the third is refused by the checked commit
        assert max(s.gpu_load().values()) == 2
        s.state.check_invariants()
        tasks[2].cancel()
        await settle()

    asyncio.run(main())


def test_drop_takes_a_stage_out_of_the_queue():
    async def main():
        s = QoSScheduler(ClusterSpec.uniform(1, 1, cpu_cores=2, virtual=True), PriorityFirstFit(), coda=False)
        busy = await enqueue(s, entry("busy"))
        t = await enqueue(s, entry("waiting"))
        s.round()
        await settle()
        assert busy.done() and not t.done()
        s.drop("waiting", "flow run cancelled")
        with pytest.raises(StageCancelled):
            await t
        assert "waiting" not in s.entries

    asyncio.run(main())


def test_coda_moves_a_core_to_a_lagging_gpu_stage(tmp_path):
    events = []
    moved = []

    async def set_cpus(e, node, cpuset):
        moved.append((e.name, node, list(cpuset)))

    async def main():
        clock = [1000.0]
        s = QoSScheduler(ClusterSpec.uniform(1, 2, cpu_cores=6, virtual=True), PriorityFirstFit(), coda=True, coda_min_elapsed=1.0,
                         on_event=lambda n, e, p: events.append((n, p)), set_cpus=set_cpus, clock=lambda: clock[0])
        cpu = entry("cpu-stage", gpus=0, cpu=3.0, expected=100)
        gpu = entry("gpu-stage", gpus=1, cpu=1.0, expected=10)
        await grant_each(s, cpu, gpu)
        prog = tmp_path / "gpu.progress"
        prog.write_text(json.dumps({"t": 0, "step": 1, "total": 10}) + "\n")
        s.attach("gpu-stage", None, str(prog))
        clock[0] += 5.0  # half the predicted time has passed, 10 % of the work is done: lagging
        moves = await s.coda_round()
        assert len(moves) == 1
        m = moves[0]
        assert m["from_stage"] == "cpu-stage" and m["to_stage"] == "gpu-stage"
        assert s.state.allocs["gpu-stage"].cpu_cores == 2.0 and s.state.allocs["cpu-stage"].cpu_cores == 2.0
        assert len(s.cpuset("gpu-stage", 0)) == 2 and len(s.cpuset("cpu-stage", 0)) == 2
        assert {n for n, _, _ in moved} == {"cpu-stage", "gpu-stage"}
        assert any(n == "qosflow.cpu.rebalanced" for n, _ in events) and s.decisions
        s.state.check_invariants()
        # on time: no move
        prog.write_text(json.dumps({"t": 0, "step": 10, "total": 10}) + "\n")
        clock[0] += 30
        assert await s.coda_round() == []

    asyncio.run(main())


def test_at_risk_event_when_forecast_crosses_deadline():
    events = []

    async def main():
        s = QoSScheduler(ClusterSpec.uniform(1, 1, cpu_cores=2, virtual=True), PriorityFirstFit(), coda=False, on_event=lambda n, e, p: events.append(n))
        a = await enqueue(s, entry("a", expected=50))
        s.round()
        await settle()
        assert a.done()
        t = await enqueue(s, entry("b", expected=10, deadline_at=time.time() + 5))
        s.round()  # b cannot start before a ends (predicted in 50 s): its forecast misses its deadline
        s.check_at_risk()
        t.cancel()
        await settle()

    asyncio.run(main())
    assert "qosflow.qos.at-risk" in events and "qosflow.stage.placed" in events


def test_at_risk_margin_flags_a_forecast_that_eats_into_the_margin():
    """at_risk_margin: the forecast meets the deadline, but inside its last fraction, so it is flagged; with
    margin 0 the same forecast is not."""
    for margin, expect in ((0.0, False), (0.5, True)):
        events = []

        async def main():
            now = [1000.0]
            s = QoSScheduler(
                ClusterSpec.uniform(1, 1, cpu_cores=2, virtual=True), PriorityFirstFit(), coda=False,
                at_risk_margin=margin, clock=lambda: now[0], on_event=lambda n, e, p: events.append((n, p)),
            )
            # ready at 1000, deadline at 1100, forecast finish 1000 + 80 = 1080: on time, inside the last 50 %
            t = await enqueue(s, entry("b", expected=80, deadline_at=1100.0))
            s.check_at_risk()
            t.cancel()
            await settle()

        asyncio.run(main())
        risky = [p for n, p in events if n == "qosflow.qos.at-risk"]
        assert bool(risky) is expect, (margin, events)
        if expect:
            assert risky[0]["margin_s"] == 50.0 and risky[0]["late_by_s"] == -20.0
    with pytest.raises(ValueError, match="at_risk_margin"):
        QoSScheduler(ClusterSpec.uniform(1, 1, virtual=True), PriorityFirstFit(), at_risk_margin=1.0)


def test_a_stage_running_slower_than_predicted_is_forecast_late(tmp_path):
    """The forecast of a running stage follows its progress reports: declared 40 s, 25 % done after 30 s.
    The learned estimator blends the observed rate in (the stage is forecast to end well after its
    deadline, so it is flagged at risk); the policy's view carries the progress and the time run."""
    from qosflow.predict.estimator import LearnedEstimator
    from qosflow.store import Store

    seen: list[tuple[float, float, float]] = []

    class Watch(PriorityFirstFit):
        def schedule(self, view: SchedulerView) -> Decision:
            seen.extend((js.progress, js.attained, js.gpu_attained) for js in view.running)
            return super().schedule(view)

    events = []

    async def main():
        clock = [1000.0]
        est = LearnedEstimator.from_store(Store.open(f"sqlite:///{tmp_path / 'q.db'}"), reference=None)
        s = QoSScheduler(ClusterSpec.uniform(1, 2, cpu_cores=4, virtual=True), Watch(), est, coda=False,
                         clock=lambda: clock[0], on_event=lambda n, e, p: events.append((n, p)))
        a = entry("slow", expected=40.0, deadline_at=1050.0)
        t = await enqueue(s, a)
        s.round()
        await settle()
        assert t.done()
        assert s.forecast_finish(a) == pytest.approx(1040.0)  # no report yet: start + prediction
        prog = tmp_path / "slow.progress"
        prog.write_text(json.dumps({"t": 0, "step": 25, "total": 100}) + "\n")
        s.attach("slow", None, str(prog))
        clock[0] = 1030.0
        s.check_at_risk()
        f = s.forecast_finish(a)
        # the prediction alone says 30 s left (1060); the observed rate says 90 s (1120)
        assert 1075.0 < f < 1120.0
        risky = [p for n, p in events if n == "qosflow.qos.at-risk"]
        assert risky and risky[0]["forecast_finish"] == pytest.approx(f)
        t2 = await enqueue(s, entry("next", expected=5.0))
        s.round()
        await settle()
        assert seen[-1] == (0.25, 30.0, 30.0)
        t2.cancel()

    asyncio.run(main())


def test_the_scheduler_records_who_shared_each_stages_gpus():
    """note_sharing: `a` starts alone, `b` then shares its GPU, `a` ends and `b` runs on alone. What each
    saw is what the learned estimator is told at its end (a solo run, a shared run, or a mix)."""

    class ShareGpu0(Policy):
        name = "test-share-gpu0"

        def schedule(self, view: SchedulerView) -> Decision:
            d = Decision()
            for js in view.pending:
                p = Placement(js.job_id, ((0, 0),), cpu=((0, 1.0),), gpu_mem_mb=1000.0)
                view.cluster.allocate(p, js.job.qos)
                d.starts.append(p)
            return d

    async def main():
        s = QoSScheduler(ClusterSpec.uniform(1, 2, cpu_cores=4, virtual=True), ShareGpu0(), HistoryEstimator(), coda=False)
        a, b = entry("a", shareable=True, mem=1000), entry("b", shareable=True, mem=1000)
        ta = await enqueue(s, a)
        s.round()
        await settle()
        assert ta.done() and a.meta.get("ran_alone") and not a.meta.get("partners")
        tb = await enqueue(s, b)
        s.round()
        await settle()
        assert tb.done()
        assert set(a.meta["partners"]) == {"b"} and a.meta["partners"]["b"] is b.job and a.meta["ran_alone"]
        assert set(b.meta["partners"]) == {"a"} and not b.meta.get("ran_alone")  # so far, shared the whole time
        s.release("a")
        assert b.meta.get("ran_alone")  # alone from now on: a mixed run
        assert s.hold("lease:x", Placement("lease:x", ((0, 0),), cpu=((0, 1.0),), gpu_mem_mb=1000.0), QoSSpec(gpus=1, shareable=True, gpu_mem_mb=1000))
        assert b.meta["partners"]["lease:x"] is None  # another worker's stage: who it is is unknown

    asyncio.run(main())


def test_history_estimator_learns(tmp_path):
    path = str(tmp_path / "h.json")
    est = HistoryEstimator(path)
    job = entry("x", expected=30).job
    assert est.duration(job) == 30 and "declared" in est.basis(job)
    for v in (10.0, 12.0, 11.0):
        est.observe(job, v)
    assert est.duration(job) == 11.0 and est.samples(job) == 3
    assert HistoryEstimator(path).duration(job) == 11.0  # persisted


# ------------------------------------------------------------------------------------ local backend
def _launch(backend, code, placement, cpusets=None, env=None):
    spec = LaunchSpec(stage_id=placement.job_id, command=[sys.executable, "-c", code], placement=placement, cluster=CL, env=env or {}, cpusets=cpusets or {})
    return backend.launch(spec)


def test_local_backend_close_lets_ending_processes_end_and_reaps_all_before_the_loop_ends(tmp_path):
    """aclose gives a process that is about to end (a flow run flushing its last logs) a grace period, kills the
    rest, and reaps every one before it returns: a child reaped after its loop closed made asyncio warn
    "Loop ... that handles pid N is closed" at the end of every demo."""
    codes = {}
    started = tmp_path / "started"

    async def main():
        b = LocalBackend(CL, stream_output=False)
        # it ends 0.5 s after it has started, whatever the interpreter's start-up costs on a loaded machine
        await _launch(b, f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(0.5)",
                      Placement("ending", ((0, 0),), cpu=((0, 1.0),)))
        await _launch(b, "import time; time.sleep(60)", Placement("stuck", ((0, 1),), cpu=((0, 1.0),)))
        procs = dict(b._procs)
        for _ in range(600):  # liveness only
            if started.exists():
                break
            await asyncio.sleep(0.05)
        await b.aclose(grace=3.0)
        codes.update({k: p.returncode for k, p in procs.items()})

    asyncio.run(main())
    assert codes["ending"] == 0  # ended on its own within the grace period
    assert codes["stuck"] == -9  # killed after it, and reaped before aclose returned


def test_local_backend_close_cancelled_during_the_grace_period_still_kills():
    """A worker torn down under cancellation (Ctrl-C, a cancelled task group) cancels aclose inside its grace
    period: the stages it was waiting for must still be killed, not left running after the worker is gone."""
    codes = {}

    async def main():
        b = LocalBackend(CL, stream_output=False)
        await _launch(b, "import time; time.sleep(600)", Placement("stuck", ((0, 0),), cpu=((0, 1.0),)))
        proc = b._procs["stuck"]
        closing = asyncio.ensure_future(b.aclose(grace=600.0))
        await asyncio.sleep(0.2)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        try:
            codes["stuck"] = await asyncio.wait_for(proc.wait(), 30)  # liveness only
        except asyncio.TimeoutError:
            os.kill(proc.pid, 9)
            codes["stuck"] = "still running"

    asyncio.run(main())
    assert codes["stuck"] == -9


def test_local_backend_environment_affinity_and_exit_kinds(tmp_path):
    out = tmp_path / "env.json"
    code = (
        "import os, json; json.dump({k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES','OMP_NUM_THREADS','QOSFLOW_NODE',"
        "'QOSFLOW_VIRTUAL_GPUS','CUDA_MPS_ACTIVE_THREAD_PERCENTAGE','QOSFLOW_PROGRESS_FILE')} | {'aff': sorted(os.sched_getaffinity(0))},"
        f" open({str(out)!r}, 'w'))"
    )

    async def main():
        b = LocalBackend(CL, stream_output=False)
        assert (await b.inventory()).num_gpus == 4
        p = Placement("s1", ((1, 1),), cpu=((1, 2.0),), gpu_milli=500)
        h = await _launch(b, code, p, cpusets={1: [0, 1]})
        st = await b.wait(h)
        assert st.kind is ExitKind.OK
        env = json.loads(out.read_text())
        assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["OMP_NUM_THREADS"] == "2" and env["QOSFLOW_NODE"] == "node1"
        assert env["QOSFLOW_VIRTUAL_GPUS"] == "1" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["QOSFLOW_PROGRESS_FILE"].endswith("s1.progress")
        assert set(env["aff"]) == set(b.real_cpus([0, 1]))
        # a user error
        h = await _launch(b, "raise SystemExit(3)", Placement("s2", ((0, 0),), cpu=((0, 1.0),)))
        st = await b.wait(h)
        assert st.kind is ExitKind.USER and st.code == 3
        # killed on request: cancelled, with its child process
        h = await _launch(b, "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
                          Placement("s3", ((0, 1),), cpu=((0, 1.0),)))
        await asyncio.sleep(0.5)
        from qosflow.backends.local import descendants

        kids = descendants(h.ref["pid"])
        t = time.time()
        await b.kill(h, "flow run cancelled")
        st = await b.wait(h)
        assert st.kind is ExitKind.CANCELLED and time.time() - t < 10
        def gone(k):
            try:
                return open(f"/proc/{k}/stat").read().split()[2] == "Z"
            except OSError:
                return True

        deadline = time.time() + 10  # a loaded machine may take a moment to reap them
        while not all(gone(k) for k in kids) and time.time() < deadline:
            await asyncio.sleep(0.05)
        assert all(gone(k) for k in kids)
        await b.aclose()

    asyncio.run(main())


def test_inventory_is_virtual_without_nvml():
    spec, why = local_inventory(ClusterSpec.uniform(2, 4, virtual=True))
    from qosflow.backends.local import nvml_gpus

    gpus, _ = nvml_gpus()
    if gpus is None:
        assert "no GPU" in why and all(n.virtual for n in spec.nodes)


def test_impossible_request_is_rejected_at_once_naming_stage_cluster_and_fix():
    from qosflow.core.cluster import PlacementError

    async def main():
        s = QoSScheduler(CL, PriorityFirstFit())
        with pytest.raises(PlacementError) as ei:
            await s.request(entry("big", gpus=16))
        return str(ei.value)

    msg = asyncio.run(main())
    assert "'big'" in msg and "16 GPUs" in msg
    assert "ask for less in its @qos_task" in msg and "cluster block or file" in msg


def test_a_waiting_stage_is_told_why_in_its_log_and_its_start_drops_the_stale_reason():
    """The policy's note on a waiting stage reached nobody: the worker now logs it to the stage's flow
    run (shown in the UI) while the stage waits, once per reason; the note a stage waited with is not
    reported as the reason of its start."""
    import types

    from qosflow.prefect.worker import QosflowWorker

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, msg, *args):
            self.lines.append(msg % args)

    async def main():
        s = QoSScheduler(CL, PriorityFirstFit(), HistoryEstimator(), coda=False)
        full = [await enqueue(s, entry(f"a{i}")) for i in range(4)]
        s.round()
        waiting = entry("w")
        t = await enqueue(s, waiting)
        s.round()
        assert waiting.state.note == "waiting"
        log = Log()
        me = types.SimpleNamespace(WHY_WAITING_EVERY_S=0.0)
        watch = asyncio.ensure_future(QosflowWorker._say_why_waiting(me, waiting, s, "train", log))
        await asyncio.sleep(2.5)
        s.round()  # the same reason again: not repeated
        await asyncio.sleep(1.2)
        assert len(log.lines) == 1 and log.lines[0].startswith("stage train waits in the QoS queue (") and log.lines[0].endswith("s so far): waiting")
        s.release(full[0].result().placement.job_id)
        s.round()
        await settle()
        assert t.done() and t.result().note == "" and waiting.state.note == ""
        watch.cancel()

    asyncio.run(main())


def test_a_stage_waiting_for_down_hosts_says_they_are_down_and_why():
    """A wrong agent token (every host down, 401): the waiting stage's log line (and so `qosflow
    status`) said "waiting: no node has 1 free cores"; the cause was only in the worker's start-up lines."""
    import types

    from qosflow.policies import get_policy
    from qosflow.prefect.worker import QosflowWorker

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, msg, *args):
            self.lines.append(msg % args)

    why = "the agent rejected our token (401): the worker and agent tokens differ"

    class Backend:
        def down_reasons(self):
            return {n.name: why for n in CL.nodes}

    async def main():
        s = QoSScheduler(CL, get_policy("qosflow"), HistoryEstimator(), coda=False)
        for i in range(len(CL.nodes)):
            s.state.set_node_down(i)
        waiting = entry("w", gpus=0)
        t = await enqueue(s, waiting)
        s.round()
        log = Log()
        me = types.SimpleNamespace(WHY_WAITING_EVERY_S=0.0, _backend=Backend())
        watch = asyncio.ensure_future(QosflowWorker._say_why_waiting(me, waiting, s, "train", log))
        await asyncio.sleep(1.5)
        watch.cancel()
        t.cancel()
        return waiting.state.note, log.lines

    note, lines = asyncio.run(main())
    names = ", ".join(n.name for n in CL.nodes)
    assert note.startswith(f"waiting: all 2 hosts are down ({names})"), note
    assert len(lines) == 1 and lines[0].endswith(f"so far): {note}; why: {why}"), lines


def test_history_estimator_states_a_band_from_the_stages_own_runs(tmp_path):
    """The policy checks deadline promises on an estimator's stated band (remaining_high); the live
    worker's `history` estimator states one from a stage's own run-to-run spread once it has run twice,
    and before any run the band of a declared duration (log-normal, sd 0.5, as `learned` states it)."""
    import math

    from qosflow.core.estimate import remaining_high

    h = HistoryEstimator(str(tmp_path / "h.json"))
    e = entry("s", expected=10.0)
    assert h.remaining(e.state) == 10.0
    assert remaining_high(h, e.state) == pytest.approx(10.0 * math.exp(1.2816 * 0.5), rel=1e-3)  # about 19 s
    undeclared = JobState(Job("u", time.time(), QoSSpec(gpus=1), 60.0, model="sig-u"))
    assert remaining_high(h, undeclared) == h.remaining(undeclared) == 60.0  # the default states no band
    h.observe(e.job, 12.0)
    assert remaining_high(h, e.state) == 12.0  # one run: a point, no spread yet
    for x in (10.0, 14.0):
        h.observe(e.job, x)
    r, hi = h.remaining(e.state), remaining_high(h, e.state)
    assert r == 12.0 and hi == pytest.approx(12.0 + 1.2816 * h.spread(e.job), rel=1e-3) and hi > 13.5
    e.state.progress = 0.5
    assert remaining_high(h, e.state) == pytest.approx(hi / 2)


def test_the_learned_estimator_says_how_to_fix_an_unreachable_store(monkeypatch):
    """The worker's default estimator keeps its data in the qosflow store: a store it cannot open fails
    its setup (the worker then takes no run and says why every 5 s) with the database's error and the
    two ways out."""
    from qosflow.errors import QosflowError
    from qosflow.prefect.scheduler import make_live_estimator

    monkeypatch.setenv("QOSFLOW_DATABASE_URL", "mysql://nobody@nowhere/qosflow")
    with pytest.raises(QosflowError) as ei:
        make_live_estimator("learned")
    text = str(ei.value)
    assert "not 'mysql'" in text and "QOSFLOW_DATABASE_URL" in text and "estimator to `history`" in text
    assert make_live_estimator("history").name == "history"  # the way out works without the database


def test_a_run_resumed_from_a_checkpoint_is_forecast_and_learned_from_its_own_pace(tmp_path):
    """A stage declared at 40 s resumes at step 50 of 100 (`qosflow.report_resumed`). After 30 s of its own it
    reports step 80: 30 steps in 30 s, so about 20 s are left (reading 80 % done in 30 s would say 7.5 s).
    CODA compares this run's share of the work with its time; at its end the worker teaches the estimator a
    whole run's time at that pace (100 s), and its step time (1 s over the 50 steps it ran)."""
    from qosflow.predict.estimator import LearnedEstimator
    from qosflow.prefect.worker import QosflowWorker
    from qosflow.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'q.db'}")

    async def main():
        clock = [1000.0]
        est = LearnedEstimator.from_store(store, reference=None)
        s = QoSScheduler(ClusterSpec.uniform(1, 2, cpu_cores=4, virtual=True), PriorityFirstFit(), est, coda=False,
                         clock=lambda: clock[0])
        a = entry("resumed", expected=40.0, deadline_at=1100.0)
        t = await enqueue(s, a)
        s.round()
        await settle()
        assert t.done()
        prog = tmp_path / "resumed.progress"
        lines = [{"t": 0, "step": 50, "total": 100, "resumed": True}, {"t": 30, "step": 80, "total": 100}]
        prog.write_text("".join(json.dumps(x) + "\n" for x in lines))
        s.attach("resumed", None, str(prog))
        clock[0] = 1030.0
        s.observe_running()
        assert (a.state.progress, a.state.progress_start, a.resumed) == (0.8, 0.5, 50)
        assert 1045.0 < s.forecast_finish(a) < 1052.0
        assert "resumed at 0.50" in est.predict_remaining(a.state).basis
        # at its end (step 100 after 50 s), as the worker tells the estimator
        with prog.open("a") as fh:
            fh.write(json.dumps({"t": 50, "step": 100, "total": 100}) + "\n")
        QosflowWorker._observe(s, a, 50.0)
        [row] = store.stage_history()
        assert (row.duration_s, row.steps, row.resumed_from, row.step_time_s) == (50.0, 50, 50, 1.0)
        nxt = dataclasses.replace(a.job, job_id="next")  # the stage's next run: 1 declaration, 1 whole run of 100 s
        assert 80.0 < est.duration(nxt) <= 100.0
        # the plain history estimator is told the whole run's time too
        h = HistoryEstimator()
        s.estimator = h
        QosflowWorker._observe(s, a, 50.0)
        assert h.runs[a.job.model] == [100.0]

    asyncio.run(main())


def test_coda_reads_a_resumed_runs_share_of_the_work(tmp_path):
    """Resumed at 50 % and 60 % done when half its predicted time has passed: this run did 10 % of the work
    in half the time, so it lags and gets a core (read as 60 % done, it would look ahead of time)."""

    async def main():
        clock = [1000.0]
        s = QoSScheduler(ClusterSpec.uniform(1, 2, cpu_cores=6, virtual=True), PriorityFirstFit(), coda=True,
                         coda_min_elapsed=1.0, clock=lambda: clock[0])
        cpu_e, gpu_e = entry("cpu-stage", gpus=0, cpu=3.0, expected=100), entry("gpu-stage", gpus=1, cpu=1.0, expected=10)
        assert s.where_ran(gpu_e) == {}  # not granted yet
        await grant_each(s, cpu_e, gpu_e)
        prog = tmp_path / "gpu.progress"
        lines = [{"t": 0, "step": 50, "total": 100, "resumed": True}, {"t": 5, "step": 60, "total": 100}]
        prog.write_text("".join(json.dumps(x) + "\n" for x in lines))
        s.attach("gpu-stage", None, str(prog))
        clock[0] += 5.0
        before = s.where_ran(gpu_e)
        moves = await s.coda_round()
        assert [m["to_stage"] for m in moves] == ["gpu-stage"]
        # where it ran, for the store: its cores are no longer one number once CODA moved some
        assert before == {"host": "node0", "gpu_type": "generic", "placement": "consolidated", "cpu_cores": 1}
        assert s.where_ran(gpu_e)["cpu_cores"] is None and s.where_ran(cpu_e)["cpu_cores"] is None
        assert s.where_ran(cpu_e)["gpu_type"] == "cpu"

    asyncio.run(main())


def test_the_worker_places_a_stage_on_the_gpu_model_its_own_runs_were_fastest_on(tmp_path):
    """On a cluster of an RTX 3090 host and an A100 host, the live scheduler (qosflow's policy with the
    learned estimator) sends each stage to the model where its signature's finished runs went fastest --
    whichever model that is for it."""
    from qosflow.core.cluster import NodeSpec
    from qosflow.policies import get_policy
    from qosflow.predict.estimator import LearnedEstimator
    from qosflow.store import Store

    est = LearnedEstimator.from_store(Store.open(f"sqlite:///{tmp_path / 'q.db'}"), reference=None)
    on = lambda model: {"placement": "consolidated", "gpu_type": model}  # noqa: E731  (what where_ran gives)
    for i in range(3):  # `train` runs twice as fast on the A100, `embed` 1.5 x as fast on the RTX 3090
        est.observe(Job(f"t{i}", 0.0, QoSSpec(gpus=1), 60.0, model="flows.train"), 50.0, steps=100, where=on("NVIDIA A100-SXM4-40GB"))
        est.observe(Job(f"u{i}", 0.0, QoSSpec(gpus=1), 60.0, model="flows.train"), 100.0, steps=100, where=on("NVIDIA GeForce RTX 3090"))
        est.observe(Job(f"e{i}", 0.0, QoSSpec(gpus=1), 60.0, model="flows.embed"), 30.0, steps=100, where=on("NVIDIA A100-SXM4-40GB"))
        est.observe(Job(f"f{i}", 0.0, QoSSpec(gpus=1), 60.0, model="flows.embed"), 20.0, steps=100, where=on("NVIDIA GeForce RTX 3090"))
    cluster = ClusterSpec([NodeSpec("old", 1, cpu_cores=4, gpu_model="rtx3090", virtual=True),
                           NodeSpec("new", 1, cpu_cores=4, gpu_model="a100", virtual=True)])

    def stage(jid, model):
        job = Job(jid, time.time(), QoSSpec(gpus=1, cpu_cores=1.0), 60.0, model=model)
        return StageEntry(JobState(job), jid, flow_run_id=jid)

    async def main():
        for model, host in (("flows.train", "new"), ("flows.embed", "old")):
            s = QoSScheduler(cluster, get_policy("qosflow"), est, coda=False)
            e = stage(f"one-{model}", model)
            t = await enqueue(s, e)
            s.round()
            await settle()
            assert cluster.nodes[t.result().placement.gpus[0][0]].name == host, model
            # (the flow run's `qosflow.gpu_model` label and the placement log line say which model it got)
            assert s.describe_grant(e)["gpu_model"] == ("a100" if host == "new" else "rtx3090")
        # a gang over both hosts runs at its slowest GPU's pace: its history records that model
        for model, slowest in (("flows.train", "rtx3090"), ("flows.embed", "a100")):
            s = QoSScheduler(cluster, get_policy("qosflow"), est, coda=False)
            job = Job(f"gang-{model}", time.time(), QoSSpec(gpus=2, cpu_cores=2.0, gang=True), 60.0, model=model)
            e = StageEntry(JobState(job), job.job_id, flow_run_id=job.job_id)
            t = await enqueue(s, e)
            s.round()
            await settle()
            assert len(t.result().placement.nodes) == 2
            assert s.where_ran(e)["gpu_type"] == slowest, model
        # without the GPU-model choice the first node (best fit, node order) takes it whatever it runs at
        s = QoSScheduler(cluster, get_policy("qosflow", gpu_models=False), est, coda=False)
        t = await enqueue(s, stage("plain", "flows.train"))
        s.round()
        await settle()
        assert cluster.nodes[t.result().placement.gpus[0][0]].name == "old"

    asyncio.run(main())


@pytest.mark.parametrize("depth", range(4))
def test_stop_ends_the_loop_even_as_it_is_woken(depth):
    """The worker stopping just as a stage ended (which wakes the queue): on Python 3.11 asyncio.wait_for
    returned the woken wait's result and swallowed stop()'s cancellation, and stop() waited for the loop
    for ever (found by a test of the Kubernetes node changes, which hung). `depth` loop iterations between
    the wake and the stop cover the moments at which the cancellation can arrive."""
    from qosflow.policies import get_policy

    async def go():
        s = QoSScheduler(CL, get_policy("fifo"), coda=False)
        s.start()
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        box = {}

        def later(n, fn):
            if n == 0:
                fn()
            else:
                loop.call_soon(later, n - 1, fn)

        s.wake()
        later(depth, lambda: box.setdefault("stop", asyncio.ensure_future(s.stop())))
        await asyncio.sleep(0.05)
        done, _ = await asyncio.wait({box["stop"]}, timeout=3)
        return bool(done)

    assert asyncio.run(go()), "stop() did not end the scheduler's loop"


def test_only_a_gang_on_several_hosts_runs_its_ranks_through_gang_rank():
    """A stage placed on several hosts runs `-m qosflow.prefect.gang_rank` (rank 0 alone runs Prefect's engine); one
    on one host, and a command that does not run the engine as a module, are left as they are."""
    from qosflow.core.placement import Placement
    from qosflow.prefect.worker import gang_command

    cmd = ["/usr/bin/python3", "-m", "prefect.engine"]
    one = Placement("s", ((0, 0), (0, 1)), cpu=((0, 1.0),))
    two = Placement("s", ((0, 0), (1, 0)), cpu=((0, 1.0), (1, 1.0)))
    assert gang_command(cmd, one) == cmd
    assert gang_command(cmd, two) == ["/usr/bin/python3", "-m", "qosflow.prefect.gang_rank"]
    assert cmd == ["/usr/bin/python3", "-m", "prefect.engine"]  # (not changed in place)
    assert gang_command(["/srv/run-stage.sh"], two) == ["/srv/run-stage.sh"]
