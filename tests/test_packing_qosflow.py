"""qosflow's packing policy: invariants, determinism, its three mechanisms, departures,
explanations, the `find_share` scorer adapter, and the regression against FGD on the real list."""

from __future__ import annotations

import numpy as np
import pytest

from qosflow.errors import QosflowError
from qosflow.packing import MILLI, Node, PackState, Placement, Pod, WorkloadDistribution, make_policy, policy_names
from qosflow.packing.experiment import run_experiment, run_packing
from qosflow.packing.qosflow_pack import CapacityModel, QosflowPacker
from qosflow.packing.scorer import fractional_scorer, job_request, workload_from_jobs

from packing_cluster import synthetic_cluster


def _prepared(nodes, wl, knowledge=None, **kw) -> tuple[PackState, QosflowPacker]:
    st = PackState(nodes)
    pol = QosflowPacker(**kw)
    pol.prepare(st, wl, np.random.default_rng(0), knowledge)
    return st, pol


def _fgd_node(nodes, wl, pod) -> int:
    """The node FGD picks for `pod` on the empty `nodes`."""
    st = PackState(nodes)
    fgd = make_policy("fgd")
    fgd.prepare(st, wl)
    return fgd.choose(st, pod).node


# ---------------------------------------------------------------------------- registry, invariants
def test_registered_and_listed():
    assert "qosflow" in policy_names()
    assert isinstance(make_policy("qosflow"), QosflowPacker)


def test_invariants_on_synthetic_cluster():
    pods, nodes = synthetic_cluster(seed=3)
    run = run_packing(pods, nodes, "qosflow", seed=11, ratio=1.3, keep_placements=True)
    gpu_used = {(n, g): 0 for n, nd in enumerate(nodes) for g in range(nd.num_gpu)}
    whole = set()
    cpu = [0] * len(nodes)
    mem = [0] * len(nodes)
    for pod_idx, n, gpus in run.placements:
        pod, nd = pods[pod_idx], nodes[n]
        cpu[n] += pod.cpu_milli
        mem[n] += pod.memory_mib
        assert len(gpus) == pod.num_gpu and len(set(gpus)) == len(gpus)
        if pod.gpu_spec:
            assert nd.model in pod.gpu_spec
        for g in gpus:
            assert 0 <= g < nd.num_gpu
            if pod.gpu_milli == MILLI:
                assert gpu_used[(n, g)] == 0
                whole.add((n, g))
            else:
                assert (n, g) not in whole
            gpu_used[(n, g)] += pod.gpu_milli
            assert gpu_used[(n, g)] <= MILLI
    assert all(cpu[n] <= nd.cpu_milli and mem[n] <= nd.memory_mib for n, nd in enumerate(nodes))
    assert run.allocated_milli[-1] == sum(gpu_used.values())
    # it only fails a pod when nothing fits: a pod that fails fits nowhere at that moment
    assert len(run.placements) + int(run.failed.sum()) == len(run.arrived_milli)


def test_fails_only_when_nothing_fits_and_does_not_touch_the_state():
    pods, nodes = synthetic_cluster(seed=4, n_pods=300)
    wl = WorkloadDistribution.from_pods(pods)
    st, pol = _prepared(nodes, wl)
    for pod in pods * 2:
        before = (st.cpu_left.copy(), st.gpu_left.copy(), st.version.copy())
        p = pol.choose(st, pod)
        assert np.array_equal(before[0], st.cpu_left) and np.array_equal(before[1], st.gpu_left)
        assert np.array_equal(before[2], st.version)
        if p is None:
            assert not st.fit_mask(pod).any()
        else:
            st.place(pod, p)
            pol.notify_placed(st, pod, p)


def test_same_seed_same_run():
    pods, nodes = synthetic_cluster(seed=2, n_pods=250)
    a = run_packing(pods, nodes, "qosflow", seed=7, keep_placements=True)
    b = run_packing(pods, nodes, "qosflow", seed=7, keep_placements=True)
    assert a.placements == b.placements
    assert a.placements != run_packing(pods, nodes, "qosflow", seed=8, keep_placements=True).placements


