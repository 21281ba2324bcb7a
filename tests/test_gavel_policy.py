"""The Gavel baseline (qosflow.policies.gavel): its allocation LP keeps Gavel's constraints and is
max-min optimal, its rounds come every 360 s, it never over-allocates, every job finishes on an
overloaded run, and on mixed GPU models a job much faster on one model runs mostly there."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qosflow.core.estimate import OracleEstimator
from qosflow.core.job import Job, JobStatus
from qosflow.core.qos import QoSSpec
from qosflow.core.speed import SpeedModel
from qosflow.policies import get_policy
from qosflow.policies.gavel import GavelPolicy, solve_allocation
from qosflow.sim.clusters import load_cluster
from qosflow.sim.engine import SimConfig, Simulator, simulate
from qosflow.sim.interference import GavelInterference


def _table(tmp_path):
    """Gavel's format: 'A' runs 10x faster on a V100 than on a K80, 'B' alike on both."""
    data = {
        "v100": {"('A', 1)": {"null": 10.0}, "('B', 1)": {"null": 4.0}, "('A', 2)": {"null": 18.0}, "('B', 2)": {"null": 7.0}},
        "k80": {"('A', 1)": {"null": 1.0}, "('B', 1)": {"null": 4.0}, "('A', 2)": {"null": 1.8}, "('B', 2)": {"null": 7.0}},
    }
    p = tmp_path / "tput.json"
    p.write_text(json.dumps(data))
    return SpeedModel(GavelInterference(p))


def _jobs(n, *, models="AB", spacing=20.0, gpus=lambda i: 1, duration=lambda i: 1500.0 + 100 * (i % 4)):
    return [Job(f"j{i}", spacing * i, QoSSpec(gpus=gpus(i), gpu_mem_mb=1000.0), duration(i), model=models[i % len(models)])
            for i in range(n)]


def _lp_min(T, sf, cap, X):
    """Gavel's objective for allocation X: the least normalised throughput over the jobs that can run."""
    allowed = (T > 0) & (sf[:, None] <= cap[None, :])
    rows = allowed.any(axis=1)
    eq = (T * allowed) @ cap / cap.sum()
    val = (T * X).sum(axis=1) * sf / np.where(rows, eq, 1.0)
    return float(val[rows].min())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tiebreak", [True, False])
def test_allocation_respects_gavels_constraints_and_is_max_min_optimal(seed, tiebreak):
    rng = np.random.default_rng(seed)
    m, n = 40, 3
    T = rng.uniform(0.1, 2.0, (m, n))
    T[rng.random((m, n)) < 0.1] = 0.0  # types some jobs may not use
    sf = rng.choice([1, 1, 1, 2, 4, 8, 16], m).astype(float)
    cap = np.array([12.0, 8.0, 4.0])  # (16-GPU jobs fit no type)
    X = solve_allocation(T, sf, cap, tiebreak=tiebreak)
    assert X.shape == (m, n)
    assert (X >= -1e-9).all()
    assert (X.sum(axis=1) <= 1 + 1e-7).all()
    assert ((X * sf[:, None]).sum(axis=0) <= cap + 1e-6).all()
    assert (X[T == 0] == 0).all() and (X[sf > cap.max()] == 0).all()
    # max-min optimal: no other feasible allocation has a larger least normalised throughput. Two
    # candidates: equal GPU-time shares of every type, and the same with jobs on their fastest types
    best = _lp_min(T, sf, cap, X)
    allowed = (T > 0) & (sf[:, None] <= cap[None, :])
    share = np.where(allowed, cap[None, :] / (sf[:, None] * allowed).sum(axis=0)[None, :], 0.0)
    share /= np.maximum(share.sum(axis=1, keepdims=True), 1.0)
    assert best >= _lp_min(T, sf, cap, share) - 1e-7
    # the tie-break keeps the max-min value
    assert best == pytest.approx(_lp_min(T, sf, cap, solve_allocation(T, sf, cap, tiebreak=not tiebreak)), rel=1e-5)


def test_allocation_puts_a_job_where_it_is_relatively_fastest():
    # job 0 runs 10x faster on type 0; job 1 alike on both: job 0 gets type 0, job 1 type 1
    T = np.array([[1.0, 0.1], [1.0, 1.0]])
    X = solve_allocation(T, np.array([1.0, 1.0]), np.array([1.0, 1.0]))
    assert X[0, 0] == pytest.approx(1.0) and X[0, 1] == pytest.approx(0.0, abs=1e-9)
    assert X[1, 1] == pytest.approx(1.0)
    # fairness in GPU-time (Gavel's scale factors): a 4-GPU job gets a quarter of a 1-GPU job's time
    X = solve_allocation(np.ones((2, 1)), np.array([1.0, 4.0]), np.array([4.0]), tiebreak=False)
    assert X[0, 0] * 1 == pytest.approx(X[1, 0] * 4, rel=1e-6)
    # nothing can run: all zero
    assert not solve_allocation(np.zeros((2, 2)), np.ones(2), np.ones(2)).any()


