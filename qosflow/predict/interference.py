"""Speed of a job when it shares its GPUs with a given partner (normalised to running alone).

One model serves three settings:

* a new job type seen only through its lightweight profile (its speed with <= 3 reference jobs,
  and theirs with it) -- leave-one-job-type-out on Gavel's table, and the live worker's cold start;
* a new pair of known jobs -- k-fold cross-validation on a co-location table;
* the live predictor, where every finished co-located stage adds an observation.

Everything known is a set of observations K = {(a, b): speed of a next to b}. For a query (a, b)
the features are (all computed from K only):

1. a low-rank factorisation of log-speed, log s(a,b) ~ mu + a_a + b_b + u_a . v_b (ALS, ridge), in
   which a job with only its profile observations is "folded in" through those few entries;
2. the profile: s(a, r), s(r, a), s(b, r), s(r, b) for each reference job r;
3. family neighbours: the speed of the same family at the nearest batch size next to b (and of a next
   to b's nearest sibling) -- a model's behaviour changes smoothly with batch size;
4. job metadata: log batch size, GPUs, log solo step time when known, same-family flag;
5. only for ``regime="new_pair"`` (known jobs, many observations each): nearest neighbours -- s(a', b)
   for the jobs a' whose logged speeds next to the partners both have seen are closest to a's after
   removing a constant offset (a' runs uniformly faster or slower), shifted by that offset; likewise
   s(a, b') over the columns; 1 and 3 neighbours -- and low-rank fits of higher rank (4 and 6);
6. only for ``regime="new_pair"``: family estimates (`_family_estimates`) -- s(a, b) from the known
   speeds of a next to b's family siblings b' (and of a's siblings next to b): by analogy (s(a, b') times
   the typical ratio of column b to column b'), from the rows nearest to a over b's family only, their
   plain mean, and a weighted line in log batch size;
7. only for ``regime="new_pair"``: block estimates (`_block_estimates`) -- over the block of a's family
   next to b's family (the cell excluded): its mean, a two-way additive estimate (block mean + row effect
   + column effect) and the RMS the additive fit leaves (how erratic the block is); and the other
   direction of the pair -- the low-rank and nearest-neighbour estimates of s(b, a), hidden with s(a, b)
   (a row of a pair table holds both) but slowed by the same contention;
8. only for ``regime="new_pair"``: a stacked estimate (`_Stack`) -- a ridge regression of log speed on
   the cell's log-speed estimates (1, 5 and 6; a missing one replaced by the rank-6 fit, with a 0/1
   column saying so), fitted on the training rows; the trees combine the estimates piecewise, and a
   linear combination is what they approximate worst from a few hundred rows;
9. only for ``regime="new_pair"``: the one-hot forest's estimate (`_OneHotForest`) -- a random forest of
   log speed on both jobs' one-hot model names (families), log batch sizes and GPUs, which pools every
   configuration of a model (on a table of many configurations measured in few rows each, the cell-level
   estimates above are sparse and noisy, and this pooling is what wins). For the training rows it is
   out of fold (one forest per group of inner folds, fitted without the pairs they hide); it is a tree
   feature and one more input of the stacked estimate. The final point is also blended with it in log
   space, (1 - w) * trees + w * one-hot, w from `ONEHOT_W` chosen per fit by the MAPE of out-of-fold
   points over the training rows (`_nested_oof`: the inner folds in `OOF_SPLITS` groups; for each group a
   whole smaller model -- its own out-of-fold features, one-hot forests, stacked estimate, `OOF_TREES`
   trees -- fitted without the pairs the group hides, predicting them; the same points serve the
   exact-match weight below); Gavel-derived tables pick w = 0-0.1, tables where the one-hot forest is
   strong more.

An extra-trees ensemble maps these to log speed; the spread of its trees gives the interval. To
train it in the regime it will be used in, the features of training pairs are computed out of fold:
with the training job's own observations hidden except its profile (``regime="new_job"``), or with
the pair itself hidden (``regime="new_pair"``).

The point estimate is the mean of the trees' log speeds (``point="mean"``, the default for
``new_job``, which the live predictor uses) or the value minimising the expected absolute percentage
error over the trees' predictions -- their median weighted by 1/speed (``point="mape"``, the default
for ``new_pair``, which is scored by MAPE).

Exact matches (``regime="new_pair"`` only, when `fit` is given ``repeats``): a pair table may hold the
same configuration several times (repeated measurements, or rows differing only in columns the model
ignores, such as AMP or GPU type). A query whose directed configuration has n > 0 measured speeds among
the training rows is answered by blending, in log space, their mean with the model:
(n * mean log v + k * log model) / (n + k). The weight k is chosen at fit time by leave-one-out over the
training configurations measured at least twice (each value held out in turn, predicted from the mean of
the others and the out-of-fold model point of `_nested_oof`, whose model never saw the configuration); k = inf (model only) wins when repeats disagree
systematically (e.g. AMP on/off). Without repeated configurations in the training set nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from qosflow.predict.forest import flatten, per_tree_predictions

Key = str
Obs = Mapping[tuple[Key, Key], float]

LOG_FLOOR = math.log(0.02)  # speeds below 2 % are "barely runs"; keep logs finite


@dataclass(frozen=True)
class JobMeta:
    family: str
    batch_size: float | None = None
    gpus: int = 1
    log_solo: float | None = None  # log solo step time (or -log throughput) on the GPU type at hand


def _log(x: float) -> float:
    return max(math.log(x), LOG_FLOOR) if x > 0 else LOG_FLOOR


def _ridge_by_group(group: np.ndarray, feats: np.ndarray, target: np.ndarray, n: int, reg: np.ndarray) -> np.ndarray:
    """For every group g < n: the ridge solution of [feats, 1] @ w ~ target over the rows of g
    (normal equations summed per group with bincount, then one batched solve)."""
    X = np.hstack([feats, np.ones((len(feats), 1))])
    d = X.shape[1]
    A = np.empty((n, d, d))
    for p in range(d):
        for q in range(p, d):
            A[:, p, q] = A[:, q, p] = np.bincount(group, weights=X[:, p] * X[:, q], minlength=n)
    b = np.stack([np.bincount(group, weights=X[:, p] * target, minlength=n) for p in range(d)], axis=1)
    return np.linalg.solve(A + reg, b[..., None])[..., 0]


class LowRank:
    """log s(a, b) ~ mu + bias_row[a] + bias_col[b] + U[a] . V[b], fitted by alternating ridge regressions."""

    def __init__(self, rank: int = 2, lam: float = 0.3, iters: int = 15, seed: int = 0):
        self.rank, self.lam, self.iters, self.seed = rank, lam, iters, seed

    def fit(self, obs: Obs) -> "LowRank":
        keys = sorted({k for ab in obs for k in ab})
        self.index = {k: i for i, k in enumerate(keys)}
        n, r = len(keys), self.rank
        ii = np.array([self.index[a] for a, _ in obs], dtype=int)
        jj = np.array([self.index[b] for _, b in obs], dtype=int)
        y = np.array([_log(v) for v in obs.values()])
        self.mu = float(y.mean()) if len(y) else 0.0
        rng = np.random.default_rng(self.seed)
        U = rng.normal(0, 0.1, (n, r))
        V = rng.normal(0, 0.1, (n, r))
        ba = np.zeros(n)
        bb = np.zeros(n)
        has_row = np.bincount(ii, minlength=n) > 0
        has_col = np.bincount(jj, minlength=n) > 0
        reg = self.lam * np.eye(r + 1)
        reg[r, r] = self.lam * 0.1  # biases are cheap
        for _ in range(self.iters):
            sol = _ridge_by_group(ii, V[jj], y - self.mu - bb[jj], n, reg)
            U[has_row], ba[has_row] = sol[has_row, :r], sol[has_row, r]
            sol = _ridge_by_group(jj, U[ii], y - self.mu - ba[ii], n, reg)
            V[has_col], bb[has_col] = sol[has_col, :r], sol[has_col, r]
        self.U, self.V, self.ba, self.bb = U, V, ba, bb
        self.n_rows = np.bincount(ii, minlength=n)
        self.n_cols = np.bincount(jj, minlength=n)
        return self

    def predict_log(self, a: Key, b: Key) -> tuple[float, int]:
        """(log speed estimate, observations supporting it: min of a's row count and b's column count)."""
        ia, ib = self.index.get(a), self.index.get(b)
        v = self.mu
        if ia is not None:
            v += self.ba[ia]
        if ib is not None:
            v += self.bb[ib]
        if ia is not None and ib is not None:
            v += float(self.U[ia] @ self.V[ib])
        na = int(self.n_rows[ia]) if ia is not None else 0
        nb = int(self.n_cols[ib]) if ib is not None else 0
        return v, min(na, nb)


#: (rank, ridge) of the extra low-rank fits used as features in the "new_pair" regime
EXTRA_LOW_RANK = ((4, 0.1), (6, 0.2))
#: neighbour counts of the nearest-neighbour features ("new_pair" regime)
NEIGHBOURS = (1, 3)
#: candidate weights k of the model against n exact-match measurements (n / (n + k) on their mean);
#: inf = model only. Chosen per fit by leave-one-out over the repeated training configurations.
EXACT_K = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, math.inf)
#: with fewer held-out values than this, the leave-one-out choice is too noisy: k = EXACT_K_DEFAULT
EXACT_MIN_LOO = 20
EXACT_K_DEFAULT = 1.0
#: out-of-fold model values for that choice and the one-hot blend weight's: one model of this many trees
#: per group of inner folds, fitted without the pairs the group hides (`InterferenceModel._nested_oof`)
OOF_SPLITS, OOF_TREES = 4, 50


#: neighbours of the family-local nearest-neighbour estimate ("new_pair" regime)
FAMILY_NEIGHBOURS = 3
#: the estimates `_family_estimates` returns, in order
FAMILY_ESTIMATES = ("analogy", "family_neighbours", "family_mean", "family_line")
#: the figures `_block_estimates` returns, in order
BLOCK_ESTIMATES = ("block_mean", "block_additive", "block_rms")


def _family_estimates(M: np.ndarray, i: int, j: int, fam: np.ndarray, lbs: np.ndarray) -> list[float]:
    """Four estimates of M[i, j] (log speeds, NaN = unknown) from the columns j' of j's family (j excluded):

    * analogy: M[i, j'] + the mean of M[r, j] - M[r, j'] over the rows r knowing both (at least 3, i
      excluded), averaged over j' with weights 1/(1 + |log2 bs(j') - log2 bs(j)|);
    * family-local neighbours: as `_neighbour_estimates`, but rows compared with row i over j's family
      columns only (at least 2 shared), `FAMILY_NEIGHBOURS` of them;
    * the mean of M[i, j'];
    * the intercept at log2 bs(j) of a line through M[i, j'] against log2 bs(j'), weighted by
      1/(1 + |log2 bs distance|) (at least 2 siblings).
    NaN where there is nothing to go on. Call with M.T (and i, j swapped) for the rows of i's family.
    """
    sib = np.flatnonzero(fam == fam[j])
    sib = sib[sib != j]
    if not len(sib):
        return [float("nan")] * len(FAMILY_ESTIMATES)
    # analogy over the family's columns
    ests, wts = [], []
    for s in sib:
        if np.isnan(M[i, s]):
            continue
        d = M[:, j] - M[:, s]
        d[i] = np.nan
        d = d[~np.isnan(d)]
        if len(d) >= 3:
            ests.append(M[i, s] + float(d.mean()))
            wts.append(1.0 / (1.0 + abs(lbs[s] - lbs[j])))
    analogy = float(np.dot(wts, ests) / np.sum(wts)) if ests else float("nan")
    # nearest rows over the family's columns only (local offset)
    local = float("nan")
    if len(sib) >= 2:
        cnt, off, dist = _offset_distances(M[i, sib][None, :] - M[:, sib])
        ok = (cnt >= 2) & ~np.isnan(M[:, j])
        ok[i] = False
        cand = np.flatnonzero(ok)
        if len(cand):
            top = cand[np.argsort(dist[cand], kind="stable")][:FAMILY_NEIGHBOURS]
            local = _neighbour_mean(M, j, top, off, dist)
    # the family's known values in row i: their mean and a weighted line in log batch size
    v = M[i, sib]
    ok = ~np.isnan(v)
    pool = float(v[ok].mean()) if ok.any() else float("nan")
    line = float("nan")
    if ok.sum() >= 2:
        dl = lbs[sib][ok] - lbs[j]
        w = 1.0 / (1.0 + np.abs(dl))
        A = np.stack([dl, np.ones_like(dl)], axis=1) * w[:, None]
        line = float(np.linalg.lstsq(A, v[ok] * w, rcond=None)[0][1])
    return [analogy, local, pool, line]


def _block_estimates(M: np.ndarray, i: int, j: int, fam: np.ndarray, iters: int = 10) -> list[float]:
    """Three figures of the block of M (log speeds, NaN = unknown) whose rows are i's family and whose
    columns are j's, cell (i, j) excluded: its mean; the two-way additive estimate of M[i, j] (block mean +
    row effect + column effect, fitted by alternating means over the known cells, a row or column with none
    known has effect 0); and the RMS of what that additive fit leaves (how erratic the block is).
    NaN where the block has no known cell (the RMS: fewer than 3)."""
    rows, cols = np.flatnonzero(fam == fam[i]), np.flatnonzero(fam == fam[j])
    B = M[np.ix_(rows, cols)].copy()
    ri, cj = int(np.flatnonzero(rows == i)[0]), int(np.flatnonzero(cols == j)[0])
    B[ri, cj] = np.nan
    known = ~np.isnan(B)
    n = int(known.sum())
    if not n:
        return [float("nan")] * len(BLOCK_ESTIMATES)
    Bz = np.where(known, B, 0.0)
    mu = float(Bz.sum() / n)
    n_r, n_c = known.sum(1), known.sum(0)
    re, ce = np.zeros(len(rows)), np.zeros(len(cols))
    for _ in range(iters):
        re = np.where(known, Bz - mu - ce[None, :], 0.0).sum(1) / np.maximum(n_r, 1)
        ce = np.where(known, Bz - mu - re[:, None], 0.0).sum(0) / np.maximum(n_c, 1)
    left = np.where(known, Bz - mu - re[:, None] - ce[None, :], 0.0)
    rms = float(np.sqrt((left ** 2).sum() / n)) if n > 2 else float("nan")
    return [mu, mu + float(re[ri] + ce[cj]), rms]


def _neighbour_estimates(M: np.ndarray, i: int, j: int, ks: Sequence[int]) -> list[float]:
    """Estimates of M[i, j] (log speeds, NaN = unknown) from the rows nearest to row i.

    Row i2 is compared with row i over the columns both know (column j excluded): after removing
    their mean difference (the offset), the RMS of what is left is the distance. Rows with fewer than
    3 shared columns or without column j are skipped. For each k in `ks`: the 1/(distance + 0.02)
    weighted mean of M[i2, j] + offset over the k nearest rows (NaN when there is none).
    """
    row = M[i]
    shared = np.flatnonzero(~np.isnan(row))
    shared = shared[shared != j]  # only the columns row i knows can be shared (a sparse matrix: a few of them)
    cnt, off, dist = _offset_distances(row[shared][None, :] - M[:, shared])
    ok = (cnt >= 3) & ~np.isnan(M[:, j])
    ok[i] = False
    cand = np.flatnonzero(ok)
    if not len(cand):
        return [float("nan")] * len(ks)
    cand = cand[np.argsort(dist[cand], kind="stable")]
    return [_neighbour_mean(M, j, cand[:k], off, dist) for k in ks]


def _offset_distances(D: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of differences D (NaN = unknown): how many are known, their mean (the offset) and
    the RMS of what is left after removing it (the distance)."""
    known = ~np.isnan(D)
    cnt = known.sum(1)
    Dz = np.where(known, D, 0.0)
    off = Dz.sum(1) / np.maximum(cnt, 1)
    dist = np.sqrt(np.where(known, (Dz - off[:, None]) ** 2, 0.0).sum(1) / np.maximum(cnt, 1))
    return cnt, off, dist


