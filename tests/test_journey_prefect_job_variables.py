"""A first user's deployment to a `qosflow` pool with wrong QoS job variables (`gpus: -1`, `priority: urgent`).

Before: `prefect deploy` took `gpus: -1`; each run of a stage-role deployment then crashed with a traceback
("Failed to submit flow run to infrastructure: SpecError: stage 'meek-cricket': ..."), naming neither the
deployment nor the fix, and a pipeline-role deployment's bad values were dropped without a word. Now the
pool's schema refuses what it can at deploy time, and the worker fails any other run at once, saying which
job variable of which deployment is wrong and how to correct it.
"""

from __future__ import annotations

import asyncio
import copy

import pytest

from qosflow.prefect.blocks import BareMetalGPUCluster


def _without_bounds(template: dict) -> dict:
    """The template of a pool created before the QoS variables had bounds (what `qosflow init` made until now)."""
    t = copy.deepcopy(template)
    for prop in t["variables"]["properties"].values():
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            prop.pop(k, None)
        for alt in prop.get("anyOf", []):
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                alt.pop(k, None)
    return t


def test_the_pool_refuses_out_of_range_qos_job_variables_at_deploy_time(prefect_server):
    from prefect.client.orchestration import get_client

    from qosflow.prefect.local import setup_pool

    pool = "journey-jv-deploy"

    async def go():
        await setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1))
        refused, accepted = {}, []
        async with get_client() as c:
            flow_id = await c.create_flow_from_name("journey-jv-flow")
            for i, jv in enumerate([{"gpus": -1}, {"gpu_milli": 2000}, {"deadline": 0}, {"cpu_cores": -2},
                                    {"gpus": 2, "cpu_cores": 0, "deadline": 60}]):
                try:
                    await c.create_deployment(flow_id=flow_id, name=f"d{i}", work_pool_name=pool, entrypoint="x.py:f",
                                              job_variables={"role": "pipeline", **jv})
                    accepted.append(jv)
                except Exception as exc:
                    refused[next(iter(jv))] = str(exc)
        return refused, accepted

    refused, accepted = asyncio.run(go())
    assert set(refused) == {"gpus", "gpu_milli", "deadline", "cpu_cores"}, (refused, accepted)
    for field, msg in refused.items():
        assert f"'{field}'" in msg, msg
    assert accepted == [{"gpus": 2, "cpu_cores": 0, "deadline": 60}]


@pytest.mark.parametrize("role,jv,field", [("pipeline", {"priority": "urgent"}, "priority"),
                                           ("auto", {"gpus": -1}, "gpus")])
def test_a_run_with_a_bad_qos_job_variable_fails_at_once_naming_it_and_its_deployment(prefect_server, role, jv, field):
    """On a pool made before the bounds (or for what a schema cannot say: an unknown priority) the worker
    fails the run before it starts, instead of crashing it with a traceback or ignoring the value."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    from qosflow.prefect.local import setup_pool
    from qosflow.prefect.worker import QosflowWorker

    pool = f"journey-jv-run-{role}"

    async def go():
        await setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1))
        async with get_client() as c:
            old = _without_bounds((await c.read_work_pool(pool)).base_job_template)
            await c.update_work_pool(pool, WorkPoolUpdate(base_job_template=old))
            flow_id = await c.create_flow_from_name("journey-jv-flow")
            dep = await c.create_deployment(flow_id=flow_id, name=f"bad-{field}", work_pool_name=pool, entrypoint="x.py:f",
                                            job_variables={"role": role, **jv})
            fr = await c.create_flow_run_from_deployment(dep)
        async with QosflowWorker(work_pool_name=pool, create_pool_if_not_found=False) as w:
            await w.sync_with_backend()
            # (what it returns depends on timing: a run failed before Prefect's submission bookkeeping ends may be
            # left out of it; the run's state, set by the worker with qosflow's message, is the test)
            await w.get_and_submit_flow_runs()
            for _ in range(200):
                async with get_client() as c:
                    state = (await c.read_flow_run(fr.id)).state
                if state.is_final():
                    break
                await asyncio.sleep(0.1)
        return state

    state = asyncio.run(go())
    assert state.is_failed(), state
    msg = state.message or ""
    assert f"job variable '{field}' of deployment 'journey-jv-flow/bad-{field}'" in msg, msg
    assert "prefect deploy" in msg and "was not started" in msg, msg



def test_an_existing_deployment_with_an_out_of_range_qos_job_variable(prefect_server):
    """What Prefect 3.8 does with `gpus: -1` for a deployment that exists already (docs/prefect.md), so that the docs
    follow it: `prefect deploy` (or `flow.deploy`) again is refused (409) without the field's name (`Error creating
    deployment: <ValidationError: '-1 is not valid under any of the given schemas'>`: Prefect validates an existing
    deployment's variables with jsonschema and shows its error's repr), and the deployment keeps its variables. A PATCH
    without the pool's name is taken, but no run of it can be created: that refusal names the field. (A pool made
    before the bounds: the worker fails the run naming it, the test above.)"""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    from qosflow.prefect.local import setup_pool

    pool = "journey-jv-existing"

    async def go():
        await setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1))
        async with get_client() as c:
            flow_id = await c.create_flow_from_name("journey-jv-flow")
            dep = await c.create_deployment(flow_id=flow_id, name="existing", work_pool_name=pool, entrypoint="x.py:f",
                                            job_variables={"role": "pipeline", "gpus": 1})
            try:  # (what `prefect deploy` and flow.deploy() send for a deployment that exists: a PATCH with its pool)
                await c.update_deployment(dep, DeploymentUpdate(work_pool_name=pool, job_variables={"role": "pipeline", "gpus": -1}))
                upsert = None
            except Exception as exc:
                upsert = str(exc)
            kept = (await c.read_deployment(dep)).job_variables
            # (a PATCH without the pool's name, as an API client may send, is not checked against the pool's schema)
            await c.update_deployment(dep, DeploymentUpdate(job_variables={"role": "pipeline", "gpus": -1}))
            try:
                await c.create_flow_run_from_deployment(dep)
                run = None
            except Exception as exc:
                run = str(exc)
        return upsert, kept, run

    upsert, kept, run = asyncio.run(go())
    assert upsert is not None and "409" in upsert and "-1 is not valid under any of the given schemas" in upsert, upsert
    assert kept == {"role": "pipeline", "gpus": 1}, kept
    assert run is not None and "Validation failed for field 'gpus'" in run, run
