"""Elastic start (`@qos_task(min_gpus=N)`) on the live side: the decorator, tags and job variables, what
a stage started on fewer GPUs than it asked for is told (QOSFLOW_GPUS, QOSFLOW_GRAD_ACCUMULATION) by
every backend, what the worker records and shows, and the helpers a stage reads them with. No server."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from types import SimpleNamespace

import pytest

import qosflow
from qosflow.backends.base import LaunchSpec, placement_env
from qosflow.core.cluster import ClusterSpec
from qosflow.core.job import Job, JobState
from qosflow.core.placement import Placement
from qosflow.core.qos import QoSSpec
from qosflow.errors import QosflowError, SpecError
from qosflow.prefect.spec import job_variables, qos_from_tags, spec_from_job_variables
from qosflow.prefect.tasks import qos_task


def train(x):
    return x


CL = ClusterSpec.uniform(2, 4, cpu_cores=8, virtual=True)
#: 4 of an 8-GPU stage's GPUs, two on each node
NARROW = Placement("train", ((0, 0), (0, 1), (1, 2), (1, 3)), cpu=((0, 2.0), (1, 2.0)))
#: all 8
FULL = Placement("train", tuple((n, g) for n in (0, 1) for g in range(4)), cpu=((0, 4.0), (1, 4.0)))


# ------------------------------------------------------------------------------------ declaring it
def test_min_gpus_travels_in_tags_job_variables_and_with_options():
    t = qos_task(train, gpus=8, min_gpus=2, deadline="2h")
    assert t.qos.min_gpus == 2 and t.qos.widths == (8, 4, 2)
    assert "qos:min_gpus=2" in t.tags
    spec, _ = qos_from_tags(t.tags)
    assert spec == t.qos and spec.min_gpus == 2 and isinstance(spec.min_gpus, int)
    assert qos_from_tags(qos_task(train, gpus=8).tags)[0].min_gpus is None  # a rigid stage says nothing
    assert qos_task(train, gpus=4, min_gpus=2.0).qos.min_gpus == 2  # as gpus=4.0 is 4
    # the work pool's job variables, and back (the worker builds the stage's spec from them)
    jv = job_variables(t.qos)
    assert jv["min_gpus"] == 2
    assert spec_from_job_variables(SimpleNamespace(**jv), "stage 'train'") == t.qos
    t2 = t.with_options(gpus=4)
    assert t2.qos.min_gpus == 2 and t2.qos.widths == (4, 2) and "qos:min_gpus=2" in t2.tags
    with pytest.raises(SpecError, match="min_gpus: must be in 1..gpus"):
        t.with_options(gpus=1)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(gpus=4, min_gpus=8), r"must be in 1\.\.gpus \(4\), got 8"),
        (dict(gpus=4, min_gpus=0), r"must be in 1\.\.gpus \(4\), got 0"),
        (dict(gpus=1, gpu_milli=500, min_gpus=1), "only a job of whole GPUs"),
        (dict(gpus=0, cpu_cores=1, min_gpus=1), "only a job of whole GPUs"),
        (dict(gpus=4, min_gpus=2.5), "must be a whole number of GPUs"),
        (dict(gpus=4, min_gpus="2"), "must be a whole number of GPUs"),
        (dict(gpus=4, min_gpus=True), "must be a whole number of GPUs"),
        (dict(gpus=4, min_gpus=3), r"3 allows no width below gpus=4, so it would have no effect.*\(4, 2, 1: .*use min_gpus=2 or 1"),
    ],
)
def test_bad_min_gpus_fails_at_decoration_naming_it(kwargs, says):
    with pytest.raises(SpecError, match=says) as ei:
        qos_task(**kwargs)  # before the function is given: the error names the decorator's line
    assert ei.value.field == "min_gpus" and "invalid min_gpus" in str(ei.value) and "@qos_task at test_elastic_live.py:" in str(ei.value)
    with pytest.raises(SpecError, match=says) as ei:
        qos_task(train, **kwargs)
    assert ei.value.field == "min_gpus" and "@qos_task 'train'" in str(ei.value)


def test_the_pool_template_carries_min_gpus_and_an_older_pool_gets_it_from_the_tags():
    from prefect.client.schemas.objects import FlowRun

    from qosflow.prefect.worker import QosflowJobConfiguration, QosflowVariables, QosflowWorker

    t = QosflowWorker.get_default_base_job_template()
    assert "min_gpus" in t["variables"]["properties"] and t["job_configuration"]["min_gpus"] == "{{ min_gpus }}"
    assert QosflowVariables(gpus=8, min_gpus=2).min_gpus == 2
    # a pool made before min_gpus existed drops that job variable; the stage run's tags still carry it
    fr = FlowRun(flow_id=uuid.uuid4(), name="p.train", tags=["qos:class=normal", "qos:gpus=8", "qos:min_gpus=2"])
    cfg = QosflowJobConfiguration(role="stage", gpus=8)
    cfg.prepare_for_flow_run(fr)
    assert cfg.min_gpus == 2 and spec_from_job_variables(cfg, "stage 'train'").widths == (8, 4, 2)
    given = QosflowJobConfiguration(role="stage", gpus=8, min_gpus=4)  # the job variable wins
    given.prepare_for_flow_run(fr)
    assert given.min_gpus == 4
    rigid = QosflowJobConfiguration(role="stage", gpus=8)
    rigid.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="p.x", tags=["qos:gpus=8"]))
    assert rigid.min_gpus is None


def test_the_early_check_of_an_elastic_stage_runs_on_one_gpu():
    """The check takes one GPU of an elastic stage: its QoS must not keep min_gpus (2 > its 1 GPU would not validate)."""
    from qosflow.prefect.worker import early_check_spec

    small = early_check_spec(QoSSpec(gpus=8, min_gpus=2, cpu_cores=8, deadline=600))
    assert (small.gpus, small.min_gpus, small.gang, small.cpu_cores, small.deadline) == (1, None, False, 2.0, None)


# ------------------------------------------------------------------------------------ what the stage is told
def _env_of(p: Placement, requested: int | None, node: int | None = None) -> dict[str, str]:
    return placement_env(p, CL, node, requested_gpus=requested)


def test_placement_env_tells_a_narrow_start_its_gpus_and_accumulation():
    for node in (0, 1):  # every node of the gang hears the whole width
        env = _env_of(NARROW, 8, node)
        assert env["QOSFLOW_GPUS"] == "4" and env["QOSFLOW_GRAD_ACCUMULATION"] == "2"
        assert env["CUDA_VISIBLE_DEVICES"] == ("0,1" if node == 0 else "2,3")
        plan = json.loads(env["QOSFLOW_PLACEMENT"])
        assert plan["requested_gpus"] == 8 and plan["grad_accumulation"] == 2
    one = _env_of(Placement("train", ((1, 3),), cpu=((1, 1.0),)), 8)
    assert (one["QOSFLOW_GPUS"], one["QOSFLOW_GRAD_ACCUMULATION"]) == ("1", "8")


def test_placement_env_sets_both_on_a_full_width_start_too():
    for requested in (8, None):  # None: a caller that does not say (as many as placed)
        env = _env_of(FULL, requested)
        assert (env["QOSFLOW_GPUS"], env["QOSFLOW_GRAD_ACCUMULATION"]) == ("8", "1")
        assert json.loads(env["QOSFLOW_PLACEMENT"])["grad_accumulation"] == 1
    frac = _env_of(Placement("f", ((0, 0),), cpu=((0, 1.0),), gpu_milli=250), 1)
    assert (frac["QOSFLOW_GPUS"], frac["QOSFLOW_GRAD_ACCUMULATION"]) == ("1", "1")
    cpu_only = _env_of(Placement("c", (), cpu=((0, 2.0),)), 0)
    assert "QOSFLOW_GPUS" not in cpu_only and "QOSFLOW_GRAD_ACCUMULATION" not in cpu_only


def test_a_width_that_does_not_divide_the_request_is_refused():
    from qosflow.backends.base import grad_accumulation

    assert grad_accumulation(4, 8) == 2 and grad_accumulation(8, 8) == 1 and grad_accumulation(2, None) == 1
    with pytest.raises(SpecError, match="min_gpus: a stage of 8 GPUs cannot start on 3"):
        grad_accumulation(3, 8)


def test_the_local_backend_starts_a_narrow_stage_with_them(tmp_path):
    from qosflow.backends.local import LocalBackend

    out = tmp_path / "env.json"
    code = ("import json, os, sys; json.dump({k: os.environ.get(k) for k in ('QOSFLOW_GPUS', 'QOSFLOW_GRAD_ACCUMULATION', "
            "'CUDA_VISIBLE_DEVICES')}, open(sys.argv[1], 'w'))")
    cluster = ClusterSpec.uniform(1, 4, cpu_cores=4, virtual=True)
    p = Placement("train", ((0, 1), (0, 2)), cpu=((0, 1.0),))

    async def main():
        b = LocalBackend(cluster, stream_output=False)
        try:
            h = await b.launch(LaunchSpec("train", [sys.executable, "-c", code, str(out)], p, cluster, requested_gpus=4))
            return await b.wait(h)
        finally:
            await b.aclose()

    assert asyncio.run(main()).ok
    assert json.loads(out.read_text()) == {"QOSFLOW_GPUS": "2", "QOSFLOW_GRAD_ACCUMULATION": "2", "CUDA_VISIBLE_DEVICES": "1,2"}


def test_the_agent_backend_sends_them_to_every_host():
    from qosflow.backends.agent import AgentBackend, AgentHost

    be = AgentBackend([AgentHost("node0", "http://127.0.0.1:1"), AgentHost("node1", "http://127.0.0.1:2")], "token")
    bodies: list[dict] = []

    async def no_start():
        return None

    async def post(part, body):
        bodies.append(body)
        return None

    be.start, be._post = no_start, post
    asyncio.run(be.launch(LaunchSpec("train-1", ["true"], NARROW, CL, requested_gpus=8)))
    assert len(bodies) == 2
    for b in bodies:
        assert b["env"]["QOSFLOW_GPUS"] == "4" and b["env"]["QOSFLOW_GRAD_ACCUMULATION"] == "2"


def test_the_kubernetes_pod_spec_carries_them():
    from kubernetes import client

    from qosflow.backends.kubernetes import ANN_PLACEMENT, GPU, KubernetesBackend

    be = KubernetesBackend(api_client=client.ApiClient(), image="img:1")

    def pod_env(spec: LaunchSpec) -> list[dict[str, str | None]]:
        jobs, _ = be.manifests(spec)
        out = []
        for j in jobs:
            c = j["spec"]["template"]["spec"]["containers"][0]
            assert c["resources"]["limits"] == {GPU: "2"}  # the pod asks for the GPUs it got, not the 8 it wanted
            env = {e["name"]: e.get("value") for e in c["env"]}
            plan = json.loads(j["spec"]["template"]["metadata"]["annotations"][ANN_PLACEMENT])
            assert str(plan["grad_accumulation"]) == env["QOSFLOW_GRAD_ACCUMULATION"]
            out.append(env)
        return out

    for env in pod_env(LaunchSpec("train-1", ["python", "t.py"], NARROW, CL, requested_gpus=8)):
        assert env["QOSFLOW_GPUS"] == "4" and env["QOSFLOW_GRAD_ACCUMULATION"] == "2"
    full = Placement("train", ((0, 0), (0, 1), (1, 0), (1, 1)), cpu=((0, 2.0), (1, 2.0)))
    for env in pod_env(LaunchSpec("train-2", ["python", "t.py"], full, CL, requested_gpus=4)):
        assert env["QOSFLOW_GPUS"] == "4" and env["QOSFLOW_GRAD_ACCUMULATION"] == "1"


# ------------------------------------------------------------------------------------ the helpers
def test_accumulation_steps_and_granted_gpus(monkeypatch):
    monkeypatch.delenv("QOSFLOW_GRAD_ACCUMULATION", raising=False)
    monkeypatch.delenv("QOSFLOW_GPUS", raising=False)
    assert qosflow.accumulation_steps() == 1 and qosflow.granted_gpus() is None  # outside the worker
    for k, v in _env_of(NARROW, 8).items():
        monkeypatch.setenv(k, v)
    assert qosflow.accumulation_steps() == 2 and qosflow.granted_gpus() == 4
    monkeypatch.setenv("QOSFLOW_GRAD_ACCUMULATION", "")
    assert qosflow.accumulation_steps() == 1  # empty is unset
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("QOSFLOW_GRAD_ACCUMULATION", bad)
        with pytest.raises(QosflowError, match=rf"accumulation_steps\(\): environment variable QOSFLOW_GRAD_ACCUMULATION='{bad}' is not a whole number >= 1"):
            qosflow.accumulation_steps()
        monkeypatch.setenv("QOSFLOW_GPUS", bad)
        with pytest.raises(QosflowError, match=rf"granted_gpus\(\): environment variable QOSFLOW_GPUS='{bad}' is not a whole number >= 1"):
            qosflow.granted_gpus()
    assert {"accumulation_steps", "granted_gpus"} <= set(dir(qosflow))


# ------------------------------------------------------------------------------------ what the worker records and shows
class HalfWidth:
    """Test-local policy: starts every pending job on the first half of node 0's GPUs."""

    name = "test-half-width"

    def schedule(self, view):
        from qosflow.policies.base import Decision

        d = Decision()
        for js in view.pending:
            w = js.job.qos.gpus // 2
            p = Placement(js.job_id, tuple((0, g) for g in range(w)), cpu=((0, 1.0),))
            view.cluster.allocate(p, js.job.qos)
            d.starts.append(p)
        return d