def test_needs_a_workload_with_gpu_types():
    st = PackState([Node("a", 8000, 8192, 1, "T4")])
    with pytest.raises(QosflowError, match="workload"):
        QosflowPacker().prepare(st, None)
    with pytest.raises(QosflowError, match="no GPU task type"):
        QosflowPacker().prepare(st, WorkloadDistribution.from_types([(1000, 0, 0, ())], [1]))


# ---------------------------------------------------------------------------- the three mechanisms
def test_cpu_only_pod_avoids_stranding_gpus():
    """n0 (first in node order): 8 GPUs, 4 cores each; n1: 2 GPUs, 32 cores each.

    A 16-core CPU-only pod on n0 would leave 16 cores for 8 GPUs whose pods need 4 cores each:
    4 GPUs stranded. FGD does not see it (one pod of every type still fits, Delta = 0, so the
    node order decides: n0); qosflow's stranding term sends the pod to n1.
    """
    nodes = [Node("n0", 32000, 262144, 8, "A"), Node("n1", 64000, 262144, 2, "A")]
    wl = WorkloadDistribution.from_types([(4000, 1, MILLI, ()), (16000, 0, 0, ())], [9, 1], memory_mib=[1024, 1024])
    pod = Pod("cpu", 16000, 1024)
    assert _fgd_node(nodes, wl, pod) == 0
    st, pol = _prepared(nodes, wl)
    assert pol.choose(st, pod).node == 1
    ex = pol.explain(st, pod)
    assert ex.runner_up[0] == 0 and "next best n0" in ex.reason and "cannot feed" in ex.reason, ex.reason


def test_memory_counts_as_well_as_cpu():
    """A memory-heavy pod on a node whose memory the GPU pods need: qosflow sees it, FGD does not."""
    nodes = [Node("n0", 64000, 65536, 4, "A"), Node("n1", 64000, 524288, 4, "A")]
    wl = WorkloadDistribution.from_types([(4000, 1, MILLI, ())], [1], memory_mib=[16384])
    pod = Pod("mem", 2000, 49152)  # CPU-only, 48 GiB: on n0 only 16 GiB stay for 4 GPU pods of 16 GiB
    assert _fgd_node(nodes, wl, pod) == 0
    st, pol = _prepared(nodes, wl)
    assert pol.choose(st, pod).node == 1
    st, pol = _prepared(nodes, wl, memory=False, balance=False)
    assert pol.choose(st, pod).node == 0  # the ablation behaves like FGD


def test_scarce_gpu_model_is_kept_for_the_pods_that_need_it():
    """Ten A nodes, one B node (first in node order); 2 % of the pods accept only B.

    An unconstrained whole-GPU pod on B destroys capacity the B-only type cannot find elsewhere.
    FGD weighs that loss by the type's frequency: 20 milli, within one integer score step, so the
    node order decides (B). Availability weighting multiplies it by free / usable-by-B capacity
    (11x here), so qosflow keeps B and uses an A node.
    """
    nodes = [Node("b0", 64000, 262144, 2, "B")] + [Node(f"a{i}", 64000, 262144, 2, "A") for i in range(10)]
    wl = WorkloadDistribution.from_types([(4000, 1, MILLI, ()), (4000, 1, MILLI, ("B",))], [49, 1], memory_mib=[1024, 1024])
    st = PackState(nodes)
    st.place(Pod("x", 4000, 1024, 1, MILLI), Placement(0, (0,)))  # b0 has one GPU left
    for i in range(1, 11):
        st.place(Pod("x", 4000, 1024, 1, MILLI), Placement(i, (0,)))  # so do all A nodes
    pod = Pod("free", 4000, 1024, 1, MILLI)
    fgd = make_policy("fgd")
    fgd.prepare(st, wl)
    assert fgd.choose(st, pod).node == 0
    pol = QosflowPacker(scarcity=False)
    pol.prepare(st, wl)
    assert pol.choose(st, pod).node == 0
    pol = QosflowPacker()
    pol.prepare(st, wl)
    w = pol.weights(st)
    assert w[1] / w[0] == pytest.approx(11 / 49)  # x (11 free GPUs / 1 usable by B); A: x 11/11
    assert pol.choose(st, pod).node != 0
    # a B-only pod still goes to B (nothing else is allowed)
    assert pol.choose(st, Pod("b", 4000, 1024, 1, MILLI, ("B",))).node == 0


