"""End to end against a real local Prefect server: stages through the qosflow worker as processes.

One server per session (conftest.prefect_server). The worker runs in a thread of the test process
and launches every stage as its own process; these tests take a minute or two on 2 cores.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from procs import alive

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def qos_worker(prefect_server, tmp_path_factory):
    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    pool = "e2e-gpu"
    cluster = BareMetalGPUCluster.virtual(1, 2, cpu_cores=8)  # one host, 2 virtual GPUs
    asyncio.run(setup_pool(pool, cluster=cluster, policy=QoSPolicy(policy="fifo", options={"backfill": True}), stream_output=False))
    os.environ["QOSFLOW_PREDICTOR_ARTIFACT_SECONDS"] = "0.5"
    os.environ["QOSFLOW_CLUSTER_ARTIFACT_SECONDS"] = "0.5"
    w = WorkerThread(pool, metrics_port=0).wait_ready(120)  # (Prometheus metrics on a free port)
    os.environ["QOSFLOW_POOL"] = pool
    yield w
    os.environ.pop("QOSFLOW_POOL", None)
    w.stop()


@pytest.fixture(autouse=True)
def _worker_idle_before_each_test(request):
    """Each test starts with its worker idle. A pipeline returns once its last stage reports its end; the
    stage's process exits later, and only then does the worker free its GPUs, release its lease and
    record it. A test that starts meanwhile can find the previous test's stage still on a GPU (its stage
    or early check goes to the other GPU, and `gpus == "0"` fails) or still in the worker's handles
    (`_start_and_cancel` took it for its own and cancelled the wrong run)."""
    for name in ("qos_worker", "elastic_worker"):
        if name in request.fixturenames:
            w = request.getfixturevalue(name).worker
            try:
                _eventually(lambda: not w._in_flight and not w._handles and not (w.scheduler is not None and w.scheduler.entries),
                            timeout=120)
            except AssertionError:
                raise AssertionError(f"the previous test's stage runs are still in flight on the worker: {sorted(w._in_flight)}") from None


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def test_three_stage_pipeline_through_the_worker(qos_worker):
    import prefect_pipelines as pp

    from qosflow.prefect.tasks import PipelineRun

    out = pp.three_stage(10)
    assert out["score"] == 45
    seen = dict(out["seen"])
    # DAG order: each stage started after its input was produced
    assert seen["load"]["t1"] <= seen["train"]["t0"] <= seen["train"]["t1"] <= seen["evaluate"]["t0"]
    # every stage ran in its own process
    assert len({s["pid"] for s in seen.values()}) == 3 and os.getpid() not in {s["pid"] for s in seen.values()}
    run = PipelineRun.finished[-1]
    assert run.flow_name == "e2e-three-stage" and run.state == "completed" and run.met is True
    recs = {r.name: r for r in run.stages.values()}
    real_cpus = qos_worker.worker._backend.real_cpus
    for name, s in seen.items():
        rec = recs[name]
        env, pl = s["env"], s["placement"]
        assert pl["placed"] and env["QOSFLOW_NODE"] == rec.host == "host0" and env["QOSFLOW_VIRTUAL_GPUS"] == "1"
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(g.split(":")[1] for g in rec.gpus)
        assert env["OMP_NUM_THREADS"] == str(int(rec.cpu_cores))
        assert len(pl["cpuset"]) == int(rec.cpu_cores) and s["affinity"] == real_cpus(pl["cpuset"])
    assert seen["load"]["env"]["CUDA_VISIBLE_DEVICES"] == ""  # CPU-only stage sees no GPU
    assert recs["train"].cpu_cores == 2 and len(recs["train"].gpus) == 1
    # stage deadlines split along the critical path: load < train < evaluate == pipeline deadline
    assert recs["load"].deadline_at < recs["train"].deadline_at < recs["evaluate"].deadline_at == pytest.approx(run.deadline_at)

    # QoS recorded on the stage runs (tags, labels) and artifacts on the pipeline run
    with _client() as c:
        for rec in recs.values():
            fr = c.read_flow_run(rec.flow_run_id)
            assert fr.state.is_completed()
            assert "qos:class=guaranteed" in fr.tags
            assert fr.labels["qosflow.host"] == "host0" and fr.labels["qosflow.virtual_gpus"] == "true"
            assert float(fr.labels["qosflow.predicted_s"]) > 0 and fr.labels["qosflow.policy"] == "fifo"
            assert "qosflow.deadline_at" in fr.labels
            assert fr.labels["qosflow.estimator"] == "learned"  # the policy block's default: the predictor
            assert fr.labels["qosflow.gpu_milli"] == ("1000" if rec.gpus else "0")  # (a CPU-only stage holds no GPU share)
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        keys = {a.key for a in c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="qosflow-")))}
        assert {"qosflow-placements-" + run.name.replace("_", "-"), "qosflow-qos-" + run.name.replace("_", "-")} <= keys or any(k.startswith("qosflow-placements-") for k in keys)
        assert any(k.startswith("qosflow-forecast-") for k in keys)
        # on the pipeline's run (its Artifacts tab in the UI), not on a stage's task run or on no run: every version
        from prefect.client.schemas.filters import ArtifactFilterFlowRunId

        on_run = [a for a in c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.flow_run_id])))
                  if (a.key or "").startswith("qosflow-")]
        assert {a.key.split("-")[1] for a in on_run} == {"placements", "qos", "forecast"}, [a.key for a in on_run]
        assert all(a.task_run_id is None for a in on_run), [(a.key, a.task_run_id) for a in on_run]

    # the predictor table in the UI: what the worker's estimator learned from the stages it ran
    import json

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    key = "qosflow-predictor-e2e-gpu"
    names: set = set()
    end = time.time() + 30
    while time.time() < end:
        with _client() as c:
            arts = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        if arts:
            latest = max(arts, key=lambda a: a.created)
            rows = json.loads(latest.data) if isinstance(latest.data, str) else latest.data
            names = {r["stage"].rsplit(".", 1)[-1] for r in rows}
            if {"load", "train", "evaluate"} <= names:
                break
        time.sleep(0.5)
    assert {"load", "train", "evaluate"} <= names, names
    row = next(r for r in rows if r["stage"].endswith("train"))
    assert row["runs"] >= 1 and row["predicts next (s)"] > 0 and row["basis"].startswith("declared+")

    # the learned estimator wrote each stage's prediction, outcome and history to the qosflow store
    from qosflow.store import Store

    store = Store.open()
    ids = {str(rec.flow_run_id) for rec in recs.values()}

    def recorded() -> set:
        return {h.stage_run_id for h in store.stage_history() if h.state == "COMPLETED" and h.duration_s > 0}

    deadline = time.time() + 30  # the worker records a stage once its process has exited, which may follow the flow's return
    while not ids <= recorded() and time.time() < deadline:
        time.sleep(0.2)
    assert ids <= recorded()
    # the worker judges a stage by the end its engine reported, as the pipeline and the UI do (its
    # process exits a moment later)
    # (its record is appended just after the stage is handed to the estimator, whose store writes run in a
    # thread of their own: the store may have it first)
    mine = _eventually(lambda: (lambda m: m if ids <= set(m) else None)({r["flow_run_id"]: r for r in qos_worker.worker.records}))
    for rec in recs.values():
        w = mine[str(rec.flow_run_id)]
        assert w["ended"] == pytest.approx(rec.ended, abs=1e-3) and w["ended"] <= w["exited"]
        assert w["actual_s"] == pytest.approx(w["ended"] - w["launched"], abs=2e-3)
    assert ids <= {p.stage_run_id for p, o in store.prediction_errors("duration") if o.actual > 0}
    # train reported 5 steps and ran alone on its GPU: a solo step-time sample for the predictor (written
    # after the stage's history row, which is all the wait above saw: flushed first)
    assert qos_worker.worker.scheduler.estimator.flush(30)
    [smp] = [x for x in store.samples_for() if x.stage_run_id == str(recs["train"].flow_run_id)]
    assert smp.steps == 5 and smp.co_runner is None and smp.source == "stage"
    assert smp.step_time_s == pytest.approx(mine[str(recs["train"].flow_run_id)]["actual_s"] / 5, rel=1e-3)


def test_no_gpu_ever_holds_more_than_two_stages(qos_worker):
    recs = [r for r in qos_worker.worker.records if r.get("gpus")]
    assert recs, "the previous test ran GPU stages"
    events = []
    for r in recs:
        for g in r["gpus"]:
            events += [(r["placed"], 1, g), (r["ended"], -1, g)]
    load: dict[str, int] = {}
    for _, d, g in sorted(events, key=lambda e: (e[0], e[1])):
        load[g] = load.get(g, 0) + d
        assert load[g] <= 2
    assert max(qos_worker.worker.scheduler.gpu_load().values(), default=0) <= 2


def test_prometheus_metrics_of_the_worker(qos_worker):
    """The worker's /metrics (qosflow.prefect.metrics) after the three-stage pipeline above: its stages
    finished ok and met their deadlines, their waits and placements were counted, and the cluster is read
    live (2 GPUs on host0, up, nothing allocated now)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    w = qos_worker.worker
    r = httpx.get(f"http://127.0.0.1:{w.metrics.port}/metrics", timeout=10)
    assert r.status_code == 200
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    assert got[("qosflow_stages_finished_total", (("exit", "ok"),))] >= 3
    assert got[("qosflow_stage_deadlines_total", (("outcome", "met"),))] >= 3
    assert sum(v for k, v in got.items() if k[0] == "qosflow_stage_wait_seconds_count") >= 3
    assert got[("qosflow_events_total", (("event", "qosflow.stage.placed"),))] >= 3
    assert got[("qosflow_node_gpus", (("node", "host0"),))] == 2 and got[("qosflow_node_up", (("node", "host0"),))] == 1
    assert got[("qosflow_scheduler_ready", ())] == 1
    info = [k for k in got if k[0] == "qosflow_worker_info"]
    assert info and dict(info[0][1])["pool"] == "e2e-gpu" and dict(info[0][1])["policy"] == "fifo"

    # the cluster table in the UI: its host, as the worker schedules it
    import json

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    def cluster_tables():
        with _client() as c:
            return [json.loads(a.data) if isinstance(a.data, str) else a.data
                    for a in c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["qosflow-cluster-e2e-gpu"])))]

    tables = _eventually(cluster_tables, timeout=30)
    assert any(t[0]["host"] == "host0" and t[0]["state"] == "up" and t[0]["GPUs"] == 2 and t[-1]["host"] == "all (1 of 1 up)"
               for t in tables), tables
    assert w.cluster_artifacts >= 1

    # a second worker asked for the same port is refused at its start, saying so (not a traceback later)
    from qosflow.errors import SpecError
    from qosflow.prefect.worker import QosflowWorker

    async def second():
        async with QosflowWorker(work_pool_name="e2e-gpu", name="metrics-second", create_pool_if_not_found=False, metrics_port=w.metrics.port):
            pass

    with pytest.raises(SpecError, match="already in use"):
        asyncio.run(second())


