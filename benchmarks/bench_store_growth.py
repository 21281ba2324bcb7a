"""How the predictor's store grows with the stages a cluster runs, and what `qosflow predict prune` gives back.

    python benchmarks/bench_store_growth.py            # writes docs/bench/store_growth.md
    python benchmarks/bench_store_growth.py --sizes 10000,100000 --stages 500   # a quicker run

1. The write path: `--stages` finished stages written through the store exactly as the worker's learned
   estimator writes one (`LearnedEstimator._write_stage`: record_prediction, record_outcome, record_stage
   with where it ran, add_sample), into a fresh SQLite file: bytes and rows per stage, time per stage.
2. Growth: stores of 10k / 100k / 1M finished stages (each one sample, one stage-history row, one
   prediction, one outcome; 300 signatures of uneven popularity, 1-8 GPUs, two GPU models, a tenth of
   the runs shared with another stage, 3,000 stages a week up to now), bulk-inserted (the write path
   would take hours for 1M). For each, in a fresh process as a worker starts: the time to read every
   sample and history row, the worker's start-up (`LearnedEstimator.from_store`: read + fit, reference
   table included), `qosflow predict stages` (`stage_report`), and peak memory. Then
   `Store.prune(90 days, keep 50 samples per configuration, 50 runs per group)` with VACUUM, and the
   same measurements on the pruned store. Ratios are within this one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine, md_table, write_section  # noqa: E402

STAGES_PER_WEEK = 3000
N_SIGS = 300


def _file_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))


def _checkpoint(path: str) -> None:
    import sqlite3

    c = sqlite3.connect(path)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()


# ------------------------------------------------------------------------------------ the write path


def write_path(stages: int, tmp: str) -> dict:
    from qosflow.predict.prediction import Prediction
    from qosflow.store import Store

    path = os.path.join(tmp, "writepath.db")
    rng = random.Random(1)
    with Store.open(f"sqlite:///{path}") as store:
        _checkpoint(path)
        empty = _file_bytes(path)
        before = {t: store.count(t) for t in _tables()}
        t0 = time.perf_counter()
        now = datetime.now(timezone.utc)
        for i in range(stages):
            sig, gpus, gpu_type, co = _config(rng)
            run = str(uuid.uuid4())
            dur = rng.lognormvariate(math.log(600), 0.5)
            steps = rng.randint(100, 5000)
            store.record_prediction(Prediction(dur * 1.1, dur * 0.8, dur * 1.5, 12, "declared+history(n=12)"),
                                    signature=sig, target="duration", stage_run_id=run)
            store.record_outcome(run, dur, signature=sig, target="duration")
            store.record_stage(stage_run_id=run, signature=sig, stage=sig.split("/")[0], state="COMPLETED", gpus=gpus,
                               steps=steps, duration_s=dur, step_time_s=dur / steps, flow_run_id=str(uuid.uuid4()),
                               co_runner=co, host=f"gpu-node-{rng.randint(1, 40):02d}", gpu_type=gpu_type,
                               placement="consolidated", cpu_cores=8, started_at=now - timedelta(seconds=dur),
                               finished_at=now)
            store.add_sample(signature=sig, gpus=gpus, step_time_s=dur / steps, steps=steps, source="stage",
                             stage_run_id=run, co_runner=co, gpu_type=gpu_type, placement="consolidated", cpu_cores=8)
        took = time.perf_counter() - t0
        after = {t: store.count(t) for t in _tables()}
    _checkpoint(path)
    grown = _file_bytes(path) - empty
    return {"stages": stages, "bytes_per_stage": grown / stages, "ms_per_stage": 1e3 * took / stages,
            "rows_per_stage": {t.__tablename__: (after[t] - before[t]) / stages for t in _tables()}}


def _tables():
    from qosflow.store.models import Outcome, PredictionRecord, Sample, StageHistory

    return (Sample, StageHistory, PredictionRecord, Outcome)


_SIGS: list[tuple[str, int, float]] = []


def _config(rng: random.Random) -> tuple[str, int, str, str | None]:
    """A finished stage's (signature, GPUs, GPU model, co-runner): popular signatures run more often."""
    if not _SIGS:
        r = random.Random(7)
        for k in range(N_SIGS):
            _SIGS.append((f"lab{k % 12}.pipeline{k // 12}.train_{r.choice(['resnet', 'bert', 'vit', 'gpt'])}/bs{r.choice([16, 32, 64, 128])}",
                          r.choice([1, 1, 1, 2, 4, 8]), 1.0 / (k + 1) ** 0.8))
    sig, gpus, _w = rng.choices(_SIGS, weights=[w for _s, _g, w in _SIGS])[0]
    if rng.random() < 0.2:  # the same stage on another GPU count now and then
        gpus = rng.choice([1, 2, 4, 8])
    gpu_type = "a100" if rng.random() < 0.3 else "v100"
    co = rng.choice(_SIGS)[0] if gpus == 1 and rng.random() < 0.1 else None
    return sig, gpus, gpu_type, co


