"""Prefect's own features on @qos_task / @qos_flow, through a real server and the qosflow worker."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def pool(prefect_server):
    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    name = "feat-gpu"
    asyncio.run(setup_pool(name, cluster=BareMetalGPUCluster.virtual(1, 2, cpu_cores=8), policy=QoSPolicy(policy="fifo", options={"backfill": True}),
                           stream_output=False))
    w = WorkerThread(name).wait_ready(120)
    os.environ["QOSFLOW_POOL"] = name
    yield name
    os.environ.pop("QOSFLOW_POOL", None)
    w.stop()


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _stage_runs(pipeline_run_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with _client() as c:
        return c.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[pipeline_run_id])))


def _last_run_id():
    from qosflow.prefect.tasks import PipelineRun

    return PipelineRun.finished[-1].flow_run_id


def test_map(pool):
    import feature_pipelines as fp

    assert fp.map_pipeline([1, 2, 3]) == [1, 4, 9]
    assert len(_stage_runs(_last_run_id())) == 3


def test_cache_policy(pool, tmp_path):
    import feature_pipelines as fp

    marker = tmp_path / "m"
    assert fp.cache_pipeline(str(marker)) == [6, 6]
    print("ran", marker.read_text().count("ran"), "stage runs", len(_stage_runs(_last_run_id())))


def test_allow_failure_and_return_state(pool):
    import feature_pipelines as fp

    out = fp.allow_failure_pipeline()
    print(out)
    assert out["after"] == 16 and out["state"] == "FAILED" and "boom 2" in out["exc"]


def test_tags_and_names(pool):
    import feature_pipelines as fp

    assert fp.tags_pipeline("t1") == 9
    rid = _last_run_id()
    with _client() as c:
        fr = c.read_flow_run(rid)
    print("pipeline name", fr.name)
    assert fr.name == "tagged-t1"
    (stage,) = _stage_runs(rid)
    # the tags of `with tags(...)` around the call reach the stage's run (it had the decorator's only)
    assert stage.name == "tagged-t1.square" and "ctx-t1" in stage.tags and "qos:gpus=0" in stage.tags


def test_pydantic_and_task_run_name(pool):
    import feature_pipelines as fp

    out = fp.pydantic_pipeline(fp.Params(lr=0.5))
    assert isinstance(out, fp.Params) and out.lr == 1.0
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    with _client() as c:
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[_last_run_id()])))
    print("task runs", [t.name for t in trs])


def test_nested_subflow(pool):
    import feature_pipelines as fp

    from qosflow.prefect.tasks import PipelineRun

    out = fp.nested_pipeline(3)
    assert out["pid"] != os.getpid()
    # a stage called in a plain subflow of the pipeline is the pipeline's: it went out as no pipeline's
    # ('stage.pid_of', unrecorded, no pipeline deadline), and ran in-process when the pool came from
    # @qos_flow(pool=...) rather than QOSFLOW_POOL
    run = PipelineRun.finished[-1]
    assert run.flow_name == "feat-nested" and list(run.stages) == ["pid_of"]
    assert out["pid"] != os.getpid()
    os.environ.pop("QOSFLOW_POOL")
    try:
        out = fp.nested_pipeline_pool_arg(4)
    finally:
        os.environ["QOSFLOW_POOL"] = pool
    assert out["pid"] != os.getpid(), "the subflow's stage ran in the pipeline's process"
    assert list(PipelineRun.finished[-1].stages) == ["pid_of"]


def test_hooks(pool):
    import feature_pipelines as fp

    fp.CALLS.clear()
    assert fp.hooks_pipeline() == "negative"
    print(fp.CALLS)
    assert [c[0] for c in fp.CALLS] == ["completed", "failed"]


def test_async_caller(pool):
    import feature_pipelines as fp

    out = asyncio.run(fp.async_caller(2))
    print(out)
    assert out["pid"] != os.getpid()


def test_with_options(pool):
    import feature_pipelines as fp

    out = fp.with_options_pipeline()
    assert out["pid"] != os.getpid()
    for r in _stage_runs(_last_run_id()):
        print("stage run", r.name, r.tags)


def test_task_concurrency_limit_by_tag(pool):
    import feature_pipelines as fp
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    with _client() as c:
        c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="tag:feat-lim", limit=1))
    (a0, a1), (b0, b1) = fp.concurrency_pipeline()
    print("intervals", a0, a1, b0, b1)
    assert a1 <= b0 or b1 <= a0


def test_run_logger_in_a_stage(pool):
    import feature_pipelines as fp
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    fp.pydantic_pipeline(fp.Params(lr=0.25))
    (stage,) = _stage_runs(_last_run_id())
    import time
    time.sleep(3)
    with _client() as c:
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[stage.id])))
    msgs = [l.message for l in logs]
    print(msgs)
    assert any("fitting with lr=0.25" in m for m in msgs)


def test_pause_in_a_stage(pool):
    import threading
    import time
    import feature_pipelines as fp
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    resumed = []

    def resume():
        from prefect.flow_runs import resume_flow_run
        deadline = time.time() + 90
        while time.time() < deadline:
            with _client() as c:
                for r in c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="pausing"))):
                    if r.state and r.state.is_paused():
                        resume_flow_run(r.id)
                        resumed.append(r.id)
                        return
            time.sleep(1)

    t = threading.Thread(target=resume, daemon=True)
    t.start()
    out = fp.pause_pipeline()
    t.join(5)
    print("pause ->", out, resumed)
    assert out == 2 and resumed


def test_flow_retries(pool, tmp_path):
    import feature_pipelines as fp

    assert fp.flow_retries_pipeline(str(tmp_path / "m")) == "ok"


def test_a_pipeline_without_a_pool_says_its_stages_run_in_its_process(prefect_server, monkeypatch):
    # `pipeline.serve()` runs are on no work pool: started from a shell without QOSFLOW_POOL, every stage ran in
    # the pipeline's process, on no GPU slot, and nothing said so
    import time

    import feature_pipelines as fp
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    monkeypatch.delenv("QOSFLOW_POOL", raising=False)
    assert fp.map_pipeline([2]) == [4]
    rid = _last_run_id()
    msgs: list = []
    for _ in range(40):
        with _client() as c:
            msgs = [l.message for l in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[rid])))]
        if any("no qosflow pool for this run" in m for m in msgs):
            break
        time.sleep(0.5)
    assert any("no qosflow pool for this run" in m for m in msgs), msgs


def test_flow_timeout_cancels_the_stage_it_waits_for(pool):
    import time

    import feature_pipelines as fp

    t0 = time.monotonic()
    state = fp.flow_timeout_pipeline(return_state=True)
    took = time.monotonic() - t0
    (stage,) = _stage_runs(_last_run_id())
    for _ in range(60):
        with _client() as c:
            stage = c.read_flow_run(stage.id)
        # (not any final state: a killed stage's engine reports Crashed first, the worker's Cancelled follows)
        if stage.state.is_cancelled():
            break
        time.sleep(1)
    print("pipeline", state.name, "took", round(took, 1), "stage", stage.state.name)
    assert state.name == "TimedOut" and took < 60
    assert stage.state.is_cancelled()


def test_served_pipeline_with_parameters(pool):
    # `pipeline.serve()`: what a Runner does, for one run; the served run's process inherits QOSFLOW_POOL.
    # The runner pickles the pipeline's wrapper by value, with the globals it names: naming a ContextVar
    # (c99b272) crashed every served run ("cannot pickle '_contextvars.ContextVar' object")
    import time

    import feature_pipelines as fp
    from prefect.deployments import run_deployment
    from prefect.runner import Runner

    runner = Runner(name="feat-serve", query_seconds=1)
    runner.add_flow(fp.pydantic_pipeline, name="served", parameters={"p": {"lr": 0.125}})
    import asyncio as aio
    import threading

    t = threading.Thread(target=lambda: aio.run(runner.start()), daemon=True)
    t.start()
    time.sleep(5)
    fr = run_deployment("feat-pydantic/served", timeout=240)
    try:
        print("served", fr.state.name, fr.state.message)
        assert fr.state.is_completed()
        (stage,) = _stage_runs(fr.id)
        assert stage.name.endswith(".fit") and stage.state.is_completed()
    finally:
        runner.stop() if hasattr(runner, "stop") else None