def test_failing_stage_is_retried_and_reported_nothing_else_lost(qos_worker, tmp_path):
    import prefect_pipelines as pp

    from qosflow.prefect.tasks import PipelineRun, StageFailed

    marker = str(tmp_path / f"flaky-{uuid.uuid4().hex}")
    with pytest.raises(Exception) as ei:
        pp.failures(marker)
    assert "broken" in str(ei.value) or isinstance(ei.value, StageFailed)
    run = PipelineRun.finished[-1]
    assert run.state == "failed"
    recs = {r.name: r for r in run.stages.values()}
    assert recs["flaky"].state == "completed" and recs["flaky"].attempts == 2  # retried per its retries=1
    assert recs["sibling"].state == "completed"  # independent work is not lost
    assert recs["broken"].state == "failed" and recs["broken"].attempts == 1  # retries=0: not retried
    assert Path(marker).exists()
    with _client() as c:
        assert c.read_flow_run(recs["sibling"].flow_run_id).state.is_completed()
        assert c.read_flow_run(recs["broken"].flow_run_id).state.is_failed()
    assert "Retried: `flaky` (2 attempts)" in run.report_markdown()


def _start_and_cancel(worker, task, flow_name: str, pidfile: Path) -> str:
    """Run a one-stage pipeline of `task` (which writes its pid to `pidfile`) in a thread, cancel the
    stage's flow run once its process runs, and wait until that process is gone and the run is
    Cancelled. Returns the stage's flow run id."""
    import threading

    from prefect.states import Cancelling

    from qosflow.prefect.tasks import qos_flow

    @qos_flow(name=flow_name)
    def pipeline():
        return task.submit(str(pidfile)).result(raise_on_failure=False)

    th = threading.Thread(target=lambda: pipeline(return_state=True), daemon=True)
    th.start()
    _eventually(lambda: pidfile.exists() and pidfile.read_text(), timeout=120)  # up to 2 min on a loaded machine
    pid = int(pidfile.read_text())
    # the run of the process that wrote the pid (not any run the worker holds: another may be exiting)
    fid = _eventually(lambda: next((f for f, h in list(worker._handles.items()) if h.ref.get("pid") == pid), None))
    with _client() as c:
        c.set_flow_run_state(fid, Cancelling(), force=True)
        _eventually(lambda: _gone(pid))
        _eventually(lambda: c.read_flow_run(fid).state.is_cancelled(), timeout=30)
    th.join(120)
    assert not th.is_alive(), "the pipeline did not end after its stage was cancelled"  # (else it ends in a later test's PipelineRun.finished[-1])
    return fid