def test_the_grant_labels_artifact_and_status_say_how_wide_it_started():
    from qosflow.prefect.scheduler import QoSScheduler, StageEntry
    from qosflow.prefect.status import _stage_status
    from qosflow.prefect.tasks import StageRecord, apply_placement_labels
    from qosflow.prefect.worker import QosflowWorker

    cluster = ClusterSpec.uniform(1, 8, cpu_cores=8, virtual=True)
    job = Job("train", time.time(), QoSSpec(gpus=8, min_gpus=2, cpu_cores=1.0), 60.0, expected_duration=60.0, model="sig-train")
    e = StageEntry(JobState(job), "train", flow_run_id="train")

    async def main():
        s = QoSScheduler(cluster, HalfWidth(), coda=False)
        t = asyncio.ensure_future(s.request(e))
        await asyncio.sleep(0)
        s.round()
        await t
        return s.describe_grant(e)

    info = asyncio.run(main())
    assert len(info["gpus"]) == 4
    # on half its GPUs it runs at half its speed: the prediction it was placed on (labels, forecast, CODA's
    # lag check) says so, and the estimator learns what a run on all 8 would have taken
    assert info["predicted_s"] == pytest.approx(120.0)
    learned = []
    QosflowWorker._observe(SimpleNamespace(estimator=SimpleNamespace(observe=lambda job, s: learned.append(s))), e, 130.0)
    assert learned == [pytest.approx(65.0)]
    assert (info["requested_gpus"], info["grad_accumulation"]) == (8, 2)
    assert info["elastic"] == "started on 4 of 8 GPUs, gradient accumulation x2"
    # the flow run's labels (what the Prefect UI shows on the run)
    w = QosflowWorker(work_pool_name="elastic-test")
    asyncio.run(w._label("fr-1", dict(info), time.time()))  # (no client here: the write fails and is logged; what it wrote is kept)
    labels = w._labels_written["fr-1"]
    assert labels["qosflow.elastic"] == "started on 4 of 8 GPUs, gradient accumulation x2"
    assert (labels["qosflow.requested_gpus"], labels["qosflow.grad_accumulation"]) == ("8", "2")
    # the pipeline's placements artifact
    rec = StageRecord("train", None, (), 60.0, 30.0, time.time())
    apply_placement_labels(rec, labels)
    assert (rec.requested_gpus, rec.grad_accumulation) == (8, 2)
    assert rec.elastic_note == " (4 of 8, gradient accumulation x2)" and rec.to_json()["grad_accumulation"] == 2
    # `qosflow status`
    fr = SimpleNamespace(id="fr-1", labels=labels, parameters={"stage": "train", "pipeline": "p"}, name="p.train", tags=["qos:class=normal"],
                         job_variables={}, expected_start_time=None, created=None,
                         state=SimpleNamespace(name="Running", is_running=lambda: True, is_pending=lambda: False))
    st = _stage_status(fr, time.time())
    assert st.elastic_note == "4 of 8 GPUs, gradient accumulation x2" and st.requested_gpus == 8
    # a rigid stage: nothing of the kind
    rigid = Job("r", time.time(), QoSSpec(gpus=2), 60.0)
    from qosflow.prefect.scheduler import elastic_info

    assert elastic_info(rigid.qos, Placement("r", ((0, 0), (0, 1)))) == {}
    assert elastic_info(QoSSpec(gpus=2, min_gpus=1), Placement("r", ((0, 0), (0, 1))))["elastic"] == "started on all 2 GPUs"


