"""`compute_bounds` with elastic jobs (`QoSSpec.min_gpus`): a job started on fewer GPUs runs at width / gpus
of its speed, so it ends no sooner than alone on all its GPUs and holds as many GPU-seconds: the bounds,
which count every job at its full width, still hold."""

import pytest

from qosflow.core.job import JobStatus
from qosflow.policies import get_policy
from qosflow.sim.clusters import load_cluster
from qosflow.sim.engine import SimConfig, simulate
from qosflow.sim.interference import default_speed_model
from qosflow.sim.metrics import compute_bounds, compute_metrics
from qosflow.sim.workload import load_workload


@pytest.mark.parametrize("seed", [0, 1])
def test_bounds_hold_for_jobs_started_on_fewer_gpus(seed):
    spec = load_cluster("2x4")
    wl = load_workload("synthetic", "synthetic", cluster=spec, seed=seed, num_jobs=60, min_gpus_share=0.25)
    speed = default_speed_model()
    res = simulate(wl.jobs, spec, get_policy("qosflow"), speed=speed, config=SimConfig(seed=seed))
    m = compute_metrics(res)
    bounds = compute_bounds(wl.jobs, spec, speed)
    assert m.elastic_starts > 0  # (the qosflow policy started deadline gangs narrower)
    # the jobs the bounds count are the jobs the run admitted (the loader rejected those whose full width
    # never fits, before they were made elastic)
    assert m.rejected == 0 and m.finished == len(wl.jobs)
    narrowed = [js for js in res.jobs if js.started_gpus is not None and js.started_gpus < js.job.qos.gpus]
    assert narrowed
    for js in narrowed:
        assert js.status is JobStatus.DONE
        assert js.finish_time - js.job.submit_time >= js.job.duration - 1e-6  # no sooner than alone on all its GPUs
        assert js.gpu_attained >= js.job.qos.gpus * js.job.duration * (1 - 1e-9)  # as many GPU-seconds
    assert m.avg_jct >= bounds.avg_jct
    assert m.makespan >= bounds.span
    assert m.dsr <= bounds.dsr