def test_cancelling_a_stage_run_kills_its_process(qos_worker, tmp_path):
    import prefect_pipelines as pp

    _start_and_cancel(qos_worker.worker, pp.sleeper, "e2e-cancel", tmp_path / "sleeper.pid")


def _gone(pid: int) -> bool:
    """No such process, or a zombie its worker has not reaped yet."""
    return not alive(pid)


def _eventually(fn, timeout: float = 60.0):
    """fn() once it is truthy: the worker books a stage after its process exits, which may be after the
    pipeline saw the stage's final state."""
    end = time.monotonic() + timeout
    while not (out := fn()):
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.1)
    return out


def _check_marks(path: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_early_check_fails_a_user_error_before_it_takes_its_gpus(qos_worker, tmp_path):
    """Philly: a 2-GPU stage that fails at once runs only on one GPU (the early check); its run fails
    with the stage's own error and never holds both GPUs."""
    import prefect_pipelines as pp

    from qosflow.prefect.tasks import PipelineRun

    marker = tmp_path / "bad.jsonl"
    with pytest.raises(Exception, match="bad input|big_bad"):
        pp.early_bad(str(marker))
    ev = _check_marks(marker)
    assert [(e["event"], e["check"], e["gpus"]) for e in ev] == [("start", True, "0")]  # one GPU, once
    run = PipelineRun.finished[-1]
    rec = next(iter(run.stages.values()))
    w = qos_worker.worker
    checks = _eventually(lambda: [c for c in w.early_checks if c["flow_run_id"] == rec.flow_run_id])
    assert [c["verdict"] for c in checks] == ["failed"]
    assert not [r for r in w.records if r["flow_run_id"] == rec.flow_run_id]  # never placed on its 2 GPUs
    with _client() as c:
        fr = c.read_flow_run(rec.flow_run_id)
        assert fr.state.is_failed() and "bad input" in (fr.state.message or "") + str(fr.state.result(raise_on_failure=False))


def test_early_check_passes_then_the_stage_runs_on_all_its_gpus(qos_worker, tmp_path):
    import prefect_pipelines as pp

    from qosflow.prefect.tasks import PipelineRun

    marker = tmp_path / "good.jsonl"
    assert pp.early_good(str(marker), 6.0) == "0,1"
    ev = _check_marks(marker)
    # the check ran the stage's code on one GPU and was stopped after 3 s (no "done"); then it ran on both GPUs, once
    assert [(e["event"], e["check"], e["gpus"]) for e in ev] == [("start", True, "0"), ("start", False, "0,1"), ("done", False, "0,1")]
    assert ev[1]["t"] - ev[0]["t"] >= 2.5  # the check's code ran for its 3 s before it was stopped
    with pytest.raises(ProcessLookupError):
        os.kill(ev[0]["pid"], 0)
    run = PipelineRun.finished[-1]
    rec = next(iter(run.stages.values()))
    w = qos_worker.worker
    assert [c["verdict"] for c in w.early_checks if c["flow_run_id"] == rec.flow_run_id] == ["passed"]
    wait_records = _eventually(lambda: [r for r in w.records if r["flow_run_id"] == rec.flow_run_id])
    assert len(wait_records) == 1 and len(wait_records[0]["gpus"]) == 2
    # a signature that passed is not checked again
    marker2 = tmp_path / "again.jsonl"
    assert pp.early_good(str(marker2), 0.5) == "0,1"
    assert [e["check"] for e in _check_marks(marker2)] == [False, False]


def test_a_stage_whose_last_run_failed_is_checked_early_again(qos_worker, tmp_path):
    """Philly: failures repeat. A stage that passed its early check is not checked again -- until a run of
    it fails with a user error (here after its check); its next run is checked first."""
    import prefect_pipelines as pp

    m1, m2, m3 = (tmp_path / f"{i}.jsonl" for i in (1, 2, 3))
    assert pp.early_late(str(m1), False) == "ok"
    assert [e["check"] for e in _check_marks(m1)] == [True, False]  # checked, then the real run
    with pytest.raises(Exception, match="found late"):
        pp.early_late(str(m2), True)
    assert [e["check"] for e in _check_marks(m2)] == [False]  # passed before: not checked; fails late
    # its process exited 0 (the engine reported the failure): the worker reads the flow run's state, and
    # learns nothing from the failed run
    from qosflow.prefect.tasks import PipelineRun

    failed_id = next(iter(PipelineRun.finished[-1].stages.values())).flow_run_id
    w = qos_worker.worker
    [rec] = _eventually(lambda: [r for r in w.records if r["flow_run_id"] == failed_id])
    assert (rec["exit"], rec["flow_state"]) == ("ok", "FAILED")
    est = w.scheduler.estimator
    if hasattr(est, "flush"):
        assert est.flush(30)
        assert not [h for h in est.store.stage_history() if h.stage_run_id == failed_id]
    assert pp.early_late(str(m3), False) == "ok"
    assert [e["check"] for e in _check_marks(m3)] == [True, False]  # its last run failed: checked again


def test_cancelling_a_stage_during_its_early_check(qos_worker, tmp_path):
    """Cancelled while it is checked on one GPU: the check's process is killed, the run ends Cancelled,
    the check says `cancelled` (not a user error), and the stage is not placed for real."""
    import prefect_pipelines as pp

    w = qos_worker.worker
    fid = _start_and_cancel(w, pp.big_sleeper, "e2e-cancel-check", tmp_path / "big-sleeper.pid")
    checks = _eventually(lambda: [ch for ch in w.early_checks if ch["flow_run_id"] == fid])
    assert [ch["verdict"] for ch in checks] == ["cancelled"]
    time.sleep(1.0)
    assert not [r for r in w.records if r["flow_run_id"] == fid]  # never placed on its 2 GPUs


def test_a_worker_stopped_as_its_pipeline_returns_still_finishes_its_bookkeeping(prefect_server):
    """A pipeline returns once its last stage reports its end; the stage's process may exit later, and
    only then does the worker free the slot, release the lease and record the outcome. Stopping the
    worker right away (as `qosflow demo` does) must not leave a lease behind for the next worker to
    "recover", and must still record the stage."""
    import prefect_pipelines as pp

    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool
    from qosflow.prefect.tasks import PipelineRun
    from qosflow.store import Store
    from qosflow.store.leases import LeaseStore

    pool = "e2e-stop"
    asyncio.run(setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1, cpu_cores=4), policy=QoSPolicy(policy="fifo"),
                           stream_output=False))
    before = os.environ.get("QOSFLOW_POOL")
    os.environ["QOSFLOW_POOL"] = pool
    w = WorkerThread(pool).wait_ready(120)
    try:
        assert pp.lingering_pipeline(10.0) == "done"
        assert w.worker._in_flight  # the stage's process is still exiting (10 s: the pipeline may see the end seconds late on a loaded machine)
    finally:
        # (a drain longer than the stage lingers: with the default 10 s against its 10 s the drain lost the race
        # about every other run, and the stage was put back in the queue instead of recorded)
        w.stop(timeout=90.0, drain=40.0)
        if before is None:
            os.environ.pop("QOSFLOW_POOL", None)
        else:
            os.environ["QOSFLOW_POOL"] = before
    assert not w.is_alive()
    from prefect.settings import PREFECT_API_URL

    from qosflow.store.leases import pool_key

    assert LeaseStore().leases(pool_key(pool, PREFECT_API_URL.value())) == []  # (keyed by the pool and its server)
    [stage] = PipelineRun.finished[-1].stages.values()
    assert str(stage.flow_run_id) in {h.stage_run_id for h in Store.open().stage_history() if h.state == "COMPLETED"}