# ------------------------------------------------------------------------------------ a store of N stages


def build(path: str, n: int) -> None:
    import sqlalchemy as sa

    from qosflow.store import Store
    from qosflow.store.models import Outcome, PredictionRecord, Sample, StageHistory

    rng = random.Random(n)
    now = datetime.now(timezone.utc)
    every = timedelta(weeks=1) / STAGES_PER_WEEK
    start = now - every * n
    with Store.open(f"sqlite:///{path}") as store:
        chunk = 20_000
        for lo in range(0, n, chunk):
            rows = {t: [] for t in ("s", "h", "p", "o")}
            for i in range(lo, min(n, lo + chunk)):
                sig, gpus, gpu_type, co = _config(rng)
                at = start + every * i
                run = str(uuid.uuid4())
                dur = rng.lognormvariate(math.log(600), 0.5)
                steps = rng.randint(100, 5000)
                rows["s"].append(dict(signature=sig, gpu_type=gpu_type, placement="consolidated", gpus=gpus, cross_node=False,
                                      cpu_cores=8, co_runner=co, step_time_s=dur / steps, steps=steps, source="stage",
                                      stage_run_id=run, created_at=at))
                rows["h"].append(dict(stage_run_id=run, flow_run_id=str(uuid.uuid4()), stage=sig.split("/")[0], signature=sig,
                                      state="COMPLETED" if rng.random() < 0.95 else "FAILED", gpu_type=gpu_type, gpus=gpus,
                                      placement="consolidated", host=f"gpu-node-{rng.randint(1, 40):02d}", cpu_cores=8,
                                      co_runner=co, steps=steps, started_at=at - timedelta(seconds=dur), finished_at=at,
                                      duration_s=dur, step_time_s=dur / steps, created_at=at))
                rows["p"].append(dict(stage_run_id=run, signature=sig, target="duration", value=dur * 1.1, low=dur * 0.8,
                                      high=dur * 1.5, n_samples=12, basis="declared+history(n=12)", context_json="{}",
                                      created_at=at))
                rows["o"].append(dict(stage_run_id=run, signature=sig, target="duration", actual=dur, created_at=at))
            with store.engine.begin() as conn:
                for key, model in (("s", Sample), ("h", StageHistory), ("p", PredictionRecord), ("o", Outcome)):
                    conn.execute(sa.insert(model.__table__), rows[key])
    _checkpoint(path)


def child(path: str, stages_cmd: bool = True, code: str | None = None) -> dict:
    """In a fresh process: read everything, start as the worker does, run `qosflow predict stages`.
    `code`: the checkout whose qosflow to import (another commit's, `--compare-with`), else this one's."""
    if code:
        sys.path.insert(0, code)
    from qosflow.predict.estimator import LearnedEstimator
    from qosflow.predict.stage_report import stage_report
    from qosflow.store import Store

    out = {}
    with Store.open(f"sqlite:///{path}") as store:
        t0 = time.perf_counter()
        if hasattr(store, "sample_rows"):  # rows of values, as the worker's start reads them now
            n = sum(1 for _ in store.sample_rows())
            h = len(store.history_rows(*[c.name for c in _tables()[1].__table__.c]))
        else:  # (older code: ORM instances)
            n = sum(1 for _ in store.iter_samples())
            h = len(store.stage_history())
        out["read_s"] = time.perf_counter() - t0
        out["samples"], out["history"] = n, h
        t0 = time.perf_counter()
        est = LearnedEstimator.from_store(store, persist=False)
        out["start_s"] = time.perf_counter() - t0
        out["configs"] = len(est.predictor._stats)
        out["signatures"] = len({s for s, *_ in est.predictor._stats})
        if stages_cmd:
            t0 = time.perf_counter()
            stage_report(store)
            out["stages_cmd_s"] = time.perf_counter() - t0
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def measure(path: str, stages_cmd: bool = True, code: str | None = None) -> dict:
    env = dict(os.environ)
    if code:  # another checkout reads the reference table this one reads (its own may have none beside it)
        from qosflow.paths import shared_data

        env.setdefault("QOSFLOW_SHARED_DATA", str(shared_data()))
    r = subprocess.run([sys.executable, __file__, "--child", path] + ([] if stages_cmd else ["--no-stages-cmd"])
                       + (["--code", code] if code else []), capture_output=True, text=True, check=True, env=env)
    return json.loads(r.stdout.strip().splitlines()[-1])


