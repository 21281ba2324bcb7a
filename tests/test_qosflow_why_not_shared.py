"""qosflow's policy says why a waiting job did not share GPUs (in `qosflow simulate`'s per-job CSV and in
the flow-run log of a waiting stage): each reason of refusal has its own words."""

import pytest

from qosflow.core import ClusterSpec, Job, QoSSpec
from qosflow.core.speed import SpeedModel
from qosflow.policies import get_policy
from qosflow.sim.engine import SimConfig, simulate


class Table:
    """Pair slowdowns by model: `pairs[(a, b)] = (xi_a, xi_b)`; unknown pairs slow both 2.5x."""

    def __init__(self, pairs):
        self.pairs = dict(pairs)
        for (a, b), (xa, xb) in list(self.pairs.items()):
            self.pairs.setdefault((b, a), (xb, xa))

    def pair_slowdown(self, a, b, gpus=1):
        return self.pairs.get((a, b), (2.5, 2.5))

    def spread_slowdown(self, model, gpus):
        return 1.5


def waiting_notes(jobs, spec, table, **opts):
    """Every note the policy gave each job in a round where the job did not start."""
    pol = get_policy("qosflow", **opts)
    seen: dict[str, list[str]] = {}
    schedule = pol.schedule

    def spy(view):
        d = schedule(view)
        started = {p.job_id for p in d.starts}
        for jid, note in d.notes.items():
            if jid not in started:
                seen.setdefault(jid, []).append(note)
        return d

    pol.schedule = spy
    res = simulate(jobs, spec, pol, speed=SpeedModel(table), config=SimConfig(restart_overhead=0))
    return seen, {j.job_id: j for j in res.jobs}


def test_best_effort_pair_that_does_not_pay():
    spec = ClusterSpec.uniform(1, 1, gpu_mem_mb=32000)
    jobs = [
        Job("long", 0.0, QoSSpec(shareable=True, gpu_mem_mb=4000), 10_000.0, model="a"),
        Job("twin", 20.0, QoSSpec(shareable=True, gpu_mem_mb=4000), 100.0, model="a"),
    ]
    notes, res = waiting_notes(jobs, spec, Table({}))
    first = notes["twin"][0]
    assert first.startswith("waiting: needs 1 GPU, 0 free; not shared: no pair pays"), first
    # 1/2.5 - (1 - 1/2.5) = -20 % GPU-throughput per GPU, at slowdown 2.50x
    assert "-20% GPU-throughput per GPU at slowdown 2.50x" in first, first
    assert res["twin"].first_start >= res["long"].finish_time - 1e-6


def test_deadline_job_whose_deadline_sharing_would_miss():
    spec = ClusterSpec.uniform(1, 1, gpu_mem_mb=32000)
    jobs = [
        Job("long", 0.0, QoSSpec(shareable=True, gpu_mem_mb=4000), 10_000.0, model="a"),
        # 100 s of work, 105 s to its deadline: at 1.1x it would take 110 s
        Job("urgent", 10.0, QoSSpec(shareable=True, gpu_mem_mb=4000, deadline=105.0), 100.0, model="b"),
    ]
    notes, _ = waiting_notes(jobs, spec, Table({("b", "a"): (1.1, 1.1)}))
    first = notes["urgent"][0]
    assert "not shared: sharing would miss its deadline: the least slowdown on offer is 1.10x (110s to run, 105s left)" in first, first