@pytest.fixture(scope="module")
def elastic_worker(prefect_server):
    """A worker with the qosflow policy on one host of 4 virtual GPUs (pool e2e-elastic)."""
    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    pool = "e2e-elastic"
    asyncio.run(setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 4, cpu_cores=8), policy=QoSPolicy(policy="qosflow"),
                           stream_output=False))
    w = WorkerThread(pool).wait_ready(120)
    yield w
    w.stop()


def test_an_elastic_stage_starts_on_the_free_half_and_is_told_so(elastic_worker, tmp_path):
    """@qos_task(gpus=4, min_gpus=2) while 2 of the 4 GPUs are held: the qosflow policy starts it on the other
    2, the stage process sees QOSFLOW_GPUS=2 and QOSFLOW_GRAD_ACCUMULATION=2, and the flow run says so."""
    import prefect_pipelines as pp

    from qosflow.prefect.tasks import PipelineRun

    out = pp.elastic_pipeline(str(tmp_path / "held"), str(tmp_path / "release"))
    assert (out["QOSFLOW_GPUS"], out["QOSFLOW_GRAD_ACCUMULATION"], out["steps"], out["granted"]) == ("2", "2", 2, 2)
    mine, held = set(out["CUDA_VISIBLE_DEVICES"].split(",")), set(out["held"].split(","))
    assert len(mine) == len(held) == 2 and not mine & held
    run = PipelineRun.finished[-1]
    rec = next(r for r in run.stages.values() if r.name.startswith("elastic_train"))
    assert rec.elastic_note == " (2 of 4, gradient accumulation x2)" and len(rec.gpus) == 2
    with _client() as c:
        labels = c.read_flow_run(rec.flow_run_id).labels
    assert labels["qosflow.elastic"] == "started on 2 of 4 GPUs, gradient accumulation x2" and labels["qosflow.policy"] == "qosflow"
    [w] = _eventually(lambda: [r for r in elastic_worker.worker.records if r["flow_run_id"] == rec.flow_run_id])  # (once its process exited)
    assert (w["requested_gpus"], w["grad_accumulation"]) == (4, 2)