def test_a_rerun_after_an_infrastructure_failure_starts_narrower_on_the_other_nodes():
    """An elastic stage that failed on node 0 for infrastructure reasons, where the other nodes hold only
    half its GPUs: it starts there, narrower, when the qosflow policy narrows it (a deadline the slower
    run meets), instead of going back to the node it failed on. When the policy would not narrow it (no
    deadline), it is placed anywhere rather than waiting for ever."""
    from qosflow.policies import get_policy
    from qosflow.prefect.scheduler import QoSScheduler, StageEntry

    cluster = ClusterSpec.uniform(2, 2, cpu_cores=4, virtual=True)

    async def place(qos: QoSSpec):
        s = QoSScheduler(cluster, get_policy("qosflow"), coda=False)
        e = StageEntry(JobState(Job("s", time.time(), qos, 60.0, expected_duration=60.0)), "s")
        e.meta["avoid_nodes"] = {0}
        s.start()
        try:
            return (await asyncio.wait_for(s.request(e), 10)).placement
        finally:
            await s.stop()

    p = asyncio.run(place(QoSSpec(gpus=4, min_gpus=2, cpu_cores=1.0, deadline=3600)))
    assert p.nodes == (1,) and len(p.gpus) == 2
    p = asyncio.run(place(QoSSpec(gpus=4, min_gpus=2, cpu_cores=1.0)))
    assert len(p.gpus) == 4


