"""What a user who deploys a pipeline with `prefect deploy` runs into (user review, 2026-11-26): the
example flow's run parameters, a pipeline deployed without QOSFLOW_POOL, a misspelt pool, a stage
cancelled from the CLI, a deadline that cannot be met."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from qosflow import qos_flow, qos_task


def test_the_example_flow_takes_a_duration_string_as_its_run_deadline():
    """`prefect deployment run retrain/hotfix-retrain -p qos_deadline=5min` was refused by Prefect
    ("'5min' is not valid under any of the given schemas"): flows/retrain.py annotated it `float | None`
    although durations may be strings (docs/prefect.md says to annotate `float | str | None`)."""
    import jsonschema
    from prefect.utilities.callables import parameter_schema

    from flows.retrain import retrain

    schema = parameter_schema(retrain.fn).model_dump_for_openapi()
    jsonschema.validate({"qos_deadline": "5min"}, schema)
    jsonschema.validate({"qos_deadline": 300}, schema)
    assert retrain.validate_parameters({"qos_deadline": "5min"})["qos_deadline"] == "5min"


# ------------------------------------------------------------------------------------ the pipeline's pool
@qos_task(gpus=0, cpu_cores=1, expected_duration=1)
def deployed_step(x):
    return x + 1


@qos_flow(name="deployed-pipe")
def deployed_pipe(x: int = 1):
    return deployed_step(x)


def _pools(*pools):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    from qosflow.prefect.local import pool_template

    async def mk():
        async with get_client() as c:
            for name, typ in pools:
                try:
                    await c.create_work_pool(WorkPoolCreate(name=name, type=typ, base_job_template=pool_template() if typ == "qosflow" else {}))
                except ObjectAlreadyExists:
                    pass

    asyncio.run(mk())


def _run_as_deployed(flow, pool: str):
    """Run `flow` in this process as the run of a deployment on `pool` that a worker took would run."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(flow, work_pool_name=pool)
    return run_flow(flow, flow_run=fr, return_type="state")


def test_a_pipeline_deployed_on_a_qosflow_pool_sends_its_stages_there_without_qosflow_pool(prefect_server, monkeypatch, caplog):
    """A deployment on the qosflow pool whose job variables do not set QOSFLOW_POOL (deployments/prefect.yaml
    without its `env:`, or `flow.deploy(work_pool_name="gpu")`) ran every stage in the pipeline's own process,
    unplaced: no GPU slot, no QoS, nothing said (user review: the run Completed with no stage run). It now
    dispatches them to the pool it was deployed on, and says so; a run deployed on a pool of another type
    still runs its stages in-process."""
    import qosflow.prefect.tasks as tasks

    _pools(("deployed-gpu", "qosflow"), ("deployed-proc", "process"))
    monkeypatch.delenv("QOSFLOW_POOL", raising=False)
    seen = []
    monkeypatch.setattr(tasks, "_dispatch", lambda task, run, pool, args, kwargs: seen.append(pool) or "dispatched")
    with caplog.at_level(logging.INFO):
        state = _run_as_deployed(deployed_pipe, "deployed-gpu")
    assert state.is_completed(), state
    assert seen == ["deployed-gpu"] and state.result() == "dispatched"
    assert any("stages go to work pool 'deployed-gpu'" in r.getMessage() for r in caplog.records)
    state = _run_as_deployed(deployed_pipe, "deployed-proc")
    assert state.is_completed() and state.result() == 2 and seen == ["deployed-gpu"]  # in-process, as before