def test_a_job_much_faster_on_one_model_runs_mostly_there(tmp_path):
    sm = _table(tmp_path)
    spec = load_cluster("4:0:4")  # 4 V100s, 4 K80s
    # A: 10x faster on a V100; B: alike on both. 24 jobs on 8 GPUs: overloaded
    jobs = _jobs(24, duration=lambda i: 3000.0 + 200 * (i % 5))
    pol = GavelPolicy()
    res = Simulator(jobs, spec, pol, estimator=OracleEstimator(sm), speed=sm, config=SimConfig(check_invariants=True)).run()
    assert all(j.status is JobStatus.DONE for j in res.jobs)
    on = {"A": {"v100": 0.0, "k80": 0.0}, "B": {"v100": 0.0, "k80": 0.0}}
    for js in res.jobs:
        for model, secs in js.tags["gavel_on"].items():
            on[js.job.model][model] += secs
    # the work A's jobs did: most of it on V100s (a K80 second is worth a tenth of a V100 second)
    a_work_v100 = on["A"]["v100"] / (on["A"]["v100"] + 0.1 * on["A"]["k80"])
    assert a_work_v100 > 0.9, on
    assert on["A"]["v100"] > on["A"]["k80"], on
    # and B, alike on both, took most of the K80 time
    assert on["B"]["k80"] > on["A"]["k80"], on
    # model-blind srtf does worse on average here
    srtf = Simulator(jobs, spec, get_policy("srtf"), estimator=OracleEstimator(sm), speed=sm).run()
    jct = lambda r: np.mean([j.finish_time - j.job.submit_time for j in r.jobs])  # noqa: E731
    assert jct(res) < jct(srtf)


def test_rounds_come_every_360_seconds_and_jobs_time_share(tmp_path):
    """One GPU type, one GPU, three equal long jobs: Gavel degenerates to max-min fair time sharing --
    each round a different job runs (preempting the last), and round starts are 360 s apart."""
    spec = load_cluster("1x1")
    jobs = [Job(f"j{i}", 0.0, QoSSpec(gpus=1), 3600.0) for i in range(3)]
    pol = GavelPolicy()
    res = simulate(jobs, spec, pol, config=SimConfig(restart_overhead=0.0, check_invariants=True))
    assert all(j.status is JobStatus.DONE for j in res.jobs)
    t = np.array(pol.round_times)
    assert len(t) >= 20
    gaps = np.diff(t)
    # a round ends early only when the cluster idles between jobs (not here): every gap is a round
    assert np.allclose(gaps, 360.0), gaps
    assert pol.lp_solves <= 4  # re-solved when the job set changes, not every round
    # time sharing: every job was preempted several times and they finish close together
    assert all(j.preemptions >= 3 for j in res.jobs)
    fin = sorted(j.finish_time for j in res.jobs)
    assert fin[-1] - fin[0] <= 2 * 360.0 + 1e-6
    # next_wakeup is the end of the current round while jobs remain
    from qosflow.core.cluster import ClusterState
    from qosflow.core.job import JobState
    from qosflow.policies.base import SchedulerView

    p2 = GavelPolicy(round_seconds=100.0)
    st = ClusterState(spec)
    js = JobState(jobs[0])
    view = SchedulerView(50.0, st.snapshot(), [js], [], OracleEstimator())
    d = p2.schedule(view)
    assert [p.job_id for p in d.starts] == ["j0"]
    assert p2.next_wakeup(SchedulerView(50.0, st, [], [js], OracleEstimator())) == pytest.approx(150.0)
    assert p2.next_wakeup(SchedulerView(50.0, st, [], [], OracleEstimator())) is None


def test_between_rounds_nothing_is_preempted_and_free_gpus_are_filled():
    spec = load_cluster("1x2")
    # j0 and j1 fill both GPUs; j2 arrives mid-round: it waits for the round (no preemption);
    # j3 arrives after j0 ends mid-round: it takes the free GPU at once (backfill)
    jobs = [Job("j0", 0.0, QoSSpec(gpus=1), 100.0), Job("j1", 0.0, QoSSpec(gpus=1), 5000.0),
            Job("j2", 50.0, QoSSpec(gpus=1), 5000.0), Job("j3", 200.0, QoSSpec(gpus=1), 5000.0)]
    pol = GavelPolicy()
    res = {j.job_id: j for j in simulate(jobs, spec, pol, config=SimConfig(restart_overhead=0.0)).jobs}
    assert res["j0"].preemptions == 0
    # j2 took j0's GPU when it ended (110 s: it was the only one waiting), j3 waited for the round
    assert res["j2"].first_start == pytest.approx(100.0)
    assert res["j3"].first_start == pytest.approx(360.0)
    # without backfill, a job waits for the next round even with a GPU free
    nob = {j.job_id: j for j in simulate(jobs, spec, GavelPolicy(backfill=False), config=SimConfig(restart_overhead=0.0)).jobs}
    assert nob["j2"].first_start == pytest.approx(360.0)


