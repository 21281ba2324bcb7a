"""The note of qosflow's deadline rescue says how many nodes the gang took, in plain words."""

import pytest

from qosflow.core import Job, QoSSpec
from qosflow.policies import get_policy
from qosflow.sim.clusters import load_cluster
from qosflow.sim.engine import SimConfig, simulate

R18 = "ResNet-18 (batch size 32)"


def _rescue_note(jobs) -> str:
    """The note qosflow gave 'gang' when it started it."""
    policy = get_policy("qosflow")
    schedule, notes = policy.schedule, {}

    def spy(view):
        d = schedule(view)
        notes.update({p.job_id: d.notes.get(p.job_id, "") for p in d.starts})
        return d

    policy.schedule = spy
    simulate(jobs, load_cluster("2x4"), policy, config=SimConfig(restart_overhead=0))
    return notes["gang"]


@pytest.mark.parametrize("case", ["one node", "two nodes"])
def test_rescue_note_counts_its_nodes_in_words(case):
    """It said "spread over 1 node(s)": a gang rescued on the free and shared GPUs of one node is "on 1 node",
    one on free GPUs of two nodes "spread over 2 nodes"."""
    if case == "one node":  # node 1 busy for long; node 0: 2 GPUs free, 2 holding a shareable job
        jobs = [Job("long", 0.0, QoSSpec(gpus=4, gpu_mem_mb=4000, gang=True), 100000.0),
                Job("b", 0.0, QoSSpec(gpus=2, gpu_mem_mb=4000, shareable=True, gang=True), 3000.0, model=R18),
                Job("gang", 10.0, QoSSpec(gpus=4, gpu_mem_mb=4000, gang=True, shareable=True, deadline=7200.0), 600.0, model=R18)]
        want = "deadline rescue: on 1 node, sharing with b; "
    else:  # one GPU free on each node
        jobs = [Job("a", 0.0, QoSSpec(gpus=3, gpu_mem_mb=4000, gang=True), 36000.0),
                Job("b", 0.0, QoSSpec(gpus=3, gpu_mem_mb=4000, gang=True), 36000.0),
                Job("gang", 10.0, QoSSpec(gpus=2, gpu_mem_mb=4000, gang=True, shareable=True, deadline=36000.0), 600.0, model=R18)]
        want = "deadline rescue: spread over 2 nodes; "
    note = _rescue_note(jobs)
    assert note.startswith(want), note
    assert "node(s)" not in note
