"""Every baseline policy, run through the simulator on random small workloads, keeps the
cluster invariants after every round, finishes every job exactly once, and conserves GPU time."""

import math

import numpy as np
import pytest

from qosflow.core import ClusterSpec, Job, QoSSpec
from qosflow.core.job import JobStatus
from qosflow.policies import available, get_policy
from qosflow.policies.sharing import bsbf_times, memory_plan
from qosflow.sim.engine import SimConfig, simulate
from qosflow.sim.metrics import compute_bounds, compute_metrics

BASELINES = ["fifo", "sjf", "srtf", "tiresias", "sjf-ffs", "sjf-bsbf", "genie", "gavel", "qosflow"]
MODELS = ["resnet18", "vgg16", "bert", "dqn"]


def random_jobs(seed, n=60, max_gpus=8, fractional=False):
    rng = np.random.default_rng(seed)
    jobs = []
    t = 0.0
    for i in range(n):
        t += float(rng.exponential(200))
        g = int(rng.choice([1, 1, 1, 2, 4, 8][: 4 if max_gpus < 8 else 6]))
        g = min(g, max_gpus)
        milli = 1000
        if fractional and g == 1 and rng.random() < 0.3:
            milli = int(rng.choice([250, 500]))
        dl = float(rng.uniform(1.2, 3)) * 1000 if rng.random() < 0.5 else None
        dur = float(60 * 10 ** rng.uniform(1, 2.5))
        jobs.append(
            Job(
                f"j{i}",
                t,
                QoSSpec(
                    gpus=g,
                    gpu_milli=milli,
                    cpu_cores=2.0 * g,
                    shareable=milli == 1000,
                    gpu_mem_mb=float(rng.choice([2000, 4000, 9000])),
                    deadline=None if dl is None else dl * dur / 1000,
                ),
                duration=dur,
                model=str(rng.choice(MODELS)),
                batch_size=64,
                resource_profile=(float(rng.uniform(0.01, 0.2)), float(rng.uniform(0.05, 0.3)), 0.01),
            )
        )
    return jobs


def test_registry_lists_baselines():
    assert set(BASELINES) <= set(available())
    with pytest.raises(Exception, match="unknown policy 'nope'"):
        get_policy("nope")


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("seed", [1, 2])
def test_policy_invariants_and_conservation(name, seed):
    spec = ClusterSpec.uniform(3, 4, cpu_cores=32, gpu_mem_mb=16000)
    jobs = random_jobs(seed, max_gpus=8, fractional=True)
    res = simulate(jobs, spec, get_policy(name), config=SimConfig(check_invariants=True, seed=seed))
    done = [j for j in res.jobs if j.status is JobStatus.DONE]
    assert len(done) == len(jobs) == len({j.job_id for j in done})
    assert all(j.finish_time >= j.job.submit_time + j.job.duration * 0.999 for j in done)
    # GPU time the jobs received is what the cluster handed out; allocation never exceeds it
    assert math.isclose(res.received_gpu_seconds, sum(j.gpu_attained for j in res.jobs), rel_tol=1e-9)
    assert res.busy_gpu_seconds <= res.received_gpu_seconds + 1e-6
    assert res.received_gpu_seconds >= res.useful_gpu_seconds * 0.999
    m = compute_metrics(res)
    b = compute_bounds(jobs, spec)
    assert m.avg_jct >= b.avg_jct * 0.999
    assert 0 <= m.dsr <= b.dsr + 1e-9
    # no job runs faster than alone, sharing or not: the last arrival plus its duration bounds the makespan
    assert b.span <= b.makespan and m.makespan >= b.span * 0.999
    assert 0 < m.gpu_util <= 1.0 + 1e-9


@pytest.mark.parametrize("name", BASELINES)
def test_deterministic_for_seed(name):
    spec = ClusterSpec.uniform(2, 4)
    jobs = random_jobs(7, n=40, max_gpus=4)
    cfg = SimConfig(seed=3, failure_share=0.3)
    a = compute_metrics(simulate(jobs, spec, get_policy(name), config=cfg)).to_json()
    b = compute_metrics(simulate(jobs, spec, get_policy(name), config=cfg)).to_json()
    a.pop("sched_seconds"), b.pop("sched_seconds")  # wall-clock time, the only thing allowed to differ
    assert a == b


