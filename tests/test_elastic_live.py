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
