"""Pipeline leases (`LeaseStore.acquire_pipeline`): a pipeline run that its pool's backend runs (a Kubernetes
Job) holds a lease that books no slot, is never held twice, and is recovered like a stage's. Direct tests of
the store; the worker's use of them is in tests/test_k8s_pipelines.py."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from qosflow.backends.base import StageHandle
from qosflow.store.leases import LeaseStore, StageBusy

from test_leases import db_url, pool, spec  # noqa: F401  (fixtures: SQLite, and PostgreSQL when configured)

pytestmark = pytest.mark.timeout(120)


class _Backend:
    """The part of a backend `LeaseStore.recover` uses: its name and `adopt`, which finds the run's Job or not."""

    name = "kubernetes"

    def __init__(self, running: set[str]):
        self.running = running

    async def adopt(self, stage_id: str, hosts=None):
        return StageHandle(stage_id=stage_id, backend="kubernetes", node="", ref={"jobs": [f"job-{stage_id}"]}) if stage_id in self.running else None


def test_a_pipeline_lease_books_no_slot_and_is_never_held_twice(db_url, pool):  # noqa: F811
    st = LeaseStore(url=db_url)
    fid = str(uuid.uuid4())
    le = st.acquire_pipeline(pool, fid, holder="w1", backend="kubernetes", command=["python", "-m", "prefect.engine"], namespace="ml")
    assert le.is_pipeline and le.stage_key == fid and le.attempt_id == fid
    assert le.placement["namespace"] == "ml" and le.placement["gpus"] == []
    assert st.booked(pool) == []  # no GPU, no core booked
    # every GPU of the cluster is still free for stages
    st.acquire(pool, "train", spec("train", [(0, 0), (0, 1), (1, 0), (1, 1)]), holder="w1")
    with pytest.raises(StageBusy, match="must not run twice"):
        st.acquire_pipeline(pool, fid, holder="w2", backend="kubernetes")
    assert [x.stage_key for x in st.pipeline_leases(pool)] == [fid]
    assert not any(x.is_pipeline for x in st.leases(pool) if x.stage_key == "train")


def test_a_pipeline_lease_is_recovered_by_another_worker_once_expired(db_url, pool):  # noqa: F811
    st = LeaseStore(url=db_url)
    alive, gone = str(uuid.uuid4()), str(uuid.uuid4())
    st.acquire_pipeline(pool, alive, holder="old-pod:1", ttl_s=0.5, backend="kubernetes")
    st.acquire_pipeline(pool, gone, holder="old-pod:1", ttl_s=0.5, backend="kubernetes")
    backend = _Backend({alive})
    # while the old worker's leases are live, another worker takes nothing
    assert asyncio.run(st.recover(backend, pool, "new-pod:2", ttl_s=30)) == []
    time.sleep(0.7)
    got = {le.stage_key: h for le, h in asyncio.run(st.recover(backend, pool, "new-pod:2", ttl_s=30))}
    assert set(got) == {alive, gone}
    assert got[alive] is not None and got[alive].ref["jobs"] == [f"job-{alive}"]
    assert got[gone] is None
    # the Job still running is the new worker's now; the lease of the one that is gone is released
    left = st.pipeline_leases(pool)
    assert [(x.stage_key, x.holder) for x in left] == [(alive, "new-pod:2")]