def test_a_stage_that_exits_0_without_reporting_its_end_is_marked_crashed(qos_worker, tmp_path, monkeypatch):
    """A stage whose code ends its process with exit code 0 (os._exit(0)) before its engine reports how
    the run ended: its flow run stayed Running and its pipeline waited for ever. After a grace the worker
    marks it Crashed, saying why, and the pipeline fails with that."""
    import prefect_pipelines as pp

    monkeypatch.setenv("QOSFLOW_UNREPORTED_END_GRACE_S", "3")
    marker = tmp_path / "quit.pid"
    out: dict = {}

    def go():
        try:
            out["r"] = pp.quits_silently_flow(str(marker))
        except BaseException as exc:  # noqa: BLE001 - what the pipeline raised is the point
            out["exc"] = exc

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(180)
    assert not th.is_alive(), "the pipeline still waits for a stage whose process has exited"
    assert marker.exists()  # the stage ran
    assert "r" not in out and "exc" in out
    from qosflow.prefect.tasks import PipelineRun

    run = PipelineRun.finished[-1]
    rec = next(iter(run.stages.values()))
    with _client() as c:
        fr = c.read_flow_run(rec.flow_run_id)
    assert fr.state.is_crashed() and "exited with code 0, but its flow run was never reported ended" in (fr.state.message or "")
    rec_w = _eventually(lambda: [r for r in qos_worker.worker.records if r["flow_run_id"] == rec.flow_run_id])
    assert rec_w[0]["exit"] == "ok" and rec_w[0]["flow_state"] == "CRASHED"