def _neighbour_mean(M: np.ndarray, j: int, top: np.ndarray, off: np.ndarray, dist: np.ndarray) -> float:
    """The 1/(distance + 0.02) weighted mean of M[r, j] + offset over the neighbour rows `top`."""
    w = 1.0 / (dist[top] + 0.02)
    return float(np.dot(w, M[top, j] + off[top]) / w.sum())


class _Layout:
    """Consecutive named segments of a feature vector, from their lengths: ``layout[name]`` is the slice
    segment `name` occupies, `size` the vector's length."""

    def __init__(self, segments: Sequence[tuple[str, int]]):
        self.slices: dict[str, slice] = {}
        pos = 0
        for name, n in segments:
            self.slices[name] = slice(pos, pos + n)
            pos += n
        self.size = pos

    def __getitem__(self, name: str) -> slice:
        return self.slices[name]

    def width(self, *names: str) -> int:
        """Total length of the named segments."""
        return sum(self.slices[n].stop - self.slices[n].start for n in names)

    def span(self, first: str, last: str) -> range:
        """The positions from the start of segment `first` to the end of segment `last`."""
        return range(self.slices[first].start, self.slices[last].stop)


class _Context:
    """Look-ups over a set of observations, shared by every feature of one batch of queries."""

    def __init__(self, obs: Obs, meta: Mapping[Key, JobMeta], refs: Sequence[Key], rank: int, lam: float,
                 neighbours: bool = False):
        self.obs = obs
        self.meta = meta
        self.refs = list(refs)
        self.mf = LowRank(rank=rank, lam=lam).fit(obs) if obs else None
        self.neighbours = neighbours
        self.layout = _Layout(self.segments(len(self.refs), neighbours))
        if neighbours:
            # stand-ins for the matrix-based estimates of a query whose job is not in the matrix
            self._nan_cell = [float("nan")] * self.layout.width("neighbours", "family", "block")
            self._nan_reverse = [float("nan")] * self.layout.width("reverse_neighbours")
            self.extra_mf = [LowRank(rank=r, lam=lm, iters=30).fit(obs) if obs else None for r, lm in EXTRA_LOW_RANK]
            keys = sorted({k for ab in obs for k in ab})
            self.index = {k: n for n, k in enumerate(keys)}
            self.M = np.full((len(keys), len(keys)), np.nan)
            for (a, b), v in obs.items():
                self.M[self.index[a], self.index[b]] = _log(v)
            self.fam_of = np.array([self._fam(k) for k in keys])
            self.lbs_of = np.array([self._lbs(k) for k in keys])
        # per family: partner -> [(member, log bs)]; per family: member -> [(partner, log bs)]
        self.by_row: dict[Key, dict[Key, float]] = {}
        self.by_col: dict[Key, dict[Key, float]] = {}
        for (a, b), v in obs.items():
            self.by_row.setdefault(a, {})[b] = v
            self.by_col.setdefault(b, {})[a] = v
        self.family_members: dict[str, list[Key]] = {}
        for k in sorted(set(self.by_row) | set(self.by_col) | set(meta)):  # sorted: stable across processes
            self.family_members.setdefault(self._fam(k), []).append(k)

    def _fam(self, k: Key) -> str:
        m = self.meta.get(k)
        return m.family if m else k

    def _lbs(self, k: Key) -> float:
        m = self.meta.get(k)
        return math.log2(m.batch_size) if m and m.batch_size else 0.0

    def _gpus(self, k: Key) -> int:
        m = self.meta.get(k)
        return m.gpus if m else 1

    def sibling_value(self, k: Key, other: Key, *, k_is_row: bool) -> float:
        """s(k', other) (or s(other, k')) for k's family sibling k' nearest in batch size and GPUs."""
        best, best_d = [], None
        for sib in self.family_members.get(self._fam(k), ()):
            if sib == k:
                continue
            v = self.by_row.get(sib, {}).get(other) if k_is_row else self.by_col.get(sib, {}).get(other)
            if v is None:
                continue
            d = abs(self._lbs(sib) - self._lbs(k)) + 2.0 * abs(math.log2(self._gpus(sib)) - math.log2(self._gpus(k)))
            if best_d is None or d < best_d - 1e-9:
                best, best_d = [v], d
            elif abs(d - best_d) <= 1e-9:
                best.append(v)
        if not best:
            return float("nan")
        return float(np.mean([_log(v) for v in best]))

    @staticmethod
    def segments(n_refs: int, neighbours: bool) -> list[tuple[str, int]]:
        """(name, length) of the segments of `features`, in the order it appends them; `layout` holds
        their positions."""
        segs = [
            ("low_rank", 2),  # the rank-2 fit's log speed, log1p of its support
            ("profile", 2 * 2 * n_refs),  # for a, then b: s(k, r), s(r, k) per reference job r
            ("siblings", 2),  # a's nearest sibling next to b, a next to b's nearest sibling
            ("meta", 2 * 3),  # for a, then b: log2 batch size, GPUs, log solo step time
            ("flags", 2),  # same family, same job
        ]
        if neighbours:
            segs += [
                ("extra_low_rank", len(EXTRA_LOW_RANK)),
                ("neighbours", 2 * len(NEIGHBOURS)),  # over the rows nearest to a, the columns nearest to b
                ("family", 2 * len(FAMILY_ESTIMATES)),  # over b's family (row a), a's family (column b)
                ("block", len(BLOCK_ESTIMATES)),
                ("reverse_low_rank", 1 + len(EXTRA_LOW_RANK)),  # s(b, a): the rank-2 fit, the extra fits
                ("reverse_neighbours", 2 * len(NEIGHBOURS)),
            ]
        return segs

    def features(self, a: Key, b: Key) -> tuple[list[float], int]:
        """The feature vector of the query (a, b), segment by segment as `segments` lists them; and the
        rank-2 fit's support."""
        f: list[float] = []
        mfv, support = self.mf.predict_log(a, b) if self.mf else (0.0, 0)
        f += [mfv, math.log1p(support)]
        for k, role_row in ((a, True), (b, False)):
            for r in self.refs:
                f.append(self.by_row.get(k, {}).get(r, -1.0))
                f.append(self.by_col.get(k, {}).get(r, -1.0))
        f.append(self.sibling_value(a, b, k_is_row=True))
        f.append(self.sibling_value(b, a, k_is_row=False))
        ma, mb = self.meta.get(a), self.meta.get(b)
        for m in (ma, mb):
            f += [math.log2(m.batch_size) if m and m.batch_size else -1.0, float(m.gpus if m else 1)]
            f.append(m.log_solo if m and m.log_solo is not None else float("nan"))
        f.append(float(self._fam(a) == self._fam(b)))
        f.append(float(a == b))
        if self.neighbours:
            f += [m.predict_log(a, b)[0] if m else 0.0 for m in self.extra_mf]
            ia, ib = self.index.get(a), self.index.get(b)
            if ia is None or ib is None:
                f += self._nan_cell
            else:
                f += _neighbour_estimates(self.M, ia, ib, NEIGHBOURS)
                f += _neighbour_estimates(self.M.T, ib, ia, NEIGHBOURS)
                f += _family_estimates(self.M, ia, ib, self.fam_of, self.lbs_of)  # b's family, row a
                f += _family_estimates(self.M.T, ib, ia, self.fam_of, self.lbs_of)  # a's family, column b
                f += _block_estimates(self.M, ia, ib, self.fam_of)
            # the other direction of the pair, s(b, a): hidden with it, but the same contention slows both
            f.append(self.mf.predict_log(b, a)[0] if self.mf else 0.0)
            f += [m.predict_log(b, a)[0] if m else 0.0 for m in self.extra_mf]
            if ia is None or ib is None:
                f += self._nan_reverse
            else:
                f += _neighbour_estimates(self.M, ib, ia, NEIGHBOURS)
                f += _neighbour_estimates(self.M.T, ia, ib, NEIGHBOURS)
        return f, support

    def estimate_columns(self) -> tuple[list[int], int]:
        """Positions in `features` of the log-speed estimates of the query's cell (``new_pair`` regime):
        the rank-2 fit, the higher-rank fits, the neighbour and the family estimates; and the position of
        the rank-6 fit (never NaN), which stands in for a missing one in `_Stack`."""
        L = self.layout
        cols = [L["low_rank"].start] + list(L.span("extra_low_rank", "family"))
        return cols, L["extra_low_rank"].stop - 1  # EXTRA_LOW_RANK ends with the rank-6 fit