@pytest.mark.parametrize("name", BASELINES)
def test_failures_are_retried_and_every_job_finishes_once(name):
    spec = ClusterSpec.uniform(2, 4)
    jobs = random_jobs(11, n=40, max_gpus=4)
    res = simulate(jobs, spec, get_policy(name), config=SimConfig(failure_share=0.4, seed=5, check_invariants=True))
    assert sum(j.failures for j in res.jobs) > 0
    assert all(j.status is JobStatus.DONE for j in res.jobs)
    assert res.wasted_gpu_seconds > 0


def test_job_that_never_fits_is_rejected_not_dropped():
    spec = ClusterSpec.uniform(1, 4)
    jobs = [Job("big", 0.0, QoSSpec(gpus=8), 100.0), Job("ok", 0.0, QoSSpec(gpus=1), 100.0)]
    res = simulate(jobs, spec, get_policy("fifo"))
    assert [r[0] for r in res.rejected] == ["big"]
    assert "8 GPUs" in res.rejected[0][1]
    assert {j.job_id: j.status for j in res.jobs} == {"big": JobStatus.REJECTED, "ok": JobStatus.DONE}


def test_fifo_is_strict_and_sjf_backfills():
    spec = ClusterSpec.uniform(1, 4)
    jobs = [
        Job("long", 0.0, QoSSpec(gpus=3), 1000.0),
        Job("wide", 1.0, QoSSpec(gpus=4), 10.0),
        Job("small", 2.0, QoSSpec(gpus=1), 10.0),
    ]
    fifo = {j.job_id: j for j in simulate(jobs, spec, get_policy("fifo"), config=SimConfig(restart_overhead=0)).jobs}
    assert fifo["small"].first_start >= fifo["wide"].finish_time - 1e-6  # blocked behind the head
    sjf = {j.job_id: j for j in simulate(jobs, spec, get_policy("sjf"), config=SimConfig(restart_overhead=0)).jobs}
    assert sjf["small"].first_start == pytest.approx(2.0)  # backfilled


def test_srtf_preempts_long_job_for_short_one():
    spec = ClusterSpec.uniform(1, 1)
    jobs = [Job("long", 0.0, QoSSpec(), 1000.0), Job("short", 10.0, QoSSpec(), 10.0)]
    res = {j.job_id: j for j in simulate(jobs, spec, get_policy("srtf"), config=SimConfig(restart_overhead=0)).jobs}
    assert res["short"].finish_time == pytest.approx(20.0)
    assert res["long"].preemptions == 1
    assert res["long"].finish_time == pytest.approx(1010.0)


def test_restart_overhead_is_charged_on_restarts_only():
    """A trace's duration is the job's whole run, start-up included: the first start costs nothing
    extra, so a short job with a deadline just above its duration meets it on an idle cluster, as
    the bound assumes; a preempted job pays the overhead when it starts again."""
    spec = ClusterSpec.uniform(1, 1)
    short = Job("short", 10.0, QoSSpec(deadline=6.0), 5.0)
    jobs = [Job("long", 0.0, QoSSpec(), 1000.0), short]
    res = simulate(jobs, spec, get_policy("srtf"), config=SimConfig(restart_overhead=7.0))
    by = {j.job_id: j for j in res.jobs}
    assert by["short"].finish_time == pytest.approx(15.0)  # started at once, no overhead
    assert by["long"].preemptions == 1
    assert by["long"].finish_time == pytest.approx(1005.0 + 7.0)  # 5 s of short, 7 s to restart
    assert compute_metrics(res).dsr == 1.0 == compute_bounds(jobs, spec).dsr