def growth(n: int, tmp: str, stages_cmd_max: int, base: str | None = None, base_stages_cmd_max: int = 0) -> dict:
    """`base`: a checkout of older code, measured on the same stores right after this one's."""
    from qosflow.store import Store

    path = os.path.join(tmp, f"store_{n}.db")
    t0 = time.perf_counter()
    build(path, n)
    print(f"  {n}: built in {time.perf_counter() - t0:.0f} s", flush=True)
    res = {"n": n, "bytes": _file_bytes(path), "before": measure(path, n <= stages_cmd_max)}
    print(f"  {n}: before {res['before']}", flush=True)
    if base:
        res["base_before"] = measure(path, n <= base_stages_cmd_max, base)
        print(f"  {n}: before, {base}: {res['base_before']}", flush=True)
    with Store.open(f"sqlite:///{path}") as store:
        t0 = time.perf_counter()
        rep = store.prune(timedelta(days=90), keep_samples=50, keep_runs=50, vacuum=True)
        res["prune_s"] = time.perf_counter() - t0
    res["prune"] = rep.to_dict()
    res["bytes_after"] = _file_bytes(path)
    res["after"] = measure(path, n <= stages_cmd_max)
    print(f"  {n}: pruned in {res['prune_s']:.1f} s, after {res['after']}", flush=True)
    if base:
        res["base_after"] = measure(path, n <= base_stages_cmd_max, base)
        print(f"  {n}: after, {base}: {res['base_after']}", flush=True)
    os.remove(path)
    return res


def _t(d: dict, key: str, base: dict | None = None, ratio: str = "x") -> str:
    if d.get(key) is None:
        return "-"
    if base is None or not base.get(key):
        return f"{d[key]:.2f} s"
    r = d[key] / base[key]
    return f"{d[key]:.2f} s ({ratio}{r:.1f})" if ratio == "x" else f"{d[key]:.2f} s ({r:.2f})"


def _describe(code: str) -> str:
    """A checkout as `commit abc1234`."""
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True, text=True).stdout.strip()
    return f"commit {rev}" if rev else code


def _ratio(new: dict, old: dict, key: str) -> str:
    if new.get(key) is None or old.get(key) is None:
        return "-"
    return f"{old[key]:.2f} s -> {new[key]:.2f} s (x{new[key] / old[key]:.2f})"