#: ridge penalty of `_Stack` (its inputs are log speeds on one scale and 0/1 flags)
STACK_ALPHA = 1.0


class _Stack:
    """A ridge regression of log speed on the cell's log-speed estimates (a missing one replaced by the
    rank-6 fit, plus a 0/1 column saying it was missing); its answer is one more feature of the trees."""

    def __init__(self, cols: Sequence[int], fill: int, alpha: float = 1.0):
        self.cols, self.fill, self.alpha = list(cols), fill, alpha

    def _design(self, X: np.ndarray) -> np.ndarray:
        E = X[:, self.cols]
        miss = ~np.isfinite(E)
        return np.hstack([np.where(miss, X[:, [self.fill]], E), miss.astype(float)])

    def fit(self, X: np.ndarray, y: np.ndarray) -> "_Stack":
        from sklearn.linear_model import Ridge

        self.ridge = Ridge(alpha=self.alpha).fit(self._design(X), y)
        return self

    def augment(self, X: np.ndarray) -> np.ndarray:
        return np.hstack([X, self.ridge.predict(self._design(X))[:, None]])


#: the one-hot forest's estimate (``new_pair``): trees per forest, and groups of inner folds its
#: out-of-fold values for the training rows are computed over (one forest per group)
ONEHOT_TREES, ONEHOT_SPLITS = 100, 5
#: candidate weights w of the one-hot forest's estimate in the final point, (1 - w) * trees + w * one-hot
#: (log space; ``new_pair``), chosen per fit by the out-of-fold error over the training rows
ONEHOT_W = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
#: with fewer training rows than this the choice is too noisy: w = 0
ONEHOT_MIN_ROWS = 40


