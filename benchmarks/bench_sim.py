"""Simulator benchmarks for issues 2 and 3, side by side in one run.

* Fidelity (issue 2): the baselines on `muri_philly_trace1.csv` with `muri_cluster_n8g8.csv`,
  against Muri's public simulator (Tiresias `dlas-gpu` 3,330,371 s, SRTF `shortest` 1,370,603 s
  average JCT; target: within 30 %), and the wall time of one policy over the whole trace
  (target: < 5 s).
* qosflow's policy (issue 3): the same run with `qosflow` next to every baseline -- average JCT
  against the best baseline and Tiresias, DSR against the best baseline, makespan against FIFO;
  sensitivity to +-30 % estimate errors and to Philly-like failures; the Gavel traces on their own
  cluster spec and on a loaded 64-GPU cluster.

Usage: python benchmarks/bench_sim.py [--quick] [--write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, md_table, write_section  # noqa: E402

from qosflow.core.estimate import NoisyEstimator, OracleEstimator, make_estimator  # noqa: E402
from qosflow.paths import shared_data  # noqa: E402
from qosflow.policies import get_policy  # noqa: E402
from qosflow.sim.engine import SimConfig, Simulator  # noqa: E402
from qosflow.sim.interference import default_speed_model  # noqa: E402
from qosflow.sim.metrics import compute_bounds, compute_metrics  # noqa: E402
from qosflow.sim.runner import resolve_workload  # noqa: E402

BASELINES = ["fifo", "sjf", "srtf", "tiresias", "sjf-ffs", "sjf-bsbf", "genie"]
REF = {"tiresias": 3_330_371.0, "srtf": 1_370_603.0}
#: the most loaded 2,000-job Gavel traces when run on 64 GPUs
LOADED_GAVEL = ["6214e9", "6c71a0", "ee9e8c"]
#: qosflow with options, shown next to its default: label -> (policy, options)
VARIANTS = {"qosflow+express": ("qosflow", {"express_share": 0.125})}
QOSFLOW = ["qosflow", "qosflow+express"]


def make_policy(label):
    name, opts = VARIANTS.get(label, (label, {}))
    return get_policy(name, **opts)


def simulate_one(wl, spec, name, est, *, seed=0, failures=0.0):
    """One policy (or VARIANTS label) over the workload with estimator `est`: (metrics, wall seconds)."""
    t0 = time.perf_counter()
    res = Simulator(wl.jobs, spec, make_policy(name), estimator=est, speed=est.speed, config=SimConfig(seed=seed, failure_share=failures)).run()
    wall = time.perf_counter() - t0
    m = compute_metrics(res)
    print(f"  {name:15s} {est.name:13s} seed={seed} fail={failures:.1f} jct={m.avg_jct:12.0f}s dsr={m.dsr:.3f} "
          f"makespan={m.makespan:11.0f}s wall={wall:5.1f}s", flush=True)
    return m, wall


def run(wl, spec, names, *, estimator="oracle", failures=0.0, seed=0):
    speed = default_speed_model()
    return {name: simulate_one(wl, spec, name, make_estimator(estimator, speed, seed=seed), seed=seed, failures=failures) for name in names}


def days(x):
    return f"{x / 86400:.2f} d"


def baselines(res):
    """The baselines' metrics in a `run` result (qosflow's runs left out), and the one with the lowest
    average JCT."""
    base = {n: m for n, (m, _) in res.items() if n not in QOSFLOW}
    return base, min(base.values(), key=lambda m: m.avg_jct)


def tie_runs(wl, spec, name, exact, *, seed=0):
    """`exact` (the exact oracle's metrics) and `TIE_ORDERS - 1` runs of `name` with the oracle off by
    `TIE_ERROR`: only how exact ties are broken changes."""
    speed = default_speed_model()
    return [exact] + [simulate_one(wl, spec, name, NoisyEstimator(speed, error=TIE_ERROR, seed=1000 + t), seed=seed)[0]
                      for t in range(TIE_ORDERS - 1)]


def verdicts(res, bounds, which="qosflow"):
    base, best_jct = baselines(res)
    q = res[which][0]
    best_dsr = max(base.values(), key=lambda m: m.dsr)
    fifo = base.get("fifo")
    tir = base.get("tiresias")
    rows = [
        ["avg JCT / best baseline", f"{q.avg_jct / best_jct.avg_jct:.3f} (best: {best_jct.policy})", "<= 0.85", "met" if q.avg_jct <= 0.85 * best_jct.avg_jct else "MISSED"],
    ]
    nonpre = [m for n, m in base.items() if not get_policy(n).preemptive]
    if nonpre and best_jct.policy not in {m.policy for m in nonpre}:
        # context, not a target: qosflow does not preempt, so the best baseline that does not either
        best_np = min(nonpre, key=lambda m: m.avg_jct)
        rows.append(["avg JCT / best non-preemptive baseline", f"{q.avg_jct / best_np.avg_jct:.3f} (best: {best_np.policy}; {best_jct.policy} / it: {best_jct.avg_jct / best_np.avg_jct:.3f})", "(context)", ""])
    if tir:
        rows.append(["avg JCT / Tiresias", f"{q.avg_jct / tir.avg_jct:.3f}", "<= 0.67 (stretch 0.25-0.4)", "met" if q.avg_jct <= 0.67 * tir.avg_jct else "MISSED"])
    dsr_ok = q.dsr >= best_dsr.dsr + 0.10 or q.dsr >= bounds.dsr - 0.02
    rows.append(["DSR", f"{q.dsr:.3f} vs {best_dsr.dsr:.3f} ({best_dsr.policy}); feasible bound {bounds.dsr:.3f}", "best + 0.10, or bound - 0.02", "met" if dsr_ok else "MISSED"])
    if fifo:
        loaded = fifo.makespan > 1.02 * bounds.makespan
        if loaded and 0.75 * fifo.makespan >= bounds.span:
            rows.append(["makespan / FIFO", f"{q.makespan / fifo.makespan:.3f}", "<= 0.75", "met" if q.makespan <= 0.75 * fifo.makespan else "MISSED"])
        elif loaded:
            # 0.75 x FIFO is shorter than the last arrival plus its own duration: no schedule reaches
            # it, so the trace's makespan is set by that job, and the light-trace target applies
            rows.append([f"makespan / last arrival + its duration (0.75 x FIFO = {0.75 * fifo.makespan / bounds.span:.2f} x that: out of reach)",
                         f"{q.makespan / bounds.span:.3f}", "<= 1.02", "met" if q.makespan <= 1.02 * bounds.span else "MISSED"])
        else:
            rows.append(["makespan / bound (light trace)", f"{q.makespan / bounds.makespan:.3f}", "<= 1.02", "met" if q.makespan <= 1.02 * bounds.makespan else "MISSED"])
    return rows


#: noise draws per deadline seed (the estimator's error is drawn per job from these seeds)
NOISE_DRAWS = 3
#: an oracle whose estimates are off by one part per million: it changes nothing but how exact ties
#: (identical jobs) are broken, which shows how far one run of the policy is from the next
TIE_ERROR = 1e-6
#: tie orders per deadline seed, the exact oracle's included
TIE_ORDERS = 3
#: the estimate kinds of the seed section's rows
TIES_KIND = f"oracle, {TIE_ORDERS} tie orders"
NOISY_KIND = f"noisy, {NOISE_DRAWS} draws"


def tie_rows(wl, spec, res):
    """Context rows: qosflow over `TIE_ORDERS` tie orders (the exact oracle's run in `res` and
    `TIE_ORDERS - 1` more), since one run of a chaotic schedule can flatter or wrong it."""
    runs = tie_runs(wl, spec, "qosflow", res["qosflow"][0])
    _base, best_jct = baselines(res)
    jct = [m.avg_jct / best_jct.avg_jct for m in runs]
    dsr = [m.dsr for m in runs]
    label = f"over {TIE_ORDERS} tie orders: mean (range)"
    return [
        [f"avg JCT / best baseline, {label}", f"{np.mean(jct):.3f} ({min(jct):.3f}-{max(jct):.3f})", "(context)", ""],
        [f"DSR, {label}", f"{np.mean(dsr):.3f} ({min(dsr):.3f}-{max(dsr):.3f})", "(context)", ""],
    ]


def seed_section(data, seeds=(0, 1, 2)):
    """The deadlines (which jobs get one, and how tight) are drawn per seed; a single seed can flatter
    or wrong a policy. Per seed: the exact oracle, the oracle with ties broken differently
    (`TIE_ERROR`), and `NOISE_DRAWS` draws of +-30 % noise. Mean and worst case over seeds."""
    acc: dict[tuple[str, str], list] = {}
    for seed in seeds:
        wl, spec = resolve_workload(str(data / "muri_philly_trace1.csv"), "muri", str(data / "muri_cluster_n8g8.csv"), seed=seed)
        speed = default_speed_model()
        s_o = simulate_one(wl, spec, "srtf", OracleEstimator(speed), seed=seed)[0]
        s_n = simulate_one(wl, spec, "srtf", NoisyEstimator(speed, error=0.3, seed=seed), seed=seed)[0]
        for n in QOSFLOW:
            exact = simulate_one(wl, spec, n, OracleEstimator(speed), seed=seed)[0]
            ties = tie_runs(wl, spec, n, exact, seed=seed)
            noisy = [simulate_one(wl, spec, n, NoisyEstimator(speed, error=0.3, seed=seed + 100 * t), seed=seed)[0] for t in range(NOISE_DRAWS)]
            for kind, ms, base in (("oracle", [exact], s_o), (TIES_KIND, ties, s_o), (NOISY_KIND, noisy, s_n)):
                jct, dsr = np.mean([m.avg_jct for m in ms]), np.mean([m.dsr for m in ms])
                acc.setdefault((n, kind), []).append((jct / base.avg_jct, dsr, base.dsr, jct, dsr, max(m.avg_jct for m in ms) / min(m.avg_jct for m in ms) - 1))
    rows = []
    for (n, kind), v in acc.items():
        v = np.array(v)
        rows.append([n, kind, f"{v[:, 0].mean():.3f}", f"{v[:, 0].max():.3f}", f"{v[:, 1].mean():.1%}", f"{v[:, 2].mean():.1%}",
                     f"{(v[:, 1] - v[:, 2]).mean() * 100:+.1f}", f"{v[:, 5].mean():.1%}" if len(v) and v[:, 5].max() > 0 else ""])
    loss_rows = []
    for n in QOSFLOW:
        z = np.array(acc[(n, NOISY_KIND)])
        for ref in ("oracle", TIES_KIND):
            o = np.array(acc[(n, ref)])
            jl, dl = (z[:, 3] / o[:, 3]).mean() - 1, (z[:, 4] - o[:, 4]).mean() * 100
            loss_rows.append([n, ref, f"{jl:+.1%}", f"{dl:+.1f}", "met" if jl <= 0.10 and dl >= -5 else "MISSED"])
    return (
        f"### Muri trace1 over deadline seeds {', '.join(map(str, seeds))}\n\n"
        "Each seed draws which jobs get a deadline and how tight (lambda in [1.2, 3]); SRTF (preemptive, the best "
        "baseline) runs with the same kind of estimates. Per seed, qosflow runs with the exact oracle, with the oracle "
        f"off by {TIE_ERROR:g} (nothing changes but how exact ties between identical jobs are broken: {TIE_ORDERS - 1} more tie "
        f"orders), and with {NOISE_DRAWS} draws of +-30 % noise; values are means over the runs of a seed, then over "
        "seeds. 'spread' is the largest over the smallest average JCT among a seed's runs. Targets: JCT <= 0.85 x SRTF, "
        "DSR >= SRTF + 10 points; noisy: at most 10 % JCT and 5 DSR points lost against the oracle.\n\n"
        + md_table(["policy", "estimates", "JCT / SRTF mean", "JCT / SRTF worst", "DSR mean", "SRTF DSR mean", "DSR - SRTF (pts)", "spread"], rows)
        + "\n\nLost to +-30 % noise (mean over seeds of noisy mean / oracle mean), against the exact oracle and against "
        f"the oracle over {TIE_ORDERS} tie orders:\n\n"
        + md_table(["policy", "against", "JCT", "DSR (pts)", "target"], loss_rows)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="Muri trace only")
    ap.add_argument("--write", action="store_true", help="write docs/bench/sim.md")
    a = ap.parse_args()
    data = shared_data() / "traces"
    names = BASELINES + QOSFLOW
    parts = [f"## Scheduling simulator (issues 2 and 3)\n\nMachine: {machine()}\n"]

    print("Muri trace1 on n8g8, oracle estimates")
    wl, spec = resolve_workload(str(data / "muri_philly_trace1.csv"), "muri", str(data / "muri_cluster_n8g8.csv"))
    bounds = compute_bounds(wl.jobs, spec)
    res = run(wl, spec, names)
    rows = []
    for n, (m, wall) in res.items():
        ref = REF.get(n)
        rows.append([n, days(m.avg_jct), f"{m.avg_jct:,.0f}", f"{ref:,.0f}" if ref else "", f"{m.avg_jct / ref - 1:+.1%}" if ref else "",
                     days(m.p99_jct), days(m.makespan), f"{m.dsr:.1%}", f"{m.gpu_util:.1%}", f"{m.shared_share:.0%}", f"{wall:.1f}"])
    rows.append(["bound", days(bounds.avg_jct), f"{bounds.avg_jct:,.0f}", "", "", "", days(bounds.makespan), f"{bounds.dsr:.1%}", "", "", ""])
    parts.append(
        f"### Muri `muri_philly_trace1.csv` on `muri_cluster_n8g8.csv` ({len(wl.jobs)} jobs, 64 GPUs), oracle estimates\n\n"
        "Reference: Muri's public simulator (which reproduces its 64-GPU testbed within about 3 %): Tiresias 3,330,371 s, "
        "SRTF 1,370,603 s. Target: baselines within 30 %; one policy over the whole trace in < 5 s. "
        "The bound row's makespan counts the total work at one job per GPU: policies that share GPUs can beat it.\n\n"
        + md_table(["policy", "avg JCT", "avg JCT (s)", "reference (s)", "vs reference", "p99 JCT", "makespan", "DSR", "GPU alloc", "GPU-time shared", "wall (s)"], rows)
        + "\n\nqosflow against the targets of issue 3 (same run):\n\n"
        + md_table(["measure", "value", "target", ""], verdicts(res, bounds))
        + "\n\n`qosflow+express` (`--set qosflow.express_share=0.125`: one node of eight kept for short and urgent jobs while deadline jobs keep arriving) "
        "against the same targets:\n\n"
        + md_table(["measure", "value", "target", ""], verdicts(res, bounds, "qosflow+express"))
    )

    print("Muri trace1: sensitivity (noisy +-30 %, failures 30 %)")
    sens_rows = []
    sens_names = ["srtf", "sjf-bsbf", "genie"] + QOSFLOW
    noisy = run(wl, spec, sens_names, estimator="noisy")
    fail_o = run(wl, spec, names, failures=0.3)
    fail_n = run(wl, spec, sens_names, estimator="noisy", failures=0.3)
    for n in sens_names:
        o, z, fo, fz = res[n][0], noisy[n][0], fail_o[n][0], fail_n[n][0]
        sens_rows.append([n, days(o.avg_jct), days(z.avg_jct), f"{z.avg_jct / o.avg_jct - 1:+.1%}", f"{o.dsr:.1%}", f"{z.dsr:.1%}",
                          f"{(z.dsr - o.dsr) * 100:+.1f}", days(fo.avg_jct), f"{fo.dsr:.1%}", days(fz.avg_jct), f"{fz.dsr:.1%}"])
    q_o, q_z = res["qosflow"][0], noisy["qosflow"][0]
    x_o, x_z = res["qosflow+express"][0], noisy["qosflow+express"][0]
    parts.append(
        "### Sensitivity on the Muri trace: estimate errors and failures\n\n"
        "Noisy: every job's duration and pair slowdowns off by a seeded factor in [0.7, 1.3]. Failures: 30 % of jobs fail "
        "part-way (1-3 times, 30 % infrastructure), losing half their progress since the attempt began, as in Philly.\n"
        "Target (issue 3): with +-30 % error at most 5 DSR points and 10 % average JCT lost against the oracle "
        f"-- qosflow: {(q_z.dsr - q_o.dsr) * 100:+.1f} points, {q_z.avg_jct / q_o.avg_jct - 1:+.1%} JCT: "
        f"{'met' if (q_o.dsr - q_z.dsr) <= 0.05 and q_z.avg_jct <= 1.10 * q_o.avg_jct else 'MISSED'}; "
        f"qosflow+express: {(x_z.dsr - x_o.dsr) * 100:+.1f} points, {x_z.avg_jct / x_o.avg_jct - 1:+.1%} JCT: "
        f"{'met' if (x_o.dsr - x_z.dsr) <= 0.05 and x_z.avg_jct <= 1.10 * x_o.avg_jct else 'MISSED'}.\n\n"
        + md_table(["policy", "JCT oracle", "JCT noisy", "delta", "DSR oracle", "DSR noisy", "delta (pts)", "JCT failures", "DSR failures", "JCT noisy+failures", "DSR noisy+failures"], sens_rows)
        + "\n\nWith failures (oracle estimates), qosflow against the baselines of that run:\n\n"
        + md_table(["measure", "value", "target", ""], verdicts(fail_o, compute_bounds(wl.jobs, spec)))
    )

    print("Muri trace1: three deadline seeds, oracle and noisy")
    parts.append(seed_section(data))

    if a.write:
        write_section("sim", "\n\n".join(parts) + "\n\n(Gavel sections still running.)")
    if not a.quick:
        gdir = data / "gavel_msr_seed0"
        traces = sorted(gdir.glob("*.trace"))
        print(f"Gavel traces on their cluster spec ({gdir / 'cluster_specs.json'})")
        rows = []
        for tr in traces:
            wl, spec = resolve_workload(str(tr), "gavel", str(gdir / "cluster_specs.json"))
            b = compute_bounds(wl.jobs, spec)
            r = run(wl, spec, ["fifo", "srtf", "sjf-bsbf", "qosflow"])
            q, f, s = r["qosflow"][0], r["fifo"][0], r["srtf"][0]
            rows.append([tr.stem, len(wl.jobs), f"{f.gpu_util:.1%}", days(s.avg_jct), days(q.avg_jct), days(b.avg_jct), days(q.makespan), days(b.makespan),
                         f"{q.makespan / b.makespan:.3f}", f"{s.dsr:.1%}", f"{q.dsr:.1%}"])
        parts.append(
            f"### Gavel traces on their own cluster spec ({spec.num_gpus} GPUs)\n\n"
            "These traces barely load that cluster, so scheduling hardly matters; the target is a makespan within 2 % "
            "of its bound (last arrival plus its duration, or the work over the GPUs).\n\n"
            + md_table(["trace", "jobs", "FIFO GPU alloc", "SRTF JCT", "qosflow JCT", "JCT bound", "qosflow makespan", "makespan bound", "ratio", "SRTF DSR", "qosflow DSR"], rows)
        )
        print("Gavel traces on a loaded 8x8 cluster")
        rows = []
        for tr in [gdir / f"{t}.trace" for t in LOADED_GAVEL]:
            wl, spec = resolve_workload(str(tr), "gavel", "8x8")
            b = compute_bounds(wl.jobs, spec)
            r = run(wl, spec, ["fifo", "sjf", "srtf", "tiresias", "sjf-bsbf", "genie", "qosflow"])
            for row in verdicts(r, b):
                rows.append([tr.stem] + row)
            rows += [[tr.stem] + row for row in tie_rows(wl, spec, r)]
        parts.append(
            "### Three 2,000-job Gavel traces on a loaded 8x8 cluster (64 GPUs)\n\n"
            "Baselines in the run: FIFO, SJF, SRTF, Tiresias, SJF-BSBF, GENIE (the others are dominated on the Muri trace; "
            "the full set would not fit the benchmark's time budget on this 2-core machine). The verdicts are on the exact "
            f"oracle's run; the context rows add {TIE_ORDERS - 1} runs with the oracle off by {TIE_ERROR:g} (only how exact "
            "ties are broken changes), since one run of qosflow's schedule on these traces can be far from the next.\n\n"
            + md_table(["trace", "measure", "value", "target", ""], rows)
        )
    text = "\n\n".join(parts)
    print(text)
    if a.write:
        print("wrote", write_section("sim", text))


if __name__ == "__main__":
    main()