def test_weights_reduce_to_frequencies_when_every_type_fits_everywhere():
    nodes = [Node(f"n{i}", 64000, 262144, 4, "A") for i in range(3)]
    wl = WorkloadDistribution.from_types([(4000, 1, 500, ()), (4000, 1, MILLI, ())], [3, 1], memory_mib=[1024, 1024])
    st, pol = _prepared(nodes, wl)
    pol.choose(st, Pod("p", 1000, 1024, 1, 500))  # refreshes the per-node cache
    assert pol.weights(st) == pytest.approx([0.75, 0.25])


# ---------------------------------------------------------------------------- departures
def _departure_setup():
    nodes = [Node("n0", 64000, 262144, 4, "A"), Node("n1", 64000, 262144, 4, "A")]
    wl = WorkloadDistribution.from_types([(16000, 4, MILLI, ()), (2000, 1, 500, ())], [1, 3], memory_mib=[1024, 1024])
    soon, late = Pod("soon", 6000, 1024, 3, MILLI), Pod("late", 6000, 1024, 3, MILLI)
    return nodes, wl, soon, late


def test_capacity_that_frees_soon_counts_as_partly_free():
    """Both nodes have one free GPU; n0's other three are held by a pod that ends in 1 s, n1's
    by one that ends in 1000 s. Without knowledge the share takes n0 (node order); with the
    expected ends it keeps n0 for the 4-GPU pods that will fit there in a second."""
    nodes, wl, soon, late = _departure_setup()
    share = Pod("share", 2000, 1024, 1, 500)
    clock = {"t": 100.0}
    ends = {"soon": 101.0, "late": 1100.0}
    for knowledge, expect in [(None, 0), ({"expected_end": ends, "clock": lambda: clock["t"], "horizon": 600.0}, 1)]:
        st, pol = _prepared(nodes, wl, knowledge)
        for pod, n in [(soon, 0), (late, 1)]:
            p = Placement(n, (0, 1, 2))
            st.place(pod, p)
            pol.notify_placed(st, pod, p)
        assert pol.choose(st, share).node == expect, knowledge
    # once the soon-ending pod has left, the node really is free; the share goes to n1 either way
    st.release(soon, Placement(0, (0, 1, 2)))
    pol.notify_released(st, soon, Placement(0, (0, 1, 2)))
    assert pol.choose(st, share).node == 1
    # a callable expected_end and a fixed 'now' work too; unknown pods are simply not tracked
    st, pol = _prepared(nodes, wl, {"expected_end": lambda pod: {"soon": 101.0}.get(pod.name), "now": 100.0, "horizon": 600})
    for pod, n in [(soon, 0), (late, 1)]:
        st.place(pod, Placement(n, (0, 1, 2)))
        pol.notify_placed(st, pod, Placement(n, (0, 1, 2)))
    assert pol.choose(st, share).node == 1


def test_bad_departure_knowledge_is_rejected():
    nodes, wl, _, _ = _departure_setup()
    with pytest.raises(QosflowError, match="clock"):
        _prepared(nodes, wl, {"expected_end": {}})
    with pytest.raises(QosflowError, match="horizon"):
        _prepared(nodes, wl, {"expected_end": {}, "now": 0.0, "horizon": -1})


# ---------------------------------------------------------------------------- explanations
def test_explain_matches_choose_and_says_why():
    pods, nodes = synthetic_cluster(seed=6, n_pods=200)
    wl = WorkloadDistribution.from_pods(pods)
    st, pol = _prepared(nodes, wl)
    for pod in pods[:120]:
        ex = pol.explain(st, pod)
        p = pol.choose(st, pod)
        assert ex.placement == p
        if p is None:
            assert "fits nowhere" in ex.reason
            continue
        assert nodes[p.node].name in ex.reason and f"score {ex.score}" in ex.reason
        assert ex.feasible_nodes == int(st.fit_mask(pod).sum())
        if ex.runner_up is not None:
            assert ex.runner_up[1] <= ex.score
            assert ("next best" in ex.reason) != ("tied with" in ex.reason)
        st.place(pod, p)
        pol.notify_placed(st, pod, p)
    nowhere = pol.explain(st, Pod("huge", 10**7, 1024, 1, 500))
    assert nowhere.placement is None and "0 all of it" in nowhere.reason


