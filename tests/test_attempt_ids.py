"""A stage run taken from the queue again gets attempt ids no launch used before (`QosflowWorker._attempt_base`).

An agent keeps the record of an ended stage, and a Kubernetes Job stays, under its attempt id, and a launch under
an id used before is answered with that earlier attempt (409: "adopt it, never start it twice"). The first attempt
of every pickup of a stage run had the flow run id as its id, so a run put back in the queue (recovery after a
worker was killed, a stage lost while no worker watched it) was "launched" onto its earlier, ended attempt: the
stage did not run and got the old exit status (checked by hand on a real agent: a second launch of an id whose
process had exited 3 returned exit 3 at once and ran nothing)."""

from __future__ import annotations

import asyncio
import logging
import re
from types import SimpleNamespace

from qosflow.prefect.worker import QosflowWorker


def _run_in(state_names):
    """A real flow run taken through `state_names` (Pending/Running/AwaitingRetry...), as the server has it."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry, Pending, Running, Scheduled

    @flow(name="stands-for-a-stage")
    def stage():
        pass

    make = {"Pending": Pending, "Running": Running, "AwaitingRetry": AwaitingRetry}
    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(stage, state=Scheduled())  # (as a deployment's run is made; the client's default is Pending)
        for n in state_names:
            c.set_flow_run_state(fr.id, make[n](), force=True)
        return fr.id


def _base(fid, client_factory=None):
    from prefect.client.orchestration import get_client

    async def go():
        async with get_client() as client:
            fr = await client.read_flow_run(fid)
            calls = []
            real = client.read_flow_run_states

            async def counted(*a, **kw):
                calls.append(1)
                if client_factory is not None:
                    raise RuntimeError("server unavailable")
                return await real(*a, **kw)

            me = SimpleNamespace(client=SimpleNamespace(read_flow_run_states=counted), _logger=logging.getLogger("t"))
            return await QosflowWorker._attempt_base(me, fr), len(calls)

    return asyncio.run(go())


def test_the_first_pickup_keeps_the_flow_run_id_and_reads_nothing(prefect_server):
    fid = _run_in([])  # (the run object a worker's run() gets is the one it read: Scheduled, run_count 0)
    base, calls = _base(fid)
    assert base == str(fid) and calls == 0


def test_a_run_taken_again_gets_a_new_base_per_pickup(prefect_server):
    # first pickup ran it; recovery put it back (AwaitingRetry); the second pickup proposed Pending
    fid = _run_in(["Pending", "Running", "AwaitingRetry", "Pending"])
    base, calls = _base(fid)
    assert base == f"{fid}-p1" and calls == 1
    fid = _run_in(["Pending", "Running", "AwaitingRetry", "Pending", "Running", "AwaitingRetry", "Pending"])
    assert _base(fid)[0] == f"{fid}-p2"
    # put back before its engine ever ran (run_count 0): the AwaitingRetry state still makes it count
    fid = _run_in(["Pending", "AwaitingRetry", "Pending"])
    assert _base(fid)[0] == f"{fid}-p1"


def test_a_history_that_cannot_be_read_gives_an_id_no_launch_used(prefect_server):
    fid = _run_in(["Pending", "Running", "AwaitingRetry", "Pending"])
    base, calls = _base(fid, client_factory=True)
    assert calls == 1 and re.fullmatch(rf"{fid}-p[0-9a-f]{{8}}", base), base
