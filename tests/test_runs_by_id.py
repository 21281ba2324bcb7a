"""The worker reads flow runs by id in pages of the server's limit (`QosflowWorker._runs_by_id`), on a real server.

Prefect's server answers a filter with at most its default limit (200) of runs and refuses a larger `limit` (422):
with more than 200 stages queued or running, the cancellation watch saw only the first 200, and the check of the
pipelines' ends failed as a whole."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace


def test_more_runs_than_one_page_are_all_read(prefect_server):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Scheduled

    from qosflow.prefect.worker import RUNS_PAGE, QosflowWorker

    @flow(name="one-of-many")
    def many():
        pass

    n = RUNS_PAGE + 37

    async def go():
        async with get_client() as client:
            ids = [str((await client.create_flow_run(many, state=Scheduled())).id) for _ in range(n)]
            # what the worker did before: one read, no limit (the server's 200), or limit=len(ids) (refused)
            plain = await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
            try:
                await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=len(ids))
                refused = False
            except Exception:
                refused = True
            me = SimpleNamespace(client=client, _logger=logging.getLogger("t"))
            got = await QosflowWorker._runs_by_id(me, ids)
            return ids, plain, refused, got

    ids, plain, refused, got = asyncio.run(go())
    assert len(plain) == RUNS_PAGE and refused  # (the server's behaviour the helper is for)
    assert sorted(str(fr.id) for fr in got) == sorted(ids)
