"""Placement decision rate: one scheduling round on 1,000 nodes x 8 GPUs with 5,000 jobs pending.

Target (issue 2): >= 2,000 placement decisions per second (kube-scheduler's CI floor is about
700 pods/s at 5,000 nodes). Half the cluster is busy with running jobs, so the round has to
search a fragmented cluster; the pending mix follows Gavel's Philly-like GPU distribution.
With `--mixed` the nodes are a third each of V100, P100 and K80 servers and jobs run at Gavel's
measured speed on each (the oracle knows it): qosflow with and without its GPU-model choice, next to
sjf-bsbf, written to docs/bench/decisions_mixed.md.
Usage: python benchmarks/bench_decisions.py [--policies a,b] [--mixed] [--write]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _common import machine, md_table, write_section  # noqa: E402

from qosflow.core import ClusterSpec, ClusterState, Job, JobState, QoSSpec  # noqa: E402
from qosflow.core.estimate import OracleEstimator  # noqa: E402
from qosflow.core.job import JobStatus  # noqa: E402
from qosflow.policies import get_policy  # noqa: E402
from qosflow.policies.base import SchedulerView  # noqa: E402
from qosflow.policies.placement import find_whole  # noqa: E402

MODELS = ["resnet18", "vgg16", "bert", "gpt2", "dqn", "a2c", "shufflenet_v2_x1_0", "vgg19"]


def make_round(seed: int = 0, nodes: int = 1000, gpus: int = 8, pending: int = 5000, busy_share: float = 0.5, mixed: bool = False):
    rng = np.random.default_rng(seed)
    spec = ClusterSpec.uniform(nodes, gpus, cpu_cores=96, gpu_mem_mb=32768, nodes_per_switch=40)
    est = OracleEstimator()
    if mixed:  # a third of the nodes each of V100, P100 and K80 servers, jobs at Gavel's speeds there
        from dataclasses import replace

        from qosflow.sim.interference import default_speed_model

        spec = ClusterSpec(tuple(replace(n, gpu_model=("v100", "p100", "k80")[i * 3 // nodes]) for i, n in enumerate(spec.nodes)),
                           name="mixed")
        est = OracleEstimator(default_speed_model())
    st = ClusterState(spec)
    running: list[JobState] = []
    i = 0
    while st.used_gpus() < busy_share * spec.num_gpus:
        g = int(rng.choice([1, 2, 4, 8], p=[0.7, 0.1, 0.15, 0.05]))
        job = Job(f"r{i}", 0.0, QoSSpec(gpus=g, cpu_cores=4 * g, shareable=True, gpu_mem_mb=6000), float(rng.uniform(600, 36000)), model=str(rng.choice(MODELS)), batch_size=64)
        i += 1
        p = find_whole(st, job, fit="first-fit") if rng.random() < 0.5 else find_whole(st, job, fit="worst-fit")
        if p is None:
            break
        st.allocate(p, job.qos)
        js = JobState(job, status=JobStatus.RUNNING, placement=p, progress=float(rng.uniform(0, 0.9)))
        js.gpu_attained = float(rng.uniform(0, 20000))
        running.append(js)
    pend = []
    for k in range(pending):
        g = int(rng.choice([1, 2, 4, 8], p=[0.7, 0.1, 0.15, 0.05]))
        dl = float(rng.uniform(3600, 86400)) if rng.random() < 0.5 else None
        job = Job(f"p{k}", float(k), QoSSpec(gpus=g, cpu_cores=4 * g, shareable=True, gpu_mem_mb=6000, deadline=dl), float(60 * 10 ** rng.uniform(1.5, 3)), model=str(rng.choice(MODELS)), batch_size=64)
        pend.append(JobState(job, queued_since=float(k)))
    return spec, st, running, pend, est


#: `--mixed`: label -> (policy, options)
MIXED_RUNS = {"sjf-bsbf": ("sjf-bsbf", {}), "qosflow, models off": ("qosflow", {"gpu_models": False}), "qosflow": ("qosflow", {})}


def run(policies: list[str], repeats: int = 3, mixed: bool = False):
    spec, st, running, pend, est = make_round(mixed=mixed)
    rows = []
    for name in policies:
        policy, options = MIXED_RUNS[name] if mixed else (name, {})
        pol = get_policy(policy, **options)
        best = None
        for r in range(repeats):
            view = SchedulerView(now=10_000.0, cluster=st.snapshot(), pending=list(pend), running=list(running), estimator=est)
            t0 = time.perf_counter()
            d = pol.schedule(view)
            dt = time.perf_counter() - t0
            if best is None or dt < best[0]:
                best = (dt, len(d.starts), len(d.preempt))
        dt, starts, pre = best
        rows.append((name, dt, starts, pre, starts / dt if dt else float("inf"), len(pend) / dt))
    return spec, st, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policies", default="fifo,sjf,srtf,tiresias,sjf-ffs,sjf-bsbf,genie,qosflow")
    ap.add_argument("--mixed", action="store_true", help="V100, P100 and K80 nodes (qosflow with and without its model choice)")
    ap.add_argument("--write", action="store_true", help="write docs/bench/decisions.md (with --mixed: decisions_mixed.md)")
    a = ap.parse_args()
    spec, st, rows = run(list(MIXED_RUNS) if a.mixed else [p for p in a.policies.split(",") if p], mixed=a.mixed)
    table = md_table(
        ["policy", "round (s)", "placements", "preemptions", "placements/s", "decisions/s (pending jobs decided)", "target 2,000/s"],
        [[n, f"{dt:.3f}", s, p, f"{rate:,.0f}", f"{cons:,.0f}", "met" if cons >= 2000 else "MISSED"] for n, dt, s, p, rate, cons in rows],
    )
    text = (
        ("## Placement decision rate on a cluster of mixed GPU models\n\n" if a.mixed else "## Placement decision rate (issue 2)\n\n")
        + f"Machine: {machine()}\n\n"
        + ("A third of the nodes each of V100, P100 and K80 servers; jobs at Gavel's measured speed on each. " if a.mixed else "")
        + f"One scheduling round on {len(spec.nodes)} nodes x 8 GPUs ({spec.num_gpus} GPUs, {st.used_gpus()} busy, "
        f"{len(st.allocs)} running jobs), 5,000 jobs pending (Gavel's Philly-like GPU mix). Best of 3 rounds, each on a fresh snapshot. A decision is one pending job placed or left waiting; FIFO's round "
        "stops at its blocked head, so its placement count is tiny by design.\n\n"
        + table
    )
    print(text)
    if a.write:
        print("wrote", write_section("decisions_mixed" if a.mixed else "decisions", text))


if __name__ == "__main__":
    main()
