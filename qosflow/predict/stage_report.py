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

    # values read in one pass per table, not ORM instances (100k stages took minutes, mostly building those)
    runs: dict[str, list[Any]] = defaultdict(list)
    for h in store.history_rows("signature", "stage", "gpus", "duration_s", signature=signature, state="COMPLETED"):
        if h.signature and h.duration_s and h.duration_s > 0:
            runs[h.signature].append(h)
    profiled: dict[str, list[Any]] = defaultdict(list)
    samples: dict[str, list[Any]] = defaultdict(list)  # a signature's samples of finished stages: their co-runners
    solo: list[tuple] = []  # what the estimator learns GPU speeds from (`LearnedEstimator._load_history`)
    for smp in store.sample_rows("signature", "source", "co_runner", "step_time_s", "gpus", "gpu_type", "placement",
                                 signature=signature):
        if smp.source == "profile":  # `qosflow profile`'s (not a shipped reference table's)
            profiled[smp.signature].append(smp)
        elif smp.source == "stage":
            samples[smp.signature].append(smp.co_runner)
        if signature is None and smp.co_runner is None and smp.placement == "consolidated" and smp.source != "reference":
            solo.append((smp.signature, smp.gpus, smp.gpu_type, smp.step_time_s))
    if not runs:
        return [_profiled_only(sig, smps) for sig, smps in profiled.items()]
    errors: dict[str, list[tuple[float, float]]] = defaultdict(list)
    # the stage's declared expected_duration, which the worker blends in as a prior: the store keeps no
    # declaration, but a prediction made on it alone (basis "declared", the runs before any measurement)
    # has its value. Without it the report answered from the runs alone ("history(n=3)") while the worker
    # planned with "declared+history(n=3)", though the help says the declaration is blended in.
    declared: dict[str, float] = {}
    for pred in store.duration_errors(signature):
        if pred.signature in runs and pred.actual > 0:
            errors[pred.signature].append((pred.value, pred.actual))
        if pred.signature in runs and pred.basis == "declared" and pred.value > 0:
            declared[pred.signature] = pred.value  # the latest
    # when each signature last ran (its last run's time only: reading every run's was a good part of the read)
    last_at = {r.id: r.created_at for r in store.history_rows("created_at", ids=[hs[-1].id for hs in runs.values()])}
    # what the worker would plan with now, from the same store: its durations come from the history and its
    # GPU speeds from the solo samples (`LearnedEstimator._load_history`), not from the predictor's models
    # (a job without iterations is never asked of them), so the predictor is not loaded and fitted; the solo
    # samples are those read above (of every signature: GPU speeds pool over them)
    est = LearnedEstimator(None, predictor=Predictor(None), persist=False)
    est._load_history(store, solo if signature is None else None)
    rows = []
    for sig, hs in runs.items():
        durations = [h.duration_s for h in hs]
        last = hs[-1]
        job = Job(f"report:{sig}", 0.0, QoSSpec(gpus=last.gpus, cpu_cores=1.0), durations[-1], model=sig,
                  expected_duration=declared.get(sig))
        now = est.predict_duration(job)
        apes = [abs(p - a) / a for p, a in errors.get(sig, ())]
        shared = [co for co in samples.get(sig, ()) if co]
        rows.append({
            "signature": sig,
            "stage": last.stage,
            "runs": len(hs),
            "last_s": round(durations[-1], 3),
            "median_s": round(statistics.median(durations), 3),
            "last_run": last_at[last.id].isoformat() if last_at.get(last.id) else None,
            "predicts_s": round(now.value, 3),
            "predicts_low_s": round(now.low, 3),
            "predicts_high_s": round(now.high, 3),
            "basis": now.basis,
            "predictions_scored": len(apes),
            "mape": round(statistics.fmean(apes), 4) if apes else None,
            "last_ape": round(apes[-1], 4) if apes else None,
            "solo_samples": len(samples.get(sig, ())) - len(shared),
            "shared_samples": len(shared),
            "co_runners": sorted(set(shared)),
            "profiled_samples": len(profiled.get(sig, ())),
        })
    rows.sort(key=lambda r: r["last_run"] or "", reverse=True)
    return rows + [_profiled_only(sig, smps) for sig, smps in profiled.items() if sig not in runs]


def _profiled_only(sig: str, samples: list[Any]) -> dict[str, Any]:
    """The row of a signature `qosflow profile` measured and no finished stage has yet."""
    steps = [s.step_time_s for s in samples if s.step_time_s and s.step_time_s > 0]
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
        "basis": (f"profiled only: step time {statistics.median(steps):.3g} s (median); the duration comes "
                  "with the first finished run or the stage's expected_duration") if steps else "profiled only",
        "predictions_scored": 0,
        "mape": None,
        "last_ape": None,
        "solo_samples": 0,
        "shared_samples": 0,
        "co_runners": [],
        "profiled_samples": len(samples),
    }