def test_a_misspelt_pool_names_the_pool_it_meant_and_where_the_name_came_from(prefect_server, monkeypatch):
    """QOSFLOW_POOL: gpus in a deployment's env (the pool is 'gpu') failed the pipeline with "work pool
    'gpus' does not exist; create it with `qosflow init --pool gpus`": a second pool was the fix it offered.
    The error now names the qosflow pools there are, the closest one, and that QOSFLOW_POOL named it."""
    _pools(("deployed-gpu", "qosflow"))
    monkeypatch.setenv("QOSFLOW_POOL", "deployed-gpus")
    state = deployed_pipe(return_state=True)
    assert state.is_failed()
    msg = str(state.result(raise_on_failure=False))
    assert "work pool 'deployed-gpus' does not exist" in msg and "did you mean 'deployed-gpu'?" in msg, msg
    assert "qosflow pools on this server: " in msg and "came from QOSFLOW_POOL" in msg, msg
    # `qosflow worker start --pool gpus` and `qosflow status --pool gpus` check the pool the same way
    from qosflow.errors import SpecError
    from qosflow.prefect.local import check_pool

    with pytest.raises(SpecError, match=r"does not exist; create it with .*, or did you mean 'deployed-gpu'\?"):
        asyncio.run(check_pool("deployed-gpus"))


