"""Side by side: qosflow with and without its deadline checks on the estimator's error band
(`deadline_band`), on the Muri trace over deadline seeds 0, 1, 2 (docs/policies.md, "Deadline
promises on the estimator's error band").

Reproduces `bench_sim.seed_section`'s estimates (per seed the exact oracle and NOISE_DRAWS draws of
+-30 % noise, SRTF under the same kind of estimates as the reference) for any set of qosflow option
sets, two simulations at a time, with results cached in a JSON file (`--cache`) so a rerun only simulates what
is new. A result is keyed by the variant's options and a fingerprint of the code that decides a schedule
(`qosflow/core`, `policies`, `sim`, `predict`): after a change to it, everything is simulated again.

    python benchmarks/bench_deadline_band.py qosflow-noband qosflow     # labels from VARIANTS below
    python benchmarks/bench_deadline_band.py --seeds 0 express-noband express
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sim  # noqa: E402
from _common import md_table  # noqa: E402

from qosflow.core.estimate import NoisyEstimator, OracleEstimator  # noqa: E402
from qosflow.paths import shared_data  # noqa: E402
from qosflow.sim.interference import default_speed_model  # noqa: E402
from qosflow.sim.runner import resolve_workload  # noqa: E402

#: label -> (policy, options); "srtf" is the reference
VARIANTS = {
    "srtf": ("srtf", {}),
    "qosflow": ("qosflow", {}),
    "qosflow-noband": ("qosflow", {"deadline_band": False}),
    "express": ("qosflow", {"express_share": 0.125, "align": True}),
    "express-noband": ("qosflow", {"deadline_band": False, "express_share": 0.125, "align": True}),
}
SEEDS = (0, 1, 2)
NOISE_DRAWS = bench_sim.NOISE_DRAWS


def code_fingerprint() -> str:
    """A short hash of the sources a simulated schedule depends on."""
    import hashlib

    root = Path(__file__).resolve().parents[1] / "qosflow"
    h = hashlib.sha1()
    for sub in ("core", "policies", "sim", "predict"):
        for f in sorted((root / sub).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _key(label: str, seed: int, draw: int, fingerprint: str) -> str:
    return f"{fingerprint}|{label}|{json.dumps(VARIANTS[label], sort_keys=True)}|{seed}|{draw}"


def _job(args):
    label, seed, draw, fp = args  # draw -1: the exact oracle
    bench_sim.VARIANTS[label] = VARIANTS[label]
    data = shared_data() / "traces"
    wl, spec = resolve_workload(str(data / "muri_philly_trace1.csv"), "muri", str(data / "muri_cluster_n8g8.csv"), seed=seed)
    speed = default_speed_model()
    est = OracleEstimator(speed) if draw < 0 else NoisyEstimator(speed, error=0.3, seed=seed + 100 * draw)
    m, wall = bench_sim.simulate_one(wl, spec, label, est, seed=seed)
    return _key(label, seed, draw, fp), {"jct": m.avg_jct, "dsr": m.dsr, "makespan": m.makespan, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("labels", nargs="+", choices=sorted(VARIANTS))
    ap.add_argument("--cache", default="/tmp/bench_deadline_band.json")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    cache = json.loads(Path(a.cache).read_text()) if os.path.exists(a.cache) else {}
    labels = ["srtf"] + [x for x in a.labels if x != "srtf"]
    fp = code_fingerprint()
    todo = [(lab, s, d, fp) for lab in labels for s in seeds for d in range(-1, NOISE_DRAWS if lab != "srtf" else 1)
            if _key(lab, s, d, fp) not in cache]
    if todo:
        with get_context("fork").Pool(a.jobs) as pool:
            for key, val in pool.imap_unordered(_job, todo):
                cache[key] = val
                Path(a.cache).write_text(json.dumps(cache, indent=1))

    def get(lab, s, d):
        return cache[_key(lab, s, d, fp)]

    rows = []
    for lab in labels[1:]:
        per = []
        for s in seeds:
            o = get(lab, s, -1)
            z = [get(lab, s, d) for d in range(NOISE_DRAWS)]
            so, sn = get("srtf", s, -1), get("srtf", s, 0)
            zj, zd = np.mean([x["jct"] for x in z]), np.mean([x["dsr"] for x in z])
            per.append((o["dsr"], zd, (zd - o["dsr"]) * 100, zj / o["jct"] - 1, o["jct"] / so["jct"], zj / sn["jct"]))
            rows.append([lab, str(s), f"{o['dsr']:.1%}", f"{zd:.1%}", " / ".join(f"{x['dsr']:.1%}" for x in z),
                         f"{(zd - o['dsr']) * 100:+.1f}", f"{zj / o['jct'] - 1:+.1%}", f"{o['jct'] / so['jct']:.3f}", f"{zj / sn['jct']:.3f}"])
        v = np.array(per)
        rows.append([f"**{lab}**", "mean", f"{v[:, 0].mean():.1%}", f"{v[:, 1].mean():.1%}", "", f"{v[:, 2].mean():+.1f}",
                     f"{v[:, 3].mean():+.1%}", f"{v[:, 4].mean():.3f}", f"{v[:, 5].mean():.3f}"])
    print(md_table(["variant", "seed", "DSR oracle", "DSR noisy (mean)", "noisy draws", "DSR lost (pts)", "JCT lost",
                    "JCT / SRTF oracle", "JCT / SRTF noisy"], rows))


if __name__ == "__main__":
    main()