def _stage_runs_named(suffix: str) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with _client() as c:
        return c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[suffix])))


def test_a_stage_past_its_timeout_is_cancelled_and_retried_one_run_at_a_time(qos_worker, tmp_path):
    """@qos_task(timeout_seconds=12, retries=1) on a stage that sleeps 300 s: Prefect's thread-based timeout
    failed the task attempt but left its stage run Running on its GPU, and the retry started a second copy
    beside it. Each attempt's run is cancelled when the timeout expires (its process killed) before the
    next starts, and the pipeline ends TimedOut."""
    import prefect_pipelines as pp

    from qosflow.prefect.tasks import PipelineRun

    path = tmp_path / "hangs.pids"
    t0 = time.monotonic()
    state = pp.timeout_pipeline(str(path), return_state=True)
    assert state.is_failed() and state.name == "TimedOut", state
    assert "exceeded its timeout of 12 s" in (state.message or ""), state.message
    assert time.monotonic() - t0 < 150
    run = PipelineRun.finished[-1]
    [rec] = run.stages.values()
    assert (rec.state, rec.attempts) == ("timed out", 2)
    runs = _stage_runs_named(f"{run.name}.hangs")
    assert len(runs) == 2 and all(r.state.is_cancelled() for r in runs), [(r.id, r.state) for r in runs]
    # each attempt's process ran and was stopped (its code too, unless its engine was still starting when
    # the timeout expired: the timeout counts from the call, its time in the queue and start-up included)
    w = qos_worker.worker
    recs = _eventually(lambda: (lambda rs: rs if len(rs) == 2 else None)(
        sorted((r for r in w.records if r["flow_run_id"] in {str(x.id) for x in runs}), key=lambda r: r["placed"])))
    assert recs[0]["exited"] <= recs[1]["placed"], recs  # the retry started once the first attempt's process was gone
    pids = [int(x) for x in path.read_text().split()] if path.exists() else []
    assert len(pids) <= 2
    for pid in pids:  # no stage process is left (a zombie is one not yet reaped by the worker's thread)
        assert _gone(pid)


