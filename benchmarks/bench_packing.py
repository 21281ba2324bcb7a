"""Benchmark: the FGD packing experiment (USENIX ATC'23) on the Alibaba v2023 default lists.

    python benchmarks/bench_packing.py [--seeds 10] [--no-ablation] [--no-variants] [--no-churn]

10 seeds (42..51, as the authors' run scripts), policies first-fit, best-fit, FGD, qosflow (and
random as an extra fidelity point), side by side in one run. Compares the share of GPUs allocated
at 100 % arrived demand with the authors' published runs (best-fit 92.9 %, FGD 95.2 %; 443 and 296
GPUs unallocated) and qosflow with the issue-3 targets (fewer unallocated GPUs than FGD; stretch
<= 0.51 x best-fit's), and times each policy-seed run (target: < 10 s on 2 cores).

Further sections (each can be skipped):
* offline reference: how much GPU slack the shares alone leave even when packed offline (FFD);
* ablations: tie-breaking of best-fit/FGD (stock kube-scheduler random ties); qosflow without each
  of its three mechanisms;
* generalisation: derived pod lists (more shares, multi-GPU, GPU-model constraints, CPU-only
  pods; `qosflow.packing.variants`), 3 seeds each;
* churn: pods that leave (`qosflow.packing.churn`), qosflow with and without departure knowledge.

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

from qosflow.packing.churn import run_churn  # noqa: E402
from qosflow.packing.experiment import PolicySummary, arrival_sequence, run_packing  # noqa: E402
from qosflow.packing.model import PackState, nodes_from_records, pods_from_records  # noqa: E402
from qosflow.packing.policies import make_policy  # noqa: E402
from qosflow.packing.qosflow_pack import QosflowPacker  # noqa: E402
from qosflow.packing.report import write_curve_csv, write_curve_png  # noqa: E402
from qosflow.packing.variants import derive_pod_list  # noqa: E402
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
#: issue 3: stretch target, the best gain FGD reports over best-fit on any of its workloads
STRETCH_FACTOR = 0.51
#: derived lists for the generalisation section (kind, level); seed VARIANT_SEED
VARIANTS = [("gpushare", 0.6), ("gpushare", 1.0), ("multigpu", 0.3), ("multigpu", 0.5), ("gpuspec", 0.2),
            ("gpuspec", 0.33), ("cpu", 0.5), ("cpu", 2.0)]
VARIANT_SEED = 2023
ABLATIONS = {
    "qosflow": {},
    "- memory": {"memory": False},
    "- stranding": {"balance": False},
    "- availability weights": {"scarcity": False},
    "FGD measure only (all three off)": {"memory": False, "balance": False, "scarcity": False},
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(policies, seeds, pods, nodes, workload, random_ties=False, factories=None, quiet=False):
    """{label: PolicySummary}; ``factories`` maps labels to policy constructors (default: registry)."""
    cap = PackState(nodes).total_gpu_milli
    out = {name: PolicySummary(name, []) for name in policies}
    own: dict[float, WorkloadDistribution] = {}  # policies with their own target workload (qosflow: all types)
    for seed in seeds:
        seq = arrival_sequence(pods, cap, seed)
        for name in policies:
            pol = factories[name]() if factories else make_policy(name)
            pol.random_ties = random_ties
            pop = pol.workload_popularity
            if pop is not None and pop not in own:
                own[pop] = WorkloadDistribution.from_pods(pods, pop)
            wl = own[pop] if pop is not None else workload
            r = run_packing(pods, nodes, pol, seed, workload=wl, sequence=seq)
            out[name].runs.append(r)
            if not quiet:
                print(f"  {name:>9} seed {seed}: {r.at_percent(100)['alloc_ratio'] * 100:6.2f} %  ({r.seconds:.2f} s)", flush=True)
    return out


def unalloc(summary: PolicySummary) -> float:
    return summary.to_dict(100)["unallocated_gpus"]


def offline_share_slack(pods, cap_milli: int, seed: int) -> tuple[float, int, float]:
    """First-fit decreasing of the shares that arrive by 100 % (known in advance, CPU/memory ignored):
    (slack in GPUs, GPUs used, share of GPUs the shares ask for)."""
    tot = 0
    shares = []
    for i in arrival_sequence(pods, cap_milli, seed):
        p = pods[int(i)]
        tot += p.total_gpu_milli
        if tot > cap_milli:
            break
        if p.is_fractional:
            shares.append(p.gpu_milli)
    free: list[int] = []
    for x in sorted(shares, reverse=True):
        for j, f in enumerate(free):
            if f >= x:
                free[j] -= x
                break
        else:
            free.append(1000 - x)
    return sum(free) / 1000, len(free), sum(shares) / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=42)
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--no-churn", action="store_true")
    ap.add_argument("--variant-seeds", type=int, default=3)
    ap.add_argument("--churn-arrivals", type=int, default=12000)
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

    main_pols = ["first-fit", "best-fit", "fgd", "qosflow", "random"]
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
        f"- command: `python benchmarks/bench_packing.py --seeds {args.seeds}"
        + "".join(f" --{k.replace('_', '-')}" for k in ("no_ablation", "no_variants", "no_churn") if getattr(args, k))
        + "`",
        f"- data: `{pod_path.name}` ({len(pods)} pods), `{node_path.name}` ({len(nodes)} nodes, {total_gpus} GPUs), "
        f"read in {load_s:.2f} s",
        f"- experiment: seeds {seeds[0]}..{seeds[-1]}; arrivals = shuffled list, then drawn with replacement, up to "
        f"130 % of GPU capacity; headline at 100 % arrived demand; FGD target workload = {len(workload)} most "
        f"frequent pod types covering 95 % of pods (all policies); ties go to the first node of a seeded node order",
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
        elif name == "qosflow":
            pub_s, delta_s, ok, unpub = "(ours)", "–", "–", "–"
        else:
            pub_s, delta_s, ok, unpub = "not published", "–", "–", "–"
        lines.append(
            f"| {name} | {pct:.2f} ± {std:.2f} % | {pub_s} | {delta_s} | {ok} | {d['unallocated_gpus']:.0f} | {unpub} | "
            f"{d['failed_pods']:.0f} | {np.mean(secs):.2f}, {np.max(secs):.2f} |"
        )
    u_bf, u_fgd, u_q = unalloc(res["best-fit"]), unalloc(res["fgd"]), unalloc(res["qosflow"])
    per_fgd = [r.at_percent(100)["unallocated_gpus"] for r in res["fgd"].runs]
    per_q = [r.at_percent(100)["unallocated_gpus"] for r in res["qosflow"].runs]
    wins = sum(q < f for q, f in zip(per_q, per_fgd))
    stretch = STRETCH_FACTOR * u_bf
    q_secs = [r.seconds for r in res["qosflow"].runs]
    lines += [
        "",
        "### qosflow vs the issue-3 targets (same runs)",
        "",
        "| target | value | met |",
        "|---|---|---|",
        f"| fewer unallocated GPUs than FGD (mean of {len(seeds)} seeds) | {u_q:.0f} vs {u_fgd:.0f} "
        f"({u_q / u_fgd:.3f} × FGD, {u_fgd - u_q:.0f} GPUs fewer; fewer on {wins}/{len(seeds)} seeds) | "
        f"{'**yes**' if u_q < u_fgd else 'no'} |",
        f"| stretch: ≤ {STRETCH_FACTOR} × best-fit's unallocated GPUs (≤ {stretch:.0f}) | {u_q:.0f} = {u_q / u_bf:.3f} × best-fit "
        f"(FGD: {u_fgd / u_bf:.3f} ×) | {'**yes**' if u_q <= stretch else 'no'} |",
        f"| < 10 s per run | {np.mean(q_secs):.2f} s mean, {np.max(q_secs):.2f} s max (FGD "
        f"{np.mean([r.seconds for r in res['fgd'].runs]):.2f} s in the same run) | {'yes' if np.max(q_secs) < 10 else 'no'} |",
    ]
    cap_milli = PackState(nodes).total_gpu_milli
    ref = [offline_share_slack(pods, cap_milli, sd) for sd in seeds]
    slack = float(np.mean([r[0] for r in ref]))
    lines += [
        "",
        "**Offline reference.** The shares that arrive by 100 % ask for "
        f"{np.mean([r[2] for r in ref]):.0f} GPUs; packed offline by first-fit decreasing (all known in advance, "
        f"CPU and memory ignored) they still occupy {np.mean([r[1] for r in ref]):.0f} GPUs and leave **{slack:.0f} GPUs "
        f"of slack** (mean over the seeds) -- mostly the 190 milli beside each 810-milli share, which only the few "
        f"shares of <= 190 milli can use. A policy that places every pod it can cannot leave much less idle at 100 % "
        f"(unallocated = idle = the demand that failed); the stretch target ({stretch:.0f}) is below this reference.",
    ]
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
    if not args.no_ablation:
        print("ablation: qosflow without each mechanism")
        facs = {k: (lambda kw=kw: QosflowPacker(**kw)) for k, kw in ABLATIONS.items()}
        qab = run(list(ABLATIONS), seeds, pods, nodes, workload, factories=facs, quiet=True)
        lines += [
            "",
            "## Ablation: qosflow's mechanisms",
            "",
            f"Unallocated GPUs at 100 % arrived demand, mean of the same {len(seeds)} seeds (FGD: {u_fgd:.0f}, "
            f"best-fit: {u_bf:.0f}).",
            "",
            "| variant | unallocated GPUs | vs full qosflow | s / run |",
            "|---|---|---|---|",
        ]
        base = unalloc(qab["qosflow"])
        for k in ABLATIONS:
            u = unalloc(qab[k])
            secs = np.mean([r.seconds for r in qab[k].runs])
            lines.append(f"| {k} | {u:.0f} | {u - base:+.0f} | {secs:.2f} |")
    if not args.no_variants:
        vseeds = seeds[: args.variant_seeds]
        vpols = ["best-fit", "fgd", "qosflow"]
        lines += [
            "",
            "## Generalisation: derived pod lists",
            "",
            f"`qosflow.packing.variants.derive_pod_list(pods, kind, level, seed={VARIANT_SEED}, nodes)` resamples the "
            "default list (same total GPU demand): `gpushare` = share of GPU pods that are GPU-sharing, `multigpu` = share "
            "of GPU demand from multi-GPU pods, `gpuspec` = share of GPU pods accepting one GPU model only, `cpu` = CPU-only "
            f"pods scaled. Same node list, arrivals and measure; seeds {vseeds[0]}..{vseeds[-1]}; each list's own target "
            "workload. (During development the policy was checked on lists derived the same way with another seed and "
            "other arrival seeds; these runs were not used to choose it.)",
            "",
            "| list | best-fit | FGD | qosflow | qosflow / FGD | qosflow / best-fit |",
            "|---|---|---|---|---|---|",
        ]
        for kind, level in VARIANTS:
            vp = derive_pod_list(pods, kind, level, VARIANT_SEED, nodes)
            vw = WorkloadDistribution.from_pods(vp)
            print(f"variant {kind} {level}")
            vr = run(vpols, vseeds, vp, nodes, vw, quiet=True)
            b, f, q = (unalloc(vr[p]) for p in vpols)
            lines.append(f"| {kind} {level:g} ({len(vp)} pods) | {b:.0f} | {f:.0f} | {q:.0f} | {q / f:.2f} | {q / b:.2f} |")
    if not args.no_churn:
        print("churn: pods that leave")
        cseeds = seeds[:2]
        combos = [("fgd", "none"), ("qosflow", "none"), ("qosflow", "oracle"), ("qosflow", "noisy")]
        crow = {}
        for pol, kn in combos:
            runs = [run_churn(pods, nodes, pol, sd, load=1.1, arrivals=args.churn_arrivals, knowledge=kn) for sd in cseeds]
            crow[(pol, kn)] = runs
            print(f"  {pol} {kn}: rejected {np.mean([r.rejected_gpu_share for r in runs]) * 100:.2f} %", flush=True)
        lines += [
            "",
            "## Pods that leave: departure knowledge",
            "",
            f"`qosflow.packing.churn.run_churn`: the default list in time -- Poisson arrivals offering 110 % of the GPUs, "
            f"each pod with its own trace lifetime (capped at the 95th percentile), rejected if it fits nowhere; warm start "
            f"near the steady state; {args.churn_arrivals} arrivals, seeds {cseeds[0]}..{cseeds[-1]}. `oracle`: the packer "
            "is told each pod's true end time; `noisy`: the lifetime × U(0.7, 1.3).",
            "",
            "| policy | departures known | GPU demand rejected | time-averaged GPUs allocated | s / run |",
            "|---|---|---|---|---|",
        ]
        for (pol, kn), runs in crow.items():
            lines.append(
                f"| {pol} | {kn} | {np.mean([r.rejected_gpu_share for r in runs]) * 100:.2f} % | "
                f"{np.mean([r.mean_alloc for r in runs]) * 100:.2f} % | {np.mean([r.seconds for r in runs]):.1f} |"
            )
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    curves = {n: res[n] for n in ["first-fit", "best-fit", "fgd", "qosflow"]}
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