def test_overloaded_mixed_run_never_over_allocates_and_finishes_every_job(tmp_path):
    sm = _table(tmp_path)
    spec = load_cluster("4:0:4")
    jobs = _jobs(40, spacing=10.0, gpus=lambda i: (1, 1, 2, 4)[i % 4])
    res = Simulator(jobs, spec, GavelPolicy(), estimator=OracleEstimator(sm), speed=sm,
                    config=SimConfig(check_invariants=True, failure_share=0.2, seed=3)).run()
    assert sorted(j.job_id for j in res.jobs if j.status is JobStatus.DONE) == sorted(j.job_id for j in jobs)
    assert res.received_gpu_seconds == pytest.approx(res.busy_gpu_seconds, rel=1e-9)
    assert max(v for _, v in res.timeline) <= spec.num_gpus + 1e-9
    assert res.shared_gpu_seconds == 0.0  # no space sharing: a GPU never holds two jobs
    # a gang never spans two GPU models (its whole gang on one type)
    for js in res.jobs:
        assert set(js.tags["gavel_on"]) <= {"v100", "k80"}


def test_policy_options_and_registry():
    pol = get_policy("gavel", round_seconds=60.0, tiebreak="none")
    assert pol.preemptive and pol.options() == {"round_seconds": 60.0, "tiebreak": "none", "backfill": True}
    with pytest.raises(ValueError, match="round_seconds"):
        GavelPolicy(round_seconds=0)
    with pytest.raises(ValueError, match="tiebreak"):
        GavelPolicy(tiebreak="water")


def test_simulate_cli_runs_gavel(tmp_path):
    from qosflow.cli.main import main

    out = tmp_path / "g.json"
    assert main(["simulate", "--jobs", "40", "--cluster", "2x4", "--policies", "gavel,srtf", "--no-plots",
                 "--set", "gavel.round_seconds=120", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"gavel", "srtf"}
    assert data["policies"]["gavel"]["jobs"] == 40


@pytest.mark.timeout(120)  # (before the fix the run never ended: a round every 360 s for ever)
def test_a_gang_wider_than_every_gpu_type_spans_types_and_finishes(tmp_path):
    """An 8-GPU gang on 4 V100s + 4 K80s: no one type holds it, and Gavel puts a job on one type, so
    it could never run. It spans the types instead (at its slowest GPU's pace), on GPUs left over,
    and every job finishes; the narrower jobs still run on one type each."""
    sm = _table(tmp_path)
    spec = load_cluster("4:0:4")
    jobs = _jobs(12, spacing=30.0, gpus=lambda i: 8 if i == 2 else (1, 2)[i % 2])
    pol = GavelPolicy()
    res = Simulator(jobs, spec, pol, estimator=OracleEstimator(sm), speed=sm,
                    config=SimConfig(check_invariants=True, restart_overhead=0.0)).run()
    assert all(j.status is JobStatus.DONE for j in res.jobs)
    wide = next(j for j in res.jobs if j.job_id == "j2")
    assert wide.finish_time < 1e6  # not left waiting round after round
    assert max(v for _, v in res.timeline) <= spec.num_gpus + 1e-9
    # 'A' runs 10x slower on a K80: the gang over both types ran at the K80's pace
    assert wide.finish_time - wide.first_start >= 10 * wide.job.duration * 0.99
    assert pol.rounds < 1000


@pytest.mark.parametrize("backfill", [True, False])
def test_a_job_whose_hosts_are_all_down_says_so_not_gavel_priority(backfill):
    """Every host that could hold a waiting job down: its note said "lower Gavel priority this round" (or
    "for the next Gavel round"), hiding that it cannot start anywhere. Now it says the hosts are down, at a
    round and between rounds; the decisions are unchanged, and with the hosts up the notes are Gavel's."""
    from qosflow.core.cluster import ClusterSpec, ClusterState
    from qosflow.core.estimate import DeclaredEstimator
    from qosflow.core.job import JobState
    from qosflow.policies.base import SchedulerView

    spec = ClusterSpec.uniform(2, 4, prefix="gpu-")
    names = ", ".join(n.name for n in spec.nodes)

    def notes(down):
        pol = GavelPolicy(backfill=backfill)
        out = []
        for now in (1.0, 2.0):  # a round's start, then between rounds
            st = ClusterState(spec)
            for i in down:
                st.set_node_down(i)
            js = JobState(Job("s", 0.0, QoSSpec(gpus=1), 60.0, expected_duration=60.0))
            d = pol.schedule(SchedulerView(now, st.snapshot(), [js], [], DeclaredEstimator()))
            assert not d.preempt
            out.append((d.notes.get("s"), [p.gpus for p in d.starts]))
        return out

    # (without backfill the job waits for the next round between rounds: that note too)
    for n, starts in notes([0, 1]):
        assert n == f"waiting: all 2 hosts are down ({names})" and not starts, n
    (n0, s0), (n1, s1) = notes([0])  # one host up: as before, it starts there, or waits for Gavel's round
    assert n0 is None and s0 == [((1, 0),)], (n0, s0)
    if backfill:
        assert n1 is None and s1 == [((1, 0),)], (n1, s1)
    else:
        assert n1 == "waiting: for the next Gavel round (360 s)" and not s1, n1
