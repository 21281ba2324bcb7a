"""Solo scaling: throughput at n GPUs (consolidated on one node, or spread) relative to 1 GPU.

The target is the ratio thr(n, placement) / thr(1) on a GPU type -- a scaling efficiency times n --
which transfers between job types far better than raw throughputs. Features of a (job, GPU type,
n, placement) row:

* log2 n, consolidated flag;
* the typical log-ratio of this (GPU type, n, placement) over the training jobs (a per-hardware prior,
  which is what the constant baseline predicts);
* the job's lightweight profile: log solo 1-GPU step time, co-located speed with the reference jobs
  and theirs with it (compute-bound vs memory-bound jobs scale differently);
* log batch size, and the ratio its family sibling at the nearest batch size reached on the same
  hardware (with the distance in log batch size), when a sibling has been measured;
* the ratio the job would reach with its siblings' per-step synchronisation overhead on top of its own
  1-GPU step time (`_sibling_overhead`): the overhead depends on the model, not the batch size.

Extra-trees on log ratio; the spread over trees is the interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from qosflow.predict.forest import flatten, per_tree_predictions
from qosflow.predict.interference import JobMeta, _nan_to


@dataclass(frozen=True)
class ScalingRow:
    job: str
    gpu_type: str
    gpus: int
    consolidated: bool
    ratio: float  # thr(n) / thr(1), > 0


class ScalingModel:
    def __init__(self, refs: Sequence[str] = (), *, n_estimators: int = 200, seed: int = 0, n_jobs: int = 1,
                 new_family_model: bool = True):
        self.refs = list(refs)
        self.n_estimators, self.seed, self.n_jobs = n_estimators, seed, n_jobs
        self.new_family_model = new_family_model

    def _prior(self, gpu_type: str, gpus: int, consolidated: bool) -> float:
        v = self.hw_prior.get((gpu_type, gpus, consolidated))
        if v is not None:
            return v
        # unseen hardware or GPU count: ideal scaling discounted like the average seen
        return math.log(gpus) + self.mean_log_eff + (0.0 if consolidated else self.spread_penalty)

    def _family_points(self, job: str, row: tuple[str, int, bool], value, exclude: str | None = None):
        """(log2 batch size, value(sibling meta, sibling ratio)) for the job's family siblings measured on
        the same hardware (never the job itself), and the job's own log2 batch size."""
        m = self.meta.get(job)
        if m is None:
            return [], 0.0
        pts = []
        for sib, ratio in self.by_hw.get(row, {}).items():
            if sib == job or sib == exclude:
                continue
            ms = self.meta.get(sib)
            if ms is None or ms.family != m.family:
                continue
            v = value(ms, ratio)
            if v is not None:
                pts.append((math.log2(ms.batch_size or 1), v))
        return pts, math.log2(m.batch_size or 1)

    @staticmethod
    def _interpolate(pts: list[tuple[float, float]], x: float) -> tuple[float, float]:
        """The value at x, linear between the nearest smaller and larger points (else the nearest one;
        the mean of the points at x itself), and the distance to the nearest point."""
        if not pts:
            return float("nan"), float("nan")
        lo = [p for p in pts if p[0] < x]
        hi = [p for p in pts if p[0] > x]
        same = [v for bx, v in pts if bx == x]
        dist = min(abs(bx - x) for bx, _ in pts)
        if same:
            return float(np.mean(same)), 0.0
        if lo and hi:
            (x0, y0), (x1, y1) = max(lo), min(hi)
            t = (x - x0) / (x1 - x0)
            return (1 - t) * y0 + t * y1, dist
        nearest = min(pts, key=lambda p: abs(p[0] - x))
        return nearest[1], dist

    def _sibling(self, job: str, row: tuple[str, int, bool], exclude: str | None = None) -> tuple[float, float]:
        """log ratio of the job's family siblings on the same hardware, interpolated in log batch size
        between the nearest smaller and larger batch sizes (else the nearest one); and the distance."""
        pts, x = self._family_points(job, row, lambda _ms, ratio: math.log(ratio), exclude)
        return self._interpolate(pts, x)

    def _sibling_overhead(self, job: str, row: tuple[str, int, bool], exclude: str | None = None) -> float:
        """log of the ratio the job would reach if it paid its siblings' per-step overhead.

        With the per-GPU batch fixed, a step on n GPUs takes t1 + c_n (1-GPU step time plus the
        synchronisation overhead), so ratio = n t1 / (t1 + c_n). c_n depends on the model (its gradient
        volume) and the hardware, not the batch size, so a sibling's c_n = t1' (n / ratio' - 1)
        transfers to the job through its own t1 (known from the profile): a larger batch hides the same
        overhead behind more compute. Interpolated in log batch size like `_sibling`; t1 + c_n is kept
        >= t1 / 5 (measured super-linear ratios make c_n negative)."""
        m = self.meta.get(job)
        if m is None or m.log_solo is None:
            return float("nan")
        n = row[1]

        def overhead(ms: JobMeta, ratio: float):
            return None if ms.log_solo is None else math.exp(ms.log_solo) * (n / ratio - 1)

        pts, x = self._family_points(job, row, overhead, exclude)
        if not pts:
            return float("nan")
        c, _dist = self._interpolate(pts, x)
        t1 = math.exp(m.log_solo)
        return math.log(n * t1 / max(t1 + c, 0.2 * t1))

    def _features(self, job: str, gpu_type: str, gpus: int, consolidated: bool, profile: Mapping[str, float] | None,
                  exclude: str | None = None) -> tuple[list[float], list[float]]:
        """A row's features in two parts: those every job has, and those from its family's measured
        siblings (`_sibling` value and distance, `_sibling_overhead`), which a job of a family nobody
        measured lacks (NaN)."""
        m = self.meta.get(job)
        prof = profile or {}
        f = [math.log2(gpus), float(consolidated), self._prior(gpu_type, gpus, consolidated)]
        f.append(m.log_solo if m and m.log_solo is not None else float("nan"))
        for r in self.refs:
            f.append(prof.get(f"with:{r}", float("nan")))
            f.append(prof.get(f"of:{r}", float("nan")))
        f.append(math.log2(m.batch_size) if m and m.batch_size else -1.0)
        row = (gpu_type, gpus, consolidated)
        return f, [*self._sibling(job, row, exclude), self._sibling_overhead(job, row, exclude)]

    def fit(self, rows: Sequence[ScalingRow], meta: Mapping[str, JobMeta], profiles: Mapping[str, Mapping[str, float]]):
        self.meta = dict(meta)
        self.profiles = dict(profiles)
        rows = [r for r in rows if r.ratio > 0 and r.gpus >= 1]
        self.by_hw: dict[tuple[str, int, bool], dict[str, float]] = {}
        for r in rows:
            self.by_hw.setdefault((r.gpu_type, r.gpus, r.consolidated), {})[r.job] = r.ratio
        self.hw_prior = {k: float(np.median(np.log(list(v.values())))) for k, v in self.by_hw.items()}
        effs = [math.log(r.ratio) - math.log(r.gpus) for r in rows if r.gpus > 1]
        self.mean_log_eff = float(np.mean(effs)) if effs else math.log(0.85)
        cons = [math.log(r.ratio) for r in rows if r.consolidated and r.gpus > 1]
        spread = [math.log(r.ratio) for r in rows if not r.consolidated and r.gpus > 1]
        self.spread_penalty = float(np.mean(spread) - np.mean(cons)) if cons and spread else math.log(1 / 1.2)
        # the features of a training row must not see the row's own job (the sibling look-up skips it
        # already, and the hardware prior is a median over many jobs)
        parts = [self._features(r.job, r.gpu_type, r.gpus, r.consolidated, self.profiles.get(r.job)) for r in rows]
        y = [math.log(r.ratio) for r in rows]
        self.n_train = len(rows)
        if not rows:
            from qosflow.errors import NotEnoughData

            raise NotEnoughData("no multi-GPU measurement to train the scaling model on")
        self.forest = self._fit_forest([base + sib for base, sib in parts], y)
        # a job of a family nobody measured has no sibling features, while in training every job of a
        # family with several batch sizes has them: its queries go to a forest fitted without them
        self.forest_new_family = self._fit_forest([base for base, _sib in parts], y) if self.new_family_model else None
        return self

    def _fit_forest(self, X: list, y: list[float]):
        from sklearn.ensemble import ExtraTreesRegressor

        forest = ExtraTreesRegressor(
            n_estimators=self.n_estimators, max_features=0.7, min_samples_leaf=1, random_state=self.seed, n_jobs=self.n_jobs
        ).fit(_nan_to(np.array(X)), np.array(y))
        flatten(forest)
        return forest

    def predict(self, queries: Sequence[tuple[str, str, int, bool]], *, profiles: Mapping[str, Mapping[str, float]] | None = None,
                extra_meta: Mapping[str, JobMeta] | None = None):
        """(ratio, low, high) arrays for (job, gpu_type, gpus, consolidated) queries."""
        if extra_meta:
            self.meta.update(extra_meta)
        profs = dict(self.profiles)
        profs.update(profiles or {})
        parts = [self._features(j, g, n, c, profs.get(j)) for j, g, n, c in queries]
        nb = len(parts[0][0]) if parts else 0  # where the sibling features start
        F = np.array([base + sib for base, sib in parts], dtype=float).reshape(len(queries), -1)
        new = ~np.isfinite(F[:, nb:]).any(axis=1) if self.forest_new_family is not None else np.zeros(len(F), bool)
        X = _nan_to(F)
        per_tree = per_tree_predictions(self.forest, X) if not new.all() else np.zeros((self.n_estimators, len(F)))
        if new.any():
            per_tree[:, new] = per_tree_predictions(self.forest_new_family, X[new][:, :nb])
        mean = np.exp(per_tree.mean(0))
        lo, hi = np.exp(np.percentile(per_tree, [10, 90], axis=0))
        # one GPU is the unit by definition
        one = np.array([n == 1 and c for _, _, n, c in queries])
        mean[one], lo[one], hi[one] = 1.0, 1.0, 1.0
        return mean, np.minimum(lo, mean), np.maximum(hi, mean)
