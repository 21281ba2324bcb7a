"""A first user SIGKILLs the worker of a local pool mid-train and starts it again (same --name): the restarted
worker finds the stage's process still running, stops it (a local stage cannot be handed to a new worker) and
reruns the stage. Its log said "recovery: stage ... is no longer running; rescheduling its flow run", and the
run's state "attempt ... was lost while no worker watched it", of a process it had itself just killed. Now both
say that the process was still running and was stopped, and why."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid

from qosflow.prefect.blocks import BareMetalGPUCluster


def test_a_local_stage_found_running_after_a_restart_is_said_to_be_stopped_not_lost(prefect_server, caplog):
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from qosflow.backends.base import StageHandle
    from qosflow.prefect.local import setup_pool
    from qosflow.prefect.worker import QosflowWorker
    from qosflow.store.leases import Lease

    pool = "journey-restart"

    async def go():
        await setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 1))
        async with get_client() as c:
            dep = await c.read_deployment_by_name(f"qosflow-stage/{pool}")
            fr = await c.create_flow_run_from_deployment(dep.id, parameters={"payload": "none"}, job_variables={"role": "stage", "gpus": 1})
            await c.set_flow_run_state(fr.id, Running(), force=True)
        fid = str(fr.id)
        # the stage's process, left by the SIGKILLed worker: a session of its own, its flow run in its environment
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                                env={**os.environ, "PREFECT__FLOW_RUN_ID": fid})
        try:
            async with QosflowWorker(work_pool_name=pool, create_pool_if_not_found=False, name="journey-w1") as w:
                await w.sync_with_backend()
                await w._ensure_qos()
                now = time.time()
                lease = Lease(uuid.uuid4().hex, w._pool_key, fid, fid, w.holder, "local", ["host0"], {}, None, now, now + 30)
                # a lease of an older qosflow: no start time recorded, so the process cannot be adopted (since
                # 2026-11-28 one whose pid and start time match is: tests/test_journey_prefect_local_restart.py)
                handle = StageHandle(fid, "local", "local", ref={"pid": proc.pid})
                with caplog.at_level(logging.WARNING):
                    await w._take_back(lease, handle)
            async with get_client() as c:
                state = (await c.read_flow_run(fr.id)).state
            return proc.pid, proc.wait(timeout=10), state
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    pid, code, state = asyncio.run(go())
    assert code == -9, code  # (stopped by the worker)
    said = [r.getMessage() for r in caplog.records if "recovery: stage" in r.getMessage()]
    assert len(said) == 1, said
    assert f"its process {pid} on host0 was still running, started by an earlier worker process, and its lease did not record its " \
           "start time (an older qosflow): it was stopped; rescheduling its flow run" in said[0], said
    assert "no longer running" not in said[0], said
    assert state.name == "AwaitingRetry", state
    assert "was still running" in state.message and "the stage runs again from its start" in state.message, state.message
