"""Fairness between users: qosflow's `fair_share` on and off, side by side, in one run.

The scenario a lab knows: one user (`sweep`) submits hyper-parameter sweeps of many short 1-GPU jobs,
several colleagues submit a few longer jobs each, on one cluster (4 x 8 GPUs by default). Weighted SJF
alone serves the sweep's short jobs first and the colleagues wait.

* `sweep`: `--bursts` sweeps (default 2, `--every` 5 hours apart) of `--sweep` jobs each (default 300),
  submitted over five minutes, each 1 GPU for 10-40 minutes (one sweep alone fills the 32 GPUs for 4 h);
* `--light` other users (default 4): about 8 jobs each, arriving at random over `--hours` (8 h), of 1, 2
  or 4 GPUs (p 0.5, 0.3, 0.2) for 30 min to 4 h (log-uniform);
* deadlines as the traces get them (docs/workloads.md: half the jobs, lambda U[1.2, 3] x the duration,
  drawn per job id and seed);
* no job declares `shareable` (a sweep's stages rarely do); oracle estimates (true durations).

Per user: average JCT, average slowdown (JCT / duration alone), DSR; Jain's fairness index over the users'
average slowdowns (1: all users slowed alike, 1/n: one user takes all the delay; these as `qosflow simulate`
reports them per user, `qosflow.sim.metrics.user_metrics`); and, since a sweep's
short jobs queue behind each other whoever else is there, each user's JCT against the same user's jobs
run alone on the cluster (Themis' finish-time fairness, with the whole cluster as the ideal: how much the
others slow a user down) and Jain's index over that; total average JCT and makespan. Every run with `fair_share` off (qosflow as before) and on (the default, half-life 1 h), plus the
half-life at 0 (the GPUs held now) and 6 h, over `--seeds` workloads.

Usage: python benchmarks/bench_fairness.py [--seeds 0,1,2,3,4] [--cluster 4x8] [--write]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, md_table, write_section  # noqa: E402

from qosflow.core.job import Job  # noqa: E402
from qosflow.core.qos import QoSSpec  # noqa: E402
from qosflow.sim.deadlines import assign_deadlines  # noqa: E402
from qosflow.sim.metrics import jain_index as jain  # noqa: E402

#: label -> qosflow options
RUNS = {
    "fair_share off": {"fair_share": False},
    "on (half-life 1 h, default)": {},
    "on, half-life 0 (GPUs held now)": {"fair_half_life": 0.0},
    "on, half-life 6 h": {"fair_half_life": 6 * 3600.0},
}
OFF, ON = "fair_share off", "on (half-life 1 h, default)"
LIGHT_NAMES = ("ann", "bo", "cy", "di", "ed", "flo", "gus", "hal")


def workload(seed: int, *, sweep: int = 300, bursts: int = 2, light: int = 4, hours: float = 8.0, every: float = 5.0) -> list[Job]:
    """The sweep user's bursts and the light users' jobs, deadlines assigned for `seed`."""
    rnd = random.Random(seed)
    jobs = []
    for b in range(bursts):
        t0 = b * every * 3600.0
        for i in range(sweep):
            jobs.append(Job(f"sweep-{b}-{i}", t0 + rnd.uniform(0, 300), QoSSpec(gpus=1, cpu_cores=4, gpu_mem_mb=4000),
                            rnd.uniform(600, 2400), model="ResNet-18 (batch size 32)", user="sweep"))
    for u in LIGHT_NAMES[:light]:
        n = rnd.randint(6, 10)
        for k in range(n):
            g = rnd.choices((1, 2, 4), weights=(0.5, 0.3, 0.2))[0]
            dur = math.exp(rnd.uniform(math.log(1800), math.log(4 * 3600)))
            model = rnd.choice(("ResNet-50 (batch size 64)", "Transformer (batch size 64)", "LM (batch size 20)"))
            jobs.append(Job(f"{u}-{k}", rnd.uniform(0, hours * 3600.0), QoSSpec(gpus=g, cpu_cores=4 * g, gpu_mem_mb=8000),
                            dur, model=model, user=u))
    jobs = assign_deadlines(jobs, seed=seed)
    return sorted(jobs, key=lambda j: (j.submit_time, j.job_id))


def run(label: str, seed: int, cluster: str, wl_kw: dict) -> dict:
    from qosflow.core.estimate import OracleEstimator
    from qosflow.policies import get_policy
    from qosflow.sim.clusters import load_cluster
    from qosflow.sim.engine import SimConfig, Simulator
    from qosflow.sim.interference import default_speed_model
    from qosflow.sim.metrics import compute_metrics

    spec = load_cluster(cluster)
    jobs = workload(seed, **wl_kw)
    speed = default_speed_model()
    t0 = time.perf_counter()
    res = Simulator(jobs, spec, get_policy("qosflow", **RUNS[label]), estimator=OracleEstimator(speed), speed=speed,
                    config=SimConfig(seed=seed)).run()
    wall = time.perf_counter() - t0
    m = compute_metrics(res)  # (every user here has jobs: its per_user holds them all, `user_metrics`)
    per_user = {name: {"jobs": u["jobs"], "jct": u["avg_jct"], "slowdown": u["avg_slowdown"],
                       "dsr": u["met"] / u["deadline_jobs"] if u["deadline_jobs"] else float("nan"), "dl": u["deadline_jobs"],
                       "met": u["met"]}
                for name, u in m.per_user.items()}
    light = [js for js in res.jobs if js.job.user != "sweep"]
    return {
        "label": label, "seed": seed, "wall": wall, "jct": m.avg_jct, "makespan": m.makespan, "dsr": m.dsr,
        "users": per_user, "jain": m.jain_slowdown,
        "light_jct": statistics.mean(js.finish_time - js.job.submit_time for js in light),
        "light_slow": statistics.mean((js.finish_time - js.job.submit_time) / js.job.duration for js in light),
        "sched_s": m.sched_seconds,
    }


def alone(seed: int, cluster: str, wl_kw: dict) -> dict[str, float]:
    """Each user's average JCT with their jobs alone on the cluster (qosflow; fairness has no one to act on)."""
    from qosflow.core.estimate import OracleEstimator
    from qosflow.policies import get_policy
    from qosflow.sim.clusters import load_cluster
    from qosflow.sim.engine import SimConfig, Simulator
    from qosflow.sim.interference import default_speed_model

    spec = load_cluster(cluster)
    jobs = workload(seed, **wl_kw)
    speed = default_speed_model()
    out = {}
    for u in sorted({j.user for j in jobs}):
        mine = [j for j in jobs if j.user == u]
        res = Simulator(mine, spec, get_policy("qosflow"), estimator=OracleEstimator(speed), speed=speed, config=SimConfig(seed=seed)).run()
        out[u] = statistics.mean(js.finish_time - js.job.submit_time for js in res.jobs)
    return out