def test_tiresias_demotes_by_attained_gpu_service():
    spec = ClusterSpec.uniform(1, 1)
    jobs = [Job("old", 0.0, QoSSpec(), 10_000.0), Job("new", 5000.0, QoSSpec(), 100.0)]
    res = {j.job_id: j for j in simulate(jobs, spec, get_policy("tiresias"), config=SimConfig(restart_overhead=0)).jobs}
    # "old" crossed 3,250 GPU-s before "new" arrived, so "new" (top queue) preempts it
    assert res["new"].first_start == pytest.approx(5000.0)
    assert res["old"].preemptions == 1


def test_bsbf_formula_matches_paper():
    # b (running) finishes first when sharing: t_con = T_a/2 + (1 - 1/(2 xi_a)) B_hat
    t_con, t_seq = bsbf_times(100.0, 50.0, 1.2, 1.2)
    assert t_seq == pytest.approx(50 + 50)
    assert t_con == pytest.approx(50 + (1 - 1 / 2.4) * 60)
    assert t_con < t_seq
    # heavy interference: sharing does not pay
    t_con, t_seq = bsbf_times(100.0, 100.0, 2.5, 2.5)
    assert t_con > t_seq


def test_bsbf_only_shares_when_it_pays():
    spec = ClusterSpec.uniform(1, 1, gpu_mem_mb=16000)
    mk = lambda jid, t, d, m: Job(jid, t, QoSSpec(shareable=True, gpu_mem_mb=4000), d, model=m)

    class Fixed:
        def __init__(self, xi):
            self.xi = xi

        def pair_slowdown(self, a, b, gpus=1):
            return (self.xi, self.xi)

        def spread_slowdown(self, model, gpus):
            return None

    from qosflow.core.speed import SpeedModel

    for xi, shared in [(1.1, True), (3.0, False)]:
        sm = SpeedModel(Fixed(xi))
        res = simulate([mk("a", 0, 101, "x"), mk("b", 1, 100, "y")], spec, get_policy("sjf-bsbf"), speed=sm)
        b = {j.job_id: j for j in res.jobs}["b"]
        assert (b.first_start < 10) is shared


def test_memory_plan_uses_sub_batches():
    job = Job("a", 0, QoSSpec(shareable=True, gpu_mem_mb=10000), 10.0, batch_size=64)
    assert memory_plan(job, 12000) == (10000, None)
    mem, plan = memory_plan(job, 7000)
    assert plan is not None and plan.sub_batch * plan.accumulation_steps == 64 and mem <= 7000
    assert memory_plan(job, 1000) is None
    assert memory_plan(job, 7000, allow_sub_batch=False) is None


def test_genie_serves_smallest_allowance_first():
    spec = ClusterSpec.uniform(1, 1)
    jobs = [
        Job("first", 0.0, QoSSpec(), 100.0),
        Job("lax", 1.0, QoSSpec(deadline=10_000), 100.0),
        Job("tight", 2.0, QoSSpec(deadline=250), 100.0),
    ]
    res = {j.job_id: j for j in simulate(jobs, spec, get_policy("genie"), config=SimConfig(restart_overhead=0)).jobs}
    assert res["tight"].first_start < res["lax"].first_start
    assert res["tight"].finish_time <= jobs[2].deadline


def test_failure_point_closer_than_the_clock_resolution_does_not_hang():
    """Regression: a failure due within less work than the clock resolves at large simulated times."""
    from qosflow.core.job import FailurePlan

    t0 = 8.5e6
    job = Job("f", t0, QoSSpec(), 1.3e5 * 0.9999999999, failure=FailurePlan(at_fraction=0.1225660568437, times=2, checkpoint_fraction=0.5))
    other = Job("o", t0 + 1234.5678, QoSSpec(), 777.0)
    res = simulate([job, other], ClusterSpec.uniform(1, 1), get_policy("fifo"), config=SimConfig(restart_overhead=3.3))
    assert all(j.status is JobStatus.DONE for j in res.jobs)
    assert {j.job_id: j.failures for j in res.jobs}["f"] == 2


