"""Benchmark: the FGD packing experiment (USENIX ATC'23) on the Alibaba v2023 default lists.

    python benchmarks/bench_packing.py [--seeds 10] [--no-ablation]

10 seeds (42..51, as the authors' run scripts), policies first-fit, best-fit, FGD (and random as
an extra fidelity point). Compares the share of GPUs allocated at 100 % arrived demand with the
authors' published runs (best-fit 92.9 %, FGD 95.2 %; 443 and 296 GPUs unallocated), and times
each policy-seed run (target: < 10 s on 2 cores; their Go simulator takes ~10 min per run).
An ablation reruns best-fit and FGD with stock kube-scheduler random tie-breaking.

Writes docs/bench/packing.md (+ packing_curve.png / .csv next to it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qosflow.packing.experiment import PolicySummary, arrival_sequence, run_packing  # noqa: E402
from qosflow.packing.model import PackState, nodes_from_records, pods_from_records  # noqa: E402
from qosflow.packing.policies import make_policy  # noqa: E402
from qosflow.packing.report import write_curve_csv, write_curve_png  # noqa: E402
from qosflow.packing.workload import WorkloadDistribution  # noqa: E402
from qosflow.sim.traces.alibaba import default_node_list, default_pod_list, load_nodes, load_pods  # noqa: E402

#: the FGD authors' published results on the default openb list, 10 seeds, 100 % arrived demand
PUBLISHED = {
    "best-fit": {"alloc_pct": 92.9, "unallocated_gpus": 443, "source": "FGD paper / artifact expected_results"},
    "fgd": {"alloc_pct": 95.2, "unallocated_gpus": 296, "source": "FGD paper / artifact expected_results"},
}
#: not a published headline: read from the artifact's expected_results/analysis_allo_discrete.csv,
#: column 100, openb_pod_list_default, 01-Random, seeds 42 and 43 only (86.17, 86.79)
RANDOM_HINT = 86.5
TOLERANCE = 1.5  # points


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(policies, seeds, pods, nodes, workload, random_ties=False):
    cap = PackState(nodes).total_gpu_milli
    out = {name: PolicySummary(name, []) for name in policies}
    for seed in seeds:
        seq = arrival_sequence(pods, cap, seed)
        for name in policies:
            pol = make_policy(name)
            pol.random_ties = random_ties
            r = run_packing(pods, nodes, pol, seed, workload=workload, sequence=seq)
            out[name].runs.append(r)
            print(f"  {name:>9} seed {seed}: {r.at_percent(100)['alloc_ratio'] * 100:6.2f} %  ({r.seconds:.2f} s)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=42)
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "packing.md")
    args = ap.parse_args()

    pod_path, node_path = default_pod_list(), default_node_list()
    if not (pod_path.is_file() and node_path.is_file()):
        print(f"shared Alibaba trace not found ({pod_path}); nothing to benchmark", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    pods = pods_from_records(load_pods(pod_path))
    nodes = nodes_from_records(load_nodes(node_path))
    load_s = time.perf_counter() - t0
    workload = WorkloadDistribution.from_pods(pods)
    total_gpus = PackState(nodes).total_gpus
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    print(f"{len(pods)} pods, {len(nodes)} nodes, {total_gpus} GPUs; {len(workload)} typical pod types; seeds {seeds}")

    main_pols = ["first-fit", "best-fit", "fgd", "random"]
    t_all = time.perf_counter()
    res = run(main_pols, seeds, pods, nodes, workload)
    wall = time.perf_counter() - t_all
    abl = None
    if not args.no_ablation:
        print("ablation: random tie-breaking (stock kube-scheduler)")
        abl = run(["best-fit", "fgd"], seeds, pods, nodes, workload, random_ties=True)

    lines = []
    now = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    u = platform.uname()
    lines += [
        "# Packing benchmark: FGD experiment on the Alibaba v2023 lists",
        "",
        f"- date: {now}",
        f"- machine: {u.system} {u.release} {u.machine}; CPU: {cpu_name()}; "
        f"{len(__import__('os').sched_getaffinity(0))} usable cores",
        f"- Python {platform.python_version()}, numpy {np.__version__}",
        f"- command: `python benchmarks/bench_packing.py --seeds {args.seeds}`",
        f"- data: `{pod_path.name}` ({len(pods)} pods), `{node_path.name}` ({len(nodes)} nodes, {total_gpus} GPUs), "
        f"read in {load_s:.2f} s",
        f"- experiment: seeds {seeds[0]}..{seeds[-1]}; arrivals = shuffled list, then drawn with replacement, up to "
        f"130 % of GPU capacity; headline at 100 % arrived demand; FGD target workload = {len(workload)} most "
        f"frequent pod types covering 95 % of pods; ties go to the first node of a seeded node order",
        "",
        "## Allocation at 100 % arrived demand vs the published runs",
        "",
        "| policy | GPUs allocated (mean ± std) | published | Δ (points) | within 1.5 | unallocated GPUs | published | "
        "failed pods ≤100 % | s / run (mean, max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in main_pols:
        d = res[name].to_dict(100)
        pct, std = d["alloc_ratio"] * 100, d["alloc_ratio_std"] * 100
        secs = [r.seconds for r in res[name].runs]
        pub = PUBLISHED.get(name)
        if pub:
            delta = pct - pub["alloc_pct"]
            pub_s, delta_s = f"{pub['alloc_pct']:.1f} %", f"{delta:+.2f}"
            ok = "yes" if abs(delta) <= TOLERANCE else "**no**"
            unpub = str(pub["unallocated_gpus"])
        elif name == "random":
            pub_s, delta_s, ok, unpub = f"≈{RANDOM_HINT:.1f} % (2 seeds)", f"{pct - RANDOM_HINT:+.2f}", "(hint)", "–"
        else:
            pub_s, delta_s, ok, unpub = "not published", "–", "–", "–"
        lines.append(
            f"| {name} | {pct:.2f} ± {std:.2f} % | {pub_s} | {delta_s} | {ok} | {d['unallocated_gpus']:.0f} | {unpub} | "
            f"{d['failed_pods']:.0f} | {np.mean(secs):.2f}, {np.max(secs):.2f} |"
        )
    lines += [
        "",
        f"All {len(main_pols)} × {len(seeds)} runs took {wall:.1f} s in total. Target: < 10 s per policy and seed "
        "(the authors' Go simulator: ~10 min per run on 2 vCPUs).",
        "",
        "Per seed (GPUs allocated at 100 % arrived, %):",
        "",
        "| seed | " + " | ".join(main_pols) + " |",
        "|---|" + "---|" * len(main_pols),
    ]
    for i, seed in enumerate(seeds):
        vals = [res[n].runs[i].at_percent(100)["alloc_ratio"] * 100 for n in main_pols]
        lines.append(f"| {seed} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    if abl is not None:
        lines += [
            "",
            "## Ablation: tie-breaking",
            "",
            "Scores are integers, so many nodes tie. The reference simulator breaks ties by a fixed, seeded node order "
            "(it prefixes node names with a seeded permutation; its patched kube-scheduler takes the first best node). "
            "With stock kube-scheduler behaviour (uniformly random among the tied nodes, per decision):",
            "",
            "| policy | node-order ties (default) | random ties | published |",
            "|---|---|---|---|",
        ]
        for name in ["best-fit", "fgd"]:
            a = res[name].to_dict(100)["alloc_ratio"] * 100
            b = abl[name].to_dict(100)["alloc_ratio"] * 100
            lines.append(f"| {name} | {a:.2f} % | {b:.2f} % | {PUBLISHED[name]['alloc_pct']:.1f} % |")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    curves = {n: res[n] for n in ["first-fit", "best-fit", "fgd"]}
    write_curve_csv(out.with_name("packing_curve.csv"), curves)
    write_curve_png(out.with_name("packing_curve.png"), curves,
                    title=f"Alibaba v2023 openb default list: GPU allocation vs arrived demand ({len(seeds)} seeds)")
    lines += [
        "",
        f"Curve (mean over seeds): `{out.with_name('packing_curve.csv').name}`, `{out.with_name('packing_curve.png').name}`.",
        "",
    ]
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
