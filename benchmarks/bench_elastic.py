"""Elastic starts (`QoSSpec.min_gpus`) on the Muri trace: how many deadlines they win back without preemption.

    python benchmarks/bench_elastic.py                 # writes docs/bench/elastic.md
    python benchmarks/bench_elastic.py --seeds 0       # a quick look

The traces record no elasticity, so whether a gang could start on fewer GPUs is an assumption: here
every job of 2+ GPUs may start on half of them (`qosflow simulate --min-gpus-share 0.5`: an 8-GPU job
on 4 with 2 steps of gradient accumulation, at half speed). Side by side, per deadline seed (which
jobs get a deadline and how tight), on the same trace and cluster:

* SRTF (preemptive, exact durations: the best baseline of issue 3) on the rigid trace;
* qosflow, and qosflow with express nodes (`express_share=0.125`), each rigid and elastic;
* qosflow elastic under +-30 % noise (the promises are checked on the error band).

Baselines ignore `min_gpus` (they start a job on all its GPUs), so SRTF's figures are the same either way.
Reported: DSR, average JCT, makespan, and the deadline jobs met among the gangs of 3-8 GPUs under an
hour (the class elastic starts aim at) and among all gangs of 3+ GPUs, with the count of elastic starts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine, md_table, write_section  # noqa: E402

#: label -> (policy, policy options, elastic share or None, estimator)
RUNS = {
    "srtf": ("srtf", {}, None, "oracle"),
    "qosflow": ("qosflow", {}, None, "oracle"),
    "qosflow elastic": ("qosflow", {}, 0.5, "oracle"),
    "qosflow+express": ("qosflow", {"express_share": 0.125}, None, "oracle"),
    "qosflow+express elastic": ("qosflow", {"express_share": 0.125}, 0.5, "oracle"),
    "qosflow elastic, noisy": ("qosflow", {}, 0.5, "noisy"),
}


def run(label: str, trace: str, cluster: str, seed: int) -> dict:
    from qosflow.core.estimate import make_estimator
    from qosflow.policies import get_policy
    from qosflow.sim.clusters import load_cluster
    from qosflow.sim.engine import SimConfig, Simulator
    from qosflow.sim.interference import default_speed_model
    from qosflow.sim.metrics import compute_metrics
    from qosflow.sim.workload import load_workload

    policy, opts, share, kind = RUNS[label]
    spec = load_cluster(cluster)
    wl = load_workload(trace, "muri", cluster=spec, seed=seed, min_gpus_share=share)
    speed = default_speed_model()
    t0 = time.perf_counter()
    res = Simulator(wl.jobs, spec, get_policy(policy, **opts), estimator=make_estimator(kind, speed, seed=seed, error=0.3),
                    speed=speed, config=SimConfig(seed=seed)).run()
    wall = time.perf_counter() - t0
    m = compute_metrics(res)
    short = [0, 0]
    gangs = [0, 0]
    narrowed = 0
    for js in res.jobs:
        j = js.job
        narrowed += js.started_gpus is not None and js.started_gpus < j.qos.gpus
        if j.deadline is None or j.qos.gpus < 3:
            continue
        met = js.finish_time is not None and js.finish_time <= j.deadline + 1e-6
        gangs[0] += met
        gangs[1] += 1
        if j.qos.gpus <= 8 and j.duration < 3600:
            short[0] += met
            short[1] += 1
    return {"label": label, "seed": seed, "dsr": m.dsr, "jct": m.avg_jct, "makespan": m.makespan, "short": short,
            "gangs": gangs, "narrowed": narrowed, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="deadline seeds, comma-separated (default 0,1,2)")
    ap.add_argument("--trace", default=None, help="default: ../shared/data/traces/muri_philly_trace1.csv")
    ap.add_argument("--cluster", default=None, help="default: ../shared/data/traces/muri_cluster_n8g8.csv")
    ap.add_argument("--workers", type=int, default=2, help="simulations at once (default 2)")
    args = ap.parse_args()
    from concurrent.futures import ProcessPoolExecutor

    from qosflow.paths import shared_data

    trace = args.trace or str(shared_data() / "traces" / "muri_philly_trace1.csv")
    cluster = args.cluster or str(shared_data() / "traces" / "muri_cluster_n8g8.csv")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    jobs = [(label, s) for s in seeds for label in RUNS]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        futs = [pool.submit(run, label, trace, cluster, s) for label, s in jobs]
        out = []
        for i, f in enumerate(futs, 1):
            out.append(f.result())
            r = out[-1]
            print(f"[{i}/{len(futs)}] seed {r['seed']} {r['label']}: DSR {r['dsr']:.1%}, JCT {r['jct'] / 86400:.2f} d, "
                  f"makespan {r['makespan'] / 86400:.1f} d, {r['narrowed']} elastic starts ({r['wall']:.0f} s)", flush=True)
    took = time.perf_counter() - t0
    rows = []
    for s in seeds:
        by = {r["label"]: r for r in out if r["seed"] == s}
        for label in RUNS:
            r = by[label]
            rows.append([s, label, f"{r['dsr']:.1%}", f"{r['jct'] / 86400:.2f} d", f"{r['makespan'] / 86400:.1f} d",
                         f"{r['short'][0]} / {r['short'][1]}", f"{r['gangs'][0]} / {r['gangs'][1]}", r["narrowed"]])
    mean_rows = []
    for label in RUNS:
        rs = [r for r in out if r["label"] == label]
        mean_rows.append([label, f"{statistics.mean(r['dsr'] for r in rs):.1%}",
                          f"{statistics.mean(r['jct'] for r in rs) / 86400:.2f} d",
                          f"{statistics.mean(r['makespan'] for r in rs) / 86400:.1f} d",
                          f"{statistics.mean(r['narrowed'] for r in rs):.0f}"])
    md = (
        "# Elastic starts on the Muri trace (qosflow, `min_gpus`)\n\n"
        f"- machine: {machine()}\n- command: `python benchmarks/bench_elastic.py --seeds {args.seeds}` ({took:.0f} s)\n"
        f"- trace: {Path(trace).name} on {Path(cluster).name}; elastic = every job of 2+ GPUs may start on half of them "
        "(an assumption: the trace records none); SRTF and the rigid runs use the trace as it is\n\n"
        "Per deadline seed. 'short gangs': deadline jobs of 3-8 GPUs under an hour, met / all; 'gangs': deadline jobs of "
        "3+ GPUs; 'elastic starts': jobs started on fewer GPUs than they asked for.\n\n"
        + md_table(["seed", "run", "DSR", "avg JCT", "makespan", "short gangs met", "gangs met", "elastic starts"], rows)
        + "\n\nMeans over the seeds:\n\n"
        + md_table(["run", "DSR", "avg JCT", "makespan", "elastic starts"], mean_rows)
        + "\n"
    )
    p = write_section("elastic", md)
    print(md)
    print(f"written: {p}")


if __name__ == "__main__":
    main()