@pytest.mark.parametrize("name", BASELINES)
def test_a_gang_wider_than_its_eligible_nodes_spans_them(name):
    """A larger node the job may not use (too little GPU memory) must not make the policy wait for
    a single node that can never hold it: the job spans whole eligible nodes instead."""
    from qosflow.core.cluster import NodeSpec

    cluster = ClusterSpec(
        [NodeSpec("big", 8, gpu_mem_mb=8_000.0), NodeSpec("a", 4, gpu_mem_mb=32_000.0), NodeSpec("b", 4, gpu_mem_mb=32_000.0)]
    )
    job = Job("wide", 0.0, QoSSpec(gpus=8, cpu_cores=8.0, gpu_mem_mb=16_000.0, shareable=False), duration=600.0, model="bert", batch_size=32)
    res = simulate([job], cluster, get_policy(name), config=SimConfig(seed=0))
    (js,) = res.jobs
    assert js.status is JobStatus.DONE, js.note


@pytest.mark.parametrize("name", BASELINES)
def test_placements_respect_host_memory(name):
    """Jobs with host memory on nodes that hold only one of them at a time, and gangs wider than a
    node whose memory is split over their nodes: every policy places them validly (a spread or
    multi-node placement used to ignore host memory, and the state rejected it) and all finish."""
    cluster = ClusterSpec.uniform(2, 4, mem_mb=100_000)
    jobs = [Job(f"j{i}", 0.0, QoSSpec(gpus=1, mem_mb=80_000), duration=100.0 + i) for i in range(3)]
    jobs += [Job(f"g{i}", 0.0, QoSSpec(gpus=4, mem_mb=10_000), duration=100.0 + i) for i in range(2)]
    jobs += [Job(f"w{i}", 0.0, QoSSpec(gpus=6, mem_mb=150_000), duration=100.0 + i) for i in range(2)]
    res = simulate(jobs, cluster, get_policy(name), config=SimConfig(seed=0))
    assert all(j.status is JobStatus.DONE for j in res.jobs)


@pytest.mark.parametrize("name", ["sjf", "sjf-ffs", "sjf-bsbf", "genie", "qosflow"])
def test_a_failed_search_does_not_skip_a_job_needing_less_host_memory(name):
    """Within a round, a whole-GPU search that failed lets the policy skip later jobs that cannot fit
    either. A job of the same GPU count, cores and GPU memory per GPU but less host memory can fit,
    so it starts at once (qosflow's skip key left host memory out and kept it waiting), and the job
    that does not fit is told it is host memory, not GPUs, that it lacks."""
    cluster = ClusterSpec.uniform(2, 4, mem_mb=100_000)
    jobs = [Job(f"hog{i}", 0.0, QoSSpec(gpus=1, mem_mb=60_000), 1000.0) for i in range(2)]
    jobs += [Job("heavy", 1.0, QoSSpec(gpus=2, mem_mb=100_000), 100.0),
             Job("light", 1.0, QoSSpec(gpus=2, mem_mb=20_000), 101.0)]
    res = {j.job_id: j for j in simulate(jobs, cluster, get_policy(name), config=SimConfig(restart_overhead=0)).jobs}
    assert res["light"].first_start == 1.0, res["light"].note
    assert res["heavy"].first_start == 1000.0
    assert "at most 40000 MB free host memory of the 100000 MB it needs" in res["heavy"].note, res["heavy"].note


def _one_node_reference(st, job, node_rank):
    """Best fit on one node, written out plainly: the up nodes with the job's GPU memory, enough empty
    GPUs, cores and host memory; among them the lowest rank, then the fewest empty GPUs, then the
    lowest index; its first empty GPUs."""
    q = job.qos
    cands = [n for n in range(st.num_nodes)
             if not st.down[n] and st.spec.nodes[n].gpu_mem_mb >= q.gpu_mem_mb and st.empty[n] >= q.gpus
             and st.cpu_free[n] >= q.cpu_cores - 1e-9 and st.mem_free[n] >= q.mem_mb - 1e-6]
    if not cands:
        return None
    if node_rank is not None:
        low = min(node_rank[n] for n in cands)
        cands = [n for n in cands if node_rank[n] <= low]
    n = min(cands, key=lambda c: (st.empty[c], c))
    gpus = [g for g in range(st.spec.nodes[n].gpus) if st.njobs[n, g] == 0][: q.gpus]
    return n, gpus


