"""qosflow's policy keeps the searches that depend on a request's shape and the cluster's state only
from one round to the next while the cluster is exactly as the last round left it
(`QosflowPolicy._same_state`). That must change no decision: a run that starts every round afresh
gives the same schedule, job by job, note by note."""

from __future__ import annotations

import pytest

from qosflow.core.estimate import make_estimator
from qosflow.policies import get_policy
from qosflow.policies.qosflow_policy import QosflowPolicy
from qosflow.sim.engine import SimConfig, Simulator
from qosflow.sim.interference import default_speed_model
from qosflow.sim.runner import resolve_workload


def _schedule(options: dict, estimator: str, fresh: bool, monkeypatch) -> tuple[list, int]:
    wl, spec = resolve_workload("synthetic", "synthetic", "4x4", seed=3, jobs=160)
    speed = default_speed_model()
    policy = get_policy("qosflow", **options)
    kept = [0]
    same = QosflowPolicy._same_state

    def counted(self, st, states):
        ok = same(self, st, states)
        kept[0] += ok
        return False if fresh else ok

    monkeypatch.setattr(QosflowPolicy, "_same_state", counted)
    sim = Simulator(wl.jobs, spec, policy, estimator=make_estimator(estimator, speed, seed=3, error=0.3), speed=speed,
                    config=SimConfig(seed=3, failure_share=0.3))
    res = sim.run()
    return sorted((js.job.job_id, js.first_start, js.finish_time, js.restarts, js.note) for js in res.jobs), kept[0]


@pytest.mark.parametrize("options,estimator", [({}, "oracle"), ({"express_share": 0.25}, "oracle"), ({}, "noisy"),
                                               ({"align": True, "express_share": 0.25}, "noisy")])
def test_searches_kept_across_rounds_change_no_decision(options, estimator, monkeypatch):
    kept, n_kept = _schedule(options, estimator, False, monkeypatch)
    fresh, _ = _schedule(options, estimator, True, monkeypatch)
    assert n_kept > 0  # (some rounds found the cluster as the last one left it)
    assert kept == fresh