# ---------------------------------------------------------------------------- find_share adapter
def _cluster_pair(n_nodes: int = 12):
    from qosflow.core.cluster import ClusterSpec, ClusterState, NodeSpec

    kinds = [("A", 8, 96.0, 393216.0), ("B", 2, 104.0, 524288.0), ("C", 4, 32.0, 131072.0)]
    specs, nodes = [], []
    for i in range(n_nodes):
        model, g, cores, mem = kinds[i % 3]
        specs.append(NodeSpec(f"n{i}", g, cpu_cores=cores, mem_mb=mem, gpu_model=model))
        nodes.append(Node(f"n{i}", int(cores * 1000), int(mem), g, model))
    return ClusterState(ClusterSpec(tuple(specs))), PackState(nodes)


def _jobs(seed: int, n: int):
    from qosflow.core.job import Job
    from qosflow.core.qos import QoSSpec

    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        r = rng.random()
        cores = float(rng.choice([2, 4, 8]))
        mem = float(rng.choice([4096, 16384]))
        model = "B" if rng.random() < 0.1 else None
        if r < 0.6:
            q = QoSSpec(gpus=1, gpu_milli=int(rng.choice([250, 460, 500, 810])), cpu_cores=cores, mem_mb=mem, gpu_model=model)
        elif r < 0.9:
            q = QoSSpec(gpus=1, cpu_cores=cores, mem_mb=mem, gpu_model=model)
        else:
            q = QoSSpec(gpus=0, cpu_cores=cores, mem_mb=mem)
        jobs.append(Job(f"j{i}", float(i), q, 100.0))
    return jobs


def test_workload_from_jobs():
    jobs = _jobs(1, 300)
    wl = workload_from_jobs(jobs, popularity=1.0)
    assert wl.prob.sum() == pytest.approx(1.0) and wl.memory_mib is not None
    keys = {(int(c), int(n), int(m), s) for c, n, m, s in zip(wl.cpu_milli, wl.num_gpu, wl.gpu_milli, wl.gpu_spec)}
    assert keys == {job_request(j).request_key for j in jobs}
    assert job_request(jobs[0]).cpu_milli == int(jobs[0].qos.cpu_cores * 1000)
    with pytest.raises(QosflowError, match="at least one job"):
        workload_from_jobs([])


@pytest.mark.parametrize("measure,policy", [("qosflow", "qosflow"), ("fgd", "fgd")])
def test_scorer_in_find_share_places_as_the_packer(measure, policy):
    """The same fractional jobs on the same cluster, once through find_share with the adapter on a
    ClusterState, once through the packing policy on a PackState: same GPUs, step by step."""
    from qosflow.policies.placement import find_share

    jobs = [j for j in _jobs(2, 400) if j.qos.fractional]
    wl = workload_from_jobs(_jobs(3, 400))
    cs, ps = _cluster_pair()
    scorer = fractional_scorer(wl, measure)
    pol = make_policy(policy)
    pol.prepare(ps, wl)
    placed = 0
    for job in jobs:
        pod = job_request(job)
        p = find_share(cs, job, scorer=scorer)
        q = pol.choose(ps, pod)
        if p is None:
            assert q is None
            continue
        (n, g), = p.gpus
        assert q == Placement(n, (g,)), job
        cs.allocate(p, job.qos)
        ps.place(pod, q)
        pol.notify_placed(ps, pod, q)
        placed += 1
    cs.check_invariants()
    assert placed > 50
    if measure == "qosflow":
        assert "score" in scorer.last_reason