def test_one_node_search_in_two_steps_matches_a_plain_best_fit():
    """`one_node_candidates` + `place_on_one_node` (which the qosflow policy uses to search once per
    request shape and cluster state, and which `find_whole` is made of) choose what a plainly written
    best fit chooses, ranked or not."""
    from qosflow.core.cluster import ClusterState, NodeSpec
    from qosflow.policies.placement import find_whole, one_node_candidates, place_on_one_node

    rng = np.random.default_rng(7)
    nodes = [NodeSpec(f"n{i}", int(g), gpu_mem_mb=float(m), cpu_cores=16.0, mem_mb=65_536.0)
             for i, (g, m) in enumerate(zip(rng.choice([2, 4, 8], 12), rng.choice([16_000, 32_000], 12)))]
    placed = 0
    for trial in range(40):
        st = ClusterState(ClusterSpec(nodes))
        # fill it partly with single-GPU jobs
        for i in range(int(rng.integers(0, 40))):
            j = Job(f"f{trial}-{i}", 0.0, QoSSpec(gpus=1, cpu_cores=float(rng.integers(1, 4)), mem_mb=1024.0), 60.0)
            p = find_whole(st, j, fit="first-fit")
            if p is not None:
                st.allocate(p, j.qos)
        for k in (1, 2, 3, 4, 8, 16):
            job = Job(f"q{k}", 0.0, QoSSpec(gpus=k, cpu_cores=2.0 * k, mem_mb=2048.0 * k,
                                           gpu_mem_mb=float(rng.choice([8_000, 20_000]))), 60.0)
            rank = rng.integers(0, 3, st.num_nodes).astype(float)
            for node_rank in (None, rank):
                cands = one_node_candidates(st, job)
                if cands is None:  # wider than every node: a multi-node placement, not this search's
                    assert k > 8
                    continue
                got = place_on_one_node(st, job, cands, fit="best-fit", node_rank=node_rank) if cands.size else None
                want = _one_node_reference(st, job, node_rank)
                assert (None if got is None else (got.nodes[0], [g for _n, g in got.gpus])) == want, (trial, k)
                assert got == find_whole(st, job, locality="consolidated", fit="best-fit", node_rank=node_rank)
                placed += got is not None
    assert placed > 50  # the comparison covered many actual placements, not only failures


def test_exclusive_search_skips_only_what_cannot_fit(monkeypatch):
    """Within a round a whole-GPU request of k GPUs that found nothing is not searched again, nor is
    any request with the same needs per GPU and more GPUs; smaller requests, other shapes and
    fractional ones still are, and every answer equals `find_for`'s."""
    import qosflow.policies.common as common
    from qosflow.core.cluster import ClusterState
    from qosflow.policies.placement import find_for

    st = ClusterState(ClusterSpec.uniform(2, 4, cpu_cores=16.0))
    for i in range(2):  # three GPUs busy on each node: one free GPU per node
        j = Job(f"busy{i}", 0.0, QoSSpec(gpus=3, cpu_cores=3.0), 60.0)
        st.allocate(find_for(st, j), j.qos)
    calls = []
    monkeypatch.setattr(common, "find_for", lambda *a, **k: calls.append(a[1].job_id) or find_for(*a, **k))
    search = common.ExclusiveSearch()

    def ask(name, **qos):
        job = Job(name, 0.0, QoSSpec(**qos), 60.0)
        got = search(st, job)
        assert got == find_for(st, job)
        return got

    assert ask("two", gpus=2, cpu_cores=2.0) is None  # no node has two free GPUs
    assert ask("two-again", gpus=2, cpu_cores=2.0) is None
    assert ask("four", gpus=4, cpu_cores=4.0) is None
    assert ask("one", gpus=1, cpu_cores=1.0) is not None
    assert ask("two-more-cores", gpus=2, cpu_cores=6.0) is None  # another shape: searched
    assert ask("half", gpus=1, gpu_milli=500, cpu_cores=1.0) is not None
    assert calls == ["two", "one", "two-more-cores", "half"]