class _OneHotForest:
    """A random forest of log speed on the two jobs' one-hot model names (families), log2 batch sizes and
    GPU counts -- the issue's baseline learner, which pools every configuration of a model. Its answer is
    one more log-speed estimate for `_Stack` and the trees (``new_pair`` only)."""

    def __init__(self, meta: Mapping[Key, JobMeta], keys, n_estimators: int = ONEHOT_TREES, seed: int = 0):
        fams = sorted({self._fam(meta, k) for k in keys})
        self.col = {f: i for i, f in enumerate(fams)}
        self.meta, self.n_estimators, self.seed = meta, n_estimators, seed

    @staticmethod
    def _fam(meta, k: Key) -> str:
        m = meta.get(k)
        return m.family if m else k

    def _x(self, pairs) -> np.ndarray:
        nf = len(self.col)
        X = np.zeros((len(pairs), 2 * (nf + 2)))
        for r, ab in enumerate(pairs):
            for side, k in enumerate(ab):
                o = side * (nf + 2)
                c = self.col.get(self._fam(self.meta, k))
                if c is not None:
                    X[r, o + c] = 1.0
                m = self.meta.get(k)
                X[r, o + nf] = math.log2(m.batch_size) if m and m.batch_size else -1.0
                X[r, o + nf + 1] = float(m.gpus if m else 1)
        return X

    def fit(self, obs: Obs) -> "_OneHotForest":
        from sklearn.ensemble import RandomForestRegressor

        pairs = list(obs)
        self.rf = RandomForestRegressor(n_estimators=self.n_estimators, random_state=self.seed, n_jobs=1).fit(
            self._x(pairs), [_log(obs[p]) for p in pairs])
        return self

    def predict_log(self, pairs) -> np.ndarray:
        return self.rf.predict(self._x(pairs)) if len(pairs) else np.zeros(0)


