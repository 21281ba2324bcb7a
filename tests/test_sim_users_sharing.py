"""Per-user GPU-hours of a simulation run with GPU sharing: a GPU two jobs share counts half to each, so the
users' GPU-hours add up to the GPU-hours the run allocated (`SimResult.gpu_seconds_split`,
`qosflow.sim.metrics.user_metrics`). They counted a shared GPU fully for both jobs, adding up to more."""

import json

import pytest

from qosflow.cli.main import main
from qosflow.core import Job, QoSSpec
from qosflow.core.cluster import ClusterSpec, NodeSpec
from qosflow.core.placement import Placement
from qosflow.policies.base import Decision, Policy, SchedulerView
from qosflow.sim.engine import SimConfig, Simulator
from qosflow.sim.metrics import compute_metrics


class _Pinned(Policy):
    """Starts each pending job on the GPUs given for it: here "a" on both GPUs, "b" co-located on GPU 0."""

    name = "pinned"

    def __init__(self, where: dict[str, tuple[tuple[int, int], ...]]):
        self.where = where

    def schedule(self, view: SchedulerView) -> Decision:
        starts = []
        for js in view.pending:
            q = js.job.qos
            p = Placement(js.job_id, self.where[js.job_id], cpu=((0, q.cpu_cores),), gpu_mem_mb=q.gpu_mem_mb or 0.0,
                          colocated_with=tuple(j for g in self.where[js.job_id] for j in view.cluster.jobs_on_gpu(*g)))
            view.cluster.allocate(p, q)
            starts.append(p)
        return Decision(starts=starts)


def test_a_shared_gpu_counts_half_to_each_user():
    """ann's 2-GPU job and bo's 1-GPU job share GPU 0 while both run: bo held half a GPU, ann one and a half,
    then ann both GPUs alone; together the GPU-hours allocated, not that plus the shared GPU's again."""
    spec = ClusterSpec((NodeSpec("n0", gpus=2, gpu_mem_mb=32_000.0, cpu_cores=16.0),), name="1x2")
    q = dict(cpu_cores=2.0, gpu_mem_mb=8_000.0, shareable=True)
    jobs = [Job("a", 0.0, QoSSpec(gpus=2, **q), 4000.0, user="ann"), Job("b", 0.0, QoSSpec(gpus=1, **q), 1000.0, user="bo")]
    res = Simulator(jobs, spec, _Pinned({"a": ((0, 0), (0, 1)), "b": ((0, 0),)}), config=SimConfig()).run()
    a, b = (next(js for js in res.jobs if js.job_id == j) for j in "ab")
    assert a.first_start == b.first_start == 0.0 and b.finish_time < a.finish_time  # (they did share GPU 0)
    both, end = b.finish_time, a.finish_time
    m = compute_metrics(res)
    assert m.shared_share > 0
    per = m.per_user
    assert per["bo"]["gpu_hours"] == pytest.approx(0.5 * both / 3600)
    assert per["ann"]["gpu_hours"] == pytest.approx((1.5 * both + 2 * (end - both)) / 3600)
    assert sum(u["gpu_hours"] for u in per.values()) == pytest.approx(res.busy_gpu_seconds / 3600)
    # (what each job received, for the policies' LAS and fair share, still counts the GPU fully for each)
    assert b.gpu_attained == pytest.approx(both) and a.gpu_attained == pytest.approx(2 * end)


def test_users_gpu_hours_add_up_to_the_gpu_hours_allocated(tmp_path):
    """`qosflow simulate --users`: with the qosflow policy sharing GPUs, the users' GPU-hours (JSON and table)
    add up to gpu_util x GPUs x makespan."""
    out = tmp_path / "res.json"
    assert main(["simulate", "--trace", "synthetic", "--jobs", "60", "--cluster", "2x4", "--users", "3", "--policies", "qosflow,fifo",
                 "--seed", "1", "--no-plots", "--parallel", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    shared = 0
    for name, pol in data["policies"].items():
        allocated = pol["gpu_util"] * 8 * pol["makespan"] / 3600
        users = pol["per_user"]["users"]
        assert sum(u["gpu_hours"] for u in users.values()) == pytest.approx(allocated, rel=1e-9), name
        shared += pol["shared_share"] > 0
    assert shared  # (the qosflow policy co-locates jobs on this workload: the case this is about)
