"""Predictor benchmark (issue 4): accuracy under cross-validation, prediction latency, refit time.

    python benchmarks/bench_predictor.py            # writes docs/bench/predictor.md

Accuracy: leave-one-job-type-out on Gavel's table (../shared/data, read in place) with a constant and
a plain random forest in the same run; 5-fold CV on pair tables derived from Gavel's (one per GPU
type: co-located speed normalised by solo, written to a temporary directory, never into the repo).
Speed: latency of cached, single uncached and batched predictions; refit time after 100,000 samples.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qosflow.predict import evaluate  # noqa: E402
from qosflow.predict.predictor import Predictor  # noqa: E402
from qosflow.predict.reference import ThroughputTable, default_gavel_path, read_pairs_csv, write_pairs_csv  # noqa: E402


#: the heading of the hand-written part of docs/bench/predictor.md, which a run keeps as it is
HAND_WRITTEN = "## Verdict against the issue's targets"


def pct(x):
    return "-" if x is None else f"{100 * x:.1f} %"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} · {cpu} · {len(os.sched_getaffinity(0))} cores · Python {platform.python_version()}"


def latency(table: ThroughputTable) -> dict:
    p = Predictor(table)
    t0 = time.perf_counter()
    p.refit()
    initial_refit = time.perf_counter() - t0
    # a new job with a profile, so the models (not only table look-ups) answer
    p.observe_profile("mynet/bs32", 0.05, ref_speeds={r: 0.7 for r in evaluate.REFERENCE_JOBS},
                      ref_partner_speeds={r: 0.8 for r in evaluate.REFERENCE_JOBS})
    p.refit()
    out = {"initial_refit_s": initial_refit}
    # single uncached model predictions (first call for a configuration)
    t = []
    for g in (2, 4, 8):
        p._cache.clear()
        t0 = time.perf_counter()
        p.predict_solo_step_time("mynet/bs32", g, False)
        t.append(time.perf_counter() - t0)
    out["solo_uncached_single_ms"] = 1e3 * sum(t) / len(t)
    t = []
    for b in table.jobs[:5]:
        p._cache.clear()
        t0 = time.perf_counter()
        p.predict_slowdown("mynet/bs32", b + " ")
        t.append(time.perf_counter() - t0)
    out["slowdown_uncached_single_ms"] = 1e3 * sum(t) / len(t)
    # batched: a scheduling round asking about 2,000 configurations/pairs at once, nothing cached
    sigs = [f"newjob{i}/bs{2 ** (3 + i % 5)}" for i in range(100)]
    for s in sigs:
        p.observe({"signature": s, "gpus": 1, "step_time_s": 0.01 * (1 + hash(s) % 9)})
    p.refit()
    qs = [(s, g, c) for s in sigs for g in (2, 4, 8, 16) for c in (True, False)] + [(s, 1, True) for s in sigs] * 2
    qs = qs[:2000]
    t0 = time.perf_counter()
    p.predict_solo_step_time_batch(qs)
    out["solo_batch_2000_per_prediction_ms"] = 1e3 * (time.perf_counter() - t0) / len(qs)
    pairs = [(a, b) for a in sigs[:40] for b in sigs[40:90]][:2000]
    t0 = time.perf_counter()
    p.predict_slowdown_batch(pairs)
    out["slowdown_batch_2000_per_prediction_ms"] = 1e3 * (time.perf_counter() - t0) / len(pairs)
    # cached / look-up answers (the common case in a scheduling round)
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        p.predict_solo_step_time(sigs[i % 100], 4, False)
    out["solo_cached_ms"] = 1e3 * (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n):
        p.predict_slowdown(pairs[i % len(pairs)][0], pairs[i % len(pairs)][1])
    out["slowdown_cached_ms"] = 1e3 * (time.perf_counter() - t0) / n
    return out


def refit_100k(table: ThroughputTable | None) -> dict:
    p = Predictor(table)
    p.refit()
    rng = random.Random(0)
    sigs = [f"job{i}/bs{2 ** (i % 6 + 3)}" for i in range(200)]
    t0 = time.perf_counter()
    for _ in range(100_000):
        s = rng.choice(sigs)
        g = rng.choice([1, 1, 1, 2, 4, 8])
        co = rng.choice(sigs) if (g == 1 and rng.random() < 0.2) else None
        p.observe({"signature": s, "gpus": g, "co_runner": co, "cpu_cores": rng.choice([2, 4, 8]),
                   "step_time_s": 0.1 * (1 + hash(s) % 7) / g ** 0.8 * rng.uniform(0.9, 1.1) * (1.5 if co else 1)})
    observe_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p.refit()
    first = time.perf_counter() - t0
    res = {"samples": p.n_observed, "aggregates": len(p._stats), "observe_100k_s": observe_s, "refit_after_100k_s": first}
    for name, sample in (
        ("refit_known_config_s", {"signature": sigs[0], "gpus": 2, "step_time_s": 0.05}),
        ("refit_new_multi_gpu_config_s", {"signature": "brandnew/bs8", "gpus": 4, "step_time_s": 0.05}),
        ("refit_new_pair_s", {"signature": "brandnew/bs8", "gpus": 1, "co_runner": sigs[3], "step_time_s": 0.05}),
    ):
        p.observe(sample)
        t0 = time.perf_counter()
        p.refit()
        res[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    p.refit(full=True)
    res["refit_full_s"] = time.perf_counter() - t0
    return res


def main() -> None:
    path = default_gavel_path()
    if not path.exists():
        print(f"Gavel's table is not at {path}: nothing to benchmark on", file=sys.stderr)
        sys.exit(1)
    table = ThroughputTable.load(path)
    t0 = time.time()
    thr = evaluate.eval_throughputs(table)
    thr_s = time.time() - t0
    pairs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in table.workers:
            csv_path = Path(tmp) / f"gavel_pairs_{w}.csv"
            write_pairs_csv(table.pair_rows(w), csv_path)
            pairs[w] = evaluate.eval_pairs(read_pairs_csv(csv_path), folds=5)
    lat = latency(table)
    ref = refit_100k(table)

    s, i = thr["solo_scaling"], thr["interference"]
    lines = [
        "# Predictor benchmark (issue 4)",
        "",
        f"- machine: {machine()}",
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `python benchmarks/bench_predictor.py` (leave-one-job-type-out took {thr_s:.0f} s)",
        f"- reference jobs of the lightweight profile: {', '.join(thr['reference_jobs'])}",
        "",
        "## Leave-one-job-type-out on Gavel's throughput table",
        "",
        "The held-out job type's profile (solo 1-GPU throughput + co-located speed with the reference jobs and",
        "theirs with it, on the GPU type at hand) is all that is known about it. Solo scaling = throughput at",
        "2/4/8 GPUs, consolidated and spread, on k80/p100/v100; co-located speed = both directions with every",
        "non-reference job, 1 GPU each. Zero speeds (pairs that fail together) are excluded from MAPE",
        f"({i['n_zero_excluded']} of them).",
        "",
        "| target | method | MAPE | p90 APE | n | target |",
        "| --- | --- | ---: | ---: | ---: | --- |",
        f"| solo throughput 2/4/8 GPUs | **qosflow** | **{pct(s['mape'])}** | {pct(s['p90_ape'])} | {s['n']} | ≤ 10 % |",
    ]
    for g, b in s["by_gpus"].items():
        lines.append(f"| | qosflow at {g} GPUs | {pct(b['mape'])} | {pct(b['p90_ape'])} | {b['n']} | |")
    for pl, b in s["by_placement"].items():
        lines.append(f"| | qosflow, {pl} | {pct(b['mape'])} | {pct(b['p90_ape'])} | {b['n']} | |")
    for name, b in s["baselines"].items():
        lines.append(f"| | baseline: {name.replace('_', ' ')} | {pct(b['mape'])} | {pct(b['p90_ape'])} | {b['n']} | |")
    lines.append(f"| co-located speed | **qosflow** | **{pct(i['mape'])}** | {pct(i['p90_ape'])} | {i['n']} | ≤ 10 % |")
    for name, b in i["baselines"].items():
        lines.append(f"| | baseline: {name.replace('_', ' ')} | {pct(b['mape'])} | {pct(b['p90_ape'])} | {b['n']} | |")
    lines += [
        "",
        "## 5-fold cross-validation on co-location pair tables",
        "",
        "No pair table is shared with us; these are built from Gavel's table (one per GPU type, 351 pairs each,",
        "speed = co-located throughput / solo throughput). Target: MAPE ≤ 5 % (the issue's reference point is",
        "a plain random forest near 6 % on a public 1,388-pair table, which we do not have).",
        "",
        "| table | qosflow MAPE | p90 APE | RF one-hot MAPE | constant MAPE | n | zero speeds excluded |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w, r in pairs.items():
        b = r["interference"]
        lines.append(f"| gavel pairs {w} | **{pct(b['mape'])}** | {pct(b['p90_ape'])} | {pct(b['baselines']['random_forest']['mape'])} "
                     f"| {pct(b['baselines']['constant']['mape'])} | {b['n']} | {b['n_zero_excluded']} |")
    lines += [
        "",
        "## Speed",
        "",
        "| what | measured | target |",
        "| --- | ---: | --- |",
        f"| cached / look-up solo step time | {lat['solo_cached_ms'] * 1e3:.1f} µs | ≤ 1 ms |",
        f"| cached / look-up slowdown | {lat['slowdown_cached_ms'] * 1e3:.1f} µs | ≤ 1 ms |",
        f"| batch of 2,000 uncached solo step times (model), per prediction | {lat['solo_batch_2000_per_prediction_ms']:.3f} ms | ≤ 1 ms |",
        f"| batch of 2,000 uncached slowdowns (model), per prediction | {lat['slowdown_batch_2000_per_prediction_ms']:.3f} ms | ≤ 1 ms |",
        f"| single uncached solo step time (model, first call for a configuration) | {lat['solo_uncached_single_ms']:.2f} ms | ≤ 1 ms |",
        f"| single uncached slowdown (model, first call for a pair) | {lat['slowdown_uncached_single_ms']:.2f} ms | ≤ 1 ms |",
        f"| ingest 100,000 samples (`observe`, validated) | {ref['observe_100k_s']:.2f} s total | |",
        f"| refit after 100,000 samples ({ref['aggregates']} aggregates) | {ref['refit_after_100k_s']:.2f} s | ≤ 1 s |",
        f"| refit after a finished stage of a known configuration | {ref['refit_known_config_s'] * 1e3:.1f} ms | ≤ 1 s |",
        f"| refit after a new multi-GPU configuration | {ref['refit_new_multi_gpu_config_s']:.2f} s | ≤ 1 s |",
        f"| refit after a new co-located pair | {ref['refit_new_pair_s']:.2f} s | ≤ 1 s |",
        f"| full refit of every model (3 GPU types) at 100,000 samples | {ref['refit_full_s']:.2f} s | |",
        f"| initial fit on Gavel's table (3 GPU types) | {lat['initial_refit_s']:.2f} s | |",
        "",
    ]
    out = ROOT / "docs" / "bench" / "predictor.md"
    # the verdict below the tables is written by hand after a run: keep it (a rerun overwrote it)
    old = out.read_text() if out.exists() else ""
    hand = old[old.index(HAND_WRITTEN):] if HAND_WRITTEN in old else ""
    out.write_text("\n".join(lines) + ("\n" + hand if hand else ""))
    (ROOT / "docs" / "bench" / "predictor.json").write_text(json.dumps(
        {"throughputs": thr, "pairs": pairs, "latency": lat, "refit": ref}, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # (--help)
    main()