@pytest.mark.parametrize("policy", ["qosflow", "fifo", "sjf", "gavel"])
def test_a_stage_waiting_because_its_hosts_are_down_says_so(policy):
    """A wrong agent token marked every host down; the waiting stage said "no node has 1 free cores"
    (admin review). Now the note says the hosts are down."""
    from qosflow.core.cluster import ClusterState
    from qosflow.core.estimate import DeclaredEstimator
    from qosflow.core.job import JobState
    from qosflow.policies.base import SchedulerView

    spec = ClusterSpec.uniform(2, 4, prefix="gpu-")
    names = ", ".join(n.name for n in spec.nodes)

    def note(qos, down):
        st = ClusterState(spec)
        for i in down:
            st.set_node_down(i)
        js = JobState(Job("s", 0.0, qos, 60.0, expected_duration=60.0))
        d = get_policy(policy).schedule(SchedulerView(1.0, st.snapshot(), [js], [], DeclaredEstimator()))
        assert not d.starts
        return d.notes["s"]

    for qos in (QoSSpec(gpus=0, cpu_cores=1.0), QoSSpec(gpus=1), QoSSpec(gpus=1, gpu_milli=500)):
        if qos.fractional and policy == "fifo":
            continue
        assert note(qos, [0, 1]).startswith(f"waiting: all 2 hosts are down ({names})"), qos
    # no host could ever hold it: not about the hosts being down
    assert note(QoSSpec(gpus=0, cpu_cores=64.0), [0]).startswith("waiting: no node has 64 free cores")


def test_why_waiting_names_the_down_hosts_that_could_hold_it():
    from qosflow.core.cluster import ClusterState
    from qosflow.core.job import JobState
    from qosflow.core.placement import Placement
    from qosflow.policies.common import why_waiting

    spec = ClusterSpec.uniform(3, 4, prefix="gpu-")
    a, b, c = (n.name for n in spec.nodes)
    st = ClusterState(spec)
    st.allocate(Placement("x", ((1, 0), (1, 1)), cpu=((1, 2.0),)), QoSSpec(gpus=2))
    st.allocate(Placement("y", ((2, 0),), cpu=((2, 1.0),)), QoSSpec(gpus=1))
    st.set_node_down(0)
    job = JobState(Job("s", 0.0, QoSSpec(gpus=4), 60.0))
    assert why_waiting(st, job) == f"waiting: needs 4 GPUs on one node; largest free block is 3; host {a} down"
    st.set_node_down(2)
    assert why_waiting(st, job) == f"waiting: needs 4 GPUs, 2 free; hosts {a}, {c} down"
    one = ClusterState(ClusterSpec.uniform(1, 1, cpu_cores=1.0, prefix="gpu-"))
    cpu = JobState(Job("s", 0.0, QoSSpec(gpus=0, cpu_cores=1.0), 60.0))
    one.cpu_free[:] = 0.0
    assert why_waiting(one, cpu) == "waiting: no node has 1 free core"
    assert why_waiting(one, JobState(Job("s", 0.0, QoSSpec(gpus=0, cpu_cores=0.5), 60.0))) == "waiting: no node has 0.5 free cores"
    one.set_node_down(0)
    assert why_waiting(one, cpu) == "waiting: host gpu-0, the cluster's only host, is down"
    # a GPU model only some hosts have: those being down is the whole reason
    mixed = ClusterSpec(tuple(spec.nodes[:2]) + (ClusterSpec.uniform(1, 4, gpu_model="a100", prefix="big-").nodes[0],))
    st = ClusterState(mixed)
    st.set_node_down(2)
    assert why_waiting(st, JobState(Job("s", 0.0, QoSSpec(gpus=1, gpu_model="a100"), 60.0))) == (
        "waiting: the host that could hold it is down (big-0)")
