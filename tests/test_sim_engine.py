"""The simulator's clock (qosflow.sim.engine): how a running job's work, its restart overhead and its
failure points turn into event times."""

import pytest

from qosflow.core import ClusterSpec, Job, QoSSpec
from qosflow.core.job import FailurePlan, JobStatus
from qosflow.core.speed import SpeedModel
from qosflow.policies import get_policy
from qosflow.sim.engine import SimConfig, simulate


class TenthSpeed(SpeedModel):
    """Every job runs at 10 % of its speed wherever it is (as if shared, spread or starved)."""

    def rate(self, job, placement, co_runners=(), *, gpus_per_node=8, gpu_models=()):
        return 0.1


def test_restart_overhead_is_wall_time_at_any_rate():
    """A restart (checkpoint load, warm-up) takes `restart_overhead` seconds of wall time whatever the
    job's pace. The engine charged it as work at the job's rate: 10 s at 10 % speed took 100 s, and
    at 1 % 1,000 s (a livelock under Gavel's 360 s rounds, tests/test_policy_properties.py).

    One GPU, rate 0.1, a job of 100 s of work failing twice at half its work and keeping half of what
    each attempt did: attempt 1 runs 50 s of work (500 s) and fails at t=500 with 25 s done; the restart
    costs 10 s (to 510), the 25 s of work to the failure point 250 s: fails at 760 with 37.5 s done;
    10 s again (to 770) and 62.5 s of work (625 s): done at 1395. A job arriving at 505, in the middle
    of the first restart, splits it over two steps and then waits its turn (1 s of work: 10 s)."""
    job = Job("f", 0.0, QoSSpec(), 100.0, failure=FailurePlan(at_fraction=0.5, times=2, checkpoint_fraction=0.5))
    late = Job("late", 505.0, QoSSpec(), 1.0)
    res = simulate([job, late], ClusterSpec.uniform(1, 1), get_policy("fifo"), speed=TenthSpeed(),
                   config=SimConfig(restart_overhead=10.0))
    by = {j.job_id: j for j in res.jobs}
    assert all(j.status is JobStatus.DONE for j in res.jobs)
    assert by["f"].failures == 2 and by["f"].restarts == 2
    assert by["f"].finish_time == pytest.approx(500.0 + 10.0 + 250.0 + 10.0 + 625.0)  # not 1,575 (100 s restarts)
    assert by["late"].finish_time == pytest.approx(1395.0 + 10.0)
    assert res.wasted_gpu_seconds == pytest.approx(25.0 + 12.5)  # work lost, overhead not counted as work
    assert res.busy_gpu_seconds == pytest.approx(res.received_gpu_seconds) == pytest.approx(1405.0)


def test_preempted_slow_job_pays_the_overhead_in_wall_time():
    """SRTF at rate 0.1: the long job (1,000 s of work) has done 1 s by t=10, the short one runs
    t=10-110, and the long one restarts at 110: 7 s of overhead, then 999 s of work at 0.1."""
    jobs = [Job("long", 0.0, QoSSpec(), 1000.0), Job("short", 10.0, QoSSpec(), 10.0)]
    res = simulate(jobs, ClusterSpec.uniform(1, 1), get_policy("srtf"), speed=TenthSpeed(),
                   config=SimConfig(restart_overhead=7.0))
    by = {j.job_id: j for j in res.jobs}
    assert by["short"].finish_time == pytest.approx(110.0)
    assert by["long"].preemptions == 1
    assert by["long"].finish_time == pytest.approx(110.0 + 7.0 + 9990.0)  # not 110 + 70 + 9990


def test_overhead_ending_at_a_large_simulated_time_does_not_stall():
    """At t ~ 1e7 s the clock resolves ~2e-9 s: an overhead left a rounding error above zero after the
    step meant to end it must count as over (the job's completion is due, not a step of zero length)."""
    t0 = 1.234567e7
    job = Job("f", t0, QoSSpec(), 333.3, failure=FailurePlan(at_fraction=0.3, times=3, checkpoint_fraction=0.7))
    others = [Job(f"o{i}", t0 + 0.1 + 17.3 * i, QoSSpec(), 3.7 + i) for i in range(4)]
    res = simulate([job, *others], ClusterSpec.uniform(1, 1), get_policy("fifo"), speed=TenthSpeed(),
                   config=SimConfig(restart_overhead=3.3))
    assert all(j.status is JobStatus.DONE for j in res.jobs)
    assert {j.job_id: j.failures for j in res.jobs}["f"] == 3