def test_scorer_ranks_lower_is_better_and_uses_departures():
    from qosflow.core.job import Job
    from qosflow.core.placement import Placement as CorePlacement
    from qosflow.core.qos import QoSSpec
    from qosflow.policies.placement import find_share

    cs, _ = _cluster_pair(2)  # n0: 8 GPUs (A), n1: 2 GPUs (B)
    wl = WorkloadDistribution.from_types([(8000, 8, MILLI, ()), (2000, 1, 500, ())], [1, 3], memory_mib=[1024, 1024])
    big = Job("big", 0.0, QoSSpec(gpus=7, cpu_cores=7.0, mem_mb=1024.0), 100.0)
    cs.allocate(CorePlacement("big", tuple((0, g) for g in range(7)), cpu=((0, 7.0),), mem_mb=1024.0), big.qos)
    small = Job("b1", 0.0, QoSSpec(gpus=1, cpu_cores=8.0, mem_mb=1024.0), 100.0)
    cs.allocate(CorePlacement("b1", ((1, 0),), cpu=((1, 8.0),), mem_mb=1024.0), small.qos)
    share = Job("s", 0.0, QoSSpec(gpus=1, gpu_milli=500, cpu_cores=2.0, mem_mb=1024.0), 100.0)
    scorer = fractional_scorer(wl)
    nodes, gpus = np.array([0, 1]), np.array([7, 1])
    base = scorer(cs, share, nodes, gpus)
    assert base.shape == (2,) and base[0] == base[1]  # one free GPU each: no difference, node order
    assert find_share(cs, share, scorer=scorer).gpus == ((0, 7),)
    # "big" ends in a second: n0 is (almost) a whole 8-GPU node again -> keep the share off it
    scorer.set_departures(100.0, {"big": 101.0, "b1": 10_000.0}, horizon=600.0)
    soon = scorer(cs, share, nodes, gpus)
    assert soon[0] > soon[1]
    assert find_share(cs, share, scorer=scorer).gpus == ((1, 1),)
    assert scorer.last_reason.startswith("s -> n1 GPU 1: score")
    ex = scorer.explain(cs, share)
    assert ex.placement is not None and ex.placement.node == 1 and "n1" in ex.reason
    scorer.set_departures(100.0, None)
    assert np.array_equal(scorer(cs, share, nodes, gpus), base)
    with pytest.raises(QosflowError, match="fractional"):
        scorer(cs, small, nodes, gpus)
    with pytest.raises(QosflowError, match="measure"):
        fractional_scorer(wl, "best-fit")
    with pytest.raises(QosflowError, match="qosflow measure"):
        fractional_scorer(wl, "fgd", balance=False)


def test_capacity_model_usable_and_stranded():
    wl = WorkloadDistribution.from_types([(4000, 1, 600, ()), (4000, 2, MILLI, ())], [1, 1], memory_mib=[1000, 1000])
    cm = CapacityModel(wl, ("A",))
    cnt, above, total = cm.stats(np.array([[1000, 500, 1000, 0]]))
    u = cm.usable(cnt, above, np.array([8000]), np.array([4000]), cm.access[[0, 0]][:1])
    assert u.tolist() == [[2000, 2000]]
    assert cm.usable(cnt, above, np.array([3000]), np.array([4000]), cm.access[:1]).tolist() == [[0, 0]]
    # the workload feeds 1000 milli-GPU with ~ (4000 + 8000)/(600 + 2000) milli-CPU each
    assert cm.rho_cpu == pytest.approx(8000 / 2600)
    assert cm.stranded(np.array([2500.0]), np.array([8000.0 / 2600 * 1000]), np.array([1e9]))[0] == pytest.approx(1500)


