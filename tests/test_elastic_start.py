"""Elastic starts (`QoSSpec.min_gpus`): a gang that declared it may start on fewer GPUs, with gradient
accumulation, at that share of its speed; the qosflow policy does so for a deadline job when its full
width is not free and the slower run still meets the deadline."""

import pytest
from qosflow.cli.main import main
from qosflow.core import ClusterSpec, Job, QoSSpec
from qosflow.core.cluster import ClusterState, PlacementError
from qosflow.core.job import JobStatus
from qosflow.core.placement import Placement
from qosflow.core.speed import SpeedModel, width_fraction
from qosflow.errors import SpecError
from qosflow.policies import get_policy
from qosflow.sim.engine import SimConfig, simulate
from qosflow.sim.workload import elastic


def test_min_gpus_is_validated_and_names_the_field():
    for bad, words in [
        (dict(gpus=4, min_gpus=5), "1..gpus (4)"),
        (dict(gpus=4, min_gpus=0), "1..gpus (4)"),
        (dict(gpus=4, min_gpus=2.0), "whole number"),
        (dict(gpus=4, min_gpus=True), "whole number"),
        (dict(gpus=1, gpu_milli=500, min_gpus=1), "only a job of whole GPUs"),
        (dict(gpus=0, cpu_cores=2, min_gpus=1), "only a job of whole GPUs"),
        # (no divisor of 4 below it is 3 or more: it would silently have no effect)
        (dict(gpus=4, min_gpus=3), "allows no width below gpus=4, so it would have no effect"),
        (dict(gpus=4, min_gpus=3), "divisor of its GPUs (4, 2, 1"),
        (dict(gpus=4, min_gpus=3), "use min_gpus=2 or 1"),
        (dict(gpus=6, min_gpus=4), "(6, 3, 2, 1"),
    ]:
        with pytest.raises(SpecError, match="min_gpus") as e:
            QoSSpec(**bad)
        assert words in str(e.value)


def test_widths_are_the_divisors_down_to_min_gpus_and_narrowing_scales_cores():
    assert QoSSpec(gpus=8).widths == (8,)
    assert QoSSpec(gpus=8, min_gpus=3).widths == (8, 4)
    assert QoSSpec(gpus=8, min_gpus=1).widths == (8, 4, 2, 1)
    assert QoSSpec(gpus=6, min_gpus=2).widths == (6, 3, 2)
    q = QoSSpec(gpus=8, min_gpus=4, cpu_cores=16, mem_mb=8000, gpu_mem_mb=10000)
    n = q.narrowed(4)
    assert (n.gpus, n.cpu_cores, n.mem_mb, n.gpu_mem_mb, n.min_gpus) == (4, 8, 4000, 10000, None)
    with pytest.raises(SpecError, match="not a width"):
        q.narrowed(2)
    assert QoSSpec.from_dict(q.to_dict()) == q
    assert "min_gpus" not in QoSSpec(gpus=8).to_dict()


def test_cluster_accepts_a_declared_width_only():
    st = ClusterState(ClusterSpec.uniform(1, 8))
    half = Placement("j", tuple((0, g) for g in range(4)), cpu=((0, 4.0),))
    with pytest.raises(PlacementError, match="gang all-or-nothing"):
        st.allocate(half, QoSSpec(gpus=8, cpu_cores=8))
    st.allocate(half, QoSSpec(gpus=8, cpu_cores=8, min_gpus=4))
    assert st.used_gpus() == 4
    with pytest.raises(PlacementError, match="may start on 8, 4; placement gives 2"):
        st.allocate(Placement("k", ((0, 4), (0, 5))), QoSSpec(gpus=8, min_gpus=4))


def test_a_job_on_half_its_gpus_runs_at_half_speed():
    sm = SpeedModel()
    job = Job("j", 0.0, QoSSpec(gpus=8, min_gpus=4, cpu_cores=16), 3600.0)
    full = Placement("j", tuple((0, g) for g in range(8)), cpu=((0, 16.0),))
    half = Placement("j", tuple((0, g) for g in range(4)), cpu=((0, 8.0),))
    assert width_fraction(job, full) == 1.0 and width_fraction(job, half) == 0.5
    assert sm.rate(job, full) == pytest.approx(1.0)
    # the narrowed request's cores feed its GPUs fully: only the width slows it
    assert sm.rate(job, half) == pytest.approx(0.5)
    # starved of cores it is slower still (CODA's curve, on the cores its four GPUs need)
    starved = Placement("j", half.gpus, cpu=((0, 4.0),))
    assert sm.rate(job, starved) < 0.5


