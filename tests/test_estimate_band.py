"""Estimators state their error band: pessimistic remaining times and pair slowdowns."""

import math

import numpy as np
import pytest

from qosflow.core import Job, QoSSpec
from qosflow.core.estimate import (
    DECLARED_HIGH_FACTOR,
    DECLARED_LOG_SD,
    HIGH_QUANTILE,
    Z_HIGH,
    DeclaredEstimator,
    NoisyEstimator,
    OracleEstimator,
    pair_slowdown_high,
    remaining_high,
)
from qosflow.core.job import JobState
from qosflow.sim.interference import default_speed_model


def _jobs(n=2000):
    models = ["resnet18", "vgg16", "gpt2", "dqn"]
    return [Job(f"j{i}", 0.0, QoSSpec(gpus=1), 100.0 + 37.0 * i, model=models[i % 4]) for i in range(n)]


def test_the_oracle_and_an_undeclared_job_state_no_band():
    speed = default_speed_model()
    a, b = _jobs(2)
    for est in (OracleEstimator(speed), DeclaredEstimator(speed)):
        for js in (JobState(a), JobState(b)):
            assert remaining_high(est, js) == est.remaining(js)
        assert pair_slowdown_high(est, a, b) == est.pair_slowdown(a, b)


def test_a_declared_duration_states_the_declared_band():
    """A declaration is rough: the declared estimator states the same log-normal band (x 1.9 at the
    90th percentile) as the live estimators do, on the time left; the default duration states none."""
    est = DeclaredEstimator(default_speed_model(), default_duration=600.0)
    declared = Job("d", 0.0, QoSSpec(gpus=1), 1000.0, model="resnet18", expected_duration=300.0)
    js = JobState(declared)
    assert est.remaining(js) == 300.0
    assert remaining_high(est, js) == pytest.approx(300.0 * math.exp(Z_HIGH * DECLARED_LOG_SD))
    assert remaining_high(est, js) == pytest.approx(300.0 * 1.898, rel=1e-3)
    js.progress = 0.5
    assert remaining_high(est, js) == pytest.approx(150.0 * DECLARED_HIGH_FACTOR)
    undeclared = JobState(Job("u", 0.0, QoSSpec(gpus=1), 1000.0, model="resnet18"))
    assert remaining_high(est, undeclared) == est.remaining(undeclared) == 600.0


def test_an_estimator_without_a_band_falls_back_to_its_point_estimates():
    class Bare:
        name = "bare"

        def remaining(self, js):
            return 42.0

        def pair_slowdown(self, a, b):
            return (1.5, 1.25)

    a, b = _jobs(2)
    assert remaining_high(Bare(), JobState(a)) == 42.0
    assert pair_slowdown_high(Bare(), a, b) == (1.5, 1.25)


@pytest.mark.parametrize("error", [0.1, 0.3, 0.5])
def test_the_noisy_band_is_the_quantile_of_its_error(error):
    """est = truth x f, f uniform in [1 - e, 1 + e]: the truth is within remaining_high of the estimate
    for HIGH_QUANTILE of the jobs, and the excess of a slowdown likewise."""
    speed = default_speed_model()
    est = NoisyEstimator(speed, error=error, seed=3)
    assert est.high_factor == pytest.approx(1.0 / (1.0 - error * (2 * HIGH_QUANTILE - 1)))
    jobs = _jobs()
    within = np.mean([j.duration <= remaining_high(est, JobState(j)) * (1 + 1e-12) for j in jobs])
    assert within == pytest.approx(HIGH_QUANTILE, abs=0.03)
    # a running job's band is its duration's (progress does not correct the noisy estimate)
    js = JobState(jobs[5])
    js.progress = 0.5
    assert remaining_high(est, js) == pytest.approx(est.remaining(js) * est.high_factor)
    ok = []
    for a, b in zip(jobs[:400], jobs[1:401]):
        truth = speed.pair_slowdown(a, b)[0]
        if truth > 1.0:
            ok.append(truth <= pair_slowdown_high(est, a, b)[0] + 1e-12)
    assert np.mean(ok) == pytest.approx(HIGH_QUANTILE, abs=0.05)
