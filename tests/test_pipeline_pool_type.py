"""A pipeline pointed at a pool of another type (admin review: QOSFLOW_POOL=proc, a process pool): the
SpecError was raised inside the first stage's task run, so Prefect retried it as a stage error (its
retries used up), the downstream stages ended NotReady and the pipeline failed with "UnfinishedRun: Run
is in PENDING state". Now the pool is checked when the pipeline starts: its failure is the SpecError, once."""

from __future__ import annotations

import asyncio

from qosflow import qos_flow, qos_task


@qos_task(gpus=0, cpu_cores=1, expected_duration=1, retries=2, retry_delay_seconds=0)
def pool_type_load(x):
    return x


@qos_task(gpus=0, cpu_cores=1, expected_duration=1)
def pool_type_use(x):
    return x + 1


@qos_flow(name="pool-type-pipe", pool="pool-type-proc")
def pool_type_pipe():
    a = pool_type_load.submit(1)
    return pool_type_use.submit(a).result()


def test_a_pipeline_on_a_pool_of_another_type_fails_once_with_the_cause(prefect_server, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    import qosflow.prefect.tasks as tasks

    async def mk():
        async with get_client() as c:
            try:
                await c.create_work_pool(WorkPoolCreate(name="pool-type-proc", type="process"))
            except ObjectAlreadyExists:
                pass

    asyncio.run(mk())
    calls = []
    real = tasks.ensure_stage_deployment

    def counted(pool):
        calls.append(pool)
        return real(pool)

    monkeypatch.setattr(tasks, "ensure_stage_deployment", counted)
    state = pool_type_pipe(return_state=True)
    msg = state.message or ""
    assert state.is_failed(), state
    assert "has type 'process'" in msg and "UnfinishedRun" not in msg and "PENDING" not in msg, msg
    assert calls == ["pool-type-proc"], calls  # once: no retry of the stage (was 3: the stage's 2 retries used up)
