"""Cross-validation of the predictor on reference tables (`qosflow predict eval`).

* `eval_throughputs`: leave-one-job-type-out on a Gavel-style table. The held-out type's lightweight
  profile -- its solo 1-GPU throughput and its co-located speed with the (at most three) reference jobs,
  and theirs with it, on the GPU type at hand -- is all that is known about it; its throughput at
  2/4/8 GPUs (consolidated and spread) and its co-located speed with every other job (both ways) are
  predicted. Baselines in the same run: a constant (the training median per GPU type, GPU count and
  placement; for pairs, the training median speed) and a plain random forest on the profile.
* `eval_pairs`: k-fold cross-validation over the rows of a co-location table; baseline: a plain random
  forest on one-hot model names, batch sizes and GPU counts.

Zero speeds (pairs that could not run together, e.g. out of memory) have no relative error; they are
left out of the MAPE and counted in ``n_zero_excluded``. Empty speed cells of a pair table (not measured)
are neither trained on nor scored; ``n_missing_excluded`` counts them.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from qosflow.errors import NotEnoughData, TraceFormatError
from qosflow.predict.interference import InterferenceModel, JobMeta
from qosflow.predict.reference import PairRow, ThroughputTable, parse_signature
from qosflow.predict.scaling import ScalingModel, ScalingRow

#: The fixed reference jobs of a job's lightweight profile (docs/predictor.md says why these three):
#: one per distinct bottleneck -- a convolutional net (compute), a recurrent language model (memory
#: bandwidth, small kernels) and a recommendation model (embedding look-ups, CPU/PCIe) -- each at the
#: middle batch size of its family in Gavel's table.
REFERENCE_JOBS = ("ResNet-50 (batch size 64)", "LM (batch size 20)", "Recommendation (batch size 2048)")


def choose_references(jobs: Sequence[str], k: int = 3) -> list[str]:
    """`REFERENCE_JOBS` when the table has them; otherwise the same rule applied to the table: the k
    families with the most batch sizes (ties by name), each at its middle batch size."""
    if all(r in jobs for r in REFERENCE_JOBS):
        return list(REFERENCE_JOBS)[:k]
    fams: dict[str, list[tuple[int, str]]] = {}
    for j in jobs:
        f, bs = parse_signature(j)
        fams.setdefault(f, []).append((bs or 0, j))
    ranked = sorted(fams.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:k]
    out = []
    for _f, members in ranked:
        members.sort()
        out.append(members[(len(members) - 1) // 2][1])
    return out


def _errors(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    return np.abs(np.asarray(pred) - np.asarray(true)) / np.asarray(true)


def summarise(err: Sequence[float], **extra) -> dict:
    e = np.asarray(err, dtype=float)
    if len(e) == 0:
        return {"mape": None, "p90_ape": None, "n": 0, **extra}
    return {"mape": float(e.mean()), "p90_ape": float(np.percentile(e, 90)), "n": int(len(e)), **extra}


def _meta(table: ThroughputTable, worker: str) -> dict[str, JobMeta]:
    solo1 = table.solo[(worker, True, 1)]
    out = {}
    for j in table.jobs:
        f, bs = parse_signature(j)
        t = solo1[table.index[j]]
        out[j] = JobMeta(family=f, batch_size=bs, gpus=1, log_solo=-math.log(t) if t > 0 else None)
    return out


def _profile(table: ThroughputTable, worker: str, job: str, refs: Sequence[str]) -> dict[str, float]:
    M = table.pair_speed[worker]
    i = table.index[job]
    p = {}
    for r in refs:
        p[f"with:{r}"] = float(M[i, table.index[r]])
        p[f"of:{r}"] = float(M[table.index[r], i])
    return p


def _profile_vec(table: ThroughputTable, worker: str, job: str, refs: Sequence[str]) -> list[float]:
    p = _profile(table, worker, job, refs)
    solo = table.solo[(worker, True, 1)][table.index[job]]
    return [p[f"with:{r}"] for r in refs] + [p[f"of:{r}"] for r in refs] + [math.log(solo) if solo > 0 else -9.0]


# ------------------------------------------------------------------------------------ interference


def eval_throughputs_interference(table: ThroughputTable, refs: Sequence[str], *, seed: int = 0,
                                  progress: Callable[[], None] | None = None) -> dict:
    from sklearn.ensemble import RandomForestRegressor

    err = {"qosflow": [], "constant": [], "random_forest": []}
    zeros = 0
    untrained: list[str] = []
    for w in table.workers:
        M = table.pair_speed.get(w)
        if M is None:
            continue
        meta = _meta(table, w)
        for A in table.jobs:
            if progress:
                progress()
            ia = table.index[A]
            fold_refs = [r for r in refs if r != A]
            train = [j for j in table.jobs if j != A]
            obs = {(a, b): float(M[table.index[a], table.index[b]]) for a in train for b in train
                   if not np.isnan(M[table.index[a], table.index[b]])}
            prof_obs = {}
            for r in fold_refs:
                ir = table.index[r]
                prof_obs[(A, r)] = float(M[ia, ir])
                prof_obs[(r, A)] = float(M[ir, ia])
            queries, truth = [], []
            for B in train + [A]:
                if B in fold_refs:
                    continue
                ib = table.index[B]
                for q, y in (((A, B), M[ia, ib]), ((B, A), M[ib, ia])):
                    if B == A and q == (B, A) and queries and queries[-1] == (A, A):
                        continue
                    if np.isnan(y):
                        continue
                    if y <= 0:
                        zeros += 1
                        continue
                    queries.append(q)
                    truth.append(float(y))
            if not queries:
                continue
            try:
                model = InterferenceModel(fold_refs, regime="new_job", seed=seed).fit(obs, meta)
            except NotEnoughData:
                untrained.append(A)  # e.g. the other types are all reference jobs: nothing to learn from
                continue
            truth = np.array(truth)
            p, _lo, _hi, _s = model.predict(queries, extra_obs=prof_obs)
            err["qosflow"] += list(_errors(p, truth))
            pos = [v for v in obs.values() if v > 0]
            err["constant"] += list(_errors(np.full(len(truth), np.median(pos)), truth))
            # plain random forest on the two profiles
            P = {j: _profile_vec(table, w, j, fold_refs) for j in table.jobs}
            Xtr = [P[a] + P[b] for (a, b), v in obs.items() if v > 0]
            ytr = [v for v in obs.values() if v > 0]
            rf = RandomForestRegressor(n_estimators=100, random_state=seed, n_jobs=1).fit(Xtr, ytr)
            err["random_forest"] += list(_errors(rf.predict([P[a] + P[b] for a, b in queries]), truth))
    block = summarise(err["qosflow"], n_zero_excluded=zeros, untrained_folds=untrained)
    block["baselines"] = {k: summarise(v) for k, v in err.items() if k != "qosflow"}
    return block


# ------------------------------------------------------------------------------------ solo scaling


def eval_throughputs_scaling(table: ThroughputTable, refs: Sequence[str], *, seed: int = 0,
                             progress: Callable[[], None] | None = None) -> dict:
    from sklearn.ensemble import RandomForestRegressor

    rows_all: list[ScalingRow] = []
    for (w, cons, n), arr in table.solo.items():
        if n == 1:
            continue  # 1 GPU is the profile itself (spread at 1 GPU is the same measurement)
        base = table.solo.get((w, True, 1))
        if base is None:
            continue
        for j in table.jobs:
            i = table.index[j]
            t, b = arr[i], base[i]
            if np.isnan(t) or np.isnan(b) or t <= 0 or b <= 0:
                continue
            rows_all.append(ScalingRow(j, w, n, cons, float(t / b)))
    workers = sorted({r.gpu_type for r in rows_all})
    err = {"qosflow": [], "constant": [], "random_forest": []}
    by_gpus: dict[int, list[float]] = {}
    by_place: dict[str, list[float]] = {}
    untrained: list[str] = []
    for A in table.jobs:
        test = [r for r in rows_all if r.job == A]
        if not test:
            continue
        if progress:
            progress()
        train = [r for r in rows_all if r.job != A]
        fold_refs = [r for r in refs if r != A]
        # the profile is per GPU type: key jobs as (job@gpu_type) so each row sees its own hardware's profile
        metas, profs = {}, {}
        for w in workers:
            m = _meta(table, w)
            for j in table.jobs:
                metas[f"{j}@{w}"] = m[j]
                profs[f"{j}@{w}"] = _profile(table, w, j, fold_refs) if w in table.pair_speed else {}
        tr = [ScalingRow(f"{r.job}@{r.gpu_type}", r.gpu_type, r.gpus, r.consolidated, r.ratio) for r in train]
        try:
            model = ScalingModel(fold_refs, seed=seed).fit(tr, metas, profs)
        except NotEnoughData:
            untrained.append(A)  # no other job type has a multi-GPU measurement: nothing to learn from
            continue
        q = [(f"{r.job}@{r.gpu_type}", r.gpu_type, r.gpus, r.consolidated) for r in test]
        truth = np.array([r.ratio for r in test])
        p, _lo, _hi = model.predict(q)
        e = _errors(p, truth)
        err["qosflow"] += list(e)
        for r, ei in zip(test, e):
            by_gpus.setdefault(r.gpus, []).append(ei)
            by_place.setdefault("consolidated" if r.consolidated else "spread", []).append(ei)
        # constant: the training median ratio for this (GPU type, GPUs, placement)
        const = []
        for r in test:
            vals = [t.ratio for t in train if (t.gpu_type, t.gpus, t.consolidated) == (r.gpu_type, r.gpus, r.consolidated)]
            const.append(np.median(vals) if vals else r.gpus)
        err["constant"] += list(_errors(np.array(const), truth))

        def rf_x(r):
            onehot = [float(r.gpu_type == w) for w in workers]
            return [r.gpus, float(r.consolidated)] + onehot + _profile_vec(table, r.gpu_type, r.job, fold_refs)

        rf = RandomForestRegressor(n_estimators=100, random_state=seed, n_jobs=1).fit(
            [rf_x(r) for r in train], [r.ratio for r in train])
        err["random_forest"] += list(_errors(rf.predict([rf_x(r) for r in test]), truth))
    block = summarise(err["qosflow"], untrained_folds=untrained)
    block["by_gpus"] = {str(k): summarise(v) for k, v in sorted(by_gpus.items())}
    block["by_placement"] = {k: summarise(v) for k, v in sorted(by_place.items())}
    block["baselines"] = {k: summarise(v) for k, v in err.items() if k != "qosflow"}
    return block


def eval_throughputs(table: ThroughputTable, *, refs: Sequence[str] | None = None, seed: int = 0,
                     progress: Callable[[], None] | None = None) -> dict:
    refs = list(refs) if refs is not None else choose_references(table.jobs)
    scaling = eval_throughputs_scaling(table, refs, seed=seed, progress=progress)
    interference = eval_throughputs_interference(table, refs, seed=seed, progress=progress)
    n = scaling["n"] + interference["n"]
    # a block with no targets (e.g. a table with 1-GPU entries only: no solo scaling) has mape None
    pooled = sum((b["mape"] or 0.0) * b["n"] for b in (scaling, interference)) / n if n else None
    return {
        "method": "leave-one-job-type-out",
        "source": table.source,
        "reference_jobs": refs,
        "mape": pooled,
        "p90_ape": max(scaling["p90_ape"] or 0, interference["p90_ape"] or 0) if n else None,
        "n": n,
        "solo_scaling": scaling,
        "interference": interference,
    }


# ------------------------------------------------------------------------------------ pair tables


def _pair_meta(rows: Sequence[PairRow]) -> dict[str, JobMeta]:
    meta = {}
    for r in rows:
        meta[r.key1] = JobMeta(r.model1, r.batchsize1 or None, r.gpu_num1)
        meta[r.key2] = JobMeta(r.model2, r.batchsize2 or None, r.gpu_num2)
    return meta


def eval_pairs(rows: Sequence[PairRow], *, folds: int = 5, seed: int = 0,
               progress: Callable[[], None] | None = None, source: str = "", exact_match: bool = True) -> dict:
    """k-fold CV over the rows. With `exact_match` (the default), a test direction whose configuration
    (model names, batch sizes, GPU counts, direction) the training fold also holds is answered from those
    measurements blended with the model (`InterferenceModel.fit(repeats=...)`); False: the model alone."""
    from sklearn.ensemble import RandomForestRegressor

    if folds < 2:
        raise ValueError("folds must be >= 2")
    usable = sum(1 for r in rows if r.speed1 > 0 or r.speed2 > 0)  # NaN (not measured) compares False
    if usable < 2 * folds:
        raise TraceFormatError(source or "pair table", None,
                               f"{usable} row(s) with a measured speed > 0; {folds}-fold cross-validation needs at "
                               f"least {2 * folds}: give a larger table or fewer folds (--folds)")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(rows))
    meta = _pair_meta(rows)
    models = sorted({r.model1 for r in rows} | {r.model2 for r in rows})

    def directed(sub):
        out = []
        for r in sub:
            for a, b, v in ((r.key1, r.key2, r.speed1), (r.key2, r.key1, r.speed2)):
                if not math.isnan(v):  # an empty speed cell: not measured
                    out.append((a, b, v, r))
        return out

    missing = sum(math.isnan(r.speed1) + math.isnan(r.speed2) for r in rows)

    def rf_x(a, b):
        ma, mb = meta[a], meta[b]
        return ([float(ma.family == m) for m in models] + [ma.batch_size or 0, ma.gpus]
                + [float(mb.family == m) for m in models] + [mb.batch_size or 0, mb.gpus])

    err = {"qosflow": [], "random_forest": [], "constant": []}
    zeros = 0
    exact = {"queries": 0, "k_per_fold": []}  # test directions whose configuration the training fold holds
    for fold in np.array_split(order, folds):
        if progress:
            progress()
        test_idx = set(fold.tolist())
        train = [rows[i] for i in range(len(rows)) if i not in test_idx]
        test = [rows[i] for i in sorted(test_idx)]
        obs: dict[tuple[str, str], float] = {}
        for a, b, v, _r in directed(train):
            obs.setdefault((a, b), [])  # type: ignore[arg-type]
            obs[(a, b)].append(v)  # type: ignore[union-attr]
        # every training measurement of each directed configuration, for the exact-match look-up; a row
        # pairing a configuration with itself measures it once (the mean of its two sides), not twice
        repeats: dict[tuple[str, str], list[float]] = {}
        for r in train:
            sides = [(a, b, v) for a, b, v in ((r.key1, r.key2, r.speed1), (r.key2, r.key1, r.speed2))
                     if not math.isnan(v) and v > 0]
            if r.key1 == r.key2 and sides:
                sides = [(r.key1, r.key2, float(np.mean([v for _a, _b, v in sides])))]
            for a, b, v in sides:
                repeats.setdefault((a, b), []).append(v)
        obs = {k: float(np.mean(v)) for k, v in obs.items()}  # type: ignore[arg-type]
        q = [(a, b) for a, b, v, _r in directed(test) if v > 0]
        truth = np.array([v for a, b, v, _r in directed(test) if v > 0])
        zeros += sum(1 for a, b, v, _r in directed(test) if v <= 0)
        if not q or not any(v > 0 for v in obs.values()):
            continue  # nothing to score, or nothing to learn from (only on a tiny table)
        model = InterferenceModel(regime="new_pair", seed=seed).fit(
            obs, meta, repeats=repeats if exact_match else None)  # type: ignore[arg-type]
        p, _lo, _hi, _s = model.predict(q)
        err["qosflow"] += list(_errors(p, truth))
        exact["queries"] += sum(1 for x in q if x in model._exact)
        exact["k_per_fold"].append(None if model.exact_k is None or math.isinf(model.exact_k) else model.exact_k)
        dtr = [(a, b, v) for a, b, v, _r in directed(train)]
        rf = RandomForestRegressor(n_estimators=100, random_state=seed, n_jobs=1).fit(
            [rf_x(a, b) for a, b, _v in dtr], [v for _a, _b, v in dtr])
        err["random_forest"] += list(_errors(rf.predict([rf_x(a, b) for a, b in q]), truth))
        pos = [v for _a, _b, v in dtr if v > 0]
        err["constant"] += list(_errors(np.full(len(truth), np.median(pos)), truth))
    block = summarise(err["qosflow"], n_zero_excluded=zeros, n_missing_excluded=missing, folds=folds, rows=len(rows),
                      exact_match=exact)
    block["baselines"] = {k: summarise(v) for k, v in err.items() if k != "qosflow"}
    return {"method": f"{folds}-fold cross-validation over rows", "source": source, "mape": block["mape"],
            "p90_ape": block["p90_ape"], "n": block["n"], "interference": block}