def _mape_point(per_tree: np.ndarray) -> np.ndarray:
    """Per column of (trees x rows) log speeds: the tree value minimising the mean absolute percentage
    error against the trees' values, i.e. their median weighted by 1/speed."""
    v = np.sort(per_tree, axis=0)
    c = np.cumsum(np.exp(-v), axis=0)
    k = np.argmax(c >= c[-1] / 2, axis=0)
    return v[k, np.arange(v.shape[1])]


def _nan_to(x: np.ndarray, fill: float = -9.0) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    x[~np.isfinite(x)] = fill
    return x


class InterferenceModel:
    """Predicts co-located speed s(a, b) in (0, 1] from known observations; see the module docstring."""

    def __init__(
        self,
        refs: Sequence[Key] = (),
        *,
        regime: str = "new_pair",
        n_estimators: int = 150,
        inner_folds: int | None = None,
        rank: int = 2,
        lam: float = 0.3,
        seed: int = 0,
        n_jobs: int = 1,
        max_train_rows: int = 2000,
        point: str | None = None,
    ):
        if regime not in ("new_pair", "new_job"):
            raise ValueError(f"regime must be 'new_pair' or 'new_job', got {regime!r}")
        point = point or ("mape" if regime == "new_pair" else "mean")
        if point not in ("mean", "mape"):
            raise ValueError(f"point must be 'mean' or 'mape', got {point!r}")
        self.refs = list(refs)
        self.regime = regime
        self.point = point
        self.n_estimators = n_estimators
        #: out-of-fold folds for the training features. For new pairs, 20 (each hides 5 % of the pairs)
        #: keeps the training features' context nearly as dense as the one the queries see.
        self.inner_folds = inner_folds or (20 if regime == "new_pair" else 5)
        #: nearest-neighbour and extra low-rank features: for known jobs with many observations each
        self.neighbours = regime == "new_pair"
        self.rank, self.lam, self.seed, self.n_jobs = rank, lam, seed, n_jobs
        #: bound on the rows the forest trains on (a random subset beyond it): keeps refits within ~1 s
        self.max_train_rows = max_train_rows

    # -- training

    def _profile_part(self, obs: Obs, job: Key, refs: Sequence[Key]) -> dict:
        return {(a, b): v for (a, b), v in obs.items() if (a == job and b in refs) or (b == job and a in refs)}

    def fit(self, obs: Obs, meta: Mapping[Key, JobMeta] | None = None, *,
            repeats: Mapping[tuple[Key, Key], Sequence[float]] | None = None) -> "InterferenceModel":
        """Fit on `obs` ({(a, b): speed of a next to b}). `repeats` (``new_pair`` only): every measured
        speed of each directed configuration (obs holds their mean); enables the exact-match answer."""
        if repeats is not None and self.regime != "new_pair":
            raise ValueError("repeats (exact-match answers) are for regime='new_pair' only")
        y, xpairs, xfold, fold_hidden = self._fit_model(obs, meta)
        self.onehot_w = 0.0
        self._exact: dict[tuple[Key, Key], tuple[float, int]] = {}
        self.exact_k: float | None = None
        self.exact_loo_n = 0
        choose_w = self._onehot is not None and len(y) >= ONEHOT_MIN_ROWS
        multi_rows: list[int] = []
        if repeats is not None:
            self._exact = self._exact_lookup(repeats)
            multi_rows = [i for i, pq in enumerate(xpairs) if pq in self._exact and self._exact[pq][1] >= 2]
        oof = None
        if choose_w or multi_rows:
            tree_oof, onehot_oof = self._nested_oof(xpairs, xfold, fold_hidden, None if choose_w else multi_rows)
            if choose_w:
                self.onehot_w = self._choose_onehot_w(tree_oof, onehot_oof, np.array(y))
            oof = self._blend(tree_oof, onehot_oof)
        if repeats is not None:
            self._fit_exact(repeats, y, xpairs, multi_rows, oof)
        return self

    def _fit_model(self, obs: Obs, meta: Mapping[Key, JobMeta] | None):
        """Everything of `fit` but the choices made from out-of-fold points (the one-hot blend weight and
        the exact-match weight: none of them set). Returns the training rows: their log speeds, pairs,
        inner folds, and the pairs each inner fold hides."""
        meta = dict(meta or {})
        self.meta = meta
        self.obs = {k: float(v) for k, v in obs.items() if v > 0}
        pairs = list(self.obs)
        rng = np.random.default_rng(self.seed)
        X, y, xpairs, xfold = [], [], [], []
        fold_hidden: list[set] = []
        if self.regime == "new_pair":
            order = rng.permutation(len(pairs))
            folds = np.array_split(order, max(2, min(self.inner_folds, len(pairs))))
            per_fold = max(1, self.max_train_rows // len(folds))
            for f_i, fold in enumerate(folds):
                hidden = {pairs[i] for i in fold}
                fold = fold[:per_fold]
                hidden |= {(b, a) for a, b in hidden}  # a row of a pair table holds both directions
                fold_hidden.append(hidden)
                ctx = _Context({k: v for k, v in self.obs.items() if k not in hidden}, meta, self.refs, self.rank,
                               self.lam, self.neighbours)
                for i in fold:
                    a, b = pairs[i]
                    X.append(ctx.features(a, b)[0])
                    y.append(_log(self.obs[(a, b)]))
                    xpairs.append((a, b))
                    xfold.append(f_i)
        else:
            jobs = sorted({k for ab in pairs for k in ab} - set(self.refs))
            order = rng.permutation(len(jobs))
            folds = np.array_split(order, max(2, min(self.inner_folds, len(jobs))))
            per_fold = max(1, self.max_train_rows // len(folds))
            for fold in folds:
                held = {jobs[i] for i in fold}
                known = {
                    (a, b): v
                    for (a, b), v in self.obs.items()
                    if (a not in held and b not in held) or (a in self.refs or b in self.refs)
                }
                ctx = _Context(known, meta, self.refs, self.rank, self.lam, self.neighbours)
                targets = [(a, b) for (a, b) in self.obs if (a in held or b in held) and (a, b) not in known]
                if len(targets) > per_fold:
                    targets = [targets[i] for i in sorted(rng.choice(len(targets), per_fold, replace=False))]
                for a, b in targets:
                    X.append(ctx.features(a, b)[0])
                    y.append(_log(self.obs[(a, b)]))
        self.n_train = len(y)
        if not y:
            from qosflow.errors import NotEnoughData

            raise NotEnoughData(
                "no pair to train the interference model on: "
                + ("no positive speed was given" if not self.obs else
                   "every measured pair involves only reference jobs of the profile" if self.regime == "new_job" else
                   "too few pairs"))
        self._ctx = _Context(self.obs, meta, self.refs, self.rank, self.lam, self.neighbours)
        X = np.array(X, dtype=float)
        self._stack = None
        self._onehot = None
        self._onehot_col: int | None = None  # the one-hot forest's column of X, when there is one
        if self.neighbours and len(y):
            X = np.hstack([X, self._onehot_oof(xpairs, xfold, fold_hidden)[:, None]])
            self._onehot_col = X.shape[1] - 1  # (the stack's column goes after it)
            self._onehot = _OneHotForest(meta, self.obs_keys(), seed=self.seed).fit(self.obs)
            cols, fill = self._ctx.estimate_columns()
            self._stack = _Stack(cols + [X.shape[1] - 1], fill, alpha=STACK_ALPHA).fit(X, np.array(y))
            X = self._stack.augment(X)
        self.forest = self._forest(self.n_estimators).fit(_nan_to(X), np.array(y))
        flatten(self.forest)
        self.onehot_w = 0.0
        return y, xpairs, xfold, fold_hidden

    def _onehot_of(self, X) -> np.ndarray | None:
        """The one-hot forest's estimates among the features X (None without that forest)."""
        return None if self._onehot_col is None else np.asarray(X)[:, self._onehot_col]

    def _blend(self, point: np.ndarray, onehot: np.ndarray | None) -> np.ndarray:
        """The final log-speed point: the trees' blended with the one-hot forest's estimate (weight `onehot_w`)."""
        w = self.onehot_w
        return point if not w else (1 - w) * point + w * onehot

    def _nested_oof(self, xpairs, xfold, fold_hidden, rows=None) -> tuple[np.ndarray, np.ndarray]:
        """Out-of-fold (tree point, one-hot estimate) of the training rows `rows` (all by default; NaN for
        the others), for the choices of the one-hot blend weight and the exact-match weight.

        The inner folds are taken in `OOF_SPLITS` groups. For each group, a model of `OOF_TREES` trees is
        fitted (`_fit_model`, as this one: its own inner folds, out-of-fold features, one-hot forests,
        stacked estimate) on the observations without the pairs the group hides (both directions), and it
        predicts the group's rows. So a held-out row feeds no feature, forest, ridge or look-up used for
        its own point: neither the training rows' features (their contexts lack the group), nor their
        one-hot values, nor the stacked estimate. (Forests fitted on the full model's training features,
        as before, leaked: those features were computed from contexts holding the held-out pairs.)"""
        from qosflow.errors import NotEnoughData

        n = len(xpairs)
        tree, onehot = np.full(n, np.nan), np.full(n, np.nan)
        want = np.zeros(n, bool)
        want[np.arange(n) if rows is None else np.asarray(rows, dtype=int)] = True
        group = np.array(xfold) % OOF_SPLITS
        for g in range(OOF_SPLITS):
            test = np.flatnonzero(want & (group == g))
            if not len(test):
                continue
            hidden = set().union(*(fold_hidden[f] for f in range(len(fold_hidden)) if f % OOF_SPLITS == g))
            train = {k: v for k, v in self.obs.items() if k not in hidden}
            if len(train) < 2:
                continue
            sub = InterferenceModel(self.refs, regime=self.regime, n_estimators=OOF_TREES,
                                    inner_folds=self.inner_folds, rank=self.rank, lam=self.lam, seed=self.seed,
                                    n_jobs=self.n_jobs, max_train_rows=self.max_train_rows, point=self.point)
            try:
                sub._fit_model(train, self.meta)
            except NotEnoughData:  # (a tiny table) no out-of-fold point for this group
                continue
            t, o, _pt, _s = sub._predict_parts([xpairs[i] for i in test], sub._ctx)
            tree[test] = t
            if o is not None:
                onehot[test] = o
        return tree, onehot

    @staticmethod
    def _choose_onehot_w(oof: np.ndarray, onehot: np.ndarray, y: np.ndarray) -> float:
        """The weight in `ONEHOT_W` whose blend of the out-of-fold tree points with the one-hot estimates
        has the least MAPE over the training rows (ties: the smaller weight)."""
        ok = np.isfinite(oof)
        if ok.sum() < ONEHOT_MIN_ROWS:
            return 0.0
        truth = np.exp(y[ok])
        best = None
        for w in ONEHOT_W:
            err = float(np.mean(np.abs(np.exp((1 - w) * oof[ok] + w * onehot[ok]) - truth) / truth))
            if best is None or err < best[0] - 1e-12:
                best = (err, w)
        return best[1]

    def obs_keys(self) -> list[Key]:
        return sorted({k for ab in self.obs for k in ab})

    def _onehot_oof(self, xpairs, xfold, fold_hidden) -> np.ndarray:
        """The one-hot forest's estimate of each training row, out of fold: one forest per group of inner
        folds (`ONEHOT_SPLITS`), fitted without the pairs those folds hide (both directions)."""
        out = np.zeros(len(xpairs))
        fa = np.array(xfold) % ONEHOT_SPLITS
        keys = self.obs_keys()
        for g in range(ONEHOT_SPLITS):
            rows = np.flatnonzero(fa == g)
            if not len(rows):
                continue
            hidden = set().union(*(fold_hidden[f] for f in range(len(fold_hidden)) if f % ONEHOT_SPLITS == g))
            train = {k: v for k, v in self.obs.items() if k not in hidden}
            if not train:
                train = self.obs
            f = _OneHotForest(self.meta, keys, seed=self.seed).fit(train)
            out[rows] = f.predict_log([xpairs[i] for i in rows])
        return out

    def _forest(self, n_estimators: int):
        from sklearn.ensemble import ExtraTreesRegressor

        return ExtraTreesRegressor(n_estimators=n_estimators, max_features=0.6, min_samples_leaf=2,
                                   random_state=self.seed, n_jobs=self.n_jobs)

    @staticmethod
    def _exact_lookup(repeats) -> dict[tuple[Key, Key], tuple[float, int]]:
        """{(a, b): (mean log speed, n)} over the positive measured speeds of each directed configuration."""
        out = {}
        for key, vals in repeats.items():
            pos = [float(v) for v in vals if v > 0]  # 0 = could not run together: no speed to average
            if pos:
                out[key] = (float(np.mean([_log(v) for v in pos])), len(pos))
        return out

    def _fit_exact(self, repeats, y, xpairs, rows, oof_points) -> None:
        """The exact-match weight k (see the module docstring) from the out-of-fold model points of the
        training rows `rows` (those whose configuration is measured at least twice)."""
        if not rows:
            self.exact_k = EXACT_K_DEFAULT
            return
        oof = {xpairs[i]: float(oof_points[i]) for i in rows if np.isfinite(oof_points[i])}
        # leave one value out: predict it from the mean of the others and the out-of-fold model value
        held, others_mean, others_n, model = [], [], [], []
        for key, m in oof.items():
            logs = [_log(v) for v in repeats[key] if v > 0]
            tot = sum(logs)
            for lv in logs:
                held.append(lv)
                others_mean.append((tot - lv) / (len(logs) - 1))
                others_n.append(len(logs) - 1)
                model.append(m)
        self.exact_loo_n = len(held)
        if len(held) < EXACT_MIN_LOO:
            self.exact_k = EXACT_K_DEFAULT
            return
        truth = np.exp(np.array(held))
        n, om, mo = np.array(others_n, float), np.array(others_mean), np.array(model)
        best = None
        for k in EXACT_K:
            est = mo if math.isinf(k) else (n * om + k * mo) / (n + k)
            err = float(np.mean(np.abs(np.exp(est) - truth) / truth))
            if best is None or err < best[0] - 1e-12:
                best = (err, k)
        self.exact_k = best[1]

    # -- prediction

    def predict(self, queries: Sequence[tuple[Key, Key]], *, extra_obs: Obs | None = None,
                extra_meta: Mapping[Key, JobMeta] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(speed, low, high, support) arrays for the queries; speed is the point estimate (see `point`),
        low/high the 10th/90th percentiles over trees.

        `extra_obs` adds observations known at prediction time (e.g. a new job's profile).
        """
        ctx = self._ctx
        if extra_obs or extra_meta:
            obs = dict(self.obs)
            obs.update({k: float(v) for k, v in (extra_obs or {}).items() if v > 0})
            meta = dict(self.meta)
            meta.update(extra_meta or {})
            ctx = _Context(obs, meta, self.refs, self.rank, self.lam, self.neighbours)
        point, onehot, per_tree, support = self._predict_parts(queries, ctx)
        point = self._blend(point, onehot)
        lo, hi = np.exp(np.percentile(per_tree, [10, 90], axis=0))
        if self._exact and not math.isinf(self.exact_k):
            for i, q in enumerate(queries):
                hit = self._exact.get(q)
                if hit is not None:
                    m, n = hit
                    point[i] = (n * m + self.exact_k * point[i]) / (n + self.exact_k)
                    support[i] += n
        mean = np.exp(point)
        return mean, np.minimum(lo, mean), np.maximum(hi, mean), support

    def _predict_parts(self, queries, ctx) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """For the queries, with the look-ups `ctx`: the trees' log-speed point (before the one-hot blend and
        the exact matches), the one-hot forest's estimate (None without it), every tree's log speed, support."""
        feats = [ctx.features(a, b) for a, b in queries]
        X = np.array([f for f, _ in feats], dtype=float).reshape(len(queries), -1)
        if self._onehot is not None:
            X = np.hstack([X, self._onehot.predict_log(list(queries))[:, None]])
        if self._stack is not None:
            X = self._stack.augment(X)
        X = _nan_to(X)
        support = np.array([s for _, s in feats])
        per_tree = per_tree_predictions(self.forest, X)
        point = _mape_point(per_tree) if self.point == "mape" else per_tree.mean(0)
        return point, self._onehot_of(X), per_tree, support
