"""Which held stage runs the worker takes past a full pool or work-queue concurrency limit (6afeb0c), without a server:
a fake client answers the worker's reads. Taken only as far as the limit would let them through if it counted stage
runs alone: a pipeline run holding the slot must not deadlock its stage, but a limit that stage runs alone fill (a
pipeline called directly: its run is not the pool's) still bounds them."""

from __future__ import annotations

import asyncio
import logging
import uuid
from types import SimpleNamespace

from prefect.client.schemas.objects import FlowRun, StateType

from qosflow.prefect.worker import QosflowWorker

DEFAULT_Q = uuid.uuid4()
OTHER_Q = uuid.uuid4()
DEP = uuid.uuid4()


class FakeClient:
    def __init__(self, *, pool_limit=None, queue_limit=None, scheduled=2, in_flight=None):
        self.pool = SimpleNamespace(id=uuid.uuid4(), is_paused=False, status="READY", concurrency_limit=pool_limit)
        self.queues = [SimpleNamespace(id=DEFAULT_Q, name="default", is_paused=False, concurrency_limit=queue_limit),
                       SimpleNamespace(id=OTHER_Q, name="other", is_paused=False, concurrency_limit=None)]
        self.scheduled = [FlowRun(flow_id=uuid.uuid4(), deployment_id=DEP, work_queue_id=DEFAULT_Q) for _ in range(scheduled)]
        self.in_flight = dict(in_flight or {})  # queue id -> Pending/Running stage runs

    pool_reads = 0

    async def read_work_pool(self, name):
        self.pool_reads += 1
        return self.pool

    async def read_work_queues(self, work_pool_name=None):
        return self.queues

    dep = DEP

    async def read_deployment_by_name(self, name):
        return SimpleNamespace(id=self.dep)

    async def read_flow_runs(self, *, flow_run_filter=None, deployment_filter=None, **kw):
        assert flow_run_filter.state.type.any_ == [StateType.SCHEDULED]
        return [r for r in self.scheduled if r.deployment_id in deployment_filter.id.any_]

    async def count_flow_runs(self, *, work_queue_filter=None, **kw):
        if work_queue_filter is None:
            return sum(self.in_flight.values())
        return sum(n for q, n in self.in_flight.items() if q in work_queue_filter.id.any_)


def _worker(client, queues=()):
    w = object.__new__(QosflowWorker)
    w._client, w._work_pool, w._stopping = client, SimpleNamespace(), False
    w._work_pool_name, w._work_queues, w._prefetch_seconds = "gpu", set(queues), 10
    w._logger = logging.getLogger("test-pool-limits")
    return w


def _taken(client, have=(), handed=()):
    args = (set(have) | {r.flow_run.id for r in handed},) + ((list(handed),) if handed else ())
    return [r.flow_run.id for r in asyncio.run(_worker(client)._stage_runs_past_limits(*args))]


def _handed(fr):
    from prefect.client.schemas.responses import WorkerFlowRunResponse

    return WorkerFlowRunResponse(work_pool_id=uuid.uuid4(), work_queue_id=fr.work_queue_id, flow_run=fr)


def test_a_limit_full_of_pipeline_runs_lets_their_stage_runs_through():
    # pool limit 1 held by a pipeline run (not a stage run): no stage run in flight, one taken past it
    c = FakeClient(pool_limit=1, scheduled=2)
    assert _taken(c) == [c.scheduled[0].id]
    # the same with a limit on the stage runs' queue
    c = FakeClient(queue_limit=2, scheduled=3)
    assert _taken(c) == [c.scheduled[0].id, c.scheduled[1].id]


def test_a_limit_that_stage_runs_alone_fill_still_holds_them_back():
    # pool limit 1, one stage run already Running (its pipeline called directly, not a run of the pool): Prefect held
    # the next one back for the limit itself; it was taken past it all the same, the limit ignored
    c = FakeClient(pool_limit=1, scheduled=1, in_flight={DEFAULT_Q: 1})
    assert _taken(c) == []
    c = FakeClient(queue_limit=2, scheduled=2, in_flight={DEFAULT_Q: 1})
    assert _taken(c) == [c.scheduled[0].id]
    # stage runs in flight in another queue count against the pool's limit, not the queue's
    c = FakeClient(pool_limit=2, scheduled=2, in_flight={OTHER_Q: 2})
    assert _taken(c) == []
    c = FakeClient(queue_limit=1, scheduled=1, in_flight={OTHER_Q: 3})
    assert _taken(c) == [c.scheduled[0].id]