def test_deadline_job_that_would_slow_a_whole_gang():
    spec = ClusterSpec.uniform(1, 8, gpu_mem_mb=32000)
    jobs = [
        Job("gang", 0.0, QoSSpec(gpus=8, shareable=True, gpu_mem_mb=4000), 10_000.0, model="a"),
        # it meets its deadline at 1.1x, but the 8-GPU gang would run 1.5x slower
        Job("urgent", 10.0, QoSSpec(shareable=True, gpu_mem_mb=4000, deadline=1000.0), 100.0, model="b"),
    ]
    notes, _ = waiting_notes(jobs, spec, Table({("b", "a"): (1.1, 1.5)}))
    first = notes["urgent"][0]
    assert "not shared: sharing meets its deadline but slows its partners' gangs too much" in first, first
    # once the guard is relaxed it shares: the refusal came from the gang's loss alone
    from qosflow.policies.qosflow_policy import QosflowPolicy

    old = QosflowPolicy.DL_COST_FLOOR
    QosflowPolicy.DL_COST_FLOOR = -10.0
    try:
        _, res = waiting_notes(jobs, spec, Table({("b", "a"): (1.1, 1.5)}))
    finally:
        QosflowPolicy.DL_COST_FLOOR = old
    assert "sharing GPUs with gang" in res["urgent"].note


def test_partner_deadline_and_not_shareable():
    spec = ClusterSpec.uniform(1, 1, gpu_mem_mb=32000)
    jobs = [
        # no slack at all: any partner would push it past its deadline
        Job("tight", 0.0, QoSSpec(shareable=True, gpu_mem_mb=4000, deadline=1001.0), 1000.0, model="a"),
        Job("other", 10.0, QoSSpec(shareable=True, gpu_mem_mb=4000), 50.0, model="b"),
        Job("solo", 20.0, QoSSpec(shareable=False), 50.0, model="c"),
    ]
    # (the makespan guard off: "tight" is also the longest job, whose partners the guard limits first)
    notes, res = waiting_notes(jobs, spec, Table({("b", "a"): (1.1, 1.1)}), makespan_beta=None)
    assert "not shared: joining would push a partner past a deadline it can still meet" in notes["other"][0], notes["other"]
    assert "not shared: it may not share a GPU" in notes["solo"][0], notes["solo"]
    assert res["tight"].finish_time <= jobs[0].deadline + 1e-6


@pytest.mark.parametrize(
    "gpu_mem, occupant, newcomer, note",
    [
        # the occupant is on the critical path (it alone is longer than the backlog): it takes only short partners
        (32000, (100_000.0, 4000), (20_000.0, 4000), "not shared: the jobs it could join are on the critical path"),
        # the occupant leaves 1000 MB of its GPU; the newcomer needs 8000 (no batch size: no smaller sub-batch)
        (16000, (10_000.0, 15000), (50.0, 8000), "not shared: no GPU holds a single shareable job with 8000 MB free"),
    ],
    ids=["critical-partner", "no-room"],
)
def test_newcomer_next_to_one_occupant(gpu_mem, occupant, newcomer, note):
    spec = ClusterSpec.uniform(1, 1, gpu_mem_mb=gpu_mem)
    jobs = [
        Job("occupant", 0.0, QoSSpec(shareable=True, gpu_mem_mb=occupant[1]), occupant[0], model="a"),
        Job("newcomer", 10.0, QoSSpec(shareable=True, gpu_mem_mb=newcomer[1]), newcomer[0], model="b"),
    ]
    notes, _ = waiting_notes(jobs, spec, Table({("b", "a"): (1.1, 1.1)}))
    assert note in notes["newcomer"][0], notes["newcomer"]


def test_job_held_off_a_node_reserved_for_a_gang_says_so():
    """Two GPUs are free, but the node is reserved for a 4-GPU gang that starts before the 2-GPU job
    would end: the waiting job's note says the GPUs are there and reserved, not that they are missing."""
    spec = ClusterSpec.uniform(1, 4)
    jobs = [
        Job("a", 0.0, QoSSpec(gpus=2), 1000.0),
        Job("wide", 1.0, QoSSpec(gpus=4), 100.0),
        Job("long", 1.0, QoSSpec(gpus=2), 5000.0),
    ]
    notes, res = waiting_notes(jobs, spec, Table({}), share=False, makespan_beta=None)
    first = notes["long"][0]
    assert "largest free block is 2" in first and "reserved for jobs that start before it would end" in first, first
    assert res["long"].first_start >= res["wide"].finish_time - 1e-6