def test_a_stage_wider_than_the_pool_is_admitted_on_its_widest_width_that_fits():
    """@qos_task(gpus=4, min_gpus=2, deadline=...) on a pool of one host with 2 GPUs: the worker rejected
    it as never fitting (asks for 4 GPUs). Under the qosflow policy it starts on the 2, deadline or
    not; under a baseline it is still rejected, saying that min_gpus would let it start on 2. One whose
    every width is too big is rejected naming min_gpus."""
    from qosflow.core.cluster import PlacementError
    from qosflow.policies import get_policy
    from qosflow.prefect.scheduler import QoSScheduler, StageEntry

    cluster = ClusterSpec.uniform(1, 2, cpu_cores=4, virtual=True)

    async def place(qos: QoSSpec, policy: str = "qosflow"):
        s = QoSScheduler(cluster, get_policy(policy), coda=False)
        e = StageEntry(JobState(Job("wide", time.time(), qos, 5.0, expected_duration=5.0)), "wide")
        s.start()
        try:
            return (await asyncio.wait_for(s.request(e), 10)).placement, e
        finally:
            await s.stop()

    for deadline in (600.0, None):
        p, e = asyncio.run(place(QoSSpec(gpus=4, min_gpus=2, cpu_cores=1.0, deadline=deadline)))
        assert len(p.gpus) == 2 and p.nodes == (0,)
        assert "started on 2 of its 4 GPUs (gradient accumulation x2): all 4 never fit this cluster" in e.state.note
    with pytest.raises(PlacementError) as ei:
        asyncio.run(place(QoSSpec(gpus=4, min_gpus=2, cpu_cores=1.0, deadline=600.0), "fifo"))
    assert "its min_gpus=2 would let it start on 2, but this policy ignores min_gpus" in str(ei.value)
    with pytest.raises(PlacementError) as ei:
        asyncio.run(place(QoSSpec(gpus=8, min_gpus=4, cpu_cores=1.0, deadline=600.0)))
    assert "asks for 8 GPUs" in str(ei.value) and "min_gpus=4" in str(ei.value) and "(gpus, min_gpus," in str(ei.value)