def _blocked_gang(deadline: float, min_gpus: int | None):
    """One 8-GPU node, half of it held for 10 h by a long job; then an 8-GPU one-hour gang."""
    return [
        Job("long", 0.0, QoSSpec(gpus=4, cpu_cores=4), 10 * 3600.0),
        Job("gang", 60.0, QoSSpec(gpus=8, cpu_cores=8, deadline=deadline, min_gpus=min_gpus), 3600.0),
    ]


def _run(jobs, **opts):
    res = simulate(jobs, ClusterSpec.uniform(1, 8), get_policy("qosflow", share=False, **opts), config=SimConfig(restart_overhead=0))
    return {j.job_id: j for j in res.jobs}


def test_a_deadline_gang_starts_on_half_its_gpus_when_that_meets_its_deadline():
    res = _run(_blocked_gang(3 * 3600.0, min_gpus=4))
    gang = res["gang"]
    assert gang.status is JobStatus.DONE
    assert gang.first_start == pytest.approx(60.0)
    # two hours on four GPUs: the deadline (3 h) is met
    assert gang.finish_time == pytest.approx(60.0 + 2 * 3600.0)
    assert gang.finish_time <= gang.job.deadline
    assert "elastic start on 4 of its 8 GPUs (gradient accumulation x2)" in gang.note
    assert gang.started_gpus == 4
    # rigid, the same gang waits the 10 h for the whole node and misses its deadline
    rigid = _run(_blocked_gang(3 * 3600.0, min_gpus=None))["gang"]
    assert rigid.first_start == pytest.approx(10 * 3600.0)
    assert rigid.finish_time > rigid.job.deadline
    # with the option off it is rigid too
    off = _run(_blocked_gang(3 * 3600.0, min_gpus=4), elastic=False)["gang"]
    assert off.first_start == pytest.approx(10 * 3600.0)


def test_no_elastic_start_that_would_miss_the_deadline():
    # 1.5 h of deadline for a 1 h job: on 4 GPUs it would take 2 h, so it waits for all 8
    gang = _run(_blocked_gang(1.5 * 3600.0, min_gpus=4))["gang"]
    assert gang.first_start == pytest.approx(10 * 3600.0)
    assert "elastic" not in gang.note


def test_a_job_without_a_deadline_is_not_narrowed():
    jobs = [Job("long", 0.0, QoSSpec(gpus=4, cpu_cores=4), 10 * 3600.0),
            Job("gang", 60.0, QoSSpec(gpus=8, cpu_cores=8, min_gpus=4), 3600.0)]
    assert _run(jobs)["gang"].first_start == pytest.approx(10 * 3600.0)


def test_the_policy_counts_a_narrowed_running_job_at_its_own_pace():
    # the narrowed gang holds 4 GPUs for 2 h; a 4-GPU deadline job that arrives meanwhile must see the
    # GPUs free at 2 h (not at 1 h, the gang's time on all its GPUs) and reserve them accordingly
    jobs = _blocked_gang(3 * 3600.0, min_gpus=4) + [Job("next", 120.0, QoSSpec(gpus=4, cpu_cores=4, deadline=4 * 3600.0), 3600.0)]
    res = _run(jobs)
    assert res["next"].first_start == pytest.approx(60.0 + 2 * 3600.0)
    assert "free for it in about 2.0 h" in _first_waiting_note(jobs)


def _first_waiting_note(jobs) -> str:
    """The note the policy gives the third job in the round of its arrival."""
    from qosflow.policies.base import SchedulerView, commit
    from qosflow.core.estimate import OracleEstimator
    from qosflow.core.job import JobState

    spec = ClusterSpec.uniform(1, 8)
    st = ClusterState(spec)
    pol = get_policy("qosflow", share=False)
    states = {j.job_id: JobState(j) for j in jobs[:2]}
    d = pol.schedule(SchedulerView(60.0, st.snapshot(), list(states.values()), [], OracleEstimator()))
    commit(st, d, states)
    for p in d.starts:
        states[p.job_id].placement = p
        states[p.job_id].status = JobStatus.RUNNING
    nxt = JobState(jobs[2], queued_since=120.0)
    d2 = pol.schedule(SchedulerView(120.0, st.snapshot(), [nxt], list(states.values()), OracleEstimator()))
    return d2.notes["next"]


