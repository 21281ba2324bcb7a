"""Prefect's own controls on a qosflow pool (journey of 2026-11-28 on a real server and `qosflow worker start`):
a pool or work-queue concurrency limit, a paused pool or queue.

A deployed pipeline run is a flow run of the pool that runs (holding no GPU) while it waits for its stages, which are
flow runs of the same pool (`qosflow-stage/<pool>`). Prefect counts both against a pool's or a queue's concurrency
limit: with `prefect work-pool set-concurrency-limit gpu 1` the first pipeline run took the only slot, the server
never handed out its stage run, and the pipeline waited for ever, its log saying the worker 'took no run'."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from qosflow import qos_flow, qos_task

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
POOL = "ctl-gpu"


@pytest.fixture(scope="module")
def ctl_worker(prefect_server):
    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    asyncio.run(setup_pool(POOL, cluster=BareMetalGPUCluster.virtual(1, 2, cpu_cores=4), policy=QoSPolicy(policy="fifo"), stream_output=False))
    w = WorkerThread(POOL).wait_ready(120)
    yield w
    w.stop()


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _set_limits(pool_limit=None, queue_limit=None, pool_paused=None):
    from prefect.client.schemas.actions import WorkPoolUpdate

    with _client() as c:
        c.update_work_pool(POOL, WorkPoolUpdate(concurrency_limit=pool_limit, is_paused=bool(pool_paused)))
        q = c.read_work_queue_by_name("default", work_pool_name=POOL)
        c.update_work_queue(q.id, concurrency_limit=queue_limit)


# a stage's timeout bounds the test: before the fix the stage run was never handed out and the pipeline
# ended with StageTimedOut instead of the stage's value (no assertion on how long anything took)
@qos_task(gpus=1, cpu_cores=1, expected_duration=2, timeout_seconds=90)
def limited_step(x: int) -> int:
    return x * 2


@qos_flow(name="limited-pipe")
def limited_pipe(x: int = 3) -> int:
    return limited_step(x)


def _run_as_deployed(flow):
    """Run `flow` in this process as the pipeline run of a deployment on POOL that a worker took: a Running flow
    run of the pool's default queue, which counts against its limits like any other."""
    from prefect.flow_engine import run_flow

    with _client() as c:
        fr = c.create_flow_run(flow, work_pool_name=POOL)
    return run_flow(flow, flow_run=fr, return_type="state")


@pytest.mark.parametrize("where", ["pool", "queue"])
def test_a_concurrency_limit_full_of_pipeline_runs_does_not_hold_back_their_stages(ctl_worker, monkeypatch, where):
    monkeypatch.delenv("QOSFLOW_POOL", raising=False)
    _set_limits(pool_limit=1 if where == "pool" else None, queue_limit=1 if where == "queue" else None)
    try:
        state = _run_as_deployed(limited_pipe)
    finally:
        _set_limits()
    assert state.is_completed(), f"the pipeline ended {state.name}: {state.message}"
    assert state.result() == 6


@qos_flow(name="paused-pipe")
def paused_pipe(x: int = 3) -> int:
    return limited_step.with_options(timeout_seconds=8)(x)


def test_a_paused_pool_holds_the_stages_too_even_past_a_full_limit_and_the_pipeline_says_why(ctl_worker, monkeypatch):
    """A pause is not bypassed (Prefect users pause a pool to stop new work): the stage's run is not taken while the
    pool is paused, also when a concurrency limit is full (where stage runs are otherwise taken past it); its
    pipeline's warning says the pool is paused and how to resume it, not that the worker 'took no run'."""
    from qosflow.prefect.tasks import StageTimedOut
    from qosflow.prefect.tasks import _pickup_hint

    monkeypatch.delenv("QOSFLOW_POOL", raising=False)
    _set_limits(pool_limit=1, pool_paused=True)
    try:
        state = _run_as_deployed(paused_pipe)
        with _client() as c:
            hint = _pickup_hint(c, POOL, "default")
    finally:
        _set_limits()
    assert state.is_failed(), f"the pipeline ended {state.name}: {state.message}"
    with pytest.raises(StageTimedOut):
        state.result()
    assert f"work pool {POOL!r} is paused" in hint and f"prefect work-pool resume {POOL}" in hint, hint


def test_a_paused_work_queue_is_named_in_the_pickup_warning(prefect_server):
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    from qosflow.prefect.local import pool_template
    from qosflow.prefect.tasks import _pickup_hint

    pool = "ctl-queue-paused"
    with _client() as c:
        try:
            c.create_work_pool(WorkPoolCreate(name=pool, type="qosflow", base_job_template=pool_template()))
        except ObjectAlreadyExists:
            pass
        c.create_work_queue("stages", work_pool_name=pool, is_paused=True)
        hint = _pickup_hint(c, pool, "stages")
    assert f"work queue 'stages' of work pool {pool!r} is paused" in hint, hint
    assert f"prefect work-queue resume stages --pool {pool}" in hint, hint