def test_the_docs_say_a_deployments_qos_policy_is_a_copy_made_at_deploy_time():
    """docs/prefect.md called the `qos_policy` job variable "a QoS policy block by reference", but
    `prefect deploy` resolves `{{ prefect.blocks.qosflow-qos-policy.nightly }}` into the block's values:
    a user who changed the block's deadline_s saw the nightly runs keep the old one."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "prefect.md").read_text()
    assert "QoS policy block by reference" not in doc
    assert "`prefect deploy` copies the block's values" in doc and "run\n  `prefect deploy` again" in doc
    assert "deploy again after changing the block" in (root / "deployments" / "prefect.yaml").read_text()
    from qosflow.prefect.worker import QosflowVariables  # the pool's variable, as the UI describes it

    said = QosflowVariables.model_fields["qos_policy"].description
    assert "by reference" not in said and "deploy again after changing the block" in said, said


# ------------------------------------------------------------------------------------ a stage cancelled from the CLI
@qos_task(gpus=0, cpu_cores=1, expected_duration=1)
def cancelled_step(x):
    return x


def test_a_stage_cancelled_from_outside_is_reported_cancelled_and_not_retried(prefect_server):
    """`prefect flow-run cancel <stage run>` while the stage ran: its run went Cancelling, then Crashed
    (its engine reporting the worker's SIGTERM), then Cancelled (the worker). The pipeline read the crash:
    StageFailed "ended Crashed: Execution was aborted by a termination signal.", and a stage with
    `retries` was started again. Now it waits for the Cancelled, raises StageCancelled, and the stage's
    retry condition refuses it (the user's own condition still decides other errors)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling, Crashed, Failed, Running

    from qosflow.prefect.tasks import StageCancelled, StageFailed, StageRecord, _stage_error, wait_for_stage

    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(deployed_pipe, name="cancelled.stage")
        for st in (Running(), Cancelling(), Crashed(message="Execution was aborted by a termination signal.")):
            c.set_flow_run_state(fr.id, st, force=True)
        fr = c.read_flow_run(fr.id)

    def worker_marks_it_cancelled():
        time.sleep(0.7)
        with get_client(sync_client=True) as c:
            c.set_flow_run_state(fr.id, Cancelled(message="cancelled: the qosflow worker stopped the stage"), force=True)

    t = threading.Thread(target=worker_marks_it_cancelled)
    t.start()
    got = wait_for_stage(fr, "no-such-pool", "train")
    t.join()
    assert got.state.is_cancelled(), got.state
    rec = StageRecord("train", "tr", (), 1.0, 0.5, time.time(), None)
    rec.flow_run_id = str(fr.id)
    err = _stage_error(got.state, "train", rec)
    assert isinstance(err, StageCancelled) and isinstance(err, StageFailed), err
    assert "was cancelled" in str(err) and "Crashed" not in str(err), err

    # without the worker's Cancelled (it died meanwhile) the crash is still said to be a cancellation
    with get_client(sync_client=True) as c:
        fr2 = c.create_flow_run(deployed_pipe, name="cancelled.stage2")
        for st in (Running(), Cancelling(), Crashed(message="Execution was aborted by a termination signal.")):
            c.set_flow_run_state(fr2.id, st, force=True)
        fr2 = c.read_flow_run(fr2.id)
    import qosflow.prefect.tasks as tasks

    got2 = tasks._settled_after_cancel(get_client(sync_client=True).__enter__(), fr2, wait_s=0.3)
    rec.flow_run_id = str(fr2.id)
    assert isinstance(_stage_error(got2.state, "train", rec), StageCancelled)

    # the retry condition: never after a cancel; otherwise retry, or the user's condition
    cond = cancelled_step.with_options(retries=2).retry_condition_fn
    assert cond(cancelled_step, None, Failed(data=StageCancelled("x"))) is False
    assert cond(cancelled_step, None, Failed(data=StageFailed("x"))) is True
    mine = cancelled_step.with_options(retries=2, retry_condition_fn=lambda task, tr, st: False).retry_condition_fn
    assert mine(cancelled_step, None, Failed(data=StageFailed("x"))) is False


def test_a_deadline_out_of_reach_is_said_on_the_pipelines_log(monkeypatch, caplog):
    """`prefect deployment run retrain/hotfix-retrain -p qos_deadline=5` (its stages take ~40 s): the
    run's log said nothing about its deadline; only an at-risk event and the forecast artifact did. The
    first at-risk forecast is now a warning on the run's log, with how late and the critical path left."""
    from qosflow.prefect import tasks
    from qosflow.prefect.tasks import PipelineRun

    written = []
    monkeypatch.setattr(tasks, "_artifact", lambda run, kind, key, data, description: written.append(key))
    events = []
    monkeypatch.setattr(tasks, "_emit", lambda name, run, payload: events.append(name))
    run = PipelineRun("hotfix", "fid", deadline=5, priority=None, pool=None,
                      plan={"load": [], "train": ["load"], "report": ["train"]}, expected={"load": 8, "train": 20, "report": 6})
    with caplog.at_level(logging.WARNING):
        run.publish_forecast()
        run.publish_forecast()
    lines = [r.getMessage() for r in caplog.records if "at risk" in r.getMessage()]
    assert events == ["qosflow.qos.at-risk"] and len(lines) == 1, (events, lines)
    assert "pipeline hotfix is at risk of missing its deadline (5s after its start)" in lines[0]
    assert "critical path left: load -> train -> report" in lines[0], lines[0]
    assert written == ["qosflow-forecast-hotfix"]  # (the second within FORECAST_MIN_INTERVAL_S: one version)


# ------------------------------------------------------------------------------------ the worker
def test_a_misspelt_job_variable_is_named_on_the_runs_log(prefect_server, caplog):
    """`qos_polcy: "{{ prefect.blocks.qosflow-qos-policy.nightly }}"` in prefect.yaml, or `prefect deployment
    run ... -jv prioirty=critical`: Prefect keeps only the pool template's variables, so the run went on
    without its deadline or class and nothing said so (user review). The worker now names each unknown
    job variable on the run's log with the one it most likely meant; qosflow's own stage runs are not checked."""
    import types
    import uuid

    from prefect.client.schemas.objects import FlowRun, WorkPool

    from qosflow.prefect.worker import QosflowJobConfiguration, QosflowWorker

    pool = WorkPool(name="gpu", type="qosflow", base_job_template=QosflowWorker.get_default_base_job_template())
    dep = types.SimpleNamespace(id=uuid.uuid4(), name="nightly", updated=None,
                                job_variables={"role": "pipeline", "qos_polcy": {"deadline_s": 3600}, "env": {"QOSFLOW_POOL": "gpu"}})
    fr = FlowRun(flow_id=uuid.uuid4(), name="elegant-pudu", job_variables={"prioirty": "critical"})
    with caplog.at_level(logging.WARNING):
        QosflowJobConfiguration(role="pipeline").prepare_for_flow_run(fr, dep, None, pool, "w")
    said = [r.getMessage() for r in caplog.records if "job variable" in r.getMessage()]
    assert len(said) == 1, said
    assert "'prioirty', 'qos_polcy' are not variables of work pool 'gpu' and are ignored" in said[0], said
    assert "did you mean 'priority' for 'prioirty'?" in said[0] and "did you mean 'qos_policy' for 'qos_polcy'?" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # well-spelt variables, and a stage run qosflow made: nothing to say
        QosflowJobConfiguration(role="pipeline").prepare_for_flow_run(
            FlowRun(flow_id=uuid.uuid4(), name="ok", job_variables={"role": "pipeline", "qos_policy": {}, "env": {}}), None, None, pool, "w")
        QosflowJobConfiguration(role="stage").prepare_for_flow_run(
            FlowRun(flow_id=uuid.uuid4(), name="p.s", job_variables={"role": "stage", "gpus": 1, "not_in_an_old_pool": 1}), None, None, pool, "w")
    assert not [r for r in caplog.records if "job variable" in r.getMessage()]


def test_a_reservation_a_few_seconds_away_is_said_in_seconds():
    """Two pipelines' 2-GPU stages on one 4-GPU host (user review): the waiting stage's note read
    "reserved host0 (free for it in about 0.0 h)"."""
    from qosflow.core import ClusterSpec, Job, QoSSpec
    from qosflow.policies import get_policy
    from qosflow.sim.engine import SimConfig, simulate

    jobs = [Job("a", 0.0, QoSSpec(gpus=4), 60.0),
            Job("b", 20.0, QoSSpec(gpus=2, deadline=180.0), 40.0)]
    res = simulate(jobs, ClusterSpec.uniform(1, 4, virtual=True), get_policy("qosflow"), config=SimConfig(restart_overhead=0))
    b = next(j for j in res.jobs if j.job_id == "b")
    assert "reserved node0 (free for it in about 40 s)" in b.note, b.note  # its last waiting note


def test_status_counts_a_schedules_coming_runs_apart_from_the_running_ones(prefect_server, capsys, monkeypatch):
    """`qosflow status --pool gpu` said "6 pipeline run(s) of its deployments not finished" with one
    pipeline running: the others were the nightly deployment's runs for the coming days (user review)."""
    from datetime import datetime, timedelta, timezone

    from prefect.client.orchestration import get_client
    from prefect.states import Running, Scheduled

    from qosflow.cli.main import main
    from qosflow.prefect.status import pool_status

    pool = "status-nightly"
    _pools((pool, "qosflow"))
    with get_client(sync_client=True) as c:
        flow_id = c.create_flow_from_name("status-nightly-retrain")
        dep = c.create_deployment(flow_id=flow_id, name="nightly", work_pool_name=pool, entrypoint="flows/retrain.py:retrain")
        later = datetime.now(timezone.utc) + timedelta(days=1)
        for d in (0, 1, 2):
            c.create_flow_run_from_deployment(dep, state=Scheduled(scheduled_time=later + timedelta(days=d)))
        now_run = c.create_flow_run_from_deployment(dep)
        c.set_flow_run_state(now_run.id, Running(), force=True)
    st = asyncio.run(pool_status(pool))
    assert (st.pipelines_running, st.pipelines_scheduled) == (1, 3), st
    assert abs(st.next_pipeline_at - later.timestamp()) < 1.0
    assert main(["status", "--pool", pool]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "1 pipeline run(s) of its deployments running or due, 3 scheduled later (the next at " in text, text


def test_submitting_a_stage_outside_a_flow_says_what_to_do_instead():
    """`featurize.submit(d)` in a script (no flow run): Prefect's "Unable to determine task runner ... please
    use `.delay`" sent users to Prefect's task workers, which do not place stages on GPU slots."""
    from qosflow.prefect.tasks import QosflowStageOutsideFlow

    with pytest.raises(QosflowStageOutsideFlow, match=r"call it in a @qos_flow function .* call the stage directly, deployed_step\(\.\.\.\)") as ei:
        deployed_step.submit(1)
    assert isinstance(ei.value, RuntimeError) and ".delay" not in str(ei.value)
    with pytest.raises(QosflowStageOutsideFlow, match=r"\.map\(\)"):
        deployed_step.map([1, 2])


def test_a_cpu_only_stage_says_it_has_no_gpu():
    """A CPU-only stage's log read "stage load_data on host0: GPU - (virtual), 1 cores (cpuset [0])"."""
    from qosflow.placement_api import PlacementInfo
    from qosflow.prefect.stage import where_placed

    cpu = PlacementInfo(placed=True, node="host0", gpus=(), gpu_milli=0, cpu_cores=1.0, cpuset=(0,), virtual_gpus=True)
    assert where_placed(cpu) == "host0: no GPU, 1 core (cpuset [0])"
    two = PlacementInfo(placed=True, node="host0", gpus=(0, 1), cpu_cores=2.0, cpuset=(0, 1), virtual_gpus=True)
    assert where_placed(two) == "host0: GPUs 0,1 (virtual), 2 cores (cpuset [0, 1])"
    half = PlacementInfo(placed=True, node="host1", gpus=(3,), gpu_milli=500, cpu_cores=1.0, cpuset=(4,))
    assert where_placed(half) == "host1: GPU 3, 1 core (cpuset [4]), share 500/1000"


@qos_task(gpus=0, cpu_cores=1, expected_duration=1)
def cut_first(x):
    return x


@qos_task(gpus=0, cpu_cores=1, expected_duration=1)
def cut_after(x):
    return x + 1


@qos_flow(name="cut-pipe")
def cut_pipe():
    a = cut_first.submit(1)
    return cut_after.submit(a).result()


def test_a_pipeline_whose_stage_was_cancelled_names_that_stage(prefect_server, monkeypatch):
    """Cancelling one stage from the CLI failed the pipeline with "UnfinishedRun: Run is in PENDING state,
    its result is not available" (the stages after it NotReady): the run's headline named no stage.
    It now says which stage did not complete, and why."""
    import uuid

    import prefect.deployments
    from prefect.states import Cancelled

    import qosflow.prefect.tasks as tasks

    class Run:  # the stage's flow run, as the pipeline reads it once the worker has cancelled it
        id = uuid.uuid4()
        state = Cancelled(message="cancelled: the qosflow worker stopped the stage")
        labels: dict = {}
        start_time = end_time = None

    monkeypatch.setenv("QOSFLOW_POOL", "cut-pool")
    monkeypatch.setattr(tasks, "ensure_stage_deployment", lambda pool: f"qosflow-stage/{pool}")
    monkeypatch.setattr(prefect.deployments, "run_deployment", lambda *a, **k: Run())
    monkeypatch.setattr(tasks, "wait_for_stage", lambda fr, *a, **k: fr)
    state = cut_pipe(return_state=True)
    assert state.is_failed()
    msg = state.message or ""
    assert "StageCancelled: stage 'cut_first' did not complete (StageCancelled: stage 'cut_first'" in msg, msg
    assert "so the stages that need its result did not run (UnfinishedRun" in msg, msg


def test_a_pipeline_run_starts_on_the_workers_host_when_its_stages_run_on_agents(tmp_path):
    """deployments/prefect.yaml deploys the pipelines themselves on the qosflow pool (role: pipeline). With a
    worker started on host agents (`qosflow worker start --pool gpu --cluster-file lab.yaml`) every such run
    crashed at once: 'Failed to submit flow run to infrastructure: RuntimeError: backend agent cannot start an
    unplaced pipeline run' (admin review, the bare-metal set-up of docs/infrastructure.md). A pipeline run
    holds no slot: it now runs as a process on the worker's host, as with the local backend, and is
    cancelled there."""
    import os
    import sys
    import uuid

    from prefect.client.schemas.objects import FlowRun

    from qosflow.backends.base import Backend
    from qosflow.core.cluster import ClusterSpec
    from qosflow.prefect.worker import QosflowJobConfiguration, QosflowWorker

    class AgentsLike(Backend):  # a backend that runs placed stages only (AgentBackend, KubernetesBackend)
        name = "agent"

        async def inventory(self):
            return ClusterSpec.uniform(1, 1, virtual=True)

        async def launch(self, spec):
            raise AssertionError("a pipeline run is not a placed stage")

        async def wait(self, handle):
            raise AssertionError("not this backend's process")

        async def kill(self, handle, reason="cancelled", grace=None):
            raise AssertionError("not this backend's process")

    out = tmp_path / "ran"

    async def go():
        w = QosflowWorker(work_pool_name="agents-pool", backend=AgentsLike(), leases=False, create_pool_if_not_found=False)
        try:
            cfg = QosflowJobConfiguration(role="pipeline", command=f"{sys.executable} -c \"open('{out}', 'w').write('ran')\"")
            done = await asyncio.wait_for(w._run(FlowRun(flow_id=uuid.uuid4(), name="p"), cfg), 60)
            assert done.status_code == 0 and out.read_text() == "ran"
            # a cancelled one is killed where it runs
            cfg = QosflowJobConfiguration(role="pipeline", command=f"{sys.executable} -c \"import time; time.sleep(600)\"")
            fr = FlowRun(flow_id=uuid.uuid4(), name="q")
            run = asyncio.ensure_future(w._run(fr, cfg))
            for _ in range(200):
                if str(fr.id) in w._handles:
                    break
                await asyncio.sleep(0.05)
            pid = w._handles[str(fr.id)].ref["pid"]
            await w.kill_infrastructure(str(pid), cfg)
            await asyncio.wait_for(run, 30)  # (ended long before its 600 s)
            assert not w._handles and not os.path.exists(f"/proc/{pid}/cmdline")
        finally:
            await w.teardown(None, None, None)

    asyncio.run(go())


def test_the_workers_placed_line_says_no_gpu_for_a_cpu_only_stage():
    """The worker's log said 'placed evaluate on host0 (GPUs - virtual, 1 core)' for every CPU-only stage of
    flows/retrain.py (admin review; the stage's own log line was fixed to 'no GPU' in 0264612)."""
    from qosflow.prefect.worker import gpus_said

    assert gpus_said({"gpus": [], "gpu_model": "cpu", "virtual_gpus": True}) == "no GPU"
    assert gpus_said({"gpus": ["1"], "gpu_model": "generic", "virtual_gpus": True}) == "GPUs 1 virtual"
    assert gpus_said({"gpus": ["lab-1:0", "lab-1:1"], "gpu_model": "a100", "virtual_gpus": False}) == "GPUs lab-1:0,lab-1:1 a100"


def test_a_stage_cancelled_with_its_pipeline_says_so():
    """A pipeline run cancelled in the UI has its running stages cancelled by the worker ('qosflow: its pipeline run
    ... was Cancelling'); the stage's StageCancelled said its run 'was cancelled from outside the pipeline, e.g.
    `prefect flow-run cancel` or the UI' (agent review). It now says it went with its pipeline's run; a stage cancelled
    on its own still names the UI and `prefect flow-run cancel`."""
    from prefect.states import Cancelled

    from qosflow.prefect.tasks import StageCancelled, StageRecord, _stage_error

    rec = StageRecord("train", None, (), 1.0, 0.0, 0.0, flow_run_id="f-1")
    err = _stage_error(Cancelled(message="qosflow: its pipeline run p-1 was Cancelling"), "train", rec, told_to_cancel=False)
    assert isinstance(err, StageCancelled) and "cancelled with its pipeline's run" in str(err), err
    err = _stage_error(Cancelled(message="cancelled by a user"), "train", rec, told_to_cancel=False)
    assert "from the UI, `prefect flow-run cancel`, or with its pipeline's run" in str(err), err
