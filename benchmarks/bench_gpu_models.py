"""Mixed GPU models: the Gavel traces on clusters of V100s, P100s and K80s, side by side in one run.

Jobs run at their measured speed on each model (Gavel's throughput table: a K80 runs ResNet-50 at
0.14 x a V100, its recommender at 1.4 x). The baselines place jobs without regard to the model, as in
their papers, except Gavel (OSDI'20), the heterogeneity-aware baseline (`qosflow.policies.gavel`: its
max-min fairness LP over GPU types and 360 s rounds); qosflow is shown with its GPU-model choice off
(`gpu_models=False`, what it did before) and on (the default), with exact and with +-30 % noisy estimates.

Usage: python benchmarks/bench_gpu_models.py [--quick] [--write]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, md_table, write_section  # noqa: E402

from qosflow.core.estimate import NoisyEstimator, make_estimator  # noqa: E402
from qosflow.paths import shared_data  # noqa: E402
from qosflow.policies import get_policy  # noqa: E402
from qosflow.sim.engine import SimConfig, Simulator  # noqa: E402
from qosflow.sim.interference import default_speed_model  # noqa: E402
from qosflow.sim.metrics import compute_metrics  # noqa: E402
from qosflow.sim.runner import resolve_workload  # noqa: E402

@dataclass
class _Mean:
    avg_jct: float
    dsr: float
    makespan: float


TRACES = ["ee9e8c", "6c71a0", "6214e9"]
#: V100s:P100s:K80s -- Gavel's own heterogeneous cluster has 36 of each; twice as many is less loaded
CLUSTERS = ["36:36:36", "64:64:64"]
#: qosflow's runs are repeated with the oracle off by one part per million: only how exact ties are
#: broken changes, which shows how far one run of a schedule is from the next (bench_sim.py's tie orders)
TIE_ORDERS = 3
#: the baselines qosflow is compared with ("best baseline"): gavel is the heterogeneity-aware one
BASELINES = ("fifo", "srtf", "tiresias", "gavel")
#: label -> (policy, options, estimator)
RUNS = {
    "fifo": ("fifo", {}, "oracle"),
    "srtf": ("srtf", {}, "oracle"),
    "tiresias": ("tiresias", {}, "oracle"),
    "gavel": ("gavel", {}, "oracle"),
    "qosflow, models off": ("qosflow", {"gpu_models": False}, "oracle"),
    "qosflow": ("qosflow", {}, "oracle"),
    "qosflow, noisy": ("qosflow", {}, "noisy"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one trace on one cluster")
    ap.add_argument("--write", action="store_true", help="write docs/bench/gpu_models.md")
    args = ap.parse_args()
    traces, clusters = (TRACES[:1], CLUSTERS[1:]) if args.quick else (TRACES, CLUSTERS)
    speed = default_speed_model()
    if speed.interference is None:
        sys.exit(f"Gavel's throughput table is missing under {shared_data()}: set QOSFLOW_SHARED_DATA")
    rows, ratios = [], []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for trace in traces:
        path = shared_data() / "traces" / "gavel_msr_seed0" / f"{trace}.trace"
        for cluster in clusters:
            wl, spec = resolve_workload(str(path), None, cluster, seed=0)[:2]
            got = {}
            for label, (pol, opts, est) in RUNS.items():
                ties = TIE_ORDERS if label in ("qosflow", "qosflow, models off") else 1
                runs, wall = [], 0.0
                for t in range(ties):
                    estimator = make_estimator(est, speed, seed=0) if t == 0 else NoisyEstimator(speed, error=1e-6, seed=1000 + t)
                    t0 = time.perf_counter()
                    res = Simulator(wl.jobs, spec, get_policy(pol, **opts), estimator=estimator, speed=speed,
                                    config=SimConfig(seed=0)).run()
                    wall += time.perf_counter() - t0
                    runs.append(compute_metrics(res))
                jct = [m.avg_jct / 86400 for m in runs]
                m = got[label] = _Mean(float(np.mean([m.avg_jct for m in runs])), float(np.mean([m.dsr for m in runs])),
                                       float(np.mean([m.makespan for m in runs])))
                spread = f" ({min(jct):.2f}-{max(jct):.2f})" if ties > 1 else ""
                print(f"{trace} {cluster} {label:20s} JCT {m.avg_jct / 86400:6.2f} d{spread}  DSR {m.dsr * 100:5.1f} %  "
                      f"makespan {m.makespan / 86400:6.1f} d  ({wall / ties:.1f} s per run)", flush=True)
                rows.append([trace, cluster, label + (f" ({ties} tie orders)" if ties > 1 else ""),
                             f"{m.avg_jct / 86400:.2f} d{spread}", f"{m.dsr * 100:.1f} %",
                             f"{m.makespan / 86400:.1f} d", f"{wall / ties:.1f} s"])
            on, off = got["qosflow"], got["qosflow, models off"]
            best = min(BASELINES, key=lambda k: got[k].avg_jct)
            best_dsr = max(BASELINES, key=lambda k: got[k].dsr)
            gv = got["gavel"]
            ratios.append([trace, cluster, f"{on.avg_jct / off.avg_jct:.3f}", f"{(on.dsr - off.dsr) * 100:+.1f}",
                           f"{on.makespan / off.makespan:.3f}", f"{on.avg_jct / got[best].avg_jct:.3f} ({best})",
                           f"{(on.dsr - got[best_dsr].dsr) * 100:+.1f} ({best_dsr})",
                           f"{on.avg_jct / gv.avg_jct:.3f}", f"{(on.dsr - gv.dsr) * 100:+.1f}",
                           f"{(got['qosflow, noisy'].dsr - on.dsr) * 100:+.1f}",
                           f"{got['qosflow, noisy'].avg_jct / on.avg_jct:.3f}"])
    md = "\n".join([
        "## Mixed GPU models: Gavel traces on V100 + P100 + K80 clusters",
        "",
        f"Machine: {machine()}; run started {started}. `python benchmarks/bench_gpu_models.py --write`.",
        "",
        "Jobs run at their measured speed on each GPU model (Gavel's table, relative to the V100 the",
        "traces' durations are computed on). Deadlines: seed 0, half of the jobs. qosflow: the mean of",
        f"{TIE_ORDERS} tie orders (the exact oracle and {TIE_ORDERS - 1} runs off by one part per million); the others: one run.",
        "",
        md_table(["trace", "cluster V:P:K", "run", "avg JCT (range over tie orders)", "DSR", "makespan", "wall per run"], rows),
        "",
        "qosflow (GPU-model choice on) against itself with the choice off and against the baselines, in the same",
        "run (qosflow: means over the tie orders):",
        "",
        md_table(["trace", "cluster", "JCT on/off", "DSR on-off (pts)", "makespan on/off", "JCT / best baseline",
                  "DSR - best baseline's (pts)", "JCT / gavel", "DSR - gavel (pts)",
                  "DSR noisy-oracle (pts)", "JCT noisy/oracle"], ratios),
        "",
        f"Baselines: {', '.join(BASELINES)} (one run each, exact oracle); \"best\" is the lowest JCT, or the highest DSR,",
        "among them. gavel is the only baseline that knows GPU models: docs/policies.md describes what it follows.",
    ])
    print(md)
    if args.write:
        print("wrote", write_section("gpu_models", md))


if __name__ == "__main__":
    main()