def report(wp: dict, runs: list[dict], empty: dict, old_code: str | None = None) -> str:
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    base = runs[0]
    lines = [
        "# The store's growth, and pruning it",
        "",
        f"Machine: {machine()}. `python benchmarks/bench_store_growth.py` (one run; compare ratios, not times across runs).",
        "",
        f"**Write path** ({wp['stages']} finished stages written as the worker writes them, fresh SQLite file): "
        f"{wp['bytes_per_stage']:.0f} bytes per stage (with indexes), rows per stage "
        + ", ".join(f"{k} {v:g}" for k, v in wp["rows_per_stage"].items())
        + f"; {wp['ms_per_stage']:.1f} ms of writes per stage (four transactions, on the worker's background thread). "
        f"At {STAGES_PER_WEEK:,} stages a week that is {wp['bytes_per_stage'] * STAGES_PER_WEEK * 52 / 2**20:.0f} MiB "
        f"and {STAGES_PER_WEEK * 52 * 4:,} rows a year, and nothing deleted them.",
        "",
        f"**Growth** (stores of N finished stages, {STAGES_PER_WEEK:,} a week up to now: 10k is {10_000 / STAGES_PER_WEEK:.1f} "
        f"weeks, 1M {1_000_000 / STAGES_PER_WEEK / 52:.1f} years; {N_SIGS} signatures). `read`: every sample and history "
        "row read (as rows of values, `Store.sample_rows` / `history_rows`); `start`: the worker's estimator built from "
        "the store (`LearnedEstimator.from_store`: read + fit, "
        f"reference table included: {empty['start_s']:.2f} s on an empty store); `predict stages`: `qosflow predict "
        "stages`' report; ratios to the smallest store. `configurations`: the "
        "predictor's sample keys (signature, GPU model, GPUs, placement, co-runner, with and without CPU cores).",
        "",
    ]
    rows = []
    for r in runs:
        b = r["before"]
        rows.append([f"{r['n']:,}", f"{mib(r['bytes'])} ({r['bytes'] / r['n']:.0f} B/stage)",
                     _t(b, "read_s", base["before"]), _t(b, "start_s", base["before"]),
                     _t(b, "stages_cmd_s", base["before"]), f"{b['peak_rss_mb']:.0f} MiB", f"{b['configs']:,}"])
    lines.append(md_table(["stages", "file", "read", "start", "predict stages", "peak memory", "configurations"], rows))
    lines += ["", "**After `qosflow predict prune --older-than 90d --vacuum`** (keep each configuration's 50 most recent "
              "samples and each group's 50 most recent runs; ratios: after / before, same store):", ""]
    rows = []
    for r in runs:
        b, a, p = r["before"], r["after"], r["prune"]
        rows.append([f"{r['n']:,}", f"{p['deleted']['sample']:,} / {p['before']['sample']:,}",
                     f"{p['deleted']['stage_history']:,} / {p['deleted']['prediction']:,} / {p['deleted']['outcome']:,}",
                     f"{r['prune_s']:.1f} s", f"{mib(r['bytes_after'])} ({r['bytes_after'] / r['bytes']:.2f})",
                     _t(a, "start_s", b, ""), _t(a, "stages_cmd_s", b, ""), f"{a['peak_rss_mb']:.0f} MiB",
                     f"{a['configs']:,} / {b['configs']:,}", f"{a['signatures']} / {b['signatures']}"])
    lines.append(md_table(["stages", "samples deleted", "history / predictions / outcomes deleted", "prune + VACUUM",
                           "file", "start", "predict stages", "peak memory", "configurations", "signatures"], rows))
    lines += ["", "The pruned store's configurations and signatures are those of the whole store (the predictor "
              "still answers for each); what remains grows with the configurations and the last 90 days, not with the years."]
    lines += ["", "**Reading the store** (since ef26e1b): the start read every sample twice as SQLAlchemy ORM "
              "instances (`Sample` objects: about half of the start at 100k stages), once for the predictor and once "
              "for the estimator's step times; `qosflow predict stages` read the samples twice more, the history twice "
              "and every prediction-outcome pair as two ORM instances, and loaded and fitted the predictor's models, "
              "which its durations never ask. Now the store hands out rows of the needed columns (SQLAlchemy Core "
              "`select`), the predictor's one pass over the samples gives the estimator its step times, and the "
              "report reads each table once and builds the estimator on a bare predictor. Same predictions and "
              "report (checked old against new on SQLite and PostgreSQL)."]
    if old_code:
        lines += ["", f"**Old ({old_code}) against new, measured in this run on the same stores** (ratio: new / old):", ""]
        rows = []
        for r in runs:
            for when, new, old in (("before prune", r["before"], r.get("base_before", {})),
                                   ("after prune", r["after"], r.get("base_after", {}))):
                rows.append([f"{r['n']:,}", when, _ratio(new, old, "read_s"), _ratio(new, old, "start_s"),
                             _ratio(new, old, "stages_cmd_s"),
                             f"{old.get('peak_rss_mb', 0):.0f} -> {new['peak_rss_mb']:.0f} MiB"])
        lines.append(md_table(["stages", "store", "read", "start", "predict stages", "peak memory"], rows))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--stages", type=int, default=2000, help="stages through the write path")
    ap.add_argument("--stages-cmd-max", type=int, default=1_000_000,
                    help="time `qosflow predict stages` on stores up to this many stages")
    ap.add_argument("--compare-with", metavar="DIR",
                    help="also measure the qosflow of this checkout (e.g. `git worktree add DIR COMMIT`) on the same "
                         "stores, and add a table of old / new times")
    ap.add_argument("--compare-stages-cmd-max", type=int, default=100_000,
                    help="with --compare-with: time its `qosflow predict stages` up to this many stages")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--code", help=argparse.SUPPRESS)
    ap.add_argument("--no-stages-cmd", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print, do not write docs/bench/store_growth.md")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, not args.no_stages_cmd, args.code)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        wp = write_path(args.stages, tmp)
        print("write path:", wp, flush=True)
        path = os.path.join(tmp, "empty.db")
        build(path, 0)
        empty = measure(path)
        print("empty store:", empty, flush=True)
        base = str(Path(args.compare_with).resolve()) if args.compare_with else None
        runs = [growth(int(n), tmp, args.stages_cmd_max, base, args.compare_stages_cmd_max) for n in args.sizes.split(",")]
    md = report(wp, runs, empty, _describe(base) if base else None)
    print(md)
    if not args.no_write:
        print("wrote", write_section("store_growth", md))


if __name__ == "__main__":
    main()