def test_a_gang_wider_than_the_cluster_starts_on_its_widest_width_that_fits_under_qosflow_only():
    """gpus=4, min_gpus=1 on one node of 2 GPUs: all 4 never fit, 2 do. The qosflow policy admits it and
    starts it on 2 (gradient accumulation x2), with a deadline or without; a 4-GPU job without min_gpus,
    and any job under a baseline (they start every job on all its GPUs), stay rejected, saying why."""
    spec = ClusterSpec.uniform(1, 2, cpu_cores=8)
    for deadline in (3600.0, None):
        jobs = [Job("busy", 0.0, QoSSpec(gpus=1), 100.0),
                Job("wide", 10.0, QoSSpec(gpus=4, min_gpus=1, cpu_cores=4, deadline=deadline), 60.0),
                Job("rigid", 10.0, QoSSpec(gpus=4), 60.0)]
        res = {j.job_id: j for j in simulate(jobs, spec, get_policy("qosflow"), config=SimConfig(restart_overhead=0)).jobs}
        wide = res["wide"]
        assert wide.status is JobStatus.DONE, wide.note
        if deadline is None:  # it waits for its 2 GPUs (not narrower: no deadline to keep)
            assert wide.started_gpus == 2 and wide.first_start == pytest.approx(100.0)
            assert wide.finish_time == pytest.approx(100.0 + 120.0)  # 60 s on 4 GPUs: 120 s on 2
            assert "started on 2 of its 4 GPUs (gradient accumulation x2): all 4 never fit this cluster" in wide.note
        else:  # a deadline it meets on 1 GPU: an elastic start below its widest width, at once
            assert wide.started_gpus == 1 and wide.first_start == pytest.approx(10.0)
            assert wide.finish_time == pytest.approx(10.0 + 240.0)
            assert "elastic start on 1 of its 4 GPUs" in wide.note
        assert res["rigid"].status is JobStatus.REJECTED and "min_gpus" not in res["rigid"].note
        for base in ("fifo", "sjf", "srtf", "tiresias"):
            out = {j.job_id: j for j in simulate(jobs, spec, get_policy(base), config=SimConfig(restart_overhead=0)).jobs}
            assert out["wide"].status is JobStatus.REJECTED, base
            assert "its min_gpus=1 would let it start on 2, but this policy ignores min_gpus" in out["wide"].note
    # with the option off, qosflow starts every job at full width too: rejected
    off = simulate(jobs, spec, get_policy("qosflow", elastic=False), config=SimConfig(restart_overhead=0)).jobs
    assert next(j for j in off if j.job_id == "wide").status is JobStatus.REJECTED


def test_a_gang_none_of_whose_widths_fits_is_rejected_naming_min_gpus():
    spec = ClusterSpec.uniform(1, 2)
    q = QoSSpec(gpus=8, min_gpus=4, deadline=600.0)
    why = spec.why_never_fits(q, elastic=True)
    assert why and "asks for 8 GPUs" in why and "nor on fewer, down to its min_gpus=4 (4 GPUs); on 4: asks for 4 GPUs" in why
    assert spec.widest_width(q) is None and spec.widest_width(QoSSpec(gpus=8, min_gpus=2)) == 2
    res = simulate([Job("w", 0.0, q, 60.0)], spec, get_policy("qosflow"), config=SimConfig(restart_overhead=0)).jobs
    assert res[0].status is JobStatus.REJECTED and "min_gpus=4" in res[0].note


def test_workload_elastic_declares_min_gpus_and_checks_the_share():
    jobs = [Job("a", 0.0, QoSSpec(gpus=8), 10.0), Job("b", 0.0, QoSSpec(gpus=1), 10.0),
            Job("c", 0.0, QoSSpec(gpus=3), 10.0), Job("d", 0.0, QoSSpec(gpus=8, min_gpus=8), 10.0)]
    out = {j.job_id: j.qos.min_gpus for j in elastic(jobs, 0.5)}
    # (3 GPUs at 0.5: no divisor of 3 below it is 2 or more, so it may start on 3 only and stays rigid)
    assert out == {"a": 4, "b": None, "c": None, "d": 8}
    assert elastic([Job("e", 0.0, QoSSpec(gpus=6), 10.0)], 0.5)[0].qos.widths == (6, 3)
    assert all(j.qos.min_gpus is None for j in elastic(jobs[:3], 1.0))
    for bad in (0, 1.5, "half"):
        with pytest.raises(SpecError, match="min_gpus_share"):
            elastic(jobs, bad)


