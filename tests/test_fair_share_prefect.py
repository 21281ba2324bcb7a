"""Who a stage runs for, through a real Prefect server and worker: a pipeline run tagged `user:alice` (as
`prefect deployment run ... --tag user:alice` makes it) dispatches its stages with that user, the worker
builds the job the QoS scheduler and its policy see with it, and a stage's own `@qos_task(user=...)` wins;
a run with no user tag is its deployment's (`FLOW/DEPLOYMENT`). The fairness options come from the pool's
QoS policy block."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from types import SimpleNamespace

import pytest

from qosflow.core import Job, QoSSpec

HERE = Path(__file__).resolve().parent


def test_a_user_tag_on_the_pipeline_run_reaches_the_job_the_scheduler_sees(prefect_server, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    import fair_pipelines as fp
    from qosflow.prefect.blocks import BareMetalGPUCluster, QoSPolicy
    from qosflow.prefect.local import WorkerThread, setup_pool
    from qosflow.prefect.scheduler import QoSScheduler

    pool = "fair-users"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p))
    policy = QoSPolicy(policy="qosflow", options={"fair_weights": {"alice": 2.0}, "fair_half_life": 600})
    asyncio.run(setup_pool(pool, cluster=BareMetalGPUCluster.virtual(1, 2, cpu_cores=4), policy=policy, stream_output=False))
    seen = []
    request = QoSScheduler.request

    async def spy(self, entry):
        seen.append((entry.name, entry.job.user, entry.job.qos.user, getattr(self.policy, "fair_weights", None)))
        return await request(self, entry)

    monkeypatch.setattr(QoSScheduler, "request", spy)
    w = WorkerThread(pool).wait_ready(120)
    try:
        monkeypatch.setenv("QOSFLOW_POOL", pool)
        with get_client(sync_client=True) as c:
            fr = c.create_flow_run(fp.fair_pipe, tags=["user:alice", "nightly"])
        state = run_flow(fp.fair_pipe, flow_run=fr, return_type="state")
        assert state.is_completed(), state
        assert state.result() == (2, 3)
    finally:
        w.stop()  # (after its stages' processes ended: the worker records a stage then)
    records = {r["stage"]: r for r in list(w.worker.records)}
    assert sorted((name, user, quser) for name, user, quser, _ in seen) == [("bobs_step", "bob", "bob"), ("tagged_step", "alice", "alice")]
    assert all(weights == {"alice": 2.0} for *_, weights in seen), seen
    # the placement record (and the qosflow.stage.placed event) say whom each stage ran for
    assert records["tagged_step"]["user"] == "alice" and records["bobs_step"]["user"] == "bob"
    # the stage runs carry it as a tag the worker reads back (a pipeline run's own tags do not reach its
    # stage runs: the dispatch reads them from the pipeline's run)
    with get_client(sync_client=True) as c:
        by_stage = {name: c.read_flow_run(r["flow_run_id"]).tags for name, r in records.items()}
    assert "qos:user=alice" in by_stage["tagged_step"], by_stage
    assert "qos:user=bob" in by_stage["bobs_step"], by_stage


def test_a_run_without_a_user_tag_is_its_deployments(prefect_server):
    from prefect.client.orchestration import get_client

    import fair_pipelines as fp
    from qosflow.prefect import tasks

    with get_client(sync_client=True) as c:
        flow_id = c.create_flow_from_name("fair-users-pipe")
        dep_id = c.create_deployment(flow_id=flow_id, name="nightly-sweep", entrypoint="fair_pipelines.py:fair_pipe")
        fr = c.create_flow_run_from_deployment(dep_id)
        plain = c.create_flow_run(fp.fair_pipe)
    assert tasks._deployment_user(fr) == "fair-users-pipe/nightly-sweep"
    assert tasks._deployment_user(plain) is None


# ------------------------------------------------------------------------------------ who: spec and tags
def test_user_travels_from_the_decorator_or_a_tag_into_the_spec():
    from qosflow import qos_task
    from qosflow.errors import SpecError
    from qosflow.prefect.spec import qos_from_tags, spec_from_job_variables, user_from_tags

    @qos_task(gpus=1, user="bob")
    def st(x):
        return x

    assert st.qos.user == "bob" and "qos:user=bob" in st.tags
    assert st.with_options(user="amy").qos.user == "amy" and st.with_options(gpus=2).qos.user == "bob"
    assert qos_from_tags(st.tags)[0].user == "bob"
    with pytest.raises(SpecError, match="user"):
        qos_task(user=3)
    with pytest.raises(SpecError, match="user"):
        qos_task(user=" ")
    # the stage's own qos:user= first, else the first user: tag (a pipeline's, or its deployment's)
    assert user_from_tags(["user:zed", "qos:user=amy"]) == "amy"
    # (several user: tags -- a run's and its deployment's, merged by the server as a set: the first by name)
    assert user_from_tags(["x", "user:zed", "user:b"]) == "b" == user_from_tags(["user:b", "user:zed"])
    assert user_from_tags(["user:", "qos:class=normal"]) is None
    # the worker's side: the job configuration of a run tagged user:alice
    cfg = SimpleNamespace(gpus=1, _related_objects={"flow-run": SimpleNamespace(tags=["qos:gpus=1", "user:alice"])})
    spec = spec_from_job_variables(cfg, "stage 't'")
    assert spec.user == "alice" and spec == QoSSpec(gpus=1)  # (the user is not part of the request)
    assert Job("j", 0.0, spec, 1.0).user == "alice"
    cfg = SimpleNamespace(gpus=1, _related_objects={"flow-run": SimpleNamespace(tags=["qos:gpus=1"])})
    assert spec_from_job_variables(cfg, "stage 't'").user is None