def test_runs_prefect_handed_out_are_not_taken_again():
    c = FakeClient(pool_limit=3, scheduled=2)
    assert _taken(c, have={c.scheduled[0].id}) == [c.scheduled[1].id]


def test_stage_runs_prefect_hands_out_in_the_same_poll_count_against_the_limit():
    # pool limit 1 of stage runs alone: Prefect handed out one and held the other back; taking that one too put two
    # stage runs under a limit of 1
    c = FakeClient(pool_limit=1, scheduled=2)
    assert _taken(c, handed=[_handed(c.scheduled[0])]) == []
    c = FakeClient(queue_limit=2, scheduled=3)
    assert _taken(c, handed=[_handed(c.scheduled[0])]) == [c.scheduled[1].id]
    # a pipeline run Prefect handed out (not a stage run) does not count: it is what the limit is for
    c = FakeClient(pool_limit=1, scheduled=1)
    pipeline = FlowRun(flow_id=uuid.uuid4(), deployment_id=uuid.uuid4(), work_queue_id=DEFAULT_Q)
    assert _taken(c, handed=[_handed(pipeline)]) == [c.scheduled[0].id]


def test_a_stage_deployment_made_again_is_followed():
    """`qosflow-stage/<pool>` deleted and made again by the next pipeline (a new id): its held stage runs were looked
    for under the old id for the worker's life, and the deadlock of a full limit came back."""
    c = FakeClient(pool_limit=1, scheduled=1)
    w = _worker(c)
    w.LIMITS_REFRESH_S = 0.0  # (every poll a refresh: no waiting in a test)
    assert [r.flow_run.id for r in asyncio.run(w._stage_runs_past_limits(set()))] == [c.scheduled[0].id]
    c.dep = uuid.uuid4()
    c.scheduled = [FlowRun(flow_id=uuid.uuid4(), deployment_id=c.dep, work_queue_id=DEFAULT_Q)]
    assert [r.flow_run.id for r in asyncio.run(w._stage_runs_past_limits(set()))] == [c.scheduled[0].id]


class _SyncClient:
    def __init__(self, pool_limit=None, queue_limit=None):
        self.pool = SimpleNamespace(is_paused=False, concurrency_limit=pool_limit)
        self.queue = SimpleNamespace(name="default", is_paused=False, concurrency_limit=queue_limit)

    def read_work_pool(self, name):
        return self.pool

    def read_work_queues(self, work_pool_name=None):
        return [self.queue]

    def read_workers_for_work_pool(self, name):
        return [SimpleNamespace(name="w1", status="ONLINE")]


def test_the_pickup_warning_names_a_concurrency_limit_that_holds_the_stage():
    """A stage run held by a limit that stage runs fill (taken past it only while fewer are in flight): its pipeline's
    warning said the worker 'took no run: see their log', which says nothing of it."""
    from qosflow.prefect.tasks import _pickup_hint

    hint = _pickup_hint(_SyncClient(pool_limit=2), "gpu", "default")
    assert "work pool 'gpu' has a concurrency limit of 2" in hint and "took no run" not in hint, hint
    assert "prefect work-pool set-concurrency-limit gpu N" in hint, hint
    hint = _pickup_hint(_SyncClient(queue_limit=1), "gpu", "default")
    assert "work queue 'default' has a concurrency limit of 1" in hint, hint
    assert "took no run" in _pickup_hint(_SyncClient(), "gpu", "default")


def test_a_limit_that_stage_runs_fill_is_not_read_again_at_every_poll():
    """Held stage runs that the limit keeps (stage runs fill it) are not a reason to read the pool's pause and limits
    afresh: that happened at every poll for as long as the limit stayed full."""
    c = FakeClient(pool_limit=1, scheduled=1, in_flight={DEFAULT_Q: 1})
    w = _worker(c)
    for _ in range(3):
        assert asyncio.run(w._stage_runs_past_limits(set())) == []
    assert c.pool_reads == 1  # (the first read; the next within LIMITS_REFRESH_S)