def test_simulate_refuses_a_bad_min_gpus_share(capsys):
    rc = main(["simulate", "--trace", "synthetic", "--jobs", "20", "--policies", "fifo", "--no-plots", "--min-gpus-share", "2"])
    assert rc == 2
    assert "invalid --min-gpus-share: must be a share of a job's GPUs in (0, 1]" in capsys.readouterr().err


def test_simulate_with_min_gpus_share_records_it(tmp_path):
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", "synthetic", "--jobs", "60", "--cluster", "2x4", "--policies", "qosflow", "--no-plots",
            "--min-gpus-share", "0.5", "--json", str(out)]
    assert main(args) == 0
    import json

    data = json.loads(out.read_text())
    assert data["workload"]["min_gpus_share"] == 0.5
    import csv

    rows = list(csv.DictReader(open(tmp_path / "jobs-qosflow.csv")))
    narrowed = [r for r in rows if r["gpus_started"] and int(r["gpus_started"]) < int(r["gpus"])]
    assert data["policies"]["qosflow"]["elastic_starts"] == len(narrowed) >= 1
    assert all("elastic start on" in r["note"] for r in narrowed)


def test_the_learned_estimator_takes_an_elastic_run_at_full_width():
    """A job that ran on half its GPUs took twice as long by design: what it teaches is its time on all
    of them (the old code learned 2 h for a 1 h job)."""
    from qosflow.core.job import JobState
    from qosflow.predict.estimator import LearnedEstimator, reference_predictor

    def stage(i: int) -> Job:
        return Job(f"e{i}", 0.0, QoSSpec(gpus=8, min_gpus=4, cpu_cores=8), 3600.0, model="etl")

    for width in (8, 4):
        est = LearnedEstimator(None, predictor=reference_predictor(None, seed=0))  # (no profiler: the live worker's case)
        j = stage(1)
        ran = Placement(j.job_id, tuple((0, g) for g in range(width)))
        est.observe_finished(JobState(j, progress=1.0, attained=3600.0 * 8 / width, placement=ran), 0.0)
        assert est.predict_duration(stage(2)).value == pytest.approx(3600.0)


def test_a_narrowed_start_counts_its_longer_run_on_a_cluster_of_gpu_models():
    """On a cluster of mixed GPU models the policy reads each start's remaining time in wall time on its
    model; an elastic start's must still be at its width (twice as long on half its GPUs). The old code
    took its full-width time there, so a job started after it in the same round saw its GPUs free an
    hour too soon."""
    from qosflow.core.cluster import NodeSpec
    from qosflow.core.estimate import OracleEstimator
    from qosflow.core.job import JobState
    from qosflow.policies.base import SchedulerView
    from qosflow.policies.qosflow_policy.policy import QosflowPolicy

    spec = ClusterSpec([NodeSpec("v", 8, 64, 256000, gpu_model="v100"), NodeSpec("p", 8, 64, 256000, gpu_model="p100")])
    st = ClusterState(spec)
    st.allocate(Placement("long", tuple((0, g) for g in range(4)), cpu=((0, 4.0),)), QoSSpec(gpus=4, cpu_cores=4))
    st.allocate(Placement("long2", tuple((1, g) for g in range(8)), cpu=((1, 8.0),)), QoSSpec(gpus=8, cpu_cores=8))
    long_js = JobState(Job("long", 0.0, QoSSpec(gpus=4, cpu_cores=4), 36000.0), status=JobStatus.RUNNING)
    long_js.placement = st.allocs["long"]
    long2 = JobState(Job("long2", 0.0, QoSSpec(gpus=8, cpu_cores=8), 36000.0), status=JobStatus.RUNNING)
    long2.placement = st.allocs["long2"]
    gang = JobState(Job("gang", 60.0, QoSSpec(gpus=8, cpu_cores=8, deadline=3 * 3600.0, min_gpus=4), 3600.0), queued_since=60.0)
    pol = QosflowPolicy(share=False)
    d = pol.schedule(SchedulerView(60.0, st.snapshot(), [gang], [long_js, long2], OracleEstimator()))
    assert [len(p.gpus) for p in d.starts] == [4]
    assert "elastic start" in d.notes["gang"]
    # after the round, the gang's GPUs are busy for its 2 h at half width, not its 1 h at full width
    assert pol._end_max[0, 4:].tolist() == [7200.0] * 4