def h(x: float) -> str:
    return f"{x / 3600:.2f} h"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3,4", help="workload seeds, comma-separated (default 0-4)")
    ap.add_argument("--cluster", default="4x8", help="cluster (default 4x8: 32 GPUs)")
    ap.add_argument("--sweep", type=int, default=300, help="jobs per sweep (default 300)")
    ap.add_argument("--bursts", type=int, default=2, help="sweeps (default 2)")
    ap.add_argument("--every", type=float, default=5.0, help="hours between sweeps (default 5)")
    ap.add_argument("--light", type=int, default=4, help="other users (default 4, at most 8)")
    ap.add_argument("--workers", type=int, default=2, help="simulations at once (default 2)")
    ap.add_argument("--write", action="store_true", help="write docs/bench/fairness.md")
    args = ap.parse_args()
    from concurrent.futures import ProcessPoolExecutor

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    wl_kw = {"sweep": args.sweep, "bursts": args.bursts, "light": args.light, "every": args.every}
    t0 = time.perf_counter()
    todo = [(label, s) for s in seeds for label in RUNS]
    out = []
    with ProcessPoolExecutor(args.workers) as pool:
        solo = {s: pool.submit(alone, s, args.cluster, wl_kw) for s in seeds}
        futs = [pool.submit(run, label, s, args.cluster, wl_kw) for label, s in todo]
        for i, f in enumerate(futs, 1):
            r = f.result()
            out.append(r)
            print(f"[{i}/{len(futs)}] seed {r['seed']} {r['label']}: JCT {h(r['jct'])}, light JCT {h(r['light_jct'])}, "
                  f"Jain {r['jain']:.3f}, DSR {r['dsr']:.1%}, makespan {h(r['makespan'])} ({r['wall']:.0f} s)", flush=True)
        solo = {s: f.result() for s, f in solo.items()}
    took = time.perf_counter() - t0
    for r in out:  # finish-time fairness: each user's JCT against their jobs alone on the cluster
        for name, u in r["users"].items():
            u["rho"] = u["jct"] / solo[r["seed"]][name]
        r["jain_rho"] = jain([u["rho"] for u in r["users"].values()])

    def mean(label, key):
        return statistics.mean(r[key] for r in out if r["label"] == label)

    summary = []
    for label in RUNS:
        summary.append([label, h(mean(label, "jct")), h(mean(label, "makespan")), f"{mean(label, 'dsr'):.1%}",
                        h(mean(label, "light_jct")), f"{mean(label, 'light_slow'):.2f}",
                        h(statistics.mean(r["users"]["sweep"]["jct"] for r in out if r["label"] == label)),
                        f"{statistics.mean(r['users']['sweep']['slowdown'] for r in out if r['label'] == label):.2f}",
                        f"{mean(label, 'jain'):.3f}", f"{mean(label, 'jain_rho'):.3f}", f"{mean(label, 'sched_s'):.1f} s"])
    # per user, on and off side by side (means over the seeds)
    names = ["sweep"] + [n for n in LIGHT_NAMES[: args.light]]
    per_user = []
    for name in names:
        row = [name, statistics.mean(r["users"][name]["jobs"] for r in out if r["label"] == OFF)]
        for label in (OFF, ON):
            rs = [r["users"][name] for r in out if r["label"] == label]
            dl = sum(x["dl"] for x in rs)
            met = sum(x["met"] for x in rs)
            row += [h(statistics.mean(x["jct"] for x in rs)), f"{statistics.mean(x['slowdown'] for x in rs):.2f}",
                    f"{statistics.mean(x['rho'] for x in rs):.2f}", f"{met / dl:.0%} ({met}/{dl})" if dl else "-"]
        per_user.append(row)
    seed_rows = []
    for s in seeds:
        by = {r["label"]: r for r in out if r["seed"] == s}
        seed_rows.append([s] + [f"{by[label]['jain']:.3f} / {by[label]['jain_rho']:.3f}" for label in RUNS] + [f"{by[OFF]['light_jct'] / 3600:.2f} -> {by[ON]['light_jct'] / 3600:.2f} h",
                                                                                 f"{by[OFF]['jct'] / 3600:.2f} -> {by[ON]['jct'] / 3600:.2f} h",
                                                                                 f"{by[OFF]['makespan'] / 3600:.2f} -> {by[ON]['makespan'] / 3600:.2f} h"])
    off_jct, on_jct = mean(OFF, "jct"), mean(ON, "jct")
    md = (
        "# Fairness between users (qosflow's `fair_share`)\n\n"
        f"- machine: {machine()}\n"
        f"- command: `python benchmarks/bench_fairness.py --seeds {args.seeds} --cluster {args.cluster} --sweep {args.sweep} "
        f"--bursts {args.bursts} --every {args.every:g} --light {args.light}` ({took:.0f} s)\n"
        f"- workload (benchmarks/bench_fairness.py): user `sweep` submits {args.bursts} sweeps of {args.sweep} 1-GPU jobs of "
        f"10-40 min, {args.every:g} h apart (each within 5 min); {args.light} other users submit 6-10 jobs each of 1/2/4 GPUs, "
        "30 min - 4 h, at random over 8 h; half the jobs have a deadline (lambda U[1.2, 3] x duration); no job shareable; "
        "oracle estimates; "
        f"cluster {args.cluster}. Means over seeds {args.seeds}.\n\n"
        "Slowdown: JCT / the job's duration alone. Jain: Jain's fairness index over the users' average slowdowns "
        "(1: every user slowed alike; 1/n: one user bears it all). 'vs alone': a user's average JCT over the same "
        "user's jobs run alone on the cluster (how much the other users slow them down; Themis' finish-time fairness "
        "with the whole cluster as the ideal), and Jain over that. 'Light': the other users' jobs together. "
        "'Sched': the policy's own time over the whole run.\n\n"
        + md_table(["run", "avg JCT", "makespan", "DSR", "light avg JCT", "light slowdown", "sweep avg JCT", "sweep slowdown",
                    "Jain (slowdowns)", "Jain (vs alone)", "sched"], summary)
        + "\n\nPer user, `fair_share` off | on (default), means over the seeds (DSR: met / deadline jobs, all seeds):\n\n"
        + md_table(["user", "jobs", "off: avg JCT", "off: slowdown", "off: vs alone", "off: DSR", "on: avg JCT", "on: slowdown",
                    "on: vs alone", "on: DSR"], per_user)
        + "\n\nPer seed: Jain's index over slowdowns / over JCT vs alone for each run, and off -> on (default) for the light "
        "users' JCT, the total JCT and the makespan:\n\n"
        + md_table(["seed", *RUNS, "light JCT", "avg JCT", "makespan"], seed_rows)
        + "\n\n"
        f"What it costs: the total average JCT goes from {h(off_jct)} to {h(on_jct)} ({on_jct / off_jct - 1:+.0%}): the sweep's "
        "many short jobs, which weighted SJF served first, now wait behind the other users' longer jobs while those wait, "
        "and they are most of the jobs. The makespan moves by "
        f"{mean(ON, 'makespan') / mean(OFF, 'makespan') - 1:+.1%} (the order changes, never whether a free GPU is used).\n"
    )
    print(md)
    if args.write:
        print(f"written: {write_section('fairness', md)}")


if __name__ == "__main__":
    main()