def test_a_stage_s_own_exception_reaches_the_pipeline(qos_worker):
    """`try: parse(s) except ValueError:` works through a pool as it does in-process (the pipeline saw
    StageFailed), and retry_condition_fn sees the ValueError; an exception that cannot be read back
    is StageFailed."""
    import prefect_pipelines as pp

    pp.RETRY_CONDITION_SAW.clear()
    out = pp.stage_exceptions()
    name, msg, notes = out["direct"]
    assert (name, msg) == ("ValueError", "invalid literal for int() with base 10: 'abc'")
    assert any("raised by qosflow stage 'parse'" in n for n in notes), notes
    assert out["submit"] == ("ValueError", "invalid literal for int() with base 10: 'xyz'")
    assert "odd_failure" in out["fallback"] and "NeedsTwoArgs: this and that" in out["fallback"]
    assert out["ok"] == 42
    assert pp.RETRY_CONDITION_SAW == ["ValueError", "ValueError"]


DIRECT_CALL_PIPELINE = """
import os, sys, time
from qosflow import qos_flow, qos_task

@qos_task(gpus=1, cpu_cores=1, expected_duration=5)
def long_step(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(300)

@qos_flow(name="e2e-direct-interrupt", pool=sys.argv[2])
def pipe(path: str):
    return long_step(path)  # called directly, not .submit()

if __name__ == "__main__":
    pipe(sys.argv[1])
"""


def test_ctrl_c_cancels_a_running_stage_called_directly(qos_worker, tmp_path, prefect_server):
    """`step(x)` (not `step.submit(x)`) waits in the pipeline's own thread, where no task runner's cancel
    event is set: after Ctrl-C the pipeline ended Crashed and its stage ran on to its end."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "direct.py"
    script.write_text(DIRECT_CALL_PIPELINE)
    pidfile = tmp_path / "step.pid"
    env = dict(os.environ, PREFECT_API_URL=prefect_server)
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(pidfile), os.environ["QOSFLOW_POOL"]], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        _eventually(lambda: pidfile.exists() and pidfile.read_text() or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, log.read_text()
        pid = int(pidfile.read_text())
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the pipeline did not end within 60 s of Ctrl-C:\n" + log.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "KeyboardInterrupt" in log.read_text()
    [fr] = [r for r in _stage_runs_named_like(".long_step") if r.parameters.get("payload") and r.state is not None]
    _eventually(lambda: _gone(pid), timeout=60)
    with _client() as c:
        _eventually(lambda: c.read_flow_run(fr.id).state.is_cancelled(), timeout=60)


def _stage_runs_named_like(suffix: str) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with _client() as c:
        return [r for r in c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=suffix)))
                if (r.name or "").endswith(suffix)]


def test_a_stage_run_created_as_its_creation_fails_is_cancelled_not_left_to_run(qos_worker, tmp_path, monkeypatch):
    """The server created the stage's run but the pipeline never learned it (Ctrl-C during the request,
    or its answer lost): the run was left Scheduled, and a worker ran the stage with nobody waiting for
    it. The pipeline now finds it by the creation's idempotency key and cancels it, and deletes its payload."""
    import prefect.deployments

    import prefect_pipelines as pp
    from qosflow.prefect import stage
    from qosflow.prefect.tasks import qos_flow

    real = prefect.deployments.run_deployment
    created: list = []

    def lost_answer(*a, **kw):
        created.append(real(*a, **kw))
        raise RuntimeError("the server's answer was lost")

    monkeypatch.setattr(prefect.deployments, "run_deployment", lost_answer)
    deleted: list[str] = []
    real_delete = stage.delete_payload
    monkeypatch.setattr(stage, "delete_payload", lambda key: (deleted.append(key), real_delete(key)))

    @qos_flow(name="e2e-lost-answer")
    def pipeline():
        return pp.sleeper(str(tmp_path / "never.pid"))

    with pytest.raises(RuntimeError, match="answer was lost"):
        pipeline()
    [fr] = created
    assert deleted == [fr.parameters["payload"]]
    with _client() as c:
        _eventually(lambda: c.read_flow_run(fr.id).state.is_cancelled(), timeout=60)
    time.sleep(1.0)
    assert not [r for r in qos_worker.worker.records if r["flow_run_id"] == str(fr.id) and r["exit"] == "ok"]


