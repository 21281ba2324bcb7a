"""`compute_bounds` with a job whose full width never fits the cluster but a narrower width does
(`QoSSpec.min_gpus`; only Python callers build such a workload, the trace loaders reject the job before
any min_gpus). A policy that starts jobs narrower runs it, so the bounds count it, at the widest width that
fits (w of g GPUs: g/w x its duration alone). They left it out, and the qosflow policy beat them."""

import pytest

from qosflow.core import Job, QoSSpec
from qosflow.policies import get_policy
from qosflow.sim.clusters import load_cluster
from qosflow.sim.engine import SimConfig, simulate
from qosflow.sim.interference import default_speed_model
from qosflow.sim.metrics import compute_bounds, compute_metrics


def _jobs():
    # "e": 32 GPUs on a 16-GPU node, may start on 16 or 8: 2000 s alone on 16 (its deadline 2500 s is feasible
    # there, not on 8: 4000 s); "r": 5000 s on 1 GPU, its deadline 4000 s infeasible
    return [Job("e", 0.0, QoSSpec(gpus=32, min_gpus=8, cpu_cores=32, deadline=2500.0), 1000.0),
            Job("r", 1.0, QoSSpec(gpus=1, cpu_cores=2, deadline=4000.0), 5000.0)]


def test_a_job_that_fits_only_narrower_counts_at_its_widest_width():
    spec = load_cluster("1x16")
    b = compute_bounds(_jobs(), spec)
    assert b.avg_jct == pytest.approx((2000.0 + 5000.0) / 2)
    assert b.dsr == pytest.approx(0.5)  # (e's deadline is feasible on 16 GPUs)
    assert b.span == pytest.approx(5001.0)
    # its work is as many GPU-seconds as on all 32 GPUs: (32 x 1000 + 5000) / 16 < span
    assert b.makespan == pytest.approx(max(5001.0, (32 * 1000.0 + 5000.0) / 16))
    # (a job that fits at no width is still left out)
    none_fits = Job("x", 0.0, QoSSpec(gpus=64, min_gpus=32, cpu_cores=32, deadline=10.0), 10.0)
    assert compute_bounds([*_jobs(), none_fits], spec) == b


def test_the_qosflow_policy_does_not_beat_the_bounds():
    spec = load_cluster("1x16")
    speed = default_speed_model()
    b = compute_bounds(_jobs(), spec, speed)
    res = simulate(_jobs(), spec, get_policy("qosflow"), speed=speed, config=SimConfig())
    m = compute_metrics(res)
    assert m.rejected == 0 and m.finished == 2 and m.elastic_starts == 1
    assert m.avg_jct >= b.avg_jct - 1e-6
    assert m.dsr <= b.dsr + 1e-9
    assert m.makespan >= b.span - 1e-6