# ---------------------------------------------------------------------------- the real list
def test_qosflow_leaves_fewer_gpus_idle_than_fgd_on_the_alibaba_list():
    """One seed of the FGD experiment (the benchmark runs 10): fewer unallocated GPUs than FGD."""
    from qosflow.packing.model import nodes_from_records, pods_from_records
    from qosflow.sim.traces.alibaba import default_node_list, default_pod_list, load_nodes, load_pods

    if not (default_pod_list().is_file() and default_node_list().is_file()):
        pytest.skip("shared Alibaba trace not found under ../shared/data/traces/")
    pods = pods_from_records(load_pods(default_pod_list()))
    nodes = nodes_from_records(load_nodes(default_node_list()))
    res = run_experiment(pods, nodes, ["fgd", "qosflow"], seeds=[42])
    fgd = res["fgd"].to_dict()["unallocated_gpus"]
    ours = res["qosflow"].to_dict()["unallocated_gpus"]
    assert ours < fgd - 15, (ours, fgd)


# ---------------------------------------------------------------------------- derived lists, churn
def test_derived_pod_lists():
    from qosflow.packing.variants import derive_pod_list

    pods, nodes = synthetic_cluster(seed=8, n_pods=600)
    demand = sum(p.total_gpu_milli for p in pods)
    share = derive_pod_list(pods, "gpushare", 0.8, seed=1)
    gpu_pods = [p for p in share if p.num_gpu]
    assert abs(sum(p.is_fractional for p in gpu_pods) / len(gpu_pods) - 0.8) < 0.02
    multi = derive_pod_list(pods, "multigpu", 0.5, seed=1)
    assert abs(sum(p.total_gpu_milli for p in multi if p.num_gpu > 1) / demand - 0.5) < 0.05
    spec = derive_pod_list(pods, "gpuspec", 1.0, seed=1, nodes=nodes)
    assert all(len(p.gpu_spec) == 1 for p in spec if p.num_gpu)
    assert len({p.gpu_spec for p in spec if p.num_gpu}) == 3
    cpu = derive_pod_list(pods, "cpu", 2.0, seed=1)
    assert sum(p.num_gpu == 0 for p in cpu) == 2 * sum(p.num_gpu == 0 for p in pods)
    for v in (share, multi, spec, cpu):
        assert abs(sum(p.total_gpu_milli for p in v) / demand - 1) < 0.05
        assert len({p.name for p in v}) == len(v)
    assert derive_pod_list(pods, "gpushare", 0.8, seed=1) == share  # deterministic
    with pytest.raises(QosflowError, match="unknown variant"):
        derive_pod_list(pods, "bigger", 1.0)
    with pytest.raises(QosflowError, match="node list"):
        derive_pod_list(pods, "gpuspec", 0.5)


@pytest.mark.parametrize("knowledge", ["none", "oracle", "noisy"])
def test_churn_runs_and_is_deterministic(knowledge):
    from qosflow.packing.churn import run_churn

    pods, nodes = synthetic_cluster(seed=9, n_nodes=12, n_pods=300)
    pods = [Pod(p.name, p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, p.gpu_spec, 0.0, 100.0 + 37 * (i % 11))
            for i, p in enumerate(pods)]
    a = run_churn(pods, nodes, "qosflow", 3, load=1.2, arrivals=600, knowledge=knowledge)
    b = run_churn(pods, nodes, "qosflow", 3, load=1.2, arrivals=600, knowledge=knowledge)
    assert (a.rejected_gpu_share, a.mean_alloc) == (b.rejected_gpu_share, b.mean_alloc)
    assert 0 < a.rejected_gpu_share < 1 and 0.5 < a.mean_alloc <= 1
    with pytest.raises(QosflowError, match="knowledge"):
        run_churn(pods, nodes, "fgd", 3, knowledge="psychic")


def test_a_policy_can_derive_its_own_target_workload():
    """`workload_popularity` on a policy: experiments derive its workload from the pod list
    (FGD's 95 % otherwise; qosflow keeps FGD's, see docs/packing.md)."""

    class Wide(QosflowPacker):
        workload_popularity = 1.0

    pods, nodes = synthetic_cluster(seed=10, n_pods=400)
    pol = Wide()
    run_packing(pods, nodes, pol, seed=1)
    assert len(pol.workload) == len(WorkloadDistribution.from_pods(pods, 1.0)) > len(WorkloadDistribution.from_pods(pods))
    pol = QosflowPacker()
    run_packing(pods, nodes, pol, seed=1)
    assert len(pol.workload) == len(WorkloadDistribution.from_pods(pods))