def test_a_stage_logs_its_prints_unless_it_says_log_prints_false(qos_worker):
    """Until 2026-11-27 a stage run logged its prints whatever the stage's `log_prints` said (the stage flow
    was log_prints=True): a training loop that printed every step filled the run's logs with no way out."""
    import prefect_pipelines as pp
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    marker = uuid.uuid4().hex[:10]
    assert pp.log_prints_pipeline(marker) == [marker] * 3
    client = _client()

    def lines_of(stage: str) -> list[str]:
        runs = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=f".{stage}")))
                if r.parameters.get("stage") == stage and r.state is not None and r.state.is_completed()]
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs])))
        return [log.message for log in logs if marker in log.message]

    _eventually(lambda: lines_of("loud") and lines_of("quiet-made-loud"), timeout=30)
    assert lines_of("loud") == [f"loud stage says {marker}"]
    assert lines_of("quiet-made-loud") == [f"quiet stage says {marker}"]
    time.sleep(2)  # (logs reach the server in batches: the loud ones are there, the quiet one would be too)
    assert lines_of("quiet") == []


def test_a_pipeline_s_deadline_reaches_the_policy_as_each_stage_s_deadline(qos_worker):
    """The stages of three_stage have no deadline of their own; their pipeline's (300 s) is split along the critical
    path into each stage's `deadline_at`. The Job the policy orders and admits carries it as its deadline (a budget from
    when the worker queued it). Before 2026-11-28 it reached only the stage's at-risk events and its record: the policy
    saw best-effort stages, ordered after every stage with a deadline of its own."""
    import prefect_pipelines as pp

    from qosflow.prefect.tasks import PipelineRun

    sched = qos_worker.worker.scheduler
    seen: dict[str, float | None] = {}
    real = sched.request

    async def spy(entry, *a, **kw):
        job = entry.state.job
        seen[entry.name] = None if job.deadline is None else job.deadline  # (absolute: submit time + budget)
        return await real(entry, *a, **kw)

    sched.request = spy
    try:
        pp.three_stage(10)
    finally:
        del sched.request  # (the bound method again)
    run = PipelineRun.finished[-1]
    recs = {r.name: r for r in run.stages.values()}
    by_stage = {name: next(v for k, v in seen.items() if name in k) for name in ("load", "train", "evaluate")}
    for name, deadline in by_stage.items():
        assert deadline is not None, f"stage {name} reached the policy without its pipeline's deadline: {seen}"
        assert deadline == pytest.approx(recs[name].deadline_at, abs=0.01), (name, deadline, recs[name].deadline_at)


def test_the_worker_learns_what_other_workers_store(qos_worker):
    """The worker's learned estimator reads the rows other workers of the pool write to the shared store every
    QOSFLOW_PREDICTOR_REFRESH_SECONDS (`_predictor_refresh_loop`); before 2026-11-28 only when the worker started."""
    w = qos_worker.worker
    assert w._refresh_task is not None and not w._refresh_task.done()
    assert hasattr(w.scheduler.estimator, "refresh_from_store")


def test_the_refresh_loop_calls_the_estimator_off_the_loop_until_the_worker_stops():
    import threading
    import types

    from qosflow.prefect.worker import QosflowWorker

    calls: list[bool] = []
    fake = types.SimpleNamespace(_stopping=False, _logger=__import__("logging").getLogger("test"))

    class Est:
        def refresh_from_store(self):
            calls.append(threading.current_thread() is threading.main_thread())
            if len(calls) == 3:
                fake._stopping = True
            return 2

    asyncio.run(asyncio.wait_for(QosflowWorker._predictor_refresh_loop(fake, Est(), 0.01), 10))
    assert calls == [False, False, False]  # (three refreshes, none on the event loop's thread; then it stopped)
