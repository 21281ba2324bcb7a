"""What the predictor has learned from finished stages, per stage signature (`qosflow predict stages`).

Reads the qosflow store the worker writes to (its default estimator, `learned`): the stage history, the
duration predictions the stages were scheduled on with their outcomes, and the step-time samples. For each
signature it gives the runs, the duration the learned estimator would predict now (and on what basis), how
far the recorded predictions were off, and how many solo and shared step-time samples there are.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from qosflow.core.job import Job
from qosflow.core.qos import QoSSpec


def stage_report(store: Any, *, signature: str | None = None) -> list[dict[str, Any]]:
    """One row per stage signature with at least one completed run (all of them, or `signature`'s),
    most recently run first; then one per signature that only `qosflow profile` measured (runs 0, no
    duration predicted yet: a profile measures step times, not how many steps a run takes)."""
    from qosflow.predict.estimator import LearnedEstimator
    from qosflow.predict.predictor import Predictor

    # values read in one pass per table, not ORM instances (100k stages took minutes, mostly building those),
    # and kept as plain values (a million rows kept as objects slowed every garbage collection)
    durations: dict[str, list[float]] = defaultdict(list)
    last: dict[str, tuple] = {}  # signature -> (id, stage, gpus) of its last completed run
    for hid, sig, stage, gpus, duration_s in store.history_rows("signature", "stage", "gpus", "duration_s",
                                                                 signature=signature, state="COMPLETED"):
        if sig and duration_s and duration_s > 0:
            durations[sig].append(duration_s)
            last[sig] = (hid, stage, gpus)
    # signature -> (GPUs, GPU model, CPU cores, step time) of each sample `qosflow profile` stored
    profiled: dict[str, list[tuple]] = defaultdict(list)
    solo_n: dict[str, int] = defaultdict(int)  # signature -> samples of finished stages that ran alone
    shared: dict[str, list[str]] = defaultdict(list)  # signature -> co-runners of those that did not
    solo: list[tuple] = []  # what the estimator learns GPU speeds from (`LearnedEstimator._load_history`)
    for _id, sig, source, co_runner, step_time_s, gpus, gpu_type, placement, cores in store.sample_rows(
            "signature", "source", "co_runner", "step_time_s", "gpus", "gpu_type", "placement", "cpu_cores",
            signature=signature):
        if source == "profile":  # `qosflow profile`'s (not a shipped reference table's)
            profiled[sig].append((gpus, gpu_type, cores, step_time_s))
        elif source == "stage":
            if co_runner:
                shared[sig].append(co_runner)
            else:
                solo_n[sig] += 1
        if signature is None and co_runner is None and placement == "consolidated" and source != "reference":
            solo.append((sig, gpus, gpu_type, step_time_s))
    if not durations:
        return [_profiled_only(sig, times) for sig, times in profiled.items()]
    errors: dict[str, list[tuple[float, float]]] = defaultdict(list)
    # the stage's declared expected_duration, which the worker blends in as a prior: the store keeps no
    # declaration, but a prediction made on it alone (basis "declared", the runs before any measurement)
    # has its value. Without it the report answered from the runs alone ("history(n=3)") while the worker
    # planned with "declared+history(n=3)", though the help says the declaration is blended in.
    declared: dict[str, float] = {}
    for sig, value, basis, actual in store.duration_errors(signature):
        if sig in durations:
            if actual > 0:
                errors[sig].append((value, actual))
            if basis == "declared" and value > 0:
                declared[sig] = value  # the latest
    # when each signature last ran (its last run's time only: reading every run's was a good part of the read)
    last_at = dict(store.history_rows("created_at", ids=[hid for hid, _stage, _gpus in last.values()]))
    # what the worker would plan with now, from the same store: its durations come from the history and its
    # GPU speeds from the solo samples (`LearnedEstimator._load_history`), not from the predictor's models
    # (a job without iterations is never asked of them), so the predictor is not loaded and fitted; the solo
    # samples are those read above (of every signature: GPU speeds pool over them)
    est = LearnedEstimator(None, predictor=Predictor(None), persist=False)
    est._load_history(store, solo if signature is None else None)
    rows = []
    for sig, ds in durations.items():
        hid, stage, gpus = last[sig]
        job = Job(f"report:{sig}", 0.0, QoSSpec(gpus=gpus, cpu_cores=1.0), ds[-1], model=sig,
                  expected_duration=declared.get(sig))
        now = est.predict_duration(job)
        apes = [abs(p - a) / a for p, a in errors.get(sig, ())]
        co = shared.get(sig, [])
        rows.append({
            "signature": sig,
            "stage": stage,
            "runs": len(ds),
            "last_s": round(ds[-1], 3),
            "median_s": round(statistics.median(ds), 3),
            "last_run": last_at[hid].isoformat() if last_at.get(hid) else None,
            "predicts_s": round(now.value, 3),
            "predicts_low_s": round(now.low, 3),
            "predicts_high_s": round(now.high, 3),
            "basis": now.basis,
            "predictions_scored": len(apes),
            "mape": round(statistics.fmean(apes), 4) if apes else None,
            "last_ape": round(apes[-1], 4) if apes else None,
            "solo_samples": solo_n.get(sig, 0),
            "shared_samples": len(co),
            "co_runners": sorted(set(co)),
            "profiled_samples": len(profiled.get(sig, ())),
        })
    rows.sort(key=lambda r: r["last_run"] or "", reverse=True)
    return rows + [_profiled_only(sig, times) for sig, times in profiled.items() if sig not in durations]


def _profiled_only(sig: str, samples: list[tuple]) -> dict[str, Any]:
    """The row of a signature `qosflow profile` measured (`samples`: its samples' GPUs, GPU model, CPU cores
    and step time) and no finished stage has yet."""
    return {
        "signature": sig,
        "stage": None,
        "runs": 0,
        "last_s": None,
        "median_s": None,
        "last_run": None,
        "predicts_s": None,
        "predicts_low_s": None,
        "predicts_high_s": None,
        "basis": (f"profiled only, step time {_profiled_step_times(samples)}; the duration comes with the first "
                  "finished run or the stage's expected_duration") if samples else "profiled only",
        "predictions_scored": 0,
        "mape": None,
        "last_ape": None,
        "solo_samples": 0,
        "shared_samples": 0,
        "co_runners": [],
        "profiled_samples": len(samples),
    }


def _profiled_step_times(samples: list[tuple]) -> str:
    """'with no GPU: 0.0533 s on 1 CPU core, 0.214 s on 2 CPU cores': the median step time of each configuration
    profiled. One median over all of them (0.134 s there) mixed the core counts, which on a busy machine
    differed four times over."""
    by_config: dict[tuple, list[float]] = defaultdict(list)
    for gpus, gpu_type, cores, t in samples:
        if t and t > 0:
            by_config[(gpus or 0, gpu_type or "", cores or 0)].append(t)
    groups: dict[str, list[str]] = {}
    for (gpus, gpu_type, cores), times in sorted(by_config.items()):
        gpu = "no GPU" if not gpus else f"{gpus} GPU{'s' if gpus > 1 else ''} ({gpu_type or 'unknown model'})"
        part = f"{statistics.median(times):.3g} s"
        if cores:
            part += f" on {cores} CPU core{'s' if cores > 1 else ''}"
        if len(times) > 1:
            part += f" (median of {len(times)})"
        groups.setdefault(gpu, []).append(part)
    return "; ".join(f"with {gpu}: {', '.join(parts)}" for gpu, parts in groups.items()) or "-"
