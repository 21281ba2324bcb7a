"""Fairness between users in qosflow's policy (`QosflowPolicy(fair_share=...)`, ordering module): a user over
their fair share of the GPUs waits behind other users' jobs, only while such a job waits; with one user or
none known nothing changes, job by job; the note says why. (The user's way from `@qos_task(user=...)` or a
`user:NAME` tag into the job the worker's scheduler sees: tests/test_fair_share_prefect.py.)"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from qosflow.core import ClusterSpec, Job, QoSSpec
from qosflow.core.estimate import OracleEstimator
from qosflow.core.job import JobState, JobStatus
from qosflow.core.placement import Placement
from qosflow.core.cluster import ClusterState
from qosflow.policies import get_policy
from qosflow.policies.base import SchedulerView
from qosflow.policies.qosflow_policy.ordering import _UsageLog, job_user
from qosflow.sim.deadlines import assign_deadlines
from qosflow.sim.engine import SimConfig, simulate

FAIR_NOTE = "of other users first"


# ------------------------------------------------------------------------------------ one round
def _round(pending_users, *, running_users=("heavy", "heavy"), gpus=3, half_life=0.0, deadline=None, **opts):
    """A round on one node of `gpus` GPUs: one 1-GPU job running per `running_users` entry, and waiting
    1-GPU jobs: (job id, user, duration) each. Returns the decision."""
    spec = ClusterSpec.uniform(1, gpus, cpu_cores=16)
    st = ClusterState(spec)
    running = []
    for i, u in enumerate(running_users):
        js = JobState(Job(f"run{i}", 0.0, QoSSpec(gpus=1), 5000.0, user=u), status=JobStatus.RUNNING)
        p = Placement(js.job_id, ((0, i),), cpu=((0, 1.0),))
        st.allocate(p, js.job.qos)
        js.placement = p
        js.first_start = js.last_start = 0.0
        running.append(js)
    pending = []
    for jid, u, dur in pending_users:
        q = QoSSpec(gpus=1, deadline=deadline) if (deadline and u == "heavy") else QoSSpec(gpus=1)
        pending.append(JobState(Job(jid, 10.0, q, dur, user=u), queued_since=10.0))
    pol = get_policy("qosflow", fair_half_life=half_life, share=False, **opts)
    view = SchedulerView(now=100.0, cluster=st.snapshot(), pending=pending, running=running, estimator=OracleEstimator())
    return pol.schedule(view)


def test_a_user_over_their_share_lets_another_users_waiting_job_go_first_and_says_why():
    # heavy holds 2 of 3 GPUs (share 1.5 each of 2 users); one GPU free: SJF would give it heavy's short job
    d = _round([("h-short", "heavy", 100.0), ("l-long", "light", 1000.0)])
    assert [p.job_id for p in d.starts] == ["l-long"]
    note = d.notes["h-short"]
    assert note.startswith("waiting: "), note
    assert "1 job of other users first: user heavy holds 2.0 GPUs, over their fair share of 1.5 of the 3 GPUs (2 users with jobs)" in note, note
    # off: weighted SJF as before
    d = _round([("h-short", "heavy", 100.0), ("l-long", "light", 1000.0)], fair_share=False)
    assert [p.job_id for p in d.starts] == ["h-short"] and FAIR_NOTE not in d.notes.get("l-long", "")


def test_an_over_share_user_is_not_held_back_when_no_other_users_job_waits():
    # the light user holds a GPU but has nothing waiting: heavy's jobs go as SJF orders them, no note
    d = _round([("h-long", "heavy", 1000.0), ("h-short", "heavy", 100.0)], running_users=("heavy", "light"))
    assert [p.job_id for p in d.starts] == ["h-short"]
    assert all(FAIR_NOTE not in n for n in d.notes.values()), d.notes


def test_work_conserving_the_over_share_user_takes_what_the_others_leave():
    d = _round([("h-short", "heavy", 100.0), ("l-long", "light", 1000.0)], running_users=("heavy",), gpus=4)
    assert sorted(p.job_id for p in d.starts) == ["h-short", "l-long"]


def test_a_job_that_can_meet_its_deadline_keeps_its_place():
    d = _round([("h-short", "heavy", 100.0), ("l-long", "light", 1000.0)], deadline=500.0)
    assert [p.job_id for p in d.starts] == ["h-short"]


def test_weights_give_a_user_a_larger_share():
    # heavy's weight 3: a share of 2.25 of 3 GPUs, and 2 held is within it
    d = _round([("h-short", "heavy", 100.0), ("l-long", "light", 1000.0)], fair_weights={"heavy": 3})
    assert [p.job_id for p in d.starts] == ["h-short"]


def test_the_margin_leaves_a_user_just_over_their_share_alone():
    d = _round([("h-short", "heavy", 100.0), ("l-long", "light", 1000.0)], fair_margin=0.5)
    assert [p.job_id for p in d.starts] == ["h-short"]


def test_users_of_jobs_without_one_form_one_account():
    d = _round([("h-short", None, 100.0), ("l-long", "light", 1000.0)], running_users=(None, None))
    assert [p.job_id for p in d.starts] == ["l-long"]
    assert "the jobs with no user hold 2.0 GPUs, over their fair share" in d.notes["h-short"], d.notes["h-short"]


# ------------------------------------------------------------------------------------ whole runs
def _mixed_workload(n: int = 160, *, seed: int = 3) -> list[Job]:
    """Jobs of every shape the policy treats apart: 1-8 GPUs, shareable, deadlines, bursts."""
    from qosflow.sim.traces.synthetic import generate_synthetic

    jobs, _ = generate_synthetic(n, seed=seed, cluster=ClusterSpec.uniform(2, 8))
    for j in jobs:  # (compressed: durations of minutes to hours, so that jobs queue on 16 GPUs)
        j.duration = j.duration / 20.0
    return assign_deadlines(jobs, share=0.4, seed=seed)


def _run(jobs, spec, **opts):
    res = simulate(jobs, spec, get_policy("qosflow", **opts), config=SimConfig(seed=0))
    return {js.job_id: (js.first_start, js.finish_time, js.note, js.restarts) for js in res.jobs}


@pytest.mark.parametrize("users", [None, "solo"])
def test_with_one_user_or_none_nothing_changes_job_by_job(users):
    spec = ClusterSpec.uniform(2, 8)
    jobs = [replace(j, user=users) for j in _mixed_workload()]
    off = _run(jobs, spec, fair_share=False)
    on = _run(jobs, spec, fair_share=True)
    assert on == off
    # and nothing waits for a reason of fairness
    assert not any(FAIR_NOTE in v[2] for v in on.values())


def _heavy_and_light(seed: int = 0) -> list[Job]:
    """A sweep of 120 short 1-GPU jobs by one user at t=0-10 min, and 3 other users' jobs of 1-4 GPUs
    arriving over two hours."""
    import random

    rnd = random.Random(seed)
    jobs = [Job(f"sweep-{i}", i * 5.0, QoSSpec(gpus=1), rnd.uniform(600, 1800), user="heavy") for i in range(120)]
    for u in ("ann", "bo", "cy"):
        t = rnd.uniform(0, 600)
        for k in range(4):
            jobs.append(Job(f"{u}-{k}", t, QoSSpec(gpus=rnd.choice((1, 2, 4))), rnd.uniform(1800, 5400), user=u))
            t += rnd.uniform(600, 2400)
    return sorted(jobs, key=lambda j: j.submit_time)


class _Spy:
    """Wraps a policy; checks at every round that a job noted as waiting for other users' jobs has one
    waiting of another user with GPUs to ask for, and collects those rounds."""

    def __init__(self, pol):
        self.pol = pol
        self.fair_rounds = 0
        self.name, self.preemptive = pol.name, pol.preemptive

    def __getattr__(self, k):
        return getattr(self.pol, k)

    def schedule(self, view):
        d = self.pol.schedule(view)
        started = {p.job_id for p in d.starts}
        for js in view.pending:
            note = d.notes.get(js.job_id, "")
            if FAIR_NOTE in note:
                assert js.job_id not in started
                me = job_user(js.job)
                others = [o for o in view.pending if job_user(o.job) != me and o.job.qos.gpus > 0]
                assert others, (js.job_id, note)
                self.fair_rounds += 1
        return d


def test_over_share_users_wait_only_while_other_users_jobs_wait_and_light_users_gain():
    spec = ClusterSpec.uniform(2, 4, cpu_cores=32)
    jobs = _heavy_and_light()
    spy = _Spy(get_policy("qosflow", share=False))
    res = simulate(jobs, spec, spy, config=SimConfig(seed=0))
    assert all(js.status is JobStatus.DONE for js in res.jobs)
    assert spy.fair_rounds > 0
    off = simulate(jobs, spec, get_policy("qosflow", share=False, fair_share=False), config=SimConfig(seed=0))

    def light_jct(r):
        xs = [js.finish_time - js.job.submit_time for js in r.jobs if js.job.user != "heavy"]
        return sum(xs) / len(xs)

    assert light_jct(res) < 0.8 * light_jct(off), (light_jct(res), light_jct(off))
    # work-conserving: the same work ends within the same time, give or take the order's packing
    end = lambda r: max(js.finish_time for js in r.jobs)  # noqa: E731
    assert end(res) <= 1.1 * end(off)


# ------------------------------------------------------------------------------------ the usage log
def test_usage_decays_with_its_half_life():
    log = _UsageLog()
    js = JobState(Job("a", 0.0, QoSSpec(gpus=4), 1e6, user="u"), status=JobStatus.RUNNING)
    view = lambda t, running: SimpleNamespace(now=t, pending=[], running=running)  # noqa: E731
    hl = 600.0
    log.record(view(0.0, [js]), hl)
    for t in range(60, 6001, 60):  # 4 GPUs for 10 half-lives
        js.gpu_attained = 4.0 * t
        log.record(view(float(t), [js]), hl)
    assert log.average("u", 4.0) == pytest.approx(4.0, rel=1e-3)
    js.status = JobStatus.DONE
    log.record(view(6000.0 + hl, []), hl)  # then nothing for one half-life
    assert log.average("u", 0.0) == pytest.approx(2.0, rel=1e-2)
    assert log.seen == {}
    log.record(view(10.0, []), hl)  # a clock that goes back: a new simulation
    assert log.usage == {} and log.kernel == 0.0


def test_the_usage_log_charges_a_job_that_ended_between_rounds_up_to_its_end():
    log = _UsageLog()
    js = JobState(Job("a", 0.0, QoSSpec(gpus=2), 100.0, user="u"))
    log.record(SimpleNamespace(now=0.0, pending=[js], running=[]), 3600.0)
    js.gpu_attained = 200.0  # ran 100 s on 2 GPUs, ended before the next round
    log.record(SimpleNamespace(now=100.0, pending=[], running=[]), 3600.0)
    assert log.usage["u"] == pytest.approx(200.0 * 2 ** (-50 / 3600), rel=1e-9)


def test_options_are_checked():
    for bad in ({"fair_half_life": -1}, {"fair_margin": math.inf}, {"fair_weights": {"a": 0}}, {"fair_weights": ["a"]},
                {"fair_share": "yes"}):
        with pytest.raises(ValueError, match="fair_"):
            get_policy("qosflow", **bad)
    pol = get_policy("qosflow", fair_weights={"alice": 2})
    assert pol.options()["fair_weights"] == {"alice": 2} and pol.options()["fair_share"] is True


def test_the_policy_block_takes_the_fairness_options():
    from qosflow.prefect.blocks import QoSPolicy

    blk = QoSPolicy(policy="qosflow", options={"fair_weights": {"alice": 2.0}, "fair_half_life": 1800})
    assert blk.options["fair_weights"] == {"alice": 2.0}
    with pytest.raises(ValueError, match="fair_weights"):
        QoSPolicy(policy="qosflow", options={"fair_weights": {"alice": -1}})


def test_the_synthetic_generator_may_give_its_jobs_users_without_changing_them():
    from qosflow.errors import SpecError
    from qosflow.sim.traces.synthetic import generate_synthetic

    plain, _ = generate_synthetic(120, seed=2)
    zipf, _ = generate_synthetic(120, seed=2, users=3)
    given, _ = generate_synthetic(120, seed=2, users=[0.9, 0.1])
    same = lambda js: [(j.job_id, j.submit_time, j.duration, j.qos, j.model) for j in js]  # noqa: E731
    assert same(plain) == same(zipf) == same(given)
    assert {j.user for j in plain} == {None}
    counts = {u: sum(j.user == u for j in zipf) for u in ("user1", "user2", "user3")}
    assert counts["user1"] > counts["user2"] > counts["user3"] > 0, counts
    assert sum(j.user == "user1" for j in given) > 90
    for bad in (0, [0.5, -1], "3", True):
        with pytest.raises(SpecError, match="users"):
            generate_synthetic(10, seed=0, users=bad)
